"""Expert checkpoints: experts on sub-meshes saved and loaded across layouts.

A small MoE (4 experts in one [E, d, h] tensor pair, dense embed, router, norm,
head) trained with AdamW at (ep 2, efsdp 2) on 4 ranks: each expert-parallel
group holds 2 experts as a DTensor sharded over the `ep` mesh (as torchtitan
makes them), sharded by flexshard over its `efsdp` group; the dense params over
all 4 ranks. The checkpoint is loaded at (ep 2, efsdp 2), at ep 1 on 2 ranks
(every expert on every rank, sharded over 2) and on 1 process, and back; each
load gives the saved values bit for bit, and the next AdamW step (optimizer
state included) matches one process holding every expert.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import flexshard as fs
from harness import run_world
from models import batch
from reference import assert_rel_close

pytestmark = pytest.mark.world

EP, EXPERTS, LR = 2, 4, 1e-2
DIM, HIDDEN, VOCAB = 16, 24, 37
BATCHES = 4  # the global batch: 4 rank batches, however many ranks run them


class Experts(nn.Module):
    """The local experts (all of them without expert parallelism). With an ep
    group, rows grouped by expert go to the peer holding their expert by an even
    all-to-all and come back the same way."""

    def __init__(self, w_in, w_out, ep_group) -> None:
        super().__init__()
        self.w_in, self.w_out, self.ep_group = nn.Parameter(w_in), nn.Parameter(w_out), ep_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w_in, w_out = (_local(w) for w in (self.w_in, self.w_out))
        if self.ep_group is None:
            return _mlp(x, w_in, w_out)
        from torch.distributed.nn.functional import all_to_all_single

        recv = all_to_all_single(torch.empty_like(x), x.contiguous(), group=self.ep_group)
        local = w_in.shape[0]
        rows = recv.reshape(EP, local, -1, DIM).transpose(0, 1).reshape(-1, DIM)
        y = _mlp(rows, w_in, w_out)
        back = y.reshape(local, EP, -1, DIM).transpose(0, 1).reshape(-1, DIM)
        return all_to_all_single(torch.empty_like(back), back.contiguous(), group=self.ep_group)


def _local(w: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return w.to_local() if isinstance(w, DTensor) else w


def _mlp(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor) -> torch.Tensor:
    x = x.reshape(w_in.shape[0], -1, DIM)
    return torch.bmm(F.gelu(torch.bmm(x, w_in)), w_out).reshape(-1, DIM)


class MoE(nn.Module):
    """Token t goes to expert t % EXPERTS, scaled by its router probability."""

    def __init__(self, ep_mesh=None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        w_in = torch.randn(EXPERTS, DIM, HIDDEN) / DIM ** 0.5
        w_out = torch.randn(EXPERTS, HIDDEN, DIM) / HIDDEN ** 0.5
        self.experts = Experts(*_expert_params(w_in, w_out, ep_mesh),
                               None if ep_mesh is None else ep_mesh.get_group())
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens).reshape(-1, DIM)
        expert = torch.arange(h.shape[0]) % EXPERTS
        gate = F.softmax(self.router(h), dim=-1).gather(1, expert[:, None])
        order = torch.argsort(expert, stable=True)
        y = self.experts(h[order])
        h = h + gate * torch.empty_like(y).index_copy(0, order, y)
        return self.head(self.norm(h)).reshape(*tokens.shape, VOCAB)


def _expert_params(w_in, w_out, ep_mesh) -> tuple:
    """Every expert, or this ep group's as DTensors sharded over the ep mesh."""
    if ep_mesh is None:
        return w_in, w_out
    from torch.distributed.tensor import DTensor, Shard

    local = EXPERTS // EP
    first = ep_mesh.get_local_rank() * local
    return tuple(DTensor.from_local(w[first:first + local].clone(), ep_mesh, [Shard(0)],
                                    run_check=False) for w in (w_in, w_out))


def step_loss(model, step: int, batches) -> torch.Tensor:
    """The mean loss over this process's rank batches of the global batch."""
    losses = []
    for b in batches:
        x, y = batch(step, b, size=4, seq=8, vocab=VOCAB)
        losses.append(F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)))
    return sum(losses) / len(losses)


def reference(steps: int) -> list:
    """One process, every expert, AdamW: the params after each step."""
    model = MoE()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out = []
    for step in range(steps):
        step_loss(model, step, range(BATCHES)).backward()
        opt.step()
        opt.zero_grad()
        out.append({k: v.detach().clone() for k, v in model.named_parameters()})
    return out


def wrapped(layout: str):
    """flex_shard'ed MoE and its AdamW: 'ep2' on 4 ranks, 'ep1' on 2, 'one' on 1."""
    if layout == "ep2":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (EP, 2), mesh_dim_names=("ep", "efsdp"))
        model = MoE(mesh["ep"])
        buckets = [fs.BucketSpec(["experts.*"], name="experts", mesh=mesh["efsdp"]),
                   fs.BucketSpec(["embed.*", "router.*", "norm.*", "head.*"], name="dense")]
        model = fs.flex_shard(model, buckets=buckets, placement=fs.RaggedShard())
    else:
        model = fs.flex_shard(MoE(), placement=fs.RaggedShard())
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def my_batches() -> range:
    """This rank's share of the global batch (4 rank batches over the world)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per = BATCHES // world
    return range(rank * per, (rank + 1) * per)


def train(model, opt, steps) -> None:
    for step in steps:
        step_loss(model, step, my_batches()).backward()
        opt.step()
        opt.zero_grad()


def save_then_resume(layout: str, directory: str, load_from=None) -> tuple:
    """Rank body: train steps 0-1 (or load `load_from` instead), save to
    `directory`, then a fresh model loads it and trains step 2:
    (full params after the first part, after the load, after step 2)."""
    model, opt = wrapped(layout)
    if load_from is None:
        train(model, opt, range(2))
    else:
        fs.load_checkpoint(load_from, model, opt)
    before = fs.full_state_dict(model)
    fs.save_checkpoint(directory, model, opt, step=2)
    fresh, fresh_opt = wrapped(layout)
    assert fs.load_checkpoint(directory, fresh, fresh_opt) == 2
    loaded = fs.full_state_dict(fresh)
    train(fresh, fresh_opt, range(2, 3))
    return before, loaded, fs.full_state_dict(fresh)


def _check(results, ref_after: list, saved=None) -> None:
    for before, loaded, after in results:
        for k, want in (saved or ref_after[1]).items():
            if saved is None:
                assert_rel_close(before[k], want, 1e-5, f"after 2 steps: {k}")
            else:
                assert torch.equal(before[k], want), f"loaded across layouts: {k}"
            assert torch.equal(loaded[k], before[k]), f"save and load: {k}"
            assert_rel_close(after[k], ref_after[2][k], 1e-5, f"step 2 after the load: {k}")


def test_expert_checkpoints_move_between_layouts(tmp_path):
    ref = reference(3)
    ep2 = run_world(4, save_then_resume, "ep2", str(tmp_path / "ep2"))
    _check(ep2, ref)
    saved = ep2[0][0]  # the global experts at step 2, as fs.full_state_dict gives them
    assert saved["experts.w_in"].shape == (EXPERTS, DIM, HIDDEN)
    ep1 = run_world(2, save_then_resume, "ep1", str(tmp_path / "ep1"), str(tmp_path / "ep2"))
    _check(ep1, ref, saved)
    one = run_world(1, save_then_resume, "one", str(tmp_path / "one"), str(tmp_path / "ep1"))
    _check(one, ref, saved)
    back = run_world(4, save_then_resume, "ep2", str(tmp_path / "back"), str(tmp_path / "one"))
    _check(back, ref, saved)
