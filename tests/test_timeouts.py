"""A dead or stalled rank makes every live rank raise within the process
group's timeout instead of hanging. Each scenario runs its own small gloo world
with a short timeout, not the shared harness world: processes forked from a
forkserver that imported torch once, so the worlds start in about a second."""

import datetime
import json
import multiprocessing as mp
import os
import time

from harness import PRELOAD, _free_port  # PRELOAD: slow imports, done once in the forkserver

PG_TIMEOUT_S = 5.0  # the worlds' process-group timeout
SLACK_S = 15.0  # scheduling noise on a loaded 2-core machine
STARTUP_S = 120.0  # starting the processes and the process groups
VICTIM = 1
FAIL_AT_STEP = 2


def record(out_dir: str, rank: int, **fields) -> None:
    """What a rank of a small world reports to the test (a JSON file per rank)."""
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(fields, f)


def _victim_hook(scenario: str, out_dir: str):
    def hook(module, args):
        record(out_dir, VICTIM, failed_at=time.time())
        if scenario == "dead":
            os._exit(17)  # no goodbye to the other ranks
        time.sleep(10 * (PG_TIMEOUT_S + SLACK_S))  # stalled

    return hook


def init_world(rank: int, world: int, port: int) -> None:
    """In a child: join the small world's gloo group, with the short timeout."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{port}",
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))


def _rank_main(rank: int, world: int, port: int, scenario: str, out_dir: str) -> None:
    """Train a few steps; the victim dies or stalls mid-step (in a block's forward)."""
    import torch

    import flexshard as fs
    from models import TinyGPT, batch, loss_fn

    init_world(rank, world, port)
    torch.manual_seed(0)
    model = fs.flex_shard(TinyGPT())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    try:
        for step in range(FAIL_AT_STEP + 1):
            if rank == VICTIM and step == FAIL_AT_STEP:
                model.layers[1].register_forward_pre_hook(_victim_hook(scenario, out_dir))
            x, y = batch(step, rank)
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    except Exception as e:  # noqa: BLE001 - what the test checks
        record(out_dir, rank, error=type(e).__name__, message=str(e)[:500], at=time.time())
        os._exit(3)  # a broken process group cannot be torn down cleanly
    record(out_dir, rank, error=None, at=time.time())
    os._exit(0)


def start_world(target, world: int, *args) -> list:
    """Start `world` processes running target(rank, world, port, *args)."""
    ctx, port = mp.get_context("forkserver"), _free_port()
    ctx.set_forkserver_preload(PRELOAD)
    procs = [ctx.Process(target=target, args=(r, world, port, *args), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    return procs


def finish_world(procs: list, out_dir: str, deadline: float) -> dict:
    """Wait for the live ranks until `deadline`, kill what is left; returns what happened."""
    for r, p in enumerate(procs):
        if r != VICTIM:
            p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if r != VICTIM and p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5)
    records = {}
    for r in range(len(procs)):
        path = os.path.join(out_dir, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                records[r] = json.load(f)
    return {"hung": hung, "codes": {r: p.exitcode for r, p in enumerate(procs)}, "records": records}


def _check(result: dict) -> None:
    assert result["hung"] == [], result
    failed_at = result["records"][VICTIM]["failed_at"]
    for rank, code in result["codes"].items():
        if rank != VICTIM:
            record = result["records"][rank]
            assert code == 3 and record["error"] == "RuntimeError", result
            assert record["at"] - failed_at < PG_TIMEOUT_S + SLACK_S, result


def test_dead_or_stalled_rank_makes_live_ranks_raise_within_the_timeout(tmp_path, monkeypatch):
    for name, value in {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}.items():
        monkeypatch.setenv(name, value)  # read by the children as they import torch
    scenarios = {"dead": 3, "stalled": 2}  # both worlds run at once, to save time
    dirs = {name: tmp_path / name for name in scenarios}
    for d in dirs.values():
        d.mkdir()
    procs = {name: start_world(_rank_main, world, name, str(dirs[name]))
             for name, world in scenarios.items()}
    deadline = time.monotonic() + STARTUP_S + PG_TIMEOUT_S + SLACK_S
    results = {name: finish_world(procs[name], str(dirs[name]), deadline) for name in scenarios}
    _check(results["dead"])
    assert results["dead"]["codes"][VICTIM] == 17
    _check(results["stalled"])
    assert "Timed out" in results["stalled"]["records"][0]["message"]
