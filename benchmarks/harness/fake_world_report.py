"""The fake-world benchmark's tables: per mode each measure, both sides, ratio.

The fake-world benchmark's report: per mode a markdown table of each measure,
both sides and their ratio (GPU time per label, ops and bytes per region, the top
ops); the run's headline and its targets."""

from __future__ import annotations

import torch

from .fake_world import WHOLE, compiled_mode, sides_of
from .op_counter import COPY_OPS, OUTSIDE

TOP_OPS = 15
LABELS = {"fsdp2": "FSDP2"}  # how a side is named in the tables


def measures(r: dict) -> dict:
    """The measures compared of one side's record: memory, times, counts, profile."""
    m = {k: r[k] for k in ("peak_bytes", "step_s", "cpu_s", "first_step_s")
         if r.get(k) is not None}
    if "counts" in r:
        m.update({k: r["counts"][k] for k in ("ops", "non_view_ops", "copy_ops", "copy_bytes",
                                              "engine_copy_bytes") if k in r["counts"]})
    if "profile" in r:
        keys = ("kernels", "copy_device_us", "engine_device_us", "model_copy_device_us",
                "fused_kernel_device_us", "copy_kernels", "compiled_graph_calls")
        m.update({k: r["profile"][k] for k in keys if k in r["profile"] and
                  (r["profile"]["device_us"] or k == "compiled_graph_calls")})
    return m


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
    ("first_step_s", "first step (a compiled mode's compiles)", lambda v: f"{v:.1f} s"),
]


def mode_text(m: dict, device: torch.device) -> str:
    """A markdown table of one mode: each measure, both sides and the ratio; the top ops."""
    where = "CPU (MemoryMeter; loaded shared machine)" if device.type == "cpu" else "GPU"
    num, den = sides_of(m["mode"])
    a, b = measures(m["sides"][num]), measures(m["sides"][den])
    x, y = LABELS.get(num, num), LABELS.get(den, den)
    placed = f"flexshard placement {m.get('placement', 'shard')}"
    if den == "fsdp2":
        placed += ", FSDP2 Shard(0)"
    lines = [f"### mode {m['mode']}, {placed} ({where})", "",
             f"| measure | {x} | {y} | {x} / {y} |", "|---|---|---|---|"]
    for key, label, fmt in _ROWS:
        if key in a and key in b:
            f = fmt.format if isinstance(fmt, str) else fmt
            unit = f" ({device.type.upper()})" if key in ("peak_bytes", "step_s", "cpu_s",
                                                          "first_step_s") else ""
            lines.append(f"| {label}{unit} | {f(a[key])} | {f(b[key])} | "
                         f"{_ratio(m['ratios'].get(key))} |")
    if compiled_mode(m["mode"]) and device.type == "cpu":
        lines.append("| peak memory (CPU) | n/a | n/a | MemoryMeter's dispatch mode would run "
                     "the compiled blocks eagerly |")
    if m["mode"] in WHOLE and device.type == "cuda":
        lines.append("| engine GPU time | not told apart | | flexshard's step is one graph: no "
                     "label inside, its copies fused into inductor's kernels |")
    if m["mode"] == "cudagraph":
        lines.append("| peak memory | not measured | | CUDA graphs' pool is outside "
                     "torch.cuda's allocated counters |")
    if compiled_mode(m["mode"]):
        g = [m["sides"][k]["graphs_after_warmup"] for k in (num, den)]
        lines.append(f"| graphs compiled after warm-up (recompiles) | {g[0]} | {g[1]} | |")
        lines.append(f"\ngraphs compiled in the timed steps (both sides): "
                     f"{m['graphs_in_timed_steps']}")
    a_prof, b_prof = (m["sides"][k].get("profile", {}) for k in (num, den))
    if a_prof.get("device_us") and "engine_label_device_us" in a_prof:
        lines += ["", *label_time_table(a_prof, b_prof, (x, y))]
    for kind, prof in ((x, a_prof), (y, b_prof)):
        if "idle" in prof:
            lines += ["", idle_text(kind, prof["idle"])]
    if m["mode"] in WHOLE and device.type == "cuda":
        for kind, prof in ((x, a_prof), (y, b_prof)):
            lines += ["", f"| {kind}: kernel (top by GPU time) | GPU time | launches |",
                      "|---|---|---|"]
            lines += [f"| `{name}` | {us / 1e3:.2f} ms | {count} |"
                      for name, us, count in prof.get("top_kernels", [])]
    if "counts" in m["sides"][num]:
        a_counts, b_counts = m["sides"][num]["counts"], m["sides"][den]["counts"]
        lines += ["", *region_table(a_counts["by_region"], b_counts["by_region"], (x, y)),
                  "", *op_table(a_counts["by_op"], b_counts["by_op"], (x, y))]
    return "\n".join(lines)


def idle_text(kind: str, idle: dict) -> str:
    """One side's profiled step on the GPU: how long every stream idled at once, each
    stream's busy time, the longest idle gaps and what they fell between."""
    streams = ", ".join(f"stream {k} {us / 1e3:.1f} ms" for k, us in
                        sorted(idle["per_stream_us"].items(), key=lambda kv: -kv[1]))
    gaps = "; ".join(f"{us / 1e3:.2f} ms after `{a}` before `{b}`" for us, a, b in idle["gaps"])
    return (f"{kind}: the GPU idled {idle['idle_us'] / 1e3:.2f} ms of the step's "
            f"{idle['span_us'] / 1e3:.2f} ms ({streams}). Longest gaps: {gaps or 'none'}")


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
