"""The fused quantize/dequantize kernels of quantized gathers, against the eager
path bit for bit, on CPU through Triton's interpreter (int8 into float32: see
tests/fused_quant_check.py; tests/test_cuda.py compares every dtype on a GPU),
and which path a device takes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
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


@pytest.mark.parametrize("kernel", ["quantize", "dequantize", "cast"])
def test_the_fused_kernels_compile_for_a_gpu_with_vector_loads(kernel):
    """Compiled here for an H100 (sm_90; Triton compiles without a GPU): the kernels
    build, and with 16-byte aligned bases and offsets (`ALIGN`) they read in 16-byte
    vectors, as one launch per weight did with its pointers and width specialized."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from flexshard.placements import quantized_kernels as qk

    if kernel == "quantize":
        fn, warps = qk._quantize, 8
        signature = {"data": "*i8", "scales": "*fp32", "src": "*fp32", "table": "*i64",
                     "starts": "*i64",
                     "qmax": "fp32", "inv_qmax": "fp32", "eps": "fp32", "INT8": "constexpr",
                     "ALIGN": "constexpr", "BLOCK": "constexpr"}
        constexprs = {"INT8": True, "ALIGN": 16, "BLOCK": qk._BLOCK}
    elif kernel == "cast":
        fn, warps = qk._scale_and_cast, 4
        signature = {"out": "*fp8e4nv", "scales": "*fp32", "src": "*bf16", "table": "*i64",
                     "starts": "*i64",
                     "top": "fp32", "ALIGN": "constexpr", "BLOCK": "constexpr"}
        constexprs = {"ALIGN": 16, "BLOCK": qk._BLOCK}
    else:
        fn, warps = qk._dequantize, 4
        signature = {"data": "*i8", "scales": "*fp32", "out": "*bf16", "table": "*i64",
                     "starts": "*i64",
                     "ALIGN": "constexpr", "BLOCK": "constexpr"}
        constexprs = {"ALIGN": 16, "BLOCK": qk._BLOCK}
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(5)}  # as Triton specializes them
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs,
                                        attrs=aligned),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    assert compiled.asm.get("cubin"), "no GPU binary"
    accesses = set(re.findall(r"(?:ld|st)\.global[.\w]*", compiled.asm["ptx"]))
    assert "ld.global.v4.b32" in accesses, accesses
