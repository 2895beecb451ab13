"""The fake-world benchmark's run and report (`python -m benchmarks.gpu --fake-world N`):
for each mode, both sides built and warmed up; each side alone: on a GPU its peak
memory and one profiled step (kernels launched, GPU time in copy-family ops and
in each library's labelled regions; with compiled blocks, on a CPU too: the
compiled graphs the step called); their steps timed alternating; last, eager
modes only, each side under the dispatch-mode meters: ops and copied bytes
(`--counts`) and, on a CPU, peak memory. See fake_world.py.
"""

from __future__ import annotations

import datetime
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from .fake_world import (COPY_OPS, LIBRARY_LABELS, OUTSIDE, PRESETS, Side, compiled_mode,
                         count_whole_step, counted, cpu_peak_bytes, sides_of, sync)
from .meters import is_collective

# (mode or "*", measure, target, device type or "*"): issue 34's targets, flexshard / FSDP2
# ("*": every mode against FSDP2)
TARGETS = [("*", "ops", 1.00, "*"), ("*", "copy_bytes", 1.00, "*"),
           # issue 44: the copies the engine writes (its labelled regions), and their GPU
           # time with the fake backend's own writes (under collective ops) set apart
           ("eager", "engine_copy_bytes", 0.55, "*"), ("*", "engine_device_us", 0.50, "cuda"),
           ("eager", "step_s", 0.90, "cuda"), ("compile", "step_s", 0.90, "cuda"),
           ("module-compile", "step_s", 0.90, "cuda"), ("*", "peak_bytes", 0.95, "cuda"),
           ("float8-compile", "step_s", 1.00, "cuda"),
           # issue 46: the whole step in one graph against FSDP2's compiled blocks
           ("whole-compile", "step_s", 0.85, "cuda"), ("cudagraph", "step_s", 0.85, "cuda"),
           # QuantizedGather against flexshard's bf16 gathers: within 5%
           ("int8-gather", "step_s", 1.05, "cuda"), ("fp8-gather", "step_s", 1.05, "cuda")]
TOP_OPS = 15
LABELS = {"fsdp2": "FSDP2"}  # how a side is named in the tables


def _allocated(device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def peak_bytes(side: Side) -> int:
    """Peak bytes one step of `side` holds: on a GPU torch.cuda's peak over the
    step, less what was allocated before it, plus what the side keeps between
    steps (`side.persistent`); on a CPU meters.MemoryMeter's peak."""
    if side.device.type != "cuda":
        return cpu_peak_bytes(side)
    gc.collect()
    sync(side.device)
    before = torch.cuda.memory_allocated(side.device)
    torch.cuda.reset_peak_memory_stats(side.device)
    side.step()
    return torch.cuda.max_memory_allocated(side.device) - before + side.persistent


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
            "compiled_graph_calls": sum(e.name.startswith("## Call CompiledFxGraph") for e in cpu)}


def _kernel_count(e) -> int:
    return len(e.kernels) + sum(_kernel_count(c) for c in e.cpu_children)


def profile_side(side: Side, out_dir: Path) -> dict:
    """One step under torch.profiler (CPU and CUDA): the device summary; the
    Chrome trace into `out_dir`."""
    from torch.profiler import ProfilerActivity, profile

    out_dir.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU]
    if side.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        side.step()
    prof.export_chrome_trace(str(out_dir / f"{side.mode}-{side.kind}.json"))
    return device_summary(prof.events())


def timed(sides: list, steps: int) -> dict:
    """Steps alternating (A B, B A, ...) so drift hits both alike: per side the
    wall seconds of each step and this process's CPU seconds (all threads)."""
    record = {s.kind: ([], []) for s in sides}
    for i in range(steps):
        order = sides if i % 2 == 0 else sides[::-1]
        for s in order:
            cpu = time.process_time()
            record[s.kind][0].append(s.step())
            record[s.kind][1].append(time.process_time() - cpu)
    return record


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process so far (0 where nothing compiled)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def build_sides(mode: str, args, shape, mesh, device) -> list:
    """Both sides built and warmed up one after the other; each knows the bytes it
    keeps between steps (`persistent`: sharded params, optimizer state)."""
    sides = []
    for kind in sides_of(mode):
        gc.collect()
        before = _allocated(device)
        side = Side(kind, mode, shape, mesh, device, args.seed,
                    placement=args.placement)
        for _ in range(args.warmup):
            side.step()
        side.persistent = _allocated(device) - before
        sides.append(side)
    return sides


def run_mode(mode: str, args, shape, mesh, device) -> dict:
    """Both sides in `mode`: each alone, its GPU memory and profiled step; their steps
    timed alternating; then each alone under the dispatch-mode meters (op counts,
    CPU memory). The meters come last: a step under a TorchDispatchMode leaves
    dynamo skipping the compiled blocks from then on (they run eagerly), so
    compiled modes get no dispatch-mode measure at all."""
    sides, out = build_sides(mode, args, shape, mesh, device), {}
    compiled = compiled_mode(mode)
    for side in sides:
        r, graphs = {}, graphs_compiled()
        if device.type == "cuda":
            r["peak_bytes"] = peak_bytes(side)
        if device.type == "cuda" or compiled:
            r["profile"] = profile_side(side, Path(args.out) / "traces")
        # a graph compiled after warm-up: a recompile (or a new graph break) every step
        r["graphs_after_warmup"] = graphs_compiled() - graphs
        out[side.kind] = r
    graphs = graphs_compiled()
    for kind, (wall, cpu) in timed(sides, args.steps).items():
        out[kind].update(step_s=statistics.median(wall), cpu_s=statistics.median(cpu),
                         step_s_all=wall)
    graphs = graphs_compiled() - graphs
    for side in sides if not compiled else ():
        if args.counts:
            out[side.kind]["counts"] = counted(side)._asdict()
        if device.type != "cuda":
            out[side.kind]["peak_bytes"] = peak_bytes(side)
    if args.counts and mode == "whole-compile" and device.type == "cpu":
        for kind, counts in whole_step_counts(sides, shape, mesh, device, args.placement).items():
            out[kind]["counts"] = counts
    del sides
    gc.collect()
    return {"mode": mode, "placement": args.placement, "sides": out,
            "ratios": ratios(out, *sides_of(mode)),
            "graphs_in_timed_steps": graphs}


def whole_step_counts(sides: list, shape, mesh, device, placement: str) -> dict:
    """--counts of whole-compile, per side: flexshard's ops and copies inside its
    graphs (counted there, before inductor's fusion; the engine's bytes: less the
    plain bf16 model's, compiled whole alike); FSDP2's under the dispatch meter
    (its blocks then run eagerly; its hooks, the engine, run eagerly under compile
    anyway)."""
    fsdp2 = counted(next(s for s in sides if s.kind == "fsdp2"))._asdict()
    whole, plain = count_whole_step(shape, mesh, device, placement)
    regions = {"(inside flexshard's compiled graphs)": (whole.ops, whole.copy_bytes),
               "(the plain bf16 model's graphs, compiled whole)": (plain.ops, plain.copy_bytes)}
    return {"fsdp2": fsdp2,
            "flexshard": {**whole._asdict(), "by_region": regions,
                          "engine_copy_bytes": whole.copy_bytes - plain.copy_bytes}}


def _measures(r: dict) -> dict:
    m = {k: r[k] for k in ("peak_bytes", "step_s", "cpu_s") if k in r}
    if "counts" in r:
        m.update({k: r["counts"][k] for k in ("ops", "non_view_ops", "copy_ops", "copy_bytes",
                                              "engine_copy_bytes") if k in r["counts"]})
    if "profile" in r:
        keys = ("kernels", "copy_device_us", "engine_device_us", "model_copy_device_us",
                "fused_kernel_device_us", "copy_kernels", "compiled_graph_calls")
        m.update({k: r["profile"][k] for k in keys if k in r["profile"] and
                  (r["profile"]["device_us"] or k == "compiled_graph_calls")})
    return m


def ratios(sides: dict, num: str = "flexshard", den: str = "fsdp2") -> dict:
    """num / den for every measure both sides have (None where den's is 0)."""
    a, b = _measures(sides[num]), _measures(sides[den])
    return {k: (a[k] / b[k] if b[k] else None) for k in a if k in b}


def targets(result: dict) -> list:
    """Issue 34's targets met by this run's modes: (mode, measure, ratio, target, verdict)."""
    rows = []
    device = result["config"]["device"]
    for m in result["modes"]:
        for mode, measure, target, dev in TARGETS:
            against_fsdp2 = sides_of(m["mode"])[1] == "fsdp2"
            if (mode == m["mode"] or mode == "*" and against_fsdp2) and dev in ("*", device) \
                    and measure in m["ratios"]:
                value = m["ratios"][measure]
                ok = value is not None and value <= target
                rows.append((m["mode"], measure, value, target, "PASS" if ok else "MISS"))
    return rows


def compile_checks(result: dict) -> list:
    """For each compiled mode and side: whether the step called compiled graphs
    (a block compiled with nothing to show ran eagerly) and compiled none anew."""
    rows = []
    for m in result["modes"]:
        if not compiled_mode(m["mode"]):
            continue
        for kind, r in m["sides"].items():
            calls, again = r["profile"]["compiled_graph_calls"], r["graphs_after_warmup"]
            verdict = ("ran eagerly" if not calls else
                       f"recompiled ({again} graphs after warm-up)" if again else "compiled")
            rows.append((m["mode"], kind, calls, again, verdict))
    return rows


def run(args, device: torch.device) -> dict:
    """Every mode of `args.modes` in a fake world of `args.fake_world` ranks."""
    from .fake_world import fake_world

    shape = PRESETS[args.preset]._replace(**{k: getattr(args, k) for k in ("batch", "seq", "layers")
                                             if getattr(args, k)})
    result = {"machine": {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                          "torch": torch.__version__, "device": str(device),
                          "gpu": torch.cuda.get_device_name(device) if device.type == "cuda"
                          else None, "threads": torch.get_num_threads()},
              "model": {"preset": args.preset, **shape._asdict(), "hf": "LlamaForCausalLM"},
              "config": {"device": device.type, "world": args.fake_world, "rank": args.rank,
                         "placement": args.placement, "param_dtype": "bf16",
                         "reduce_dtype": "fp32", "steps": args.steps,
                         "warmup": args.warmup, "counts": args.counts},
              "modes": []}
    with fake_world(args.fake_world, args.rank, device) as mesh:
        for mode in args.modes:
            result["modes"].append(run_mode(mode, args, shape, mesh, device))
            print(mode_text(result["modes"][-1], device), flush=True)
    result["targets"] = targets(result)
    result["compile_checks"] = compile_checks(result)
    return result


def _mib(n) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _ratio(v) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


_ROWS = [  # (measure, label, format)
    ("ops", "aten ops per forward+backward", "{:,}"),
    ("non_view_ops", "  of them not views", "{:,}"),
    ("copy_ops", "copy-family ops", "{:,}"),
    ("copy_bytes", "bytes written by copy-family ops", _mib),
    ("engine_copy_bytes", "  of them in the library's labelled regions (engine)", _mib),
    ("kernels", "kernels launched per step", "{:,}"),
    ("copy_kernels", "  of them under copy-family ops", "{:,}"),
    ("copy_device_us", "GPU time in copy-family ops", lambda v: f"{v / 1e3:.2f} ms"),
    ("engine_device_us", "  of it in the library's labels, outside collective ops (engine)",
     lambda v: f"{v / 1e3:.2f} ms"),
    ("model_copy_device_us", "  of it outside every library label (the model's own)",
     lambda v: f"{v / 1e3:.2f} ms"),
    ("fused_kernel_device_us", "  engine: of it flexshard's fused (Triton) quantize kernels",
     lambda v: f"{v / 1e3:.2f} ms"),
    ("compiled_graph_calls", "compiled graphs called per step", "{:,}"),
    ("peak_bytes", "peak memory", _mib),
    ("step_s", "step time, median", lambda v: f"{v * 1e3:.1f} ms"),
    ("cpu_s", "process CPU time per step, median", lambda v: f"{v * 1e3:.1f} ms"),
]


def mode_text(m: dict, device: torch.device) -> str:
    """A markdown table of one mode: each measure, both sides and the ratio; the top ops."""
    where = "CPU (MemoryMeter; loaded shared machine)" if device.type == "cpu" else "GPU"
    num, den = sides_of(m["mode"])
    a, b = _measures(m["sides"][num]), _measures(m["sides"][den])
    x, y = LABELS.get(num, num), LABELS.get(den, den)
    placed = f"flexshard placement {m.get('placement', 'shard')}"
    if den == "fsdp2":
        placed += ", FSDP2 Shard(0)"
    lines = [f"### mode {m['mode']}, {placed} ({where})", "",
             f"| measure | {x} | {y} | {x} / {y} |", "|---|---|---|---|"]
    for key, label, fmt in _ROWS:
        if key in a and key in b:
            f = fmt.format if isinstance(fmt, str) else fmt
            unit = f" ({device.type.upper()})" if key in ("peak_bytes", "step_s", "cpu_s") else ""
            lines.append(f"| {label}{unit} | {f(a[key])} | {f(b[key])} | "
                         f"{_ratio(m['ratios'].get(key))} |")
    if compiled_mode(m["mode"]) and device.type == "cpu":
        lines.append("| peak memory (CPU) | n/a | n/a | MemoryMeter's dispatch mode would run "
                     "the compiled blocks eagerly |")
    if compiled_mode(m["mode"]):
        g = [m["sides"][k]["graphs_after_warmup"] for k in (num, den)]
        lines.append(f"| graphs compiled after warm-up (recompiles) | {g[0]} | {g[1]} | |")
        lines.append(f"\ngraphs compiled in the timed steps (both sides): "
                     f"{m['graphs_in_timed_steps']}")
    a_prof, b_prof = (m["sides"][k].get("profile", {}) for k in (num, den))
    if a_prof.get("device_us") and "engine_label_device_us" in a_prof:
        lines += ["", *label_time_table(a_prof, b_prof, (x, y))]
    if "counts" in m["sides"][num]:
        a_counts, b_counts = m["sides"][num]["counts"], m["sides"][den]["counts"]
        lines += ["", *region_table(a_counts["by_region"], b_counts["by_region"], (x, y)),
                  "", *op_table(a_counts["by_op"], b_counts["by_op"], (x, y))]
    return "\n".join(lines)


def label_time_table(a: dict, b: dict, names: tuple) -> list:
    """GPU time per library label, both sides: all of it, and the engine's (less the
    collective ops under the label: the fake backend's writes, standing in for NCCL)."""
    ms = lambda v: "" if v is None else f"{v / 1e3:.2f} ms"  # noqa: E731
    lines = [f"| label | GPU time {names[0]} | engine {names[0]} | GPU time {names[1]} | "
             f"engine {names[1]} |", "|---|---|---|---|---|"]
    for label in sorted(set(a["label_device_us"]) | set(b.get("label_device_us", {}))):
        row = [d.get(k, {}).get(label) for d in (a, b)
               for k in ("label_device_us", "engine_label_device_us")]
        lines.append(f"| {label} | " + " | ".join(ms(v) for v in row) + " |")
    return lines


def region_table(a: dict, b: dict, names: tuple) -> list:
    """Ops and copied bytes per library region (record_function range), both sides:
    the unlabelled row holds the model's own ops, equal on both sides, plus any
    library work outside its labels."""
    lines = [f"| region | ops {names[0]} | ops {names[1]} | copy bytes {names[0]} | "
             f"copy bytes {names[1]} |", "|---|---|---|---|---|"]
    for r in sorted(set(a) | set(b), key=lambda r: (r != OUTSIDE, r)):
        (ca, ba), (cb, bb) = a.get(r, (0, 0)), b.get(r, (0, 0))
        lines.append(f"| {r} | {ca:,} | {cb:,} | {_mib(ba)} | {_mib(bb)} |")
    return lines


def op_table(fs_ops: dict, fsdp_ops: dict, names: tuple = ("flexshard", "FSDP2"),
             top: int = TOP_OPS) -> list:
    """The ops dispatched most (by either side) and every copy-family op:
    count and copied bytes on each side."""
    ops = sorted(set(fs_ops) | set(fsdp_ops),
                 key=lambda n: -max(fs_ops.get(n, (0, 0))[0], fsdp_ops.get(n, (0, 0))[0]))
    shown = ops[:top] + [n for n in ops[top:] if n in COPY_OPS]
    lines = [f"| op | {names[0]} | {names[1]} | copy bytes {names[0]} | copy bytes {names[1]} |",
             "|---|---|---|---|---|"]
    for n in shown:
        (ca, ba), (cb, bb) = fs_ops.get(n, (0, 0)), fsdp_ops.get(n, (0, 0))
        copy = n in COPY_OPS
        lines.append(f"| {n} | {ca:,} | {cb:,} | {_mib(ba) if copy else ''} | "
                     f"{_mib(bb) if copy else ''} |")
    return lines


def text(result: dict) -> str:
    m, c = result["model"], result["config"]
    lines = [f"fake world of {c['world']} (rank {c['rank']}), {c['device']}: HF Llama "
             f"dim {m['dim']}, ffn {m['ffn']}, {m['heads']} heads ({m['kv_heads']} KV), "
             f"{m['layers']} layers, vocab {m['vocab']}, seq {m['seq']}, batch {m['batch']}/rank; "
             f"bf16 params, fp32 reduce, reshard after forward; flexshard placement "
             f"{c.get('placement', 'shard')}, FSDP2 Shard(0)"]
    for mode, measure, value, target, verdict in result["targets"]:
        names = "/".join(LABELS.get(k, k) for k in sides_of(mode))
        lines.append(f"target {mode} {measure} {names}: {_ratio(value)} "
                     f"(<= {target:.2f}) {verdict}")
    return "\n".join(lines)


def write(result: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))
    return path
