"""GPU time of one profiled step: kernels, copy-family ops, labelled regions.

GPU time of one profiled step, from torch.profiler's events: kernels launched,
the time under copy-family ops, and under each library's labelled regions
(FlexShard::*, FSDP::*) with the fake backend's own writes set apart; the
compiled graphs the step called."""

from __future__ import annotations

import json
from pathlib import Path

from .fake_world import Side
from .meters import is_collective
from .op_counter import COPY_OPS, LIBRARY_LABELS
from .trace import record, summarize_trace


def _ancestors(e) -> list:
    out, p = [], e.cpu_parent
    while p is not None:
        out.append(p)
        p = p.cpu_parent
    return out


def _top_level(events, names) -> list:
    """The events named in `names` with no ancestor named in `names` (an op's
    inner copies count once, with it)."""
    return [e for e in events
            if e.name in names and not any(p.name in names for p in _ancestors(e))]


FUSED_KERNELS = frozenset({"_quantize", "_dequantize", "_scale_and_cast"})


def _labelled(e) -> bool:
    return any(p.name.startswith(LIBRARY_LABELS) for p in _ancestors(e))


def _under_collective(e) -> bool:
    return any(is_collective(p.name) for p in _ancestors(e))


def _label_us(cpu_events) -> dict:
    """GPU time per library label (FlexShard::*, FSDP::*), most first."""
    labels: dict = {}
    for e in cpu_events:
        if e.name.startswith(LIBRARY_LABELS):
            labels[e.name] = labels.get(e.name, 0.0) + e.device_time_total
    return dict(sorted(labels.items(), key=lambda kv: -kv[1]))


def engine_label_us(cpu_events) -> dict:
    """GPU time per library label less the time of the collective ops under it:
    under the fake backend those kernels are its own writes (`_allgather_base_`
    copies the input into each rank's chunk, standing in for NCCL), not the
    engine's work."""
    labels = _label_us(cpu_events)
    for c in _top_level(cpu_events, {e.name for e in cpu_events if is_collective(e.name)}):
        for p in _ancestors(c):
            if p.name in labels:
                labels[p.name] -= c.device_time_total
    return dict(sorted(labels.items(), key=lambda kv: -kv[1]))


def device_summary(events) -> dict:
    """From a profiled step's FunctionEvents: device kernels launched, their total
    time, the time and kernels under copy-family ops, and under each library's
    labelled regions (FlexShard::*, FSDP::*); compiled graphs the step called
    (forward and backward: inductor's "## Call CompiledFxGraph" regions)."""
    # GPU-side record_function ranges (gpu_user_annotation) are device events too: not kernels
    device = [e for e in events if e.device_type.name != "CPU"
              and not getattr(e, "is_user_annotation", False)]
    kernels = [e for e in device if not e.name.startswith(("Memcpy", "Memset"))]
    cpu = [e for e in events if e.device_type.name == "CPU"]
    copies = _top_level(cpu, COPY_OPS)
    copy_us = sum(e.device_time_total for e in copies)
    labelled = [e for e in copies if _labelled(e)]
    # flexshard's Triton kernels (placements/quantized_kernels.py) are no aten op and
    # the profiler links them to no CPU range: counted by name, as engine work
    fused_us = sum(e.device_time_total for e in kernels if e.name in FUSED_KERNELS)
    return {"kernels": len(kernels), "memcpy_memset": len(device) - len(kernels),
            "device_us": sum(e.device_time_total for e in device),
            "copy_device_us": copy_us,
            # copy-family time in the library's labelled regions, less the fake backend's
            # own copies (inside collective ops): the engine's
            "engine_device_us": fused_us + sum(e.device_time_total for e in labelled
                                               if not _under_collective(e)),
            "fused_kernel_device_us": fused_us,
            # outside every label: the model's own copies, the same on both sides unless
            # a library leaves engine work unlabelled (the meter's check)
            "model_copy_device_us": copy_us - sum(e.device_time_total for e in labelled),
            "copy_kernels": sum(_kernel_count(e) for e in copies),
            "label_device_us": _label_us(cpu),
            "engine_label_device_us": engine_label_us(cpu),
            "compiled_graph_calls": sum(e.name.startswith("## Call CompiledFxGraph") for e in cpu),
            "top_kernels": top_kernels(kernels)}


def top_kernels(kernels, n: int = 12) -> list:
    """The `n` kernels of most device time, by name: [name, microseconds, launches]."""
    by_name: dict = {}
    for e in kernels:
        us, count = by_name.get(e.name, (0.0, 0))
        by_name[e.name] = (us + e.device_time_total, count + 1)
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:n]
    return [[name[:80], round(us, 1), count] for name, (us, count) in ranked]


def _kernel_count(e) -> int:
    return len(e.kernels) + sum(_kernel_count(c) for c in e.cpu_children)


def profile_side(side: Side, out_dir: Path) -> dict:
    """One step under torch.profiler (CPU and CUDA): the device summary; the
    Chrome trace into `out_dir`."""
    path = out_dir / f"{side.mode}-{side.kind}.json"
    summary = device_summary(record(side.step, side.device, path).events())
    if side.device.type == "cuda":  # where the GPU idled: every stream idle at once
        t = summarize_trace(json.loads(path.read_text()))
        summary["idle"] = {"span_us": t.span_us, "idle_us": t.idle_us,
                           "per_stream_us": {str(k): v for k, v in t.per_stream_us.items()},
                           "gaps": [[g.length_us, g.before[:60], g.after[:60]] for g in t.gaps]}
    return summary
