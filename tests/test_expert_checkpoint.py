"""Expert checkpoints: experts on sub-meshes saved and loaded across layouts.

A small MoE (4 experts in one [E, d, h] tensor pair, dense embed, router, norm,
head) trained with AdamW at (ep 2, efsdp 2) on 4 ranks: each expert-parallel
group holds 2 experts as a DTensor sharded over the `ep` mesh (as torchtitan
makes them), sharded by flexshard over its `efsdp` group; the dense params over
all 4 ranks. Checked against one process holding every expert, within 1e-6:

- the first step's gradients (AdamW is blind to their scale) and the params;
- `model.state_dict()` has the unsharded model's keys and global shapes, and the
  checkpoint reads into the plain model and AdamW through DCP alone (params and
  AdamW's exp_avg / exp_avg_sq as one process has them);
- the checkpoint loads at (ep 2, efsdp 2), at ep 1 on 2 ranks (every expert on
  every rank, sharded over 2) and on 1 process, and back; each load gives the
  saved values bit for bit, and the next AdamW step matches one process;
- at (ep 4, efsdp 1), one expert per rank, training matches one process too
  (the experts' grads averaged over the world) and its checkpoint loads at ep 2.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import flexshard as fs
from harness import expect_all_ranks_raise, run_world
from models import batch
from reference import assert_rel_close
from training_helpers import full_grads

pytestmark = pytest.mark.world

EXPERTS, LR, REL = 4, 1e-2, 1e-6
DIM, HIDDEN, VOCAB = 16, 24, 37
BATCHES = 4  # the global batch: 4 rank batches, however many ranks run them
DENSE = ["embed.*", "router.*", "norm.*", "head.*"]


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

        ep, local = dist.get_world_size(self.ep_group), w_in.shape[0]
        recv = all_to_all_single(torch.empty_like(x), x.contiguous(), group=self.ep_group)
        rows = recv.reshape(ep, local, -1, DIM).transpose(0, 1).reshape(-1, DIM)
        y = _mlp(rows, w_in, w_out)
        back = y.reshape(local, ep, -1, DIM).transpose(0, 1).reshape(-1, DIM)
        return all_to_all_single(torch.empty_like(back), back.contiguous(), group=self.ep_group)


def _local(w: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return w.to_local() if isinstance(w, DTensor) else w


def _mlp(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor) -> torch.Tensor:
    x = x.reshape(w_in.shape[0], -1, DIM)
    return torch.bmm(F.gelu(torch.bmm(x, w_in)), w_out).reshape(-1, DIM)


class MoE(nn.Module):
    """Token t goes to expert t % experts, scaled by its router probability."""

    def __init__(self, ep_mesh=None, experts: int = EXPERTS, as_dtensor: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.router = nn.Linear(DIM, experts, bias=False)
        w_in = torch.randn(experts, DIM, HIDDEN) / DIM ** 0.5
        w_out = torch.randn(experts, HIDDEN, DIM) / HIDDEN ** 0.5
        self.experts = Experts(*_expert_params(w_in, w_out, ep_mesh, as_dtensor),
                               None if ep_mesh is None else ep_mesh.get_group())
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens).reshape(-1, DIM)
        expert = torch.arange(h.shape[0]) % self.router.out_features
        gate = F.softmax(self.router(h), dim=-1).gather(1, expert[:, None])
        order = torch.argsort(expert, stable=True)
        y = self.experts(h[order])
        h = h + gate * torch.empty_like(y).index_copy(0, order, y)
        return self.head(self.norm(h)).reshape(*tokens.shape, VOCAB)


def _expert_params(w_in, w_out, ep_mesh, as_dtensor: bool) -> tuple:
    """Every expert, or this ep group's (as DTensors sharded over the ep mesh,
    or as plain tensors: what a checkpoint cannot place)."""
    if ep_mesh is None:
        return w_in, w_out
    from torch.distributed.tensor import DTensor, Shard

    local = w_in.shape[0] // ep_mesh.size()
    first = ep_mesh.get_local_rank() * local
    mine = tuple(w[first:first + local].clone() for w in (w_in, w_out))
    if not as_dtensor:
        return mine
    return tuple(DTensor.from_local(w, ep_mesh, [Shard(0)], run_check=False) for w in mine)


def step_loss(model, step: int, batches) -> torch.Tensor:
    """The mean loss over this process's rank batches of the global batch."""
    losses = []
    for b in batches:
        x, y = batch(step, b, size=4, seq=8, vocab=VOCAB)
        losses.append(F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)))
    return sum(losses) / len(losses)


class Reference(NamedTuple):
    params: list  # after each step: FQN -> tensor
    first_grads: dict  # FQN -> the first step's gradient
    adam: dict  # after 2 steps: FQN -> {exp_avg, exp_avg_sq}


def reference(steps: int) -> Reference:
    """One process, every expert, AdamW."""
    model = MoE()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    params, grads, adam = [], {}, {}
    for step in range(steps):
        step_loss(model, step, range(BATCHES)).backward()
        grads = grads or {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        params.append({k: v.detach().clone() for k, v in model.named_parameters()})
        if step == 1:
            adam = _adam_state(model, opt)
    return Reference(params, grads, adam)


def _adam_state(model, opt) -> dict:
    return {k: {n: opt.state[p][n].clone() for n in ("exp_avg", "exp_avg_sq")}
            for k, p in model.named_parameters()}


def _ep_mesh(ep: int, efsdp: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (ep, efsdp), mesh_dim_names=("ep", "efsdp"))


EP_LAYOUTS = {"ep2": (2, 2), "ep4": (4, 1)}  # (ep, efsdp) on 4 ranks


def wrapped(layout: str, **moe_kw):
    """flex_shard'ed MoE and its AdamW: 'ep2' (2 experts per group, sharded over
    its 2 ranks) or 'ep4' (one expert per rank) on 4 ranks, 'ep1' on 2, 'one' on 1."""
    if layout in EP_LAYOUTS:
        mesh = _ep_mesh(*EP_LAYOUTS[layout])
        buckets = [fs.BucketSpec(["experts.*"], name="experts", mesh=mesh["efsdp"]),
                   fs.BucketSpec(DENSE, name="dense")]
        model = fs.flex_shard(MoE(mesh["ep"], **moe_kw), buckets=buckets,
                              placement=fs.RaggedShard())
    else:
        model = fs.flex_shard(MoE(**moe_kw), placement=fs.RaggedShard())
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def my_batches() -> range:
    """This rank's share of the global batch (4 rank batches over the world)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per = BATCHES // world
    return range(rank * per, (rank + 1) * per)


def train(model, opt, steps, first_grads: dict) -> None:
    for step in steps:
        step_loss(model, step, my_batches()).backward()
        if step == 0:
            first_grads.update(global_grads(model))
        opt.step()
        opt.zero_grad()


def global_grads(model) -> dict:
    """FQN -> the full gradient on every rank, the experts' gathered over ep
    into the global expert tensor (fs.full_grads does both gathers)."""
    return full_grads(model)


class Run(NamedTuple):
    """What one rank saw: full params (fs.full_state_dict) at each point."""

    before: dict  # after training steps 0-1, or after loading another layout's save
    loaded: dict  # a fresh model after loading this run's own save
    after: dict  # the fresh model after step 2
    first_grads: dict  # the first step's global gradients (when this run trained)
    shapes: dict  # model.state_dict(): key -> shape


def save_then_resume(layout: str, directory: str, load_from=None) -> Run:
    """Rank body: train steps 0-1 (or load `load_from` instead), save to
    `directory`, then a fresh model loads it and trains step 2."""
    model, opt = wrapped(layout)
    grads: dict = {}
    if load_from is None:
        train(model, opt, range(2), grads)
    else:
        fs.load_checkpoint(load_from, model, opt)
    before = fs.full_state_dict(model)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    fs.save_checkpoint(directory, model, opt, step=2)
    fresh, fresh_opt = wrapped(layout)
    assert fs.load_checkpoint(directory, fresh, fresh_opt) == 2
    loaded = fs.full_state_dict(fresh)
    train(fresh, fresh_opt, range(2, 3), {})
    return Run(before, loaded, fs.full_state_dict(fresh), grads, shapes)


def read_unsharded(ckpt: str) -> tuple:
    """The plain MoE and AdamW, without flexshard or a process group, loaded
    from a flexshard checkpoint through DCP: (params, AdamW state)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = MoE()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model_sd, optim_sd = get_state_dict(model, opt)  # AdamW's state, initialised to zeros
    holder = {"model": model_sd, "optim": optim_sd, "step": -1}
    with warnings.catch_warnings():  # DCP's note that it loads in a single process
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(holder, checkpoint_id=ckpt)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    assert holder["step"] == 2
    return {k: p.detach() for k, p in model.named_parameters()}, _adam_state(model, opt)


def _check(runs, ref: Reference, saved=None) -> None:
    """Every rank: the save loads bit for bit and step 2 after it matches one
    process; `before` matches one process after 2 steps (or `saved` bitwise)."""
    for run in runs:
        for k, want in (saved or ref.params[1]).items():
            if saved is None:
                assert_rel_close(run.before[k], want, REL, f"after 2 steps: {k}")
            else:
                assert torch.equal(run.before[k], want), f"loaded across layouts: {k}"
            assert torch.equal(run.loaded[k], run.before[k]), f"save and load: {k}"
            assert_rel_close(run.after[k], ref.params[2][k], REL, f"step 2 after the load: {k}")


@pytest.fixture(scope="module")
def ref() -> Reference:
    return reference(3)


@pytest.fixture(scope="module")
def ep2(tmp_path_factory) -> tuple:
    """The (ep 2, efsdp 2) run on 4 ranks: (its checkpoint directory, runs)."""
    root = tmp_path_factory.mktemp("experts")
    return root, run_world(4, save_then_resume, "ep2", str(root / "ep2"))


def test_training_at_ep2_matches_one_process(ref, ep2):
    _check_trained(ep2[1], ref)


def _check_trained(runs, ref: Reference) -> None:
    unsharded = {k: tuple(v.shape) for k, v in MoE().state_dict().items()}
    for rank, run in enumerate(runs):
        assert run.first_grads.keys() == ref.first_grads.keys()
        for k, want in ref.first_grads.items():
            assert_rel_close(run.first_grads[k], want, REL, f"rank {rank} first grad of {k}")
        assert run.shapes == unsharded, f"rank {rank}: state_dict keys or shapes"
    _check(runs, ref)


def test_ep2_checkpoint_reads_into_the_unsharded_model(ref, ep2):
    root, _ = ep2
    params, adam = read_unsharded(str(root / "ep2" / "step_00000002"))
    for k, want in ref.params[1].items():
        assert_rel_close(params[k], want, REL, k)
        for name, state in ref.adam[k].items():
            assert_rel_close(adam[k][name], state, REL, f"{k}.{name}")


def test_expert_checkpoints_move_between_layouts(ref, ep2):
    root, runs = ep2
    saved = runs[0].before  # the global experts after 2 steps, as fs.full_state_dict gives them
    assert saved["experts.w_in"].shape == (EXPERTS, DIM, HIDDEN)
    ep1 = run_world(2, save_then_resume, "ep1", str(root / "ep1"), str(root / "ep2"))
    _check(ep1, ref, saved)
    one = run_world(1, save_then_resume, "one", str(root / "one"), str(root / "ep1"))
    _check(one, ref, saved)
    back = run_world(4, save_then_resume, "ep2", str(root / "back"), str(root / "one"))
    _check(back, ref, saved)


def test_one_expert_per_rank(ref, ep2):
    """(ep 4, efsdp 1): each group is one rank holding one expert, which flexshard
    does not shard but still divides its grads by the world size."""
    root, _ = ep2
    ep4 = run_world(4, save_then_resume, "ep4", str(root / "ep4"))
    _check_trained(ep4, ref)
    back = run_world(4, save_then_resume, "ep2", str(root / "ep4_to_ep2"), str(root / "ep4"))
    _check(back, ref, ep4[0].before)


# Bad input: every rank raises, naming the bucket or key and the fix.


def _load_plain_experts(directory: str) -> None:
    model, opt = wrapped("ep2", as_dtensor=False)
    fs.load_checkpoint(directory, model, opt)


def _load_other_expert_count(directory: str) -> None:
    model, opt = wrapped("ep2", experts=2 * EXPERTS)
    fs.load_checkpoint(directory, model, opt)


def test_bad_input(ep2):
    root, _ = ep2
    ckpt = str(root / "ep2")
    expect_all_ranks_raise(4, _load_plain_experts, ValueError,
                           r"load_checkpoint: bucket 'experts' runs on its own mesh of 2 of the "
                           r"model's 4 ranks, and its parameter 'experts\.w_in' is a plain "
                           r"tensor.*DTensor\.from_local\(local_experts, mesh\['ep'\], "
                           r"\[Shard\(0\)\]\)", ckpt)
    expect_all_ranks_raise(4, _load_other_expert_count, ValueError,
                           r"checkpoint '.*step_00000002': 'model\.router\.weight' has shape "
                           r"\(4, 16\) but the model's is \(8, 16\); load it into the same model",
                           ckpt)
