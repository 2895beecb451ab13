"""One profiled training step and a text summary of its Chrome trace.

One profiled training step (`python -m benchmarks.gpu --profile DIR`), and a
short text summary of its Chrome trace: device time per stream, where the GPU
idles and between which kernels.

The summary reads the Chrome trace torch.profiler exports (events whose "cat"
is "kernel", "gpu_memcpy" or "gpu_memset" carry "ts", "dur" in microseconds and
"args.stream"), so it is plain JSON arithmetic and is tested on CPU with a
made-up trace. On a CPU run the trace holds no device events and the summary
says so (and lists the busiest CPU ops instead).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, NamedTuple

import torch

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
GAPS_SHOWN = 5


class Gap(NamedTuple):
    start_us: float
    length_us: float
    before: str  # the device event that ended last before the gap
    after: str  # the first device event after it


class TraceSummary(NamedTuple):
    device_events: int
    span_us: float  # first device event start to last device event end
    busy_us: float  # union of device events over all streams
    idle_us: float  # span - busy: no stream runs anything
    per_stream_us: dict  # stream id -> summed durations of its events
    per_category_us: dict  # kernel / memcpy / memset -> summed durations
    gaps: list  # the longest idle gaps, longest first
    top_cpu_ops: list  # (name, total us) of the busiest CPU ops

    def text(self, title: str) -> str:
        lines = [f"== {title}"]
        if not self.device_events:
            lines.append("no device events in the trace (a CPU run): nothing ran on a GPU")
        else:
            busy = 100.0 * self.busy_us / self.span_us if self.span_us else 0.0
            lines.append(f"device span {self.span_us / 1e3:.2f} ms, busy {self.busy_us / 1e3:.2f} "
                         f"ms ({busy:.1f}%), idle {self.idle_us / 1e3:.2f} ms, "
                         f"{self.device_events} device events")
            for stream, us in sorted(self.per_stream_us.items(), key=lambda kv: -kv[1]):
                lines.append(f"  stream {stream}: {us / 1e3:.2f} ms")
            for cat, us in sorted(self.per_category_us.items()):
                lines.append(f"  {cat}: {us / 1e3:.2f} ms")
            for gap in self.gaps:
                lines.append(f"  idle {gap.length_us / 1e3:.3f} ms at +{gap.start_us / 1e3:.2f} ms: "
                             f"after {gap.before[:60]!r}, before {gap.after[:60]!r}")
        if self.top_cpu_ops:
            lines.append("busiest CPU ops (inclusive): " + ", ".join(f"{n} {us / 1e3:.2f} ms"
                                                        for n, us in self.top_cpu_ops))
        return "\n".join(lines)


def summarize_trace(trace: dict, gaps_shown: int = GAPS_SHOWN) -> TraceSummary:
    """The summary of a Chrome trace (torch.profiler's export_chrome_trace)."""
    events = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    device = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES),
                    key=lambda e: e["ts"])
    per_stream: dict = {}
    per_cat: dict = {}
    for e in device:
        stream = (e.get("args") or {}).get("stream", "?")
        per_stream[stream] = per_stream.get(stream, 0.0) + float(e["dur"])
        per_cat[e["cat"]] = per_cat.get(e["cat"], 0.0) + float(e["dur"])
    busy, gaps = _busy_and_gaps(device)
    span = (max(e["ts"] + e["dur"] for e in device) - device[0]["ts"]) if device else 0.0
    gaps.sort(key=lambda g: -g.length_us)
    return TraceSummary(len(device), float(span), busy, float(span) - busy, per_stream, per_cat,
                        gaps[:gaps_shown], _top_cpu_ops(events))


def _busy_and_gaps(device: list) -> tuple:
    """Union length of the (sorted) device events and the gaps between them."""
    busy, gaps = 0.0, []
    if not device:
        return busy, gaps
    origin = device[0]["ts"]
    start, end, last = device[0]["ts"], device[0]["ts"] + device[0]["dur"], device[0]
    for e in device[1:]:
        if e["ts"] > end:  # nothing runs on any stream from `end` to this event
            busy += end - start
            gaps.append(Gap(end - origin, e["ts"] - end, last.get("name", "?"), e.get("name", "?")))
            start = e["ts"]
        if e["ts"] + e["dur"] >= end:
            end, last = e["ts"] + e["dur"], e
    busy += end - start
    return float(busy), gaps


def _top_cpu_ops(events: list, n: int = 5) -> list:
    totals: dict = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cpu_op":
            totals[e["name"]] = totals.get(e["name"], 0.0) + float(e.get("dur", 0.0))
    return sorted(totals.items(), key=lambda kv: -kv[1])[:n]


def record(step: Callable[[], None], device: torch.device, trace_path: Path):
    """Run `step` once under torch.profiler (CPU, and CUDA on a GPU); write its
    Chrome trace to `trace_path`; return the profiler."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    with profile(activities=activities) as prof:
        step()
    prof.export_chrome_trace(str(trace_path))
    return prof


def profile_step(step: Callable[[], None], device: torch.device, out_dir: Path,
                 name: str) -> TraceSummary:
    """Run `step` once under torch.profiler; write `name`.json (the Chrome trace)
    and `name`-summary.txt into `out_dir`; return the summary."""
    def synced() -> None:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    trace_path = out_dir / f"{name}.json"
    record(synced, device, trace_path)
    summary = summarize_trace(json.loads(trace_path.read_text()))
    (out_dir / f"{name}-summary.txt").write_text(summary.text(name) + "\n")
    return summary
