"""Clean exits under torchrun: N runs of each script, flexshard and FSDP2 interleaved.

A finished run must exit 0; a run that prints "terminate called" (SIGABRT at
interpreter exit) or exits non-zero counts as an abort. The "+300" cases end the
quickstart with 300 all-reduces, which makes an abort at exit likely when the
process group is left to interpreter finalization (flexshard/wrap/teardown.py). `--load K` starts K
busy-looping processes for the duration, to reproduce a loaded machine.

    PYTHONPATH=$PWD python -m benchmarks.exit_stress --runs 12 --load 2
    PYTHONPATH=$PWD python -m benchmarks.exit_stress --suite programs --runs 5 --load 1

`--suite programs` launches every multi-rank program a user copies: each docs python block
marked for a world above 1 (at its smallest such world), the examples' multi-rank programs, and
docs/checkpoints.md's save/load round trip at 4 ranks. Prints one line per case: aborts,
timeouts and other non-zero exits / launches. Logs of failing runs go under
runs/exit_stress/ (ignored by git).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SCRIPTS = os.path.join(HERE, "exit_scripts")
EXAMPLES = os.path.join(REPO, "examples")
CASES = {  # name -> (ranks or None for --nproc, argv after torchrun's own); "{dir}": a fresh directory
    "quickstart flexshard": (None, ["quickstart.py", "flexshard"]),
    "quickstart fsdp2": (None, ["quickstart.py", "fsdp2"]),
    "quickstart+300 flexshard": (None, ["quickstart.py", "flexshard", "300"]),
    "quickstart+300 fsdp2": (None, ["quickstart.py", "fsdp2", "300"]),
    "quickstart+300 flexshard destroy": (None, ["quickstart.py", "flexshard", "300", "destroy"]),
    "quickstart+300 fsdp2 destroy": (None, ["quickstart.py", "fsdp2", "300", "destroy"]),
    "quickstart+300 fsdp2 destroy+sleep": (None, ["quickstart.py", "fsdp2", "300", "destroy-sleep"]),
    "quickstart+300 flexshard pause50": (None, ["quickstart.py", "flexshard-pause50", "300"]),
    "dcp save/load flexshard": (None, ["dcp_roundtrip.py", "flexshard", "{dir}"]),
    "dcp save/load fsdp2": (None, ["dcp_roundtrip.py", "fsdp2", "{dir}"]),
    "fs checkpoint w4": (4, ["fs_checkpoint.py", "{dir}"]),
}
EXAMPLE_CASES = {  # the examples' multi-rank programs, at the world sizes their docstrings name
    "examples/custom_placement.py": (2, ["custom_placement.py"]),
    "examples/muon.py": (2, ["muon.py"]),
    "examples/train.py mixed int8": (2, ["train.py", "--steps", "4", "--placement", "mixed",
                                         "--gather", "int8", "--checkpoint-dir", "{dir}",
                                         "--checkpoint-every", "2", "--plot", "{dir}/loss.png"]),
    "examples/torchtitan_cpu.py": (2, ["torchtitan_cpu.py", "--steps", "4"]),
    "examples/halo_graph.py": (3, ["halo_graph.py"]),
    "examples/domain_parallel.py": (4, ["domain_parallel.py"]),
    "examples/shard_tensor.py": (4, ["shard_tensor.py"]),
}
MARKER = re.compile(r"<!-- readme-test: world ([\d, ]+) -->\n```python\n(.*?)\n```", re.S)


def doc_cases(directory: str) -> dict:
    """Every docs/README python block marked for a world above 1, written to `directory`,
    at its smallest such world."""
    cases = {}
    pages = ["README.md"] + sorted(f"docs/{p}" for p in os.listdir(os.path.join(REPO, "docs")))
    for page in pages:
        text = open(os.path.join(REPO, page)).read()
        for match in MARKER.finditer(text):
            worlds = [int(w) for w in match.group(1).split(",") if int(w) > 1]
            if not worlds:
                continue
            line = text[:match.start()].count("\n") + 2  # the opening fence
            path = os.path.join(directory, f"{page.replace('/', '_')[:-3]}_{line}.py")
            with open(path, "w") as f:
                f.write(match.group(2) + "\n")
            cases[f"{page}:{line}"] = (min(worlds), [path])
    return cases


def _spin(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10000))


def _script(name: str) -> str:
    for folder in (SCRIPTS, EXAMPLES):
        if os.path.exists(os.path.join(folder, name)):
            return os.path.join(folder, name)
    return name  # a docs block, already a path


def _allow_cores() -> None:  # in the child: a SIGABRT leaves a core in the launch's directory
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def run_once(argv: list, nproc: int, timeout: float, cores: str = "") -> tuple:
    """(ok, output) of one torchrun of `argv` (a timeout is not ok, and says so). With
    `cores`, the launch runs in a directory under it, kept when it holds a core."""
    directory = tempfile.mkdtemp(prefix="exit-stress-", dir=cores or None)
    argv = [a.replace("{dir}", directory) for a in argv]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", _script(argv[0]), *argv[1:]]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=directory,
                              preexec_fn=_allow_cores if cores else None)
        out, rc = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = f"timeout after {timeout}s\n{e.stdout or ''}{e.stderr or ''}", -1
    finally:
        if not (cores and any(n.startswith("core") for n in os.listdir(directory))):
            shutil.rmtree(directory, ignore_errors=True)
    return rc == 0 and "terminate called" not in out, out


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=12, help="rounds; each launches every case once")
    parser.add_argument("--nproc", type=int, default=2,
                        help="ranks for the cases that name none (the exit_scripts quickstarts)")
    parser.add_argument("--load", type=int, default=0, help="busy processes beside the runs")
    parser.add_argument("--suite", choices=("exit", "programs", "all"), default="exit",
                        help="exit: the exit_scripts cases; programs: the docs' multi-rank blocks, "
                             "the examples' multi-rank programs and fs checkpoint w4; all: both")
    parser.add_argument("--cases", nargs="*", default=None,
                        help="run only these case names (see --list), instead of the suite")
    parser.add_argument("--list", action="store_true", help="print the case names and exit")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds one launch may take (a 4-rank launch on a loaded 2-core "
                             "machine takes minutes)")
    parser.add_argument("--log-dir", default=os.path.join("runs", "exit_stress"),
                        help="where the output of each failing launch is written")
    parser.add_argument("--cores", default="",
                        help="run each launch in a folder under this one with core dumps on; "
                             "a launch that leaves a core keeps its folder")
    return parser.parse_args(argv)


def _cases(args, blocks_dir: str) -> dict:
    exit_cases = {k: v for k, v in CASES.items() if k != "fs checkpoint w4"}
    programs = {**doc_cases(blocks_dir), **EXAMPLE_CASES, "fs checkpoint w4": CASES["fs checkpoint w4"]}
    every = {**exit_cases, **programs}
    if args.cases:
        unknown = sorted(set(args.cases) - set(every))
        if unknown:
            raise SystemExit(f"unknown cases {unknown}; --list names them")
        return {c: every[c] for c in args.cases}
    return {"exit": exit_cases, "programs": programs, "all": every}[args.suite]


def _failure(out: str) -> str:
    """What kind of failure a failed launch's output shows."""
    if out.startswith("timeout after"):
        return "timeouts"
    if "terminate called" in out or "Signal 6 (SIGABRT)" in out or "exitcode  : -6" in out:
        return "aborts"
    return "other"


def _rounds(args, cases: dict) -> dict:
    tally = {c: {"launches": 0, "aborts": 0, "timeouts": 0, "other": 0} for c in cases}
    os.makedirs(args.log_dir, exist_ok=True)
    for i in range(args.runs):
        for case, (nproc, argv) in cases.items():  # interleaved: every case sees the same load
            began = time.time()
            ok, out = run_once(argv, nproc or args.nproc, args.timeout, args.cores)
            tally[case]["launches"] += 1
            kind = "ok" if ok else _failure(out)
            if not ok:
                tally[case][kind] += 1
                name = re.sub(r"[^\w.-]+", "_", case)
                with open(os.path.join(args.log_dir, f"{name}-{i}.log"), "w") as f:
                    f.write(out)
            print(f"  {case}: {kind} ({time.time() - began:.0f} s)", flush=True)  # a partial run counts
        print(f"round {i + 1}/{args.runs}: nonzero " + ", ".join(
            f"{c} {sum(t.values()) - t['launches']}" for c, t in tally.items() if
            sum(t.values()) > t["launches"]), flush=True)
    return tally


def main(argv=None) -> dict:
    args = _parse(argv)
    blocks_dir = tempfile.mkdtemp(prefix="exit-stress-blocks-")
    cases = _cases(args, blocks_dir)
    if args.list:
        print("\n".join(f"{c} (ranks {n or args.nproc})" for c, (n, _) in cases.items()))
        return {}
    if args.cores:
        os.makedirs(args.cores, exist_ok=True)
    os.environ["PYTHONPATH"] = os.pathsep.join(  # launches run in their own folders
        p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)
    stop = mp.Event()
    spinners = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(args.load)]
    for p in spinners:
        p.start()
    start = time.time()
    try:
        tally = _rounds(args, cases)
    finally:
        stop.set()
        for p in spinners:
            p.join()
        shutil.rmtree(blocks_dir, ignore_errors=True)
    _print_tally(args, tally, time.time() - start)
    return tally


def _print_tally(args, tally: dict, seconds: float) -> None:
    launches = sum(t["launches"] for t in tally.values())
    failed = {k: sum(t[k] for t in tally.values()) for k in ("aborts", "timeouts", "other")}
    print(f"{launches} launches ({args.runs} per case), {args.load} busy processes, {seconds:.0f} s: "
          f"{failed['aborts']} aborts, {failed['timeouts']} timeouts, {failed['other']} other nonzero")
    for case, t in tally.items():
        print(f"{case:<44} aborts {t['aborts']}/{t['launches']}, timeouts {t['timeouts']}, "
              f"other {t['other']}")


if __name__ == "__main__":
    main()
