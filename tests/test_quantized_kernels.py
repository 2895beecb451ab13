"""The fused quantize/dequantize kernels of quantized gathers, against the eager
path bit for bit, on CPU through Triton's interpreter (int8 into float32: see
tests/fused_quant_check.py; tests/test_cuda.py compares every dtype on a GPU),
and which path a device takes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from flexshard.placements import batch

HERE = Path(__file__).resolve().parent


def test_the_fused_kernels_write_the_eager_bits_under_the_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, str(HERE / "fused_quant_check.py")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "bit-equal to eager" in run.stdout


def test_cpu_tensors_take_the_eager_path_without_importing_triton():
    assert batch.fused_kernels([torch.zeros(4)]) is False
    code = ("import sys, torch; from flexshard.placements import batch; "
            "batch.fused_kernels([torch.zeros(4)]); "
            "assert 'flexshard.placements.quantized_kernels' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
