"""The CPU allocator's record of a call: bytes at its end, at its peak, live then.

The CPU allocator's own record of a call: bytes allocated minus freed at its
end and at its peak, and what was live at the peak, read from the profiler's raw
"[memory]" events. They see every allocation (inductor's buffers as much as an
eager op's), where a TorchDispatchMode meter sees ops only and would make dynamo
run compiled blocks eagerly."""

from __future__ import annotations

import json
import os
import tempfile

import torch


def allocated(fn) -> tuple:
    """(fn's result, bytes allocated minus freed at the end, at the peak, what was
    live at the peak: a LiveAtPeak) while fn runs.

    Read from the profiler's raw allocator records ("[memory]" events: one per malloc
    and free, its size signed), in time order, from every thread the profiler saw. Not
    from `prof.events()`' per-op self memory: that attribution is not a faithful sum
    (it read 66 to 98 MiB after a forward whose raw records say 36.2 MiB, varying run to
    run). What was live: {(allocating span, op): bytes} over the allocations made
    during fn and not yet freed at the peak."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        out = fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    records = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    live = peak = peak_ts = 0
    held, at_peak = {}, {}
    for e in records:
        size, addr = e["args"]["Bytes"], e["args"]["Addr"]
        live += size
        if size > 0:
            held[addr] = (size, e["ts"])
        else:
            held.pop(addr, None)
        if live > peak:
            peak, at_peak, peak_ts = live, dict(held), e["ts"]
    spans = [e for e in events if e.get("ph") == "X"]
    return out, live, peak, LiveAtPeak(_by_span(at_peak.values(), spans), _running(peak_ts, spans))


class LiveAtPeak(dict):
    """{(span, op): bytes} live at the peak; `running`: the spans running then."""

    def __init__(self, groups: dict, running: str) -> None:
        super().__init__(groups)
        self.running = running


def _running(ts, spans) -> str:
    """The outermost-first chain of non-aten spans running at time `ts`."""
    around = sorted((s for s in spans if s["ts"] <= ts <= s["ts"] + s.get("dur", 0)),
                    key=lambda s: -s.get("dur", 0))
    return " > ".join(s["name"][:40] for s in around
                      if not s["name"].startswith(("aten::", "[", "PyTorch Profiler")))[-160:]


def _by_span(allocations, spans) -> dict:
    """Bytes per (innermost span that is not an aten op, innermost op) at allocation."""
    out: dict = {}
    for size, ts in allocations:
        around = sorted((s for s in spans if s["ts"] <= ts <= s["ts"] + s.get("dur", 0)),
                        key=lambda s: s.get("dur", 0))
        names = [s["name"] for s in around] or ["?"]
        span = next((n for n in names if not n.startswith(("aten::", "["))), names[0])
        key = (span[:48], names[0][:32])
        out[key] = out.get(key, 0) + size
    return out
