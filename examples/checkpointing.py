"""Atomic checkpoints of the training example with torch.distributed.checkpoint (DCP).

Layout: <dir>/step_000050/ holds the DCP files of model and optimizer plus
train.json (step, loss curve). A save writes <dir>/step_000050.tmp/ first and
rank 0 renames it when every rank has finished, so a crash mid-save leaves
the previous checkpoint as the newest complete one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from flexshard.state import get_state

KEEP = 2  # complete checkpoints kept; older ones are deleted after a save


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def check_dcp_ready(model) -> None:
    """NotImplementedError unless the model's state dict describes global tensors:
    a rank's local shard saved as if it were the whole tensor is a corrupt checkpoint."""
    state = get_state(model)
    if state.world_size == 1:
        return
    shapes = {s.fqn: tuple(s.shape) for b in state.buckets for s in b.slots}
    for fqn, value in model.state_dict().items():
        if fqn in shapes and type(value) is torch.Tensor and tuple(value.shape) != shapes[fqn]:
            raise NotImplementedError(
                f"checkpointing needs flexshard state dicts that DCP can reshard: "
                f"{fqn!r} comes back as a plain local shard of shape {tuple(value.shape)} "
                f"(full shape {shapes[fqn]}); this flexshard lacks the checkpoint feature")


class Checkpointer:
    """Saves every `every` steps (and at the last) under `root`; loads the newest."""

    def __init__(self, root: Path, every: int) -> None:
        self.root, self.every = Path(root), every

    def due(self, step: int, last: int) -> bool:
        return self.every > 0 and (step % self.every == 0 or step == last)

    def latest(self) -> Optional[Path]:
        done = sorted(p for p in self.root.glob("step_*") if p.is_dir() and p.suffix != ".tmp")
        return done[-1] if done else None

    def save(self, step: int, model, opt, losses: list) -> Path:
        check_dcp_ready(model)
        final = self.root / f"step_{step:06d}"
        tmp = self.root / f"step_{step:06d}.tmp"
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
        if _rank() == 0:
            (tmp / "train.json").write_text(json.dumps({"step": step, "losses": losses}))
        _barrier()
        if _rank() == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            for old in sorted(p for p in self.root.glob("step_*") if p.suffix != ".tmp")[:-KEEP]:
                shutil.rmtree(old, ignore_errors=True)
        _barrier()
        return final

    def load(self, model, opt) -> tuple:
        """Restore model and optimizer in place; returns (step, losses so far)."""
        check_dcp_ready(model)
        path = self.latest()
        if path is None:
            raise FileNotFoundError(f"--resume: no complete checkpoint (step_*/) in {self.root}; "
                                    "train with --checkpoint-every first, or drop --resume")
        meta = json.loads((path / "train.json").read_text())
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        return meta["step"], list(meta["losses"])
