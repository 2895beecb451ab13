"""Checkpoints of the training example: flexshard's atomic, resharding DCP checkpoints
(`fs.save_checkpoint` / `fs.load_checkpoint`) plus the loss curve so far.

The loss curve goes to <dir>/losses.json, replaced atomically *before* each
checkpoint is published, so it always covers at least the newest complete
checkpoint's steps; a resumed run keeps its first `step` entries.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch.distributed as dist

import flexshard as fs

KEEP = 2  # complete checkpoints kept; older ones are deleted after a save


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class Checkpointer:
    """Saves every `every` steps (and at the last) under `root`; resumes from the newest."""

    def __init__(self, root: Path, every: int) -> None:
        self.root, self.every = Path(root), every

    @staticmethod
    def holds_steps(root: Path) -> bool:
        """Whether `root` holds checkpoints (a new run there would overwrite its losses)."""
        return Path(root).is_dir() and any(p.name.startswith("step_") for p in Path(root).iterdir())

    def due(self, step: int, last: int) -> bool:
        return self.every > 0 and (step % self.every == 0 or step == last)

    def save(self, step: int, model, opt, losses: list) -> str:
        if _rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = self.root / "losses.json.tmp"
            tmp.write_text(json.dumps(losses))
            os.replace(tmp, self.root / "losses.json")
        return fs.save_checkpoint(str(self.root), model, opt, step, keep=KEEP)

    def load(self, model, opt) -> tuple:
        """Restore model and optimizer in place; returns (step, losses of steps before it)."""
        try:
            step = fs.load_checkpoint(str(self.root), model, opt)
        except FileNotFoundError as e:
            raise FileNotFoundError(f"--resume: {e}; train with --checkpoint-every first, "
                                    "or drop --resume") from None
        losses = json.loads((self.root / "losses.json").read_text())
        if len(losses) < step:
            raise ValueError(f"--resume: {self.root / 'losses.json'} has {len(losses)} losses, "
                             f"fewer than the checkpoint's {step} steps")
        return step, losses[:step]
