"""Tensor parallelism: a Llama-style model parallelized with torch's
parallelize_module on mesh["tp"] of a (dp 2, tp 2) mesh, flex-sharded over
mesh["dp"], against a single process trained on both dp ranks' batches.

Every case runs in the one 4-rank world; each rank body runs several cases.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import flexshard as fs
from compile_check import compiled_graph_calls, counting_backend
from flexshard.runtime.state import get_state
from harness import expect_all_ranks_raise, run_world
from reference import assert_rel_close, average_grads
from tp_model import batch, dp_tp_mesh, loss_fn, make_llama, tensor_parallel

pytestmark = pytest.mark.world

WORLD, DP = 4, 2
STEPS = 5
LR = 1e-2
BF16 = fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
PLACEMENTS = {"shard0": fs.Shard(0), "ragged": fs.RaggedShard(), "owned": fs.Owned()}
# (placement, reshard after forward, bf16 compute)
CASES = [("shard0", True, False), ("shard0", False, False), ("ragged", True, False),
         ("ragged", False, False), ("owned", True, False), ("shard0", True, True),
         ("ragged", False, True)]


def tp_model(mesh, placement="shard0", reshard=True, bf16=False, **kw):
    """The TP model on mesh['tp'], flex-sharded over mesh['dp']."""
    model = tensor_parallel(make_llama(), mesh["tp"])
    return fs.flex_shard(model, mesh["dp"], placement=PLACEMENTS[placement],
                         reshard_after_forward=reshard, mp_policy=BF16 if bf16 else
                         fs.MixedPrecisionPolicy(), **kw)


def train_steps(model, dp_rank, opt, steps, first=0, step_fn=None, on_loss=None) -> list:
    """Optimizer steps on this dp rank's batches; per-step losses averaged over dp."""
    world = dist.get_world_size()
    losses = []
    for step in range(first, first + steps):
        x, y = batch(step, dp_rank)
        loss = loss_fn(model(x), y)
        if on_loss is not None:
            on_loss(loss)
        loss.backward()
        if step_fn is not None:
            step_fn(model)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)  # the tp ranks of a dp rank hold the same loss
        losses.append(mean.item() / world)
    return losses


def train_cases(cases) -> list:
    """Rank body: every case in turn; (losses, full params, DTensor names in forward)."""
    mesh = dp_tp_mesh()
    out = []
    for placement, reshard, bf16 in cases:
        model = tp_model(mesh, placement, reshard, bf16)
        seen = _dtensors_in_forward(model)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        losses = train_steps(model, mesh.get_local_rank(0), opt, STEPS)
        out.append((losses, fs.full_state_dict(model), sorted(seen)))
    return out


def _dtensors_in_forward(model) -> set:
    """The names of params that are DTensors while their block's forward runs."""
    from torch.distributed.tensor import DTensor

    seen: set = set()

    def record(module, prefix):
        for name, p in module.named_parameters():
            if isinstance(p, DTensor):
                seen.add(prefix + name)

    for i, block in enumerate(model.layers):
        # flexshard's pre-forward hook, registered first, has installed the unsharded params.
        block.register_forward_pre_hook(lambda m, a, i=i: record(m, f"layers.{i}."))
    return seen


def reference(steps: int = STEPS, param_dtype=None, step_fn=None, sgd=False) -> tuple:
    """One process on both dp ranks' batches: (losses, params)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the harness workers
    try:
        model = make_llama()
        opt = _optimizer(model, sgd)
        losses = []
        for step in range(steps):
            losses.append(_reference_grads(model, step, param_dtype))
            if step_fn is not None:
                step_fn(model)
            opt.step()
            opt.zero_grad()
        return losses, {k: v.detach().clone() for k, v in model.named_parameters()}
    finally:
        torch.set_num_threads(threads)


def _optimizer(model, sgd: bool):
    # SGD's step scales with the gradient: it pins the mean over dp that AdamW hides.
    if sgd:
        return torch.optim.SGD(model.parameters(), lr=0.5)
    return torch.optim.AdamW(model.parameters(), lr=LR)


def sgd_training() -> tuple:
    mesh = dp_tp_mesh()
    model = tp_model(mesh, "ragged")
    losses = train_steps(model, mesh.get_local_rank(0), _optimizer(model, True), 3)
    return losses, fs.full_state_dict(model)


def test_sgd_steps_pin_the_mean_over_dp():
    losses, full = run_world(WORLD, sgd_training)[0]
    ref_losses, ref_params = reference(steps=3, sgd=True)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for k, ref in ref_params.items():
        assert_rel_close(full[k], ref, 1e-5, k)


def _reference_grads(model, step, param_dtype) -> float:
    if param_dtype is None:
        xs, ys = zip(*(batch(step, r) for r in range(DP)))
        loss = loss_fn(model(torch.cat(xs)), torch.cat(ys))
        loss.backward()
        return loss.item()
    # Mixed precision: each dp rank's batch on a low-precision copy, fp32 grads averaged.
    return average_grads(model, step, DP, param_dtype, batch, loss_fn)


def tp_reference_bf16() -> tuple:
    """Rank body: the bf16 reference for TP, which no single process reproduces
    (a rowwise layer's partial sums round in bf16 per tp rank): the TP model
    without flex_shard, each step's forward and backward on a bf16 copy, the fp32
    grads averaged over dp by hand, AdamW on the fp32 DTensor params."""
    from torch.distributed.tensor import DTensor

    mesh = dp_tp_mesh()
    model = tensor_parallel(make_llama(), mesh["tp"])
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    dp_group, losses = mesh.get_group(0), []
    for step in range(STEPS):
        low = copy.deepcopy(model).to(torch.bfloat16)
        x, y = batch(step, mesh.get_local_rank(0))
        loss = loss_fn(low(x), y)
        loss.backward()
        for p, q in zip(model.parameters(), low.parameters()):
            g = (q.grad.to_local() if isinstance(q.grad, DTensor) else q.grad).float()
            dist.all_reduce(g, group=dp_group)
            g = g / DP
            p.grad = DTensor.from_local(g, p.device_mesh, p.placements, run_check=False,
                                        shape=p.shape, stride=p.stride()) \
                if isinstance(p, DTensor) else g
        opt.step()
        opt.zero_grad()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / WORLD)
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.named_parameters()}
    return losses, full


def test_parity_with_a_single_process():
    results = run_world(WORLD, train_cases, CASES, timeout=600)
    refs = {False: reference(), True: run_world(WORLD, tp_reference_bf16)[0]}
    for i, (placement, reshard, bf16) in enumerate(CASES):
        label = f"{placement} reshard={reshard} bf16={bf16}"
        ref_losses, ref_params = refs[bf16]
        losses, full, seen = results[0][i]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5,
                                   atol=0, msg=lambda m: f"{label}: {m}")
        assert full.keys() == ref_params.keys(), label
        for k, ref in ref_params.items():
            assert_rel_close(full[k], ref, 1e-5, f"{label}: {k}")
        assert len(seen) == 14 and all("attn.w" in n or "mlp." in n for n in seen), seen
        for rank, per_case in enumerate(results):
            assert per_case[i][0] == losses, f"{label}: rank {rank} disagrees on the loss"


# fs.compile: the TP model compiled whole, dp's gathers and reductions in the graph
# beside TP's own collectives, each TP-local param made a DTensor again in the graph.

WHOLE_CASES = [("shard0", True), ("owned", False)]
# TP's all-reduces per block: forward, rowwise wo and down reduce their outputs;
# backward, each colwise layer (wq, wk, wv, gate, up) its input's grad
TP_REDUCES = (2, 5)


def whole_step_training(cases) -> list:
    """Rank body: per case, SGD steps through fs.compile(fullgraph=True) with a
    backend counting each graph's collectives: (losses, compiled graph calls per
    step, graph breaks, the graphs' counts, the buckets' names, full params)."""
    from torch._dynamo.utils import counters

    mesh = dp_tp_mesh()
    out = []
    for placement, reshard in cases:
        torch._dynamo.reset()
        counters.clear()
        model, graphs = tp_model(mesh, placement, reshard), []
        fs.compile(model, fullgraph=True, backend=counting_backend(graphs))
        calls = []
        losses = train_steps(model, mesh.get_local_rank(0), _optimizer(model, True), 3,
                             on_loss=lambda loss: calls.append(compiled_graph_calls(loss)))
        breaks = sum(counters["graph_break"].values()) + sum(counters["unimplemented"].values())
        out.append((losses, calls, breaks, graphs, [b.name for b in get_state(model).buckets],
                    fs.full_state_dict(model)))
    return out


def test_whole_step_compile_trains_as_one_process():
    """Shard(0) resharding after forward, Owned not: one forward and one backward
    graph a step, no graph break, each bucket's all-gather over dp in forward (again
    in backward for the resharded blocks) and its reduce-scatter in backward; SGD
    steps land on the one-process reference's params."""
    ref_losses, ref_params = reference(steps=3, sgd=True)
    results = run_world(WORLD, whole_step_training, WHOLE_CASES, timeout=600)
    for i, (placement, reshard) in enumerate(WHOLE_CASES):
        label = f"{placement} reshard={reshard}"
        losses, calls, breaks, graphs, names, full = results[0][i]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5,
                                   atol=0, msg=lambda m: f"{label}: {m}")
        for k, ref in ref_params.items():
            assert_rel_close(full[k], ref, 1e-5, f"{label}: {k}")
        blocks = len([n for n in names if n != "root"]) if reshard else 0
        for rank, per_case in enumerate(results):
            losses, calls, breaks, graphs = per_case[i][:4]
            assert breaks == 0 and calls == [1, 1, 1], (label, rank, breaks, calls)
            assert [kind for kind, _ in graphs] == ["forward", "backward"], (label, graphs)
            (_, forward), (_, backward) = graphs
            assert forward["all_gather_into_tensor_coalesced"] == len(names), (label, graphs)
            assert backward["all_gather_into_tensor_coalesced"] == blocks, (label, graphs)
            assert backward["reduce_scatter_tensor_coalesced"] == len(names), (label, graphs)
            # TP's own all-reduces over tp, run once each: reshard's checkpoint
            # recomputes dp's gathers in backward, never TP's collectives
            layers = len(names) - 1
            assert forward["all_reduce"] == TP_REDUCES[0] * layers, (label, graphs)
            assert backward["all_reduce"] == TP_REDUCES[1] * layers, (label, graphs)


# Checkpoints: saved at (dp 2, tp 2), loaded into a 1-D world of 2 ranks without TP, and back.


def _save_tp(root, steps) -> dict:
    mesh = dp_tp_mesh()
    model = tp_model(mesh, "ragged")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    train_steps(model, mesh.get_local_rank(0), opt, steps)
    fs.save_checkpoint(root, model, opt, step=steps)
    return fs.full_state_dict(model)


def _load_flat_and_save(src, dst) -> tuple:
    """A 1-D world of 2 ranks, no TP: load, check, one step, save."""
    model = fs.flex_shard(make_llama(seed=1), placement=fs.Shard(0))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    step = fs.load_checkpoint(src, model, opt)
    loaded = fs.full_state_dict(model)
    train_steps(model, dist.get_rank(), opt, 1, first=step)
    fs.save_checkpoint(dst, model, opt, step=step + 1)
    return loaded, fs.full_state_dict(model)


def _load_tp_and_step(src) -> tuple:
    mesh = dp_tp_mesh()
    model = tp_model(mesh, "shard0", reshard=False)
    for p in model.parameters():  # other values than the checkpoint's
        torch.nn.init.normal_(p)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    step = fs.load_checkpoint(src, model, opt)
    train_steps(model, mesh.get_local_rank(0), opt, 1, first=step)
    return step, fs.full_state_dict(model)


def test_checkpoint_to_one_dimensional_and_back(tmp_path):
    first, second = str(tmp_path / "tp"), str(tmp_path / "flat")
    saved = run_world(WORLD, _save_tp, first, 2, timeout=300)[0]
    flat = run_world(2, _load_flat_and_save, first + "/step_00000002", second, timeout=300)
    for k, v in saved.items():
        assert torch.equal(flat[0][0][k], v), k
    _, ref_params = reference(steps=3)
    for k, ref in ref_params.items():
        assert_rel_close(flat[0][1][k], ref, 1e-5, f"after a step at 1-D: {k}")
    back = run_world(WORLD, _load_tp_and_step, second, timeout=300)
    assert [r[0] for r in back] == [3] * WORLD
    _, ref_params = reference(steps=4)
    for k, ref in ref_params.items():
        for rank, (_, params) in enumerate(back):
            assert_rel_close(params[k], ref, 1e-5, f"back at (2, 2), rank {rank}: {k}")


# A model per pipeline stage, each with TP params: each stage's checkpoint is its own.


def _stage_checkpoints(root) -> tuple:
    """(pp 2, dp 2, tp 1): each stage saves its model to its own directory and loads
    it back; then stage 0 alone saves (stage 1 goes on: no collective spans it)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("pp", "dp", "tp"))
    stage = mesh.get_coordinate()[0]
    model = fs.flex_shard(tensor_parallel(make_llama(seed=stage), mesh["tp"]), mesh["dp"])
    saved = fs.full_state_dict(model)
    path = fs.save_checkpoint(f"{root}/stage{stage}", model, None, step=1)
    other = fs.flex_shard(tensor_parallel(make_llama(seed=7), mesh["tp"]), mesh["dp"])
    fs.load_checkpoint(path, other)
    if stage == 0:
        fs.save_checkpoint(f"{root}/alone", model, None, step=2)
    return saved, fs.full_state_dict(other)


def test_each_pipeline_stage_checkpoints_its_own_model(tmp_path):
    """The files group spans flex_shard's mesh and the TP mesh, not the root's other
    dims: before, both stages' saves met in one DCP plan (overlapping chunks) and a
    stage saving alone hung."""
    for saved, loaded in run_world(WORLD, _stage_checkpoints, str(tmp_path), timeout=300):
        assert saved.keys() == loaded.keys()
        for k, v in saved.items():
            assert torch.equal(loaded[k], v), k


# fs.clip_grad_norm_ over both dims.

MAX_NORM = 0.05


def _clip(norms):
    def step_fn(model):
        clip = fs.clip_grad_norm_ if isinstance(model, fs.FlexShardModule) else \
            (lambda m, n: torch.nn.utils.clip_grad_norm_(m.parameters(), n))
        norms.append(float(clip(model, MAX_NORM)))
    return step_fn


def clipped_training() -> tuple:
    mesh = dp_tp_mesh()
    model = tp_model(mesh, "ragged")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    norms: list = []
    losses = train_steps(model, mesh.get_local_rank(0), opt, 3, step_fn=_clip(norms))
    return losses, fs.full_state_dict(model), norms


def test_clip_grad_norm_over_dp_and_tp():
    results = run_world(WORLD, clipped_training)
    ref_norms: list = []
    ref_losses, ref_params = reference(steps=3, step_fn=_clip(ref_norms))
    losses, full, norms = results[0]
    assert all(n > MAX_NORM for n in ref_norms), "the test must actually clip"
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for k, ref in ref_params.items():
        assert_rel_close(full[k], ref, 1e-5, k)
    assert all(r[2] == norms for r in results), "ranks disagree on the norm"


# Bad input: every rank raises before any collective.


def _whole_mesh():
    mesh = dp_tp_mesh()
    fs.flex_shard(tensor_parallel(make_llama(), mesh["tp"]), mesh)


def _foreign_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    tp = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    fs.flex_shard(tensor_parallel(make_llama(), tp), dp_tp_mesh()["dp"])


def _partial_param():
    from torch.distributed.tensor import DTensor, Partial

    mesh = dp_tp_mesh()
    model = make_llama()
    weight = model.head.weight.detach()
    model.head.weight = torch.nn.Parameter(DTensor.from_local(weight, mesh["tp"], [Partial()]))
    fs.flex_shard(model, mesh["dp"])


def _one_dp_rank():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp", "tp"))
    fs.flex_shard(tensor_parallel(make_llama(), mesh["tp"]), mesh["dp"])


def _no_mesh():
    fs.flex_shard(tensor_parallel(make_llama(), dp_tp_mesh()["tp"]))


def _muon_over_tp_matrices():
    fs.optim.split_for_muon(tp_model(dp_tp_mesh(), "owned"))


def _muon_step_on_tp_matrices():
    model = tp_model(dp_tp_mesh(), "owned")
    matrices = [p for name, p in model.named_parameters() if name.endswith("attn.wq.weight")]
    train_steps(model, 0, torch.optim.Muon(matrices, lr=LR), 1)


def test_bad_input():
    expect_all_ranks_raise(WORLD, _whole_mesh, ValueError,
                           r"flex_shard's mesh \(2, 2\) \('dp', 'tp'\) includes mesh dim 'tp', on "
                           r"which DTensor parameter 'layers\.0\.attn\.wq\.weight' is already "
                           r"sharded \(Shard\(dim=0\)\); .* pass e\.g\. mesh\['dp'\]")
    expect_all_ranks_raise(WORLD, _foreign_mesh, ValueError,
                           r"parameter 'layers\.0\.attn\.wq\.weight' is a DTensor on mesh \(4,\) "
                           r"\('tp',\), which is not part of flex_shard's mesh \(2,\) \('dp',\)'s "
                           r"parent: its dim 0 spans ranks \[0, 1, 2, 3\], 2 of them in "
                           r"flex_shard's mesh; make both from one init_device_mesh")
    expect_all_ranks_raise(WORLD, _partial_param, NotImplementedError,
                           r"parameter 'head\.weight' has DTensor placement Partial\(sum\); "
                           r"flex_shard shards DTensor params placed with Shard\(d\) or Replicate")
    expect_all_ranks_raise(WORLD, _one_dp_rank, NotImplementedError,
                           r"parameter 'layers\.0\.attn\.wq\.weight' is a DTensor and flex_shard's "
                           r"mesh shards over 1 rank")
    # Owned cannot make a TP block whole: split_for_muon says so, not Muon's first step
    expect_all_ranks_raise(WORLD, _muon_over_tp_matrices, ValueError,
                           r"parameter 'layers\.0\.attn\.wq\.weight' in bucket .* is picked for "
                           r"Muon but tensor parallelism splits it across ranks .* leave it out "
                           r"with is_matrix")
    expect_all_ranks_raise(WORLD, _muon_step_on_tp_matrices, ValueError,
                           r"torch\.optim\.Muon orthogonalizes each matrix as a whole, but "
                           r"parameter 'layers\.0\.attn\.wq\.weight' .* split across ranks by "
                           r"tensor parallelism.*Leave the TP-split params out of its param groups")
    expect_all_ranks_raise(WORLD, _no_mesh, ValueError,
                           r"parameter 'layers\.0\.attn\.wq\.weight' is a DTensor \(tensor "
                           r"parallel\); pass flex_shard the data-parallel slice of its mesh")


# Reshard after forward frees the unsharded params although autograd saved DTensors.


def unsharded_after_forward(reshard: bool) -> tuple:
    from training_helpers import UnshardedTracker

    mesh = dp_tp_mesh()
    model = tp_model(mesh, "shard0", reshard)
    model.set_prefetch_depth(0)  # no gather in flight to count
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    train_steps(model, mesh.get_local_rank(0), opt, 1)
    tracker = UnshardedTracker(model)
    x, y = batch(1, mesh.get_local_rank(0))
    loss = loss_fn(model(x), y)
    after_forward = sorted(tracker.live_bytes())
    loss.backward()
    return after_forward, sorted(tracker.live_bytes())


def test_reshard_after_forward_frees_dtensor_params():
    for after_forward, after_backward in run_world(WORLD, unsharded_after_forward, True):
        assert after_forward == ["root"]  # the blocks' saved DTensors became handles
        assert after_backward == []
    for after_forward, _ in run_world(WORLD, unsharded_after_forward, False):
        assert after_forward == ["layers.0", "layers.1", "root"]


# Full tensors in: load_pretrained and fs.load_full_state_dict read each rank's
# dp piece of its TP-local block.


def load_full_tensors() -> tuple:
    mesh = dp_tp_mesh()
    want = make_llama(seed=3).state_dict()
    model = tp_model(mesh, "ragged")
    fs.load_pretrained(model, want)
    pretrained = fs.full_state_dict(model)
    other = tp_model(mesh, "shard0")
    fs.load_full_state_dict(other, want)
    return all(torch.equal(pretrained[k], want[k]) for k in want), \
        all(torch.equal(v, want[k]) for k, v in fs.full_state_dict(other).items())


def test_full_tensors_load_into_the_tp_pieces():
    assert run_world(WORLD, load_full_tensors) == [(True, True)] * WORLD


# A DTensor on the whole (dp, tp) mesh, Replicate() on dp: flex_shard shards its local tensor too.


class _Colwise2D(torch.nn.Module):
    """y = x W^T with W sharded over tp on the 2-D mesh (replicated over dp)."""

    def __init__(self, mesh) -> None:
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        super().__init__()
        torch.manual_seed(0)
        full = torch.randn(6, 10)
        self.mesh = mesh
        self.weight = torch.nn.Parameter(distribute_tensor(full, mesh, [Replicate(), Shard(0)]))

    def forward(self, x):
        from torch.distributed.tensor import DTensor, Replicate

        x = DTensor.from_local(x, self.mesh, [Replicate(), Replicate()], run_check=False)
        y = torch.nn.functional.linear(x, self.weight)  # Shard(-1) over tp
        return y.redistribute(self.mesh, [Replicate(), Replicate()]).to_local()


def two_dim_dtensor() -> tuple:
    mesh = dp_tp_mesh()
    model = fs.flex_shard(_Colwise2D(mesh), mesh["dp"], placement=fs.RaggedShard())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    g = torch.Generator().manual_seed(mesh.get_local_rank(0))
    for _ in range(3):
        x = torch.randn(4, 10, generator=g)
        (model(x) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return fs.full_state_dict(model)["weight"]


def test_dtensor_on_the_whole_mesh_replicated_over_dp():
    results = run_world(WORLD, two_dim_dtensor)
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(6, 10))
    opt = torch.optim.AdamW([weight], lr=LR)
    gens = [torch.Generator().manual_seed(r) for r in range(DP)]
    for _ in range(3):
        x = torch.cat([torch.randn(4, 10, generator=g) for g in gens])
        (torch.nn.functional.linear(x, weight) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    for got in results:
        assert_rel_close(got, weight.detach(), 1e-5, "weight")
