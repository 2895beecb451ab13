"""examples/train.py, the README's main command, run as users run it."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness import run_world

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "examples" / "train.py"
STEPS = 8


def torchrun(*args: str, nproc: int = 2, timeout: float = 300) -> str:
    """Run train.py under torchrun; its output (fails the test on a non-zero exit)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(TRAIN), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{out[-4000:]}"
    return proc.stdout


def losses_of(stdout: str) -> tuple:
    """(first loss, final loss) from the summary; the final loss must be the last line."""
    last = stdout.strip().splitlines()[-1]
    final = re.fullmatch(r"final loss (\S+)", last)
    assert final, f"last line is {last!r}, not 'final loss <value>'"
    first = re.search(r"^loss (\S+) at step 1, (\S+) at step", stdout, re.M)
    assert first, stdout[-2000:]
    assert float(first.group(2)) == float(final.group(1))
    return float(first.group(1)), float(final.group(1))


def load_train_module():
    spec = importlib.util.spec_from_file_location("train_example", TRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_two_ranks_learn_and_resume_from_a_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    common = ["--steps", str(STEPS), "--checkpoint-dir", str(ckpt)]
    out = torchrun(*common, "--checkpoint-every", "4", "--plot", str(tmp_path / "a.png"))
    first, final = losses_of(out)
    assert final < first - 1.0, f"loss did not fall: {first} -> {final}"
    assert "bucket" in out and "layers.0" in out, "no bucket plan printed"
    assert re.search(r"collectives per step: 9\.0 all-gathers, 5\.0 reduce-scatters", out), out
    assert re.search(r"peak memory per rank \(max RSS of the process\) r0: [\d.]+ MiB, r1: ", out)
    saved = {int(p.name.split("_")[1]): p for p in ckpt.glob("step_*")}
    assert sorted(saved) == [4, 8]

    shutil.rmtree(saved[8])  # as if the run had died after step 4's save
    # The resumed run is train.main in the harness's 2-rank world (its process group
    # stands in for torchrun's): the launch is checked above, and a second torchrun
    # would pay the imports of three more processes for no other check.
    out = run_world(2, _main_in_world, [*common, "--resume", "--plot", str(tmp_path / "b.png")],
                    timeout=120)[0]
    assert "resumed from step 4" in out
    resumed_first, resumed_final = losses_of(out)
    assert resumed_first == first, "the resumed loss curve lost its first steps"
    assert resumed_final == pytest.approx(final, rel=1e-6), "resume diverged from the original run"
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "a.png").stat().st_size > 0 and (tmp_path / "b.png").stat().st_size > 0


def test_one_process_without_torchrun(tmp_path, capsys, monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    train = load_train_module()
    train.main(["--steps", "4", "--plot", str(tmp_path / "loss.png"), "--mp", "bf16"])
    out = capsys.readouterr().out
    first, final = losses_of(out)
    assert final < first
    assert "on 1 rank(s)" in out and "mp bf16" in out


def _main_in_world(argv: list) -> str:
    """Harness body: train.main in the harness's process group; rank 0's output."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        load_train_module().main(argv)
    return out.getvalue()


@pytest.mark.world(2)
@pytest.mark.parametrize("flags, gathers", [
    (["--placement", "owned"], 9), (["--placement", "ragged"], 9),
    (["--placement", "mixed", "--mp", "bf16"], 9), (["--no-reshard"], 5),
    (["--bucket-bytes", "400000"], None),
])
def test_flags_train_at_two_ranks(flags, gathers, tmp_path):
    out = run_world(2, _main_in_world, ["--steps", "4", "--plot", str(tmp_path / "l.png"), *flags],
                    timeout=120)[0]
    first, final = losses_of(out)
    assert final < first - 0.5, f"{flags}: loss did not fall: {first} -> {final}"
    if gathers is None:  # smaller buckets than one per block: more collectives
        counts = re.search(r"collectives per step: (\S+) all-gathers, (\S+) reduce-scatters", out)
        assert float(counts.group(1)) > 9 and float(counts.group(2)) > 5, out
    else:
        assert f"collectives per step: {gathers}.0 all-gathers, 5.0 reduce-scatters" in out, out
    placement = flags[1] if flags[0] == "--placement" else "shard"
    assert f"on 2 rank(s), cpu, placement {placement}" in out


def test_help_describes_every_flag(capsys):
    train = load_train_module()
    with pytest.raises(SystemExit) as exit_:
        train.parse_args(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--steps", "--placement", "--bucket-bytes", "--mp", "--no-reshard", "--offload",
                 "--checkpoint-dir", "--checkpoint-every", "--resume", "--seed"):
        assert re.search(rf"{flag}\b[^\n]*\n?\s+\S", text), f"{flag} has no description"
    for choice in ("shard", "owned", "ragged", "mixed"):
        assert choice in text


def test_help_states_every_default(capsys):
    """Each flag that takes a value names its default in --help."""
    train = load_train_module()
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    options = re.split(r"\n  (?=-)", capsys.readouterr().out.split("options:", 1)[1])
    for flag, shown in (("--steps", "200"), ("--seed", "0"), ("--batch-size", "16"),
                        ("--lr", "3e-3"), ("--checkpoint-every", "0"), ("--plot", "runs/loss.png")):
        help_ = " ".join(next(o for o in options if o.startswith(flag + " ")).split())
        assert f"default {shown})" in help_, f"{flag}'s help does not name its default {shown}"


@pytest.mark.parametrize("argv, message", [
    (["--checkpoint-every", "2"], "need --checkpoint-dir"),
    (["--resume"], "need --checkpoint-dir"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--bucket-bytes", "0"], "--bucket-bytes must be positive"),
    (["--checkpoint-every", "-5", "--checkpoint-dir", "ckpt"], "--checkpoint-every must be >= 0"),
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--batch-size", "-1"], "--batch-size must be >= 1, got -1"),
    (["--lr", "nan"], "--lr must be a finite number >= 0, got nan"),
    (["--lr", "inf"], "--lr must be a finite number >= 0, got inf"),
    (["--lr", "-0.001"], "--lr must be a finite number >= 0, got -0.001"),
])
def test_bad_flags_are_refused(argv, message, capsys):
    train = load_train_module()
    with pytest.raises(SystemExit):
        train.parse_args(argv)
    assert message in capsys.readouterr().err


def test_a_new_run_into_another_runs_checkpoints_is_refused(tmp_path, capsys):
    """Without --resume its saves would replace the other run's losses.json and its
    step_* (keep=2 keeps the highest steps, the other run's)."""
    (tmp_path / "step_00000200").mkdir()
    train = load_train_module()
    with pytest.raises(SystemExit):
        train.parse_args(["--checkpoint-every", "50", "--checkpoint-dir", str(tmp_path)])
    assert "holds another run's checkpoints: pass --resume" in capsys.readouterr().err
    train.parse_args(["--checkpoint-every", "50", "--checkpoint-dir", str(tmp_path), "--resume"])


def test_resume_without_a_checkpoint_says_so(tmp_path, monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    train = load_train_module()
    with pytest.raises(FileNotFoundError, match=r"--resume: no checkpoint in .*--checkpoint-every"):
        train.main(["--steps", "2", "--checkpoint-dir", str(tmp_path), "--resume"])


def test_unwritable_plot_and_checkpoint_dirs_are_refused_before_training(tmp_path, capsys):
    """Found before the first step, not when the plot or the first save is written."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # no directory can be made under a plain file
    train = load_train_module()
    if importlib.util.find_spec("matplotlib"):  # without it no plot is written: nothing to check
        with pytest.raises(SystemExit):
            train.parse_args(["--plot", str(blocker / "loss.png")])
        err = capsys.readouterr().err
        assert f"--plot {blocker / 'loss.png'}: cannot write in {blocker}" in err, err
    with pytest.raises(SystemExit):
        train.parse_args(["--checkpoint-dir", str(blocker / "ckpt"), "--checkpoint-every", "1",
                          "--plot", str(tmp_path / "l.png")])
    err = capsys.readouterr().err
    assert f"--checkpoint-dir {blocker / 'ckpt'}: cannot write in it" in err, err
    args = train.parse_args(["--plot", str(tmp_path / "new" / "l.png"), "--checkpoint-every", "1",
                             "--checkpoint-dir", str(tmp_path / "ckpt")])
    assert args.plot == tmp_path / "new" / "l.png"


def test_resume_at_or_past_steps(tmp_path, capsys, monkeypatch):
    """A checkpoint at --steps leaves nothing to train: the run says so and succeeds (a
    finished job started again is done, as torchtitan's and Hugging Face's trainers do);
    one past --steps is refused, naming both, before any step."""
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    train = load_train_module()
    common = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--plot", str(tmp_path / "l.png")]
    train.main(["--steps", "2", "--checkpoint-every", "2", *common])
    capsys.readouterr()
    with pytest.raises(ValueError, match=r"--steps 1 is before the checkpoint's step 2 in .*ckpt: "
                                         r"pass --steps 2 or more"):
        train.main(["--steps", "1", "--resume", *common])
    train.main(["--steps", "2", "--resume", *common])
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1] == "resumed from step 2: --steps 2 reached, nothing to train"
