"""What the training example shows besides the plan: progress, traffic, memory, the loss curve."""

from __future__ import annotations

import resource
import sys
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from flexshard.runtime.state import get_state


class Traffic(NamedTuple):
    """flexshard's collectives and the bytes they moved, summed over buckets."""

    gathers: int
    reduces: int
    wire_bytes: int  # bytes of the collectives' buffers, padding included
    ideal_bytes: int  # the bytes that had to move

    @classmethod
    def zero(cls) -> "Traffic":
        return cls(0, 0, 0, 0)

    @classmethod
    def of(cls, model) -> "Traffic":
        total = cls.zero()
        for b in get_state(model).buckets:
            c = b.counters
            total = total + cls(c.gathers, c.reduces,
                                c.gather_wire_bytes + c.reduce_wire_bytes,
                                c.gather_ideal_bytes + c.reduce_ideal_bytes)
        return total

    def __add__(self, other):  # type: ignore[override]
        return Traffic(*(a + b for a, b in zip(self, other)))

    def __sub__(self, other):
        return Traffic(*(a - b for a, b in zip(self, other)))

    @property
    def padding_bytes(self) -> int:
        return self.wire_bytes - self.ideal_bytes


def peak_memory_bytes(env) -> list:
    """Every rank's peak memory: CUDA max allocated, or the process's max RSS on CPU."""
    if env.device.type == "cuda":
        mine = torch.cuda.max_memory_allocated(env.device)
    else:
        mine = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    peaks = torch.zeros(env.world_size, dtype=torch.float64, device=env.device)
    peaks[env.rank] = mine
    if env.world_size > 1:
        dist.all_reduce(peaks)
    return [int(p) for p in peaks.tolist()]


class _Lines:
    """A progress 'bar' for when tqdm is missing: a line every tenth of the run."""

    def __init__(self, it, initial: int, total: int) -> None:
        self.it, self.total, self.done, self.postfix = it, total, initial, {}
        self.every = max(1, (total - initial) // 10)

    def __iter__(self):
        for x in self.it:
            yield x
            self.done += 1
            if self.done % self.every == 0 or self.done == self.total:
                extra = " ".join(f"{k}={v}" for k, v in self.postfix.items())
                print(f"step {self.done}/{self.total} {extra}", flush=True)

    def set_postfix(self, **kw) -> None:
        self.postfix = kw


class _Silent:
    def __init__(self, it) -> None:
        self.it = it

    def __iter__(self):
        return iter(self.it)

    def set_postfix(self, **kw) -> None:
        pass


def progress(it, enabled: bool, initial: int, total: int):
    """tqdm on rank 0 when installed; plain lines otherwise; nothing on other ranks."""
    if not enabled:
        return _Silent(it)
    try:
        from tqdm import tqdm
    except ImportError:
        return _Lines(it, initial, total)
    return tqdm(it, initial=initial, total=total, desc="train", unit="step",
                dynamic_ncols=True, file=sys.stdout)


def plot_losses(losses: list, path: Path) -> str:
    """Write the loss curve to `path`; says where, or why not (no matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        return "skipped: matplotlib is not installed (pip install 'flexshard[plots]')"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    ax.set_title("flexshard examples/train.py")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)
