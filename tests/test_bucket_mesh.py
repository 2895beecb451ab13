"""A mesh per bucket (BucketSpec(mesh=...)): a small MoE at 4 ranks whose experts
differ across 2 expert-parallel groups, tokens routed with an even all-to-all,
each group's experts sharded over its own 2 ranks, dense layers over all 4
(and over a 2-D HSDP mesh), against one process that holds every expert.

Mesh (ep=2, efsdp=2) = [[0, 1], [2, 3]]: ranks 0 and 1 hold experts 0 and 1,
sharded over {0, 1}; ranks 2 and 3 hold experts 2 and 3, sharded over {2, 3};
tokens travel between ep peers {0, 2} and {1, 3}.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import flexshard as fs
from compile_check import compiled_graph_calls, counting_backend
from harness import expect_all_ranks_raise, run_world
from models import batch
from reference import assert_rel_close
from training_helpers import GroupComm, NoCollectives

pytestmark = pytest.mark.world

WORLD, EP, EXPERTS, STEPS, LR, MAX_NORM = 4, 2, 4, 3, 1e-2, 0.3
DIM, HIDDEN, VOCAB = 16, 24, 37


class Experts(nn.Module):
    """`local` experts (a slice of EXPERTS), each a GELU MLP. Given rows grouped
    by expert (EXPERTS equal groups), with an ep group it sends each ep peer the
    groups of its experts (an even all-to-all) and brings the outputs back."""

    def __init__(self, first: int, local: int, ep_group) -> None:
        super().__init__()
        w_in = torch.randn(EXPERTS, DIM, HIDDEN) / DIM ** 0.5
        w_out = torch.randn(EXPERTS, HIDDEN, DIM) / HIDDEN ** 0.5
        self.w_in = nn.Parameter(w_in[first:first + local].clone())
        self.w_out = nn.Parameter(w_out[first:first + local].clone())
        self.ep_group = ep_group
        self.traced = False  # the all-to-all as a functional collective (fs.compile's graph)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ep_group is None:
            return self._apply(x, EXPERTS)
        # Every peer's rows for our experts, peer-major: (EP, local experts, rows, DIM).
        recv = self._all_to_all(x)
        local = self.w_in.shape[0]
        rows = recv.reshape(EP, local, -1, DIM).transpose(0, 1).reshape(-1, DIM)
        y = self._apply(rows, local)
        back = y.reshape(local, EP, -1, DIM).transpose(0, 1).reshape(-1, DIM)
        return self._all_to_all(back)

    def _all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        if self.traced:
            from torch.distributed._functional_collectives import all_to_all_single_autograd

            return all_to_all_single_autograd(x.contiguous(), None, None, self.ep_group)
        from torch.distributed.nn.functional import all_to_all_single

        return all_to_all_single(torch.empty_like(x), x.contiguous(), group=self.ep_group)

    def _apply(self, x: torch.Tensor, groups: int) -> torch.Tensor:
        x = x.reshape(groups, -1, DIM)
        return torch.bmm(F.gelu(torch.bmm(x, self.w_in)), self.w_out).reshape(-1, DIM)


class MoE(nn.Module):
    """Embedding, a router, experts, a norm and a head. Token t of a rank's batch
    goes to expert t % EXPERTS, scaled by its router probability (so the
    router learns too)."""

    def __init__(self, first: int = 0, local: int = EXPERTS, ep_group=None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = Experts(first, local, ep_group)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens).reshape(-1, DIM)
        expert = torch.arange(h.shape[0]) % EXPERTS
        gate = F.softmax(self.router(h), dim=-1).gather(1, expert[:, None])
        order = torch.argsort(expert, stable=True)  # grouped by expert: an even split
        y = self.experts(h[order])
        h = h + gate * torch.empty_like(y).index_copy(0, order, y)
        return self.head(self.norm(h)).reshape(*tokens.shape, VOCAB)


def moe_loss(model, step: int, rank: int) -> torch.Tensor:
    x, y = batch(step, rank, size=4, seq=8, vocab=VOCAB)  # 32 tokens: 8 per expert
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def reference(steps: int) -> tuple:
    """One process, every expert: the mean of the 4 ranks' losses, clipped AdamW."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = MoE()
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        losses, norms = [], []
        for step in range(steps):
            loss = sum(moe_loss(model, step, r) for r in range(WORLD)) / WORLD
            loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, norms, {k: v.detach().clone() for k, v in model.named_parameters()}
    finally:
        torch.set_num_threads(threads)


def _meshes():
    from torch.distributed.device_mesh import init_device_mesh

    ep = init_device_mesh("cpu", (EP, WORLD // EP), mesh_dim_names=("ep", "efsdp"))
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return ep, hsdp


def _wrap(dense_hsdp: bool, comm=None):
    ep, hsdp = _meshes()
    p = ep.get_coordinate()[0]  # this rank's expert-parallel index
    model = MoE(first=p * (EXPERTS // EP), local=EXPERTS // EP, ep_group=ep.get_group("ep"))
    buckets = [fs.BucketSpec(["experts.*"], name="experts", mesh=ep["efsdp"]),
               fs.BucketSpec(["router.*"], name="router"),
               fs.BucketSpec(["embed.*", "norm.*", "head.*"], name="dense",
                             mesh=hsdp if dense_hsdp else None)]
    return fs.flex_shard(model, buckets=buckets, placement=fs.RaggedShard(), comm=comm), p


def train_moe(dense_hsdp: bool, whole: bool = False) -> tuple:
    """Rank body: (losses, norms, full params, collectives of the last step, plan),
    and with `whole`, through fs.compile: (the compiled graphs' collectives,
    compiled graph calls and graph breaks) instead of the collectives."""
    comm = GroupComm()
    model, p = _wrap(dense_hsdp, comm)
    graphs, graph_calls = [], []
    if whole:
        torch._dynamo.reset()
        counters.clear()
        model.experts.traced = True
        fs.compile(model, fullgraph=True, backend=counting_backend(graphs))
    opt = torch.optim.AdamW([q for q in model.parameters() if q.numel()], lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        comm.calls.clear()
        loss = moe_loss(model, step, dist.get_rank())
        graph_calls.append(compiled_graph_calls(loss))
        loss.backward()
        calls = dict(comm.calls)
        norms.append(fs.clip_grad_norm_(model, MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / WORLD)
    if whole:
        breaks = sum(counters["graph_break"].values()) + sum(counters["unimplemented"].values())
        calls = (graphs, graph_calls, breaks)
    return losses, norms, p, fs.full_state_dict(model), calls, fs.describe(model)


@pytest.mark.parametrize("dense_hsdp", [False, True])
def test_moe_parity(dense_hsdp):
    ref_losses, ref_norms, ref_params = reference(STEPS)
    results = run_world(WORLD, train_moe, dense_hsdp, timeout=300)
    assert all(n > MAX_NORM for n in ref_norms), "the test must actually clip"
    local = EXPERTS // EP
    for rank, (losses, norms, p, full, calls, plan) in enumerate(results):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5,
                                   atol=1e-6, msg=lambda m: f"rank {rank}: {m}")
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5,
                                   atol=0, msg=lambda m: f"rank {rank} grad norms: {m}")
        for k, ref in ref_params.items():
            if k.startswith("experts."):  # this group's experts, gathered over its 2 ranks
                ref = ref[p * local:(p + 1) * local]
            assert_rel_close(full[k], ref, 1e-5, f"rank {rank}: {k}")
        group, everyone = ((0, 1) if rank < 2 else (2, 3)), (0, 1, 2, 3)
        dense_group = group if dense_hsdp else everyone
        # Per step: experts within their group and the router over all 4 (each
        # regathered in backward), the root's dense layers over all 4 or, on the
        # HSDP mesh, within (0,1)/(2,3) and then across them.
        want = Counter({("all_gather", group): 2, ("reduce_scatter", group): 1,
                        ("all_gather", everyone): 2, ("reduce_scatter", everyone): 1})
        want[("all_gather", dense_group)] += 1
        want[("reduce_scatter", dense_group)] += 1
        if dense_hsdp:
            want[("all_reduce", (rank % 2, rank % 2 + 2))] = 1
        assert calls == dict(want), f"rank {rank}: {calls}"
        shapes = {b.name: len(b.local_bytes) for b in plan.buckets}
        assert shapes == {"experts": 2, "router": 4, "dense": 2 if dense_hsdp else 4}
        assert plan.buckets[0].reshard_after_forward is True
        assert plan.buckets[2].all_reduces_per_step == int(dense_hsdp)


# torch.amp.GradScaler with one optimizer for the experts and one for the rest: an inf
# in ep group 0's experts skips the experts' step on all 4 ranks (ranks 2 and 3 hold
# other experts, all finite), as one process holding every expert skips it.


def scaled_moe_steps(model, loss_of, poison) -> tuple:
    """SGD under GradScaler("cpu"), two optimizers; `poison(model)` after step 1's
    backward: (steps whose scale dropped, final scale)."""
    experts = [q for q in model.experts.parameters() if q.numel()]
    rest = [q for n, q in model.named_parameters() if not n.startswith("experts.")]
    opts = [torch.optim.SGD(experts, lr=LR), torch.optim.SGD(rest, lr=LR)]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    skipped = []
    for step in range(STEPS):
        scaler.scale(loss_of(model, step)).backward()
        if step == 1:
            poison(model)
        scale = scaler.get_scale()
        for opt in opts:
            scaler.step(opt)
        scaler.update()
        for opt in opts:
            opt.zero_grad()
        skipped.append(scaler.get_scale() < scale)
    return skipped, scaler.get_scale()


def _poison_rank0_expert(model):
    if dist.get_rank() == 0:  # a piece of expert 0 or 1 (ep group 0): none of ranks 2, 3's
        model.experts.w_in.grad.view(-1)[0] = float("inf")


def scaled_moe() -> tuple:
    model, p = _wrap(dense_hsdp=True)
    rank = dist.get_rank()
    result = scaled_moe_steps(model, lambda m, step: moe_loss(m, step, rank),
                              _poison_rank0_expert)
    return result, p, fs.full_state_dict(model)


def _poison_expert0(model):
    model.experts.w_in.grad[0, 0, 0] = float("inf")


def _mean_loss(model, step: int) -> torch.Tensor:
    return sum(moe_loss(model, step, r) for r in range(WORLD)) / WORLD


def test_grad_scaler_skips_the_experts_step_on_every_rank():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref_model = MoE()
        ref = scaled_moe_steps(ref_model, _mean_loss, _poison_expert0)
    finally:
        torch.set_num_threads(threads)
    assert ref == ([False, True, False], 8.0)
    local = EXPERTS // EP
    for rank, (result, p, full) in enumerate(run_world(WORLD, scaled_moe, timeout=300)):
        assert result == ref, f"rank {rank}"
        for k, want in ref_model.named_parameters():
            if k.startswith("experts."):
                want = want[p * local:(p + 1) * local]
            assert_rel_close(full[k], want.detach(), 1e-5, f"rank {rank}: {k}")


@pytest.mark.parametrize("dense_hsdp", [False, True])
def test_moe_whole_step_compile(dense_hsdp):
    """fs.compile of the MoE: the experts' bucket gathers and reduces over its own
    2 ranks inside the graph, beside the router's over all 4, the all-to-alls and
    (on the HSDP mesh) the dense layers' all-reduce across replicas; the same
    losses, clipped grad norms (flexshard's, weighted per bucket mesh) and params
    as one process."""
    ref_losses, ref_norms, ref_params = reference(STEPS)
    results = run_world(WORLD, train_moe, dense_hsdp, True, timeout=300)
    local = EXPERTS // EP
    for rank, (losses, norms, p, full, (graphs, graph_calls, breaks), _) in enumerate(results):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5,
                                   atol=1e-6, msg=lambda m: f"rank {rank}: {m}")
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5,
                                   atol=0, msg=lambda m: f"rank {rank} grad norms: {m}")
        for k, ref in ref_params.items():
            if k.startswith("experts."):
                ref = ref[p * local:(p + 1) * local]
            assert_rel_close(full[k], ref, 1e-5, f"rank {rank}: {k}")
        assert breaks == 0 and graph_calls == [1] * STEPS, (rank, breaks, graph_calls)
        # experts and router each gather in forward and again in backward (resharded),
        # the root's dense layers once; each bucket reduces once
        assert graphs == [
            ("forward", {"all_gather_into_tensor_coalesced": 3,
                         "reduce_scatter_tensor_coalesced": 0, "all_reduce": 0,
                         "all_reduce_coalesced": 0}),
            ("backward", {"all_gather_into_tensor_coalesced": 2,
                          "reduce_scatter_tensor_coalesced": 3,
                          "all_reduce": int(dense_hsdp), "all_reduce_coalesced": 0})], graphs


# Bad input: every rank raises before any collective.


def _bucket_mesh_outside_world():
    from torch.distributed.device_mesh import init_device_mesh

    world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    # flex_shard over the pair {0, 1} / {2, 3}, the experts over the other pair dim.
    fs.flex_shard(MoE(), world["b"], comm=NoCollectives(),
                  buckets=[fs.BucketSpec(["experts.*"], name="experts", mesh=world["a"]),
                           fs.BucketSpec(["embed.*", "router.*", "norm.*", "head.*"])])


def _owner_outside_bucket_mesh():
    ep, _ = _meshes()
    fs.flex_shard(MoE(), comm=NoCollectives(),
                  buckets=[fs.BucketSpec(["experts.*"], name="experts", mesh=ep["efsdp"],
                                         placement=fs.Owned(rank=2)),
                           fs.BucketSpec(["embed.*", "router.*", "norm.*", "head.*"])])


def _reshard_not_dividing_bucket_mesh():
    ep, _ = _meshes()
    fs.flex_shard(MoE(), comm=NoCollectives(), reshard_after_forward=4,
                  buckets=[fs.BucketSpec(["experts.*"], name="experts", mesh=ep["efsdp"]),
                           fs.BucketSpec(["embed.*", "router.*", "norm.*", "head.*"],
                                         name="dense")])


def _three_dim_bucket_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    cube = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("a", "b", "c"))
    fs.flex_shard(MoE(), comm=NoCollectives(),
                  buckets=[fs.BucketSpec(["experts.*"], name="experts", mesh=cube),
                           fs.BucketSpec(["embed.*", "router.*", "norm.*", "head.*"])])


def _save_expert_checkpoint(directory):
    model, _ = _wrap(False)
    fs.save_checkpoint(directory, model, torch.optim.AdamW(model.parameters()), step=1)


def test_bad_input(tmp_path):
    expect_all_ranks_raise(WORLD, _bucket_mesh_outside_world, ValueError,
                           r"bucket 'experts': its mesh holds rank\(s\) \[\d\] outside "
                           r"flex_shard's mesh of ranks \[\d, \d\]; a bucket's mesh must be a "
                           r"sub-mesh or flattening of flex_shard's")
    expect_all_ranks_raise(WORLD, _three_dim_bucket_mesh, ValueError,
                           r"bucket 'experts': its mesh must be 1-D \(shard\) or 2-D \(HSDP: "
                           r"replicate, shard\), got a 3-D mesh of shape \(1, 2, 2\)")
    expect_all_ranks_raise(WORLD, _owner_outside_bucket_mesh, ValueError,
                           r"parameter 'experts\.w_\w+' in bucket 'experts': Owned\(rank=2\) is outside "
                           r"the world of 2 rank\(s\).*the bucket's own mesh \(1, 2\)")
    expect_all_ranks_raise(WORLD, _reshard_not_dividing_bucket_mesh, ValueError,
                           r"bucket 'experts': reshard_after_forward=4 does not divide its shard "
                           r"group of 2 rank\(s\)")
    expect_all_ranks_raise(WORLD, _save_expert_checkpoint, ValueError,
                           r"save_checkpoint: bucket 'experts' runs on its own mesh of 2 of the "
                           r"model's 4 ranks, and its parameter 'experts\.w_\w+' is a plain "
                           r"tensor.*DTensor\.from_local\(local_experts, mesh\['ep'\], "
                           r"\[Shard\(0\)\]\)", str(tmp_path))
