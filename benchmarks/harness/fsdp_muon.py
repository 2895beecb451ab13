"""Muon for FSDP2: the honest path an FSDP2 user has to take.

Muon orthogonalizes each 2-D update as a whole matrix, but FSDP2 holds only
this rank's rows. Per matrix this optimizer keeps the momentum on the local
rows (it is elementwise), gathers the update matrix (one all-gather through
DTensor.full_tensor()), runs torch.optim.Muon's Newton-Schulz iteration on
it (on every rank: the redundant compute FSDP2 users pay or trade for a
scatter), and applies this rank's rows. The math is torch.optim.Muon's.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

MUON_DEFAULTS = dict(lr=0.02, weight_decay=0.01, momentum=0.95, nesterov=True,
                     ns_coefficients=(3.4445, -4.775, 2.0315), eps=1e-7, ns_steps=5,
                     adjust_lr_fn=None)


def _row_start(param: DTensor) -> int:
    """First global row of this rank's Shard(0) piece (torch.chunk rows)."""
    if tuple(param.placements) != (Shard(0),):
        raise NotImplementedError(f"GatheredMuon needs Shard(0) matrices, got {param.placements}")
    rows, ws = param.shape[0], param.device_mesh.size()
    chunk = -(-rows // ws)
    return min(rows, param.device_mesh.get_local_rank() * chunk)


class GatheredMuon(torch.optim.Optimizer):
    """torch.optim.Muon over FSDP2's Shard(0) DTensor matrices (see module note)."""

    def __init__(self, params, **overrides) -> None:
        super().__init__(params, {**MUON_DEFAULTS, **overrides})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._update(param, group)

    def _update(self, param: DTensor, group: dict) -> None:
        grad = param.grad.to_local()
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad)
        buf = state["momentum_buffer"]
        buf.lerp_(grad, 1 - group["momentum"])
        update = grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
        full = DTensor.from_local(update, param.device_mesh, param.placements,
                                  shape=param.shape, stride=param.stride()).full_tensor()
        ortho = _zeropower_via_newtonschulz(full, group["ns_coefficients"],
                                            group["ns_steps"], group["eps"])
        local = param.to_local()
        rows = ortho.narrow(0, _row_start(param), local.shape[0])
        local.mul_(1 - group["lr"] * group["weight_decay"])
        local.add_(rows, alpha=-_adjust_lr(group["lr"], group["adjust_lr_fn"], param.shape))
