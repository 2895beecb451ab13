"""examples/torchtitan_cpu.py, the CPU recipe of docs/torchtitan.md, run as users run it."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "examples" / "torchtitan_cpu.py"
STEPS = 4


def test_two_ranks_match_one_process_on_the_global_batch():
    """2 ranks under torchrun (gloo) against the script's one-process run on both
    ranks' batches: torchtitan's loss convention (summed grads, global token count)
    gives the same losses; they fall."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=2", str(SCRIPT), "--steps", str(STEPS)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:  # the reference runs in this process while the ranks train
        reference = _load_example().main(["--reference", "2", "--steps", str(STEPS)])
        out, err = proc.communicate(timeout=300)  # a hang guard, as the other launched jobs'
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{err[-4000:]}"
    lines = out.strip().splitlines()
    steps = [re.fullmatch(r"step (\d+) loss (\S+)", line) for line in lines[:-1]]
    assert all(steps) and [int(m.group(1)) for m in steps] == list(range(1, STEPS + 1)), out
    final = re.fullmatch(r"final loss (\S+)", lines[-1])
    assert final, f"last line is {lines[-1]!r}, not 'final loss <value>'"
    losses = [float(m.group(2)) for m in steps]
    assert float(final.group(1)) == losses[-1]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-5, atol=0)
    assert all(b < a for a, b in zip(losses, losses[1:])), f"loss did not fall: {losses}"


def _load_example():
    spec = importlib.util.spec_from_file_location("torchtitan_cpu_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv, message", [
    (["--reference", "0"], "--reference must be >= 1, got 0"),
    (["--reference", "-1"], "--reference must be >= 1, got -1"),
    (["--reference", "2", "--steps", "0"], "--steps must be >= 1, got 0"),
    (["--reference", "2", "--steps", "-3"], "--steps must be >= 1, got -3"),
    ([], "run under torchrun --nproc-per-node N, or pass --reference N"),
])
def test_bad_flags_are_refused(argv, message, capsys, monkeypatch):
    """Argument errors, before the model is built or a process group is joined: without
    torchrun's environment and without --reference, env:// rendezvous would fail."""
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    module = _load_example()
    with pytest.raises(SystemExit) as exit_:
        module.parse_args(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
