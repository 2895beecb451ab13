"""One instrumented training step of a runner: collectives, copies, memory.

Measured outside the timed steps (the dispatch modes cost Python time per op).
"""

from __future__ import annotations

from functools import partial

import torch
from torch.distributed.tensor.debug import CommDebugMode

from .meters import COPY_KINDS, MemoryMeter, TrafficMeter, distinct_storages, footprint
from .model import batch, build_model, loss_fn
from .runners import DTYPES


def direction(kind: str) -> str:
    """"gather" or "reduce" (or "other") for a collective kind."""
    if "gather" in kind:
        return "gather"
    if "reduce" in kind:
        return "reduce"
    return "other"


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under `tensors` (padding included), each at
    its allocator footprint as MemoryMeter counts it."""
    return sum(footprint(st) for st in distinct_storages(tensors))


def _tag_unsharded(meter: MemoryMeter, module, args) -> None:
    meter.tag_unsharded(module.parameters(recurse=False))


def _collectives(traffic: TrafficMeter) -> dict:
    return {k: {"count": n, "wire_bytes": traffic.collective_bytes[k]}
            for k, n in sorted(traffic.collectives.items())}


def _wire(runner, traffic: TrafficMeter, counters: dict, world_size: int) -> dict:
    """Per direction: bytes on the wire (padding included) and the bytes that had to move."""
    out = {d: {"wire_bytes": 0, "ideal_bytes": 0} for d in ("gather", "reduce")}
    if runner.kind == "flexshard":
        for d in ("gather", "reduce"):
            out[d] = {"wire_bytes": counters[f"{d}_wire_bytes"],
                      "ideal_bytes": counters[f"{d}_ideal_bytes"]}
        return out
    ideal = runner.fsdp2_ideal(world_size)
    for kind, size in traffic.events:
        # not a param's collective: torchao's fp8 scale all-reduces (4 bytes each), which
        # flexshard's bucket counters leave out as well
        if direction(kind) not in out or kind.startswith("all_reduce"):
            continue
        if size not in ideal.get(kind, {}):
            raise AssertionError(f"{runner.kind}: a {kind} of {size} bytes matches no FSDP2 "
                                 f"parameter group ({ideal.get(kind)})")
        out[direction(kind)]["wire_bytes"] += size
        out[direction(kind)]["ideal_bytes"] += ideal[kind][size]
    return out


def _counter_delta(before: dict, after: dict) -> dict:
    """Per bucket counter differences, and their sum over buckets."""
    buckets = {}
    for name, counts in after.items():
        buckets[name] = {k: (v - before[name][k] if k != "placements" else v)
                         for k, v in counts.items()}
    total: dict = {}
    copy_out: dict = {}  # bucket placements ("Owned+Shard") -> copy-out bytes
    for counts in buckets.values():
        for k, v in counts.items():
            if k != "placements":
                total[k] = total.get(k, 0) + v
        mix = "+".join(counts["placements"])
        copy_out[mix] = copy_out.get(mix, 0) + counts["copy_out_bytes"]
    return {"total": total, "copy_out_by_placements": copy_out}


def _memory(meter: MemoryMeter, runner) -> dict:
    grads = runner.grads()
    return {"peak_bytes": meter.peak,
            "peak_by_kind": meter.peak_by_kind(grads),
            "param_bytes": storage_bytes(runner.params()),
            "grad_bytes": storage_bytes(grads),
            "opt_state_bytes": storage_bytes(runner.optim.state_tensors())}


def _memory_step(runner, step: int) -> dict:
    """One step under the MemoryMeter alone (other modes may keep tensors alive)."""
    runner.optim.zero_grad()
    mem = MemoryMeter()
    mem.register(runner.params(), "param")
    mem.register(runner.optim.state_tensors(), "opt_state")
    hooks = [m.register_forward_pre_hook(partial(_tag_unsharded, mem))
             for m in runner.model.modules()]
    cuda = runner.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(runner.device)
    try:
        with mem:
            runner.forward_backward(step)
            runner.optim.step()
    finally:
        for h in hooks:
            h.remove()
    result = _memory(mem, runner)
    if cuda:
        result["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(runner.device)
    return result


def _traffic_step(runner, step: int, world_size: int) -> dict:
    """One step counting collectives and copies (forward+backward, then optimizer)."""
    runner.optim.zero_grad()
    before = runner.bucket_counters()
    fb, fb_debug, opt, opt_debug = TrafficMeter(), CommDebugMode(), TrafficMeter(), CommDebugMode()
    with fb_debug, fb:
        loss = runner.forward_backward(step)
    with opt_debug, opt:
        runner.optim.step()
    counters = _counter_delta(before, runner.bucket_counters()) if before else None
    return {
        "loss": loss.item(),
        "collectives": _collectives(fb),
        "comm_debug_count": fb_debug.get_total_counts(),
        "wire": _wire(runner, fb, counters["total"] if counters else {}, world_size),
        "copies": {k: fb.copies[k] for k in COPY_KINDS},
        "optimizer_collectives": _collectives(opt),
        "optimizer_comm_debug_count": opt_debug.get_total_counts(),
        "flexshard_counters": counters,
    }


def measure_step(runner, step: int, world_size: int) -> dict:
    """Two instrumented training steps of `runner` (`step`, `step + 1`):
    traffic, then memory."""
    result = _traffic_step(runner, step, world_size)
    result["memory"] = _memory_step(runner, step + 1)
    return result


def plain_copies(model_name: str, param_dtype: str, step: int, rank: int, device) -> dict:
    """Copy bytes of the unwrapped model's forward and backward in `param_dtype`:
    the model's own copies, subtracted to show what a runtime adds."""
    model = build_model(model_name).to(device=device, dtype=DTYPES[param_dtype] or torch.float32)
    meter = TrafficMeter()
    with meter:
        x, y = batch(model_name, step, rank, device)
        loss_fn(model(x), y).backward()
    return {k: meter.copies[k] for k in COPY_KINDS}
