"""fs.compile: the whole step in one graph (gathers and reductions inside it)
trains as the one-process reference does, with SGD, and nothing runs eagerly."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch.utils.checkpoint import CheckpointPolicy

import flexshard as fs
from compile_check import compiled_graph_calls, counting_backend
from flexshard.compat import FUNCTIONAL_COLLECTIVES_NAMESPACE
from flexshard.runtime.state import get_state
from flexshard.runtime.traced import TracedBucket, recompute_gather_policy
from harness import expect_all_ranks_raise, run_world
from models import TinyGPT, batch, loss_fn
from reference import (assemble_grads, assert_rel_close, make_model, reference_run,
                       sharded_grads)

STEPS = 4
LR = 1e-2
BF16 = fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _breaks() -> int:
    return sum(counters["graph_break"].values()) + sum(counters["unimplemented"].values())


def _saved_numels(model, x) -> set:
    """numel of every tensor autograd saves in one forward of `model`, less the
    sharded params themselves (what a checkpoint keeps to regather from; an Owned
    param's owner holds it whole) and int64 ones: index plans' positions (Shard(1)),
    inputs of the graph, never a weight or a gather output."""
    seen, shards = set(), {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        if t.dtype != torch.int64 and t.untyped_storage().data_ptr() not in shards:
            seen.add(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return seen


def train_whole(config: dict, backend: str = "count", fullgraph: bool = True,
                model_kw=None) -> dict:
    """Rank body: STEPS SGD steps of fs.compile(flex_shard(TinyGPT(**model_kw))):
    what `_run` returns, each graph's collectives (in all and by group) and matmuls,
    and what forward saves of a block's unsharded weights or gather output."""
    import torch.distributed as dist

    torch._dynamo.reset()
    counters.clear()
    rank = dist.get_rank()
    model = fs.flex_shard(make_model(**(model_kw or {})), **config)
    buckets = get_state(model).buckets
    names = _group_names(buckets[0])
    graphs, chains, matmuls, groups, scatters = [], [], [], [], []
    fs.compile(model, fullgraph=fullgraph,
               backend=counting_backend(graphs, chains=chains, matmuls=matmuls, groups=groups,
                                        scatters=scatters)
               if backend == "count" else backend)
    run = _run(model, rank, clip=False)
    # what forward saves for backward: an unsharded block weight or a block's gather
    # output, or (int reshard n) the 1/n of it backward regathers from
    unsharded = {p.numel() for p in make_model(**(model_kw or {})).layers[0].parameters()
                 if p.dim() == 2}
    outputs = {b.gather.layout.wire_bytes // 4 for b in buckets if b.name != "root"}
    saved = _saved_numels(model, batch(0, rank)[0])
    n = buckets[0].gather.post_forward_size
    traced = [TracedBucket(b) for b in buckets]
    return {**run, "breaks": _breaks(), "graphs": graphs, "chains": chains, "matmuls": matmuls,
            "scatters": scatters, "kept": saved & (unsharded | outputs),
            # each compact reduce group: (bucket, group, its stand-in's numel, its width)
            "compact": [(b.name, k, numel, g.splits[1][k])
                        for b, g in zip(buckets, traced)
                        for k, (numel, mine) in enumerate(g.reduces) if mine is not None],
            "kept_slice": n is not None and {o // n for o in outputs} <= saved,
            "indexed": sum(map(_indexed, traced)),
            "groups": [(kind, {(op, names.get(g, g)): c for (op, g), c in counts.items()})
                       for kind, counts in groups],
            "buckets": [(b.name, b.gather.reshard_after_forward) for b in buckets]}


def _indexed(traced: TracedBucket) -> int:
    """The elements a bucket's index-plan grads (Shard(d > 0)) write into its reduce
    stand-ins: one index_put per block size and reduce group."""
    return sum(len({p for p, _ in group.members if isinstance(p, int)}) * numel  # a block
               for group, (numel, _) in zip(traced.span_groups, traced.reduces))


def whole_and_plain(config: dict) -> tuple:
    """Rank body: train_whole's results, and the elements the plain model's own
    slice-grad ops write, compiled whole the same way (one forward and backward)."""
    result = train_whole(config)
    torch._dynamo.reset()
    graphs, scatters = [], []
    plain = torch.compile(make_model(), fullgraph=True,
                          backend=counting_backend(graphs, scatters=scatters))
    x, y = batch(0, 0)
    loss_fn(plain(x), y).backward()
    return result, scatters


def _group_names(bucket) -> dict:
    """Group name -> "shard", and under an int reshard n "within" (this rank's
    post-forward group) and "across" (the group across those)."""
    names, n = {bucket.group.group_name: "shard"}, bucket.gather.post_forward_size
    if n is not None:
        names[bucket.subgroups.of(bucket.rank, n).group_name] = "within"
        names[bucket.subgroups.across(bucket.rank, n).group_name] = "across"
    return names


def mixed(fqn: str, param) -> fs.Placement:
    """Three placements in every block's bucket."""
    if ".up." in fqn or ".down." in fqn:
        return fs.Owned()
    return fs.RaggedShard() if param.dim() == 1 else fs.Shard(0)


def check_whole(world: int, config: dict, rel: float = 1e-5, body=train_whole, **kw) -> list:
    ref_losses, ref_params, ref_grads = reference_run(
        world, STEPS, make_opt=lambda m: torch.optim.SGD(m.parameters(), lr=LR),
        param_dtype=(config.get("mp_policy") or fs.MixedPrecisionPolicy()).param_dtype,
        model_kw=kw.get("model_kw"))
    results = run_world(world, body, config, timeout=400, **kw)
    mean = [sum(r["losses"][s] for r in results) / world for s in range(STEPS)]
    torch.testing.assert_close(torch.tensor(mean), torch.tensor(ref_losses), rtol=rel, atol=0)
    grads = assemble_grads([(None, None, r["grads"]) for r in results])
    for k, ref in ref_grads.items():
        assert_rel_close(grads[k], ref, rel, f"grad of {k}")
    for k, ref in ref_params.items():
        assert_rel_close(results[0]["full"][k], ref, rel, k)
    for r in results:
        assert r["breaks"] == 0 and r["graph_calls"] == [1] * STEPS, r
    return results


def _shard1_matrices(fqn: str, param) -> fs.Placement:
    return fs.Shard(1) if param.dim() > 1 else fs.Shard(0)


@pytest.mark.parametrize("placement", [fs.Shard(0), fs.Owned(), fs.RaggedShard(),
                                       _shard1_matrices],
                         ids=["shard", "owned", "ragged", "shard1"])
def test_whole_step_matches_reference(placement):
    """Each placement: the reference's training, one compiled forward and one
    backward graph, each bucket one (coalesced) all-gather in forward and one
    reduce-scatter in backward, the blocks' gathers recomputed in backward (reshard after
    forward, the root's params kept as FSDP2 keeps them) and no unsharded block
    weight saved for backward. Backward's slice-grad writes are the plain model's
    own (its position table's slice) and, for Shard(1) matrices (index plans), one
    index_put per block size and reduce group, not a zero-filled reduce input per
    param."""
    plain = make_model().pos.numel()
    for r in check_whole(2, {"placement": placement}):
        assert r["scatters"] == [("forward", 0), ("backward", plain + r["indexed"])], \
            (r["scatters"], r["indexed"])
        assert (r["indexed"] > 0) == (placement is _shard1_matrices), r["indexed"]
        names = [name for name, _ in r["buckets"]]
        blocks = len([n for n in names if n != "root"])
        assert r["graphs"] == [
            ("forward", {"all_gather_into_tensor_coalesced": len(names),
                         "reduce_scatter_tensor_coalesced": 0, "all_reduce": 0,
                         "all_reduce_coalesced": 0}),
            ("backward", {"all_gather_into_tensor_coalesced": blocks,
                          "reduce_scatter_tensor_coalesced": len(names), "all_reduce": 0,
                          "all_reduce_coalesced": 0})], \
            r["graphs"]
        assert not r["kept"], f"saved for backward: {r['kept']}"
        assert r["chains"] == [True] * (len(names) - 1), r["chains"]
        # backward's matmuls are the grads' (two per forward matmul), none recomputed
        (_, forward), (_, backward) = r["matmuls"]
        assert forward > 0 and backward == 2 * forward, r["matmuls"]


def test_whole_step_without_reshard_keeps_the_params():
    """reshard_after_forward=False: no gather in backward, the gathered weights
    kept (so the check above can tell the two apart)."""
    for r in check_whole(2, {"reshard_after_forward": False}):
        assert r["graphs"][1][1]["all_gather_into_tensor_coalesced"] == 0, r["graphs"]
        assert r["kept"], "the test cannot tell resharded from kept params"
        # one reduce-scatter in flight here too, where inductor left alone waits every
        # one at the end of the backward (benchmarks/RESULTS.md, "torch.compile")
        assert r["chains"] == [True] * (len(r["buckets"]) - 1), r["chains"]


def test_whole_step_uneven_world_mixed_placements_and_inductor():
    """World 3 (uneven pieces), Shard(0), Owned and RaggedShard in one bucket each
    way, inductor: the same training."""
    config = {"placement": mixed}
    check_whole(3, config, backend="inductor")


def _shard1_beside_owned(fqn: str, param) -> fs.Placement:
    """Shard(1) matrices (index plans) in a bucket with Owned ones and Shard(0) vectors."""
    if ".up." in fqn:
        return fs.Owned()
    return fs.Shard(1) if param.dim() > 1 else fs.Shard(0)


def train_meta_whole(config: dict) -> dict:
    """Rank body: a model made on the meta device, wrapped and compiled whole before
    to_empty() and its weights' load (the Shard(1) gathers' index positions, made at
    fs.compile, must follow to the new device), then trained as train_whole does."""
    import torch.distributed as dist

    torch._dynamo.reset()
    counters.clear()
    with torch.device("meta"):
        model = fs.flex_shard(make_model(), **config)
    fs.compile(model, fullgraph=True, backend="aot_eager")
    model.to_empty(device="cpu")
    fs.load_full_state_dict(model, make_model().state_dict())
    return {**_run(model, dist.get_rank(), clip=False), "breaks": _breaks()}


def test_whole_step_compiled_on_the_meta_device_then_loaded():
    """Shard(1) matrices (gathered by index positions) compiled before to_empty():
    the reference's training, where the positions left on the meta device gave NaN."""
    check_whole(2, {"placement": _shard1_matrices}, body=train_meta_whole)


def freeze_eager_and_whole() -> list:
    """Rank body: the embedding frozen after flex_shard (trainable when wrapped), then
    unfrozen after two steps, eager and under fs.compile: per step the loss and the
    grads' global norm (torch's, over the ShardedGrads), and the full params after."""
    import torch.distributed as dist

    rank, out = dist.get_rank(), []
    for whole in (False, True):
        torch._dynamo.reset()
        model = fs.flex_shard(make_model())
        model.tok.weight.requires_grad_(False)
        if whole:
            fs.compile(model, fullgraph=True, backend="aot_eager")
        opt, trace = torch.optim.SGD(model.parameters(), lr=LR), []
        for step in range(STEPS):
            model.tok.weight.requires_grad_(step >= 2)
            x, y = batch(step, rank)
            loss = loss_fn(model(x), y)
            calls = compiled_graph_calls(loss)  # 1 a step compiled, 0 eager
            loss.backward()
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            trace.append((calls, len(grads), torch.nn.utils.get_total_norm(grads).item()))
            opt.step()
            opt.zero_grad()
        out.append((trace, fs.full_state_dict(model)))
    return out


def test_whole_step_follows_params_frozen_after_the_wrap():
    """A param frozen after flex_shard and before fs.compile (it used to fail in
    compile with torch's hook error, half-compiled), unfrozen later: the compiled
    model trains as eager does, the grads' norm global at every step."""
    for (eager, eager_full), (whole, whole_full) in run_world(2, freeze_eager_and_whole,
                                                               timeout=400):
        assert [c for c, _, _ in eager] == [0] * STEPS and [c for c, _, _ in whole] == [1] * STEPS
        assert [n for _, n, _ in whole] == [n for _, n, _ in eager] and eager[0][1] < eager[2][1], \
            eager
        torch.testing.assert_close(torch.tensor([t for *_, t in whole]),
                                   torch.tensor([t for *_, t in eager]), rtol=1e-5, atol=0)
        for k, v in eager_full.items():
            assert_rel_close(whole_full[k], v, 1e-5, k)


def test_whole_step_shard1_under_inductor():
    """Shard(1) matrices beside Owned and Shard(0) params in each bucket, inductor at
    world 2 (one block: inductor compiles slowly): the reference's training, one
    compiled graph each step. Their index plans' positions are inputs of the graph:
    held as constants, inductor's fake tensor pass refused them."""
    check_whole(2, {"placement": _shard1_beside_owned}, backend="inductor",
                model_kw={"layers": 1})


def test_whole_step_ragged_with_uneven_groups_gathers_the_padded_layout():
    """World 3, RaggedShard, matrices large enough for uneven gather groups in eager
    (layout.py): the whole-step graph gathers over the padded layout, the same training.
    A 0-dim param (logit_scale) is Owned in the root's bucket."""
    results = check_whole(3, {"placement": fs.RaggedShard()},
                          model_kw={"dim": 128, "hidden": 512, "heads": 4, "logit_scale": True})
    for r in results:
        assert r["breaks"] == 0


def _owned_but_the_head(fqn: str, param) -> fs.Placement:
    return fs.Shard(0) if fqn == "head.weight" else fs.Owned()


def test_whole_step_owned_reduces_compact_by_an_all_reduce():
    """Owned tensors (the head Shard(0)) at world 3, hidden 480: each block's qkv
    matrix alone outweighs the rest of its bucket, so a block's padded rank-major
    reduce input is over twice what its owners hold, as is the root's Owned group
    (embedding, position table, norm) beside the head's own group. Those are
    all-reduced unpadded, each owner taking its span; the head's group is
    reduce-scattered, in the root's second collective. A rank owns nothing of
    block 1 (its reduction has no wait; the chains start after it). The
    reference's training."""
    results = check_whole(3, {"placement": _owned_but_the_head}, model_kw={"dim": 480})
    assert sorted(len(r["chains"]) for r in results) == [2, 3, 3], [r["chains"] for r in results]
    for r in results:
        backward = r["graphs"][1][1]
        assert (backward["reduce_scatter_tensor_coalesced"], backward["all_reduce_coalesced"]) \
            == (1, 3), r["graphs"]
        assert r["chains"] and all(r["chains"]), r["chains"]
        assert [(name, group) for name, group, _, _ in r["compact"]] == \
            [("layers.0", 0), ("layers.1", 0), ("root", 1)], r["compact"]
        for _, _, numel, width in r["compact"]:
            assert 2 * numel <= 3 * width, r["compact"]


def test_whole_step_mixed_bucket_joins_grads_in_one_write():
    """Three placements in each block's bucket at world 3: the reference's training,
    and the backward's slice-grad ops write no more than the plain model's own. Each
    member's grad pieces (a Shard(0) or RaggedShard param's, one per rank) join the
    reduce input in one write, not a zero-filled reduce group per piece."""
    results = run_world(3, whole_and_plain, {"placement": mixed}, timeout=400)
    for r, plain in results:
        assert r["breaks"] == 0 and r["graph_calls"] == [1] * STEPS, r
        assert r["scatters"][1][1] <= plain[1][1], (r["scatters"], plain)
    ref_losses, _, ref_grads = reference_run(
        3, STEPS, make_opt=lambda m: torch.optim.SGD(m.parameters(), lr=LR))
    mean = [sum(r["losses"][s] for r, _ in results) / 3 for s in range(STEPS)]
    torch.testing.assert_close(torch.tensor(mean), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    grads = assemble_grads([(None, None, r["grads"]) for r, _ in results])
    for k, ref in ref_grads.items():
        assert_rel_close(grads[k], ref, 1e-5, f"grad of {k}")


@pytest.mark.parametrize("world", [1, 2])
def test_whole_step_bf16_gathers(world):
    """bf16 gathers train as the reference; at one rank (a cast, so hooked) the
    graphs hold no collective, as eager runs none."""
    for r in check_whole(world, {"mp_policy": BF16}, rel=2 ** -6):
        counts = [c for _, graph in r["graphs"] for c in graph.values()]
        assert [kind for kind, _ in r["graphs"]] == ["forward", "backward"], r["graphs"]
        assert (sum(counts) == 0) == (world == 1), r["graphs"]


def _run(model, rank: int, clip: bool) -> dict:
    """STEPS SGD steps: losses, step 0's sharded grads, the clip norms, the
    compiled graphs each step called, the full params after."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms, grads, graph_calls = [], [], None, []
    for step in range(STEPS):
        x, y = batch(step, rank)
        loss = loss_fn(model(x), y)
        graph_calls.append(compiled_graph_calls(loss))
        loss.backward()
        if step == 0:
            grads = sharded_grads(model)
        if clip:  # flexshard's and torch's (on ShardedGrads) agree, and both are global
            norms.append(torch.nn.utils.get_total_norm(
                [p.grad for p in model.parameters() if p.grad is not None]).item())
            norms.append(fs.clip_grad_norm_(model, 0.5).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "norms": norms, "graph_calls": graph_calls,
            "full": fs.full_state_dict(model)}


def eager_and_whole(config: dict, mesh_shape=None, clip: bool = False,
                    model_kw: dict = None) -> tuple:
    """Rank body: the same training eagerly and through fs.compile (aot_eager)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    if mesh_shape is not None:
        from torch.distributed.device_mesh import init_device_mesh
        config = dict(config, mesh=init_device_mesh("cpu", mesh_shape,
                                                    mesh_dim_names=("replicate", "shard")))
    eager = fs.flex_shard(make_model(**(model_kw or {})), **config)
    torch._dynamo.reset()
    counters.clear()
    model = fs.compile(fs.flex_shard(make_model(**(model_kw or {})), **config), fullgraph=True,
                       backend="aot_eager")
    out = _run(model, rank, clip)
    out["breaks"] = _breaks()
    return _run(eager, rank, clip), out


def check_eager_and_whole(world: int, config: dict, rel: float = 1e-6, **kw) -> None:
    for eager, whole in run_world(world, eager_and_whole, config, timeout=400, **kw):
        assert whole["breaks"] == 0
        torch.testing.assert_close(torch.tensor(whole["losses"]), torch.tensor(eager["losses"]),
                                   rtol=rel, atol=0)
        torch.testing.assert_close(torch.tensor(whole["norms"]), torch.tensor(eager["norms"]),
                                   rtol=rel, atol=0)
        for k, (_, _, ref) in eager["grads"].items():
            if ref is not None and ref.numel():
                assert_rel_close(whole["grads"][k][2], ref, rel, f"grad of {k}")
        for k, ref in eager["full"].items():
            assert_rel_close(whole["full"][k], ref, rel, k)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_whole_step_quantized_gathers_train_as_eager(dtype):
    """QuantizedGather's wire in the graph: the eager flex_shard training (itself
    checked against a quantizing reference in test_quantized_gather.py), at world 3."""
    policy = fs.MixedPrecisionPolicy(gather_format=fs.QuantizedGather(dtype, min_numel=256))
    check_eager_and_whole(3, {"mp_policy": policy})


def test_whole_step_mixed_dtype_bucket_trains_as_eager():
    """A bucket of fp32 and bf16 params (TinyGPT's position table in bf16, in the
    root's bucket) at world 3: each gathered in its own dtype, reduced together in
    fp32 (their promoted dtype), each grad back in its param's dtype, as eager
    does (itself checked against one process in test_mixed_bucket.py)."""
    check_eager_and_whole(3, {}, model_kw={"bf16_pos": True})


class CheckpointedGPT(TinyGPT):
    """TinyGPT whose forward checkpoints each block (torch.utils.checkpoint), as
    Hugging Face's gradient checkpointing does."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False)
        return self.head(self.norm(x))


def eager_and_whole_checkpointed() -> tuple:
    """Rank body: CheckpointedGPT trained eagerly and through fs.compile."""
    import torch.distributed as dist

    rank, out = dist.get_rank(), []
    for whole in (False, True):
        torch.manual_seed(0)
        model = fs.flex_shard(CheckpointedGPT())
        if whole:
            torch._dynamo.reset()
            counters.clear()
            fs.compile(model, fullgraph=True, backend="aot_eager")
        out.append({**_run(model, rank, clip=False), "breaks": _breaks()})
    return tuple(out)


def test_whole_step_under_the_users_activation_checkpointing():
    """Blocks the model's forward checkpoints itself compile whole too (fullgraph:
    nothing fs.compile adds may be a side effect dynamo refuses inside a
    checkpoint) and train as eager flex_shard does."""
    for eager, whole in run_world(2, eager_and_whole_checkpointed, timeout=400):
        assert whole["breaks"] == 0 and whole["graph_calls"] == [1] * STEPS, whole
        torch.testing.assert_close(torch.tensor(whole["losses"]), torch.tensor(eager["losses"]),
                                   rtol=1e-6, atol=0)
        for k, ref in eager["full"].items():
            assert_rel_close(whole["full"][k], ref, 1e-6, k)


@pytest.mark.parametrize("mesh_shape", [(2, 2), (2, 1)], ids=["2x2", "replicas-only"])
def test_whole_step_hsdp_and_clip_train_as_eager(mesh_shape):
    """HSDP (2 replicas x 2 shards): the reduce-scatter and the replicas'
    all-reduce in the graph; clip_grad_norm_ (flexshard's and torch's) global. And
    2 replicas of one shard each (a shard group of one rank, whose graph skips the
    gather and the reduce-scatter: counted in test_whole_step_bf16_gathers[1])."""
    check_eager_and_whole(mesh_shape[0] * mesh_shape[1], {}, mesh_shape=mesh_shape, clip=True)


def test_reshard_recomputes_the_buckets_collectives_only():
    """Reshard after forward's checkpoint policy: the gather's collectives (over the
    buckets' groups) and waits recomputed in backward, another group's collective
    (tensor parallelism's) saved: recomputing it would run it again. Matmuls saved,
    the rest left to the partitioner, which may recompute cheap ops as for any
    compiled block."""
    ops = getattr(torch.ops, FUNCTIONAL_COLLECTIVES_NAMESPACE)
    policy = functools.partial(recompute_gather_policy, frozenset({"dp"}))
    t = torch.empty(4)
    recompute, save = CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_SAVE
    assert policy(None, ops.all_gather_into_tensor_coalesced.default, [t], 2, "dp") == recompute
    assert policy(None, ops.wait_tensor.default, t) == recompute
    assert policy(None, ops.all_gather_into_tensor.default, t, 2, "tp") == save
    assert policy(None, ops.all_reduce.default, t, "sum", "tp") == save
    assert policy(None, torch.ops.aten.mm.default, t, t) == save
    assert policy(None, torch.ops.aten.mul.Tensor, t, t) == CheckpointPolicy.PREFER_SAVE
    assert policy(None, torch.ops.aten._to_copy.default, t) == recompute


def test_whole_step_int_reshard_regathers_within_the_smaller_group():
    """reshard_after_forward=2 at world 4: forward gathers each block's bucket
    across the post-forward groups, then within its own (one copy orders the
    output), keeps the first gather's output (1/2 of the params) and backward
    regathers within the post-forward group only, as eager's int reshard does;
    the reference's training. The root keeps its params (one gather)."""
    gather, reduce = "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced"
    for r in check_whole(4, {"reshard_after_forward": 2}):
        blocks = len(r["buckets"]) - 1
        assert r["groups"] == [
            ("forward", {(gather, "across"): blocks, (gather, "within"): blocks,
                         (gather, "shard"): 1}),
            ("backward", {(gather, "within"): blocks, (reduce, "shard"): blocks + 1})], \
            r["groups"]
        assert not r["kept"], f"saved for backward: {r['kept']}"
        assert r["kept_slice"], "the first gather's output is not what forward saves"


@dataclass(frozen=True)
class _Rotated(fs.WireFormat):
    """A matrix sent times a signed permutation Q (exact), which encode hands
    decode as its meta: decode multiplies by Q's transpose, a matmul, which the
    checkpoint policy saves where it is not inside one opaque op."""

    def parts(self, shape, placement, world_size):
        return (fs.WirePart(torch.Size(shape), torch.float32, placement),)

    def encode(self, piece, outs, mesh=None):
        n = piece.shape[-1]
        signs = torch.ones(n, device=piece.device).index_fill_(0, torch.arange(0, n, 2), -1)
        q = torch.eye(n, device=piece.device).flip(0) * signs
        outs[0].copy_(piece @ q)
        return (q,)

    def decode(self, fulls, meta=None):
        return fulls[0] @ meta[0].T


@dataclass(frozen=True)
class _RotateMatrices(fs.WirePolicy):
    def format(self, fqn, shape, dtype, gather_dtype, placement, world_size):
        return _Rotated() if len(shape) > 1 else None


def test_whole_step_user_wire_format_trains_as_the_reference():
    """A user-defined format whose decode is a matmul with its meta (_Rotated) on
    the matrices of a model of Owned matrices and RaggedShard vectors, at an uneven
    world of 3: the reference's training, and its decode (one opaque op) recomputed
    in backward, so no decoded block weight is saved for backward."""
    from test_wire_format import owned_matrices

    config = {"mp_policy": fs.MixedPrecisionPolicy(gather_format=_RotateMatrices()),
              "placement": owned_matrices}
    for r in check_whole(3, config):
        assert r["graphs"][1][1]["all_gather_into_tensor_coalesced"] == len(r["buckets"]) - 1
        assert not r["kept"], f"saved for backward: {r['kept']}"


@dataclass(frozen=True)
class _Odd(fs.WireFormat):
    """A format whose encode returns its meta as a list (`meta`), or whose decode
    returns a tuple (`pair`)."""

    kind: str

    def parts(self, shape, placement, world_size):
        return (fs.WirePart(torch.Size(shape), torch.float32, placement),)

    def encode(self, piece, outs, mesh=None):
        outs[0].copy_(piece)
        return [piece.shape[0]] if self.kind == "meta" else None

    def decode(self, fulls, meta=None):
        return (fulls[0] * 1,) if self.kind == "pair" else fulls[0] * 1


@dataclass(frozen=True)
class _OddMatrices(fs.WirePolicy):
    kind: str

    def format(self, fqn, shape, dtype, gather_dtype, placement, world_size):
        return _Odd(self.kind) if len(shape) > 1 else None


def compile_odd_format(kind: str) -> None:
    fs.compile(fs.flex_shard(make_model(), mp_policy=fs.MixedPrecisionPolicy(
        gather_format=_OddMatrices(kind))), fullgraph=True, backend="aot_eager")


@pytest.mark.parametrize("kind,match", [
    ("meta", r"wire format _Odd's encode returned a list as its meta; in a compiled step a "
             r"user-defined format's meta must be None, a tensor or a tuple of tensors"),
    ("pair", r"wire format _Odd's decode returned a tuple, not a plain tensor; compile each "
             r"block with block.compile\(\) instead")])
def test_whole_step_refuses_a_user_format_it_cannot_run_as_ops(kind, match):
    """A user format's meta that is not tensors, or a decode that returns no
    tensor: refused by fs.compile itself, before any collective, on every rank."""
    expect_all_ranks_raise(2, compile_odd_format, "NotImplementedError", match, kind)


def compile_unbatched_subclass() -> None:
    """torchao's float8 weights as a subclass flexshard does not batch (as a user's
    own FSDP2-style subclass is): its encode needs the mesh the graph lacks."""
    from flexshard.placements import float8
    from test_float8_gather import _wrap, float8_model

    batched, float8.is_dynamic_float8 = float8.is_dynamic_float8, lambda *args: False
    try:  # the world runs other tests after this one
        fs.compile(_wrap("flexshard", float8_model(), torch.bfloat16))
    finally:
        float8.is_dynamic_float8 = batched


def test_whole_step_refuses_what_it_leaves_out():
    """Before any change to the model and before any collective, on every rank."""
    expect_all_ranks_raise(2, compile_unbatched_subclass, "NotImplementedError",
                           r"fs.compile does not support the wire format\(s\) SubclassGather "
                           r"\(bucket '.*'\): compile each block with block.compile\(\) "
                           "instead")


def test_whole_step_offloaded():
    """CPU offload of two buckets of three trains as the reference. Each gather
    copies the shard to the compute device in the graph: on CPU the same device,
    so the copies are no-ops here; tests/test_cuda.py runs them for real."""
    buckets = [fs.BucketSpec("layers.0.*", name="layers.0"),
               fs.BucketSpec("layers.1.*", offload_policy=False, name="kept"),
               fs.BucketSpec(["tok.*", "pos", "norm.*", "head.*"], name="root")]
    for r in check_whole(2, {"offload_policy": fs.OffloadPolicy(pin_memory=False),
                             "buckets": buckets}):
        assert [n for n, _ in r["buckets"]] == ["layers.0", "kept", "root"], r["buckets"]
        assert r["graphs"][1][1]["reduce_scatter_tensor_coalesced"] == 3, r["graphs"]
        assert not r["kept"], f"saved for backward: {r['kept']}"


def _biases_owned(fqn: str, param) -> fs.Placement:
    return fs.Owned() if param.dim() == 1 else fs.Shard(0)


def _linear(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(13, 7))


def _linear_batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 13, generator=torch.Generator().manual_seed(100 * step + rank))


def linear_whole() -> tuple:
    """Rank body: fs.compile(Linear(13, 7)), its weight Shard(0) and its bias Owned
    by rank 1 (rank 0's empty piece at the weight's offset): STEPS SGD steps, the
    mean losses, step 0's full grads, the full params after, the graphs called."""
    import torch.distributed as dist

    torch._dynamo.reset()
    model = fs.compile(fs.flex_shard(_linear(), placement=_biases_owned), fullgraph=True,
                       backend="aot_eager")
    opt, losses, grads, calls = torch.optim.SGD(model.parameters(), lr=LR), [], None, []
    for step in range(STEPS):
        loss = model(_linear_batch(step, dist.get_rank())).square().mean()
        calls.append(compiled_graph_calls(loss))
        loss.backward()
        grads = fs.full_grads(model) if step == 0 else grads
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return losses, grads, fs.full_state_dict(model), calls


def test_whole_step_empty_owned_piece_beside_a_shard():
    """A rank's empty Owned piece at the same place in its segment as a Shard piece
    (it used to end that rank's segment early, and rank 0's backward failed) trains
    as one process does on both ranks' batches."""
    model, ref_losses = _linear(), []
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        loss = sum(model(_linear_batch(step, r)).square().mean() for r in range(2)) / 2
        loss.backward()
        if step == 0:
            ref_grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    for losses, grads, full, calls in run_world(2, linear_whole, timeout=400):
        assert calls == [1] * STEPS, calls
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5,
                                   atol=0)
        for k, p in model.named_parameters():
            assert_rel_close(grads[k], ref_grads[k], 1e-5, f"grad of {k}")
            assert_rel_close(full[k], p.detach(), 1e-5, k)


def misuse() -> list:
    """What fs.compile refuses, and the setters that a compiled model refuses."""
    said = []
    offloaded = fs.flex_shard(make_model(), offload_policy=fs.OffloadPolicy(pin_memory=False))
    try:
        fs.compile(offloaded, cudagraphs=True)
    except ValueError as err:
        said.append(str(err))
    for call in (lambda m: fs.compile(m, cudagraphs=True),
                 lambda m: fs.compile(m, cudagraphs=True, mode="max-autotune"),
                 lambda m: (m.layers[0].compile(), fs.compile(m))):
        try:
            call(fs.flex_shard(make_model()))
        except (ValueError, RuntimeError) as err:
            said.append(str(err))
    model = fs.compile(fs.flex_shard(make_model()), backend="aot_eager")
    for call in (lambda: fs.compile(model), lambda: model.set_requires_gradient_sync(False),
                 lambda: model.set_reshard_after_forward(False), model.unshard,
                 lambda: model.set_gradient_divide_factor(1.0)):
        try:
            call()
        except RuntimeError as err:
            said.append(str(err))
    accumulating = fs.flex_shard(make_model())
    accumulating.set_requires_gradient_sync(False)
    try:  # the compiled step would reduce every backward
        fs.compile(accumulating, backend="aot_eager")
    except RuntimeError as err:
        said.append(str(err))
    frozen = make_model()
    frozen.tok.weight.requires_grad_(False)
    frozen = fs.compile(fs.flex_shard(frozen), backend="aot_eager")
    frozen.tok.weight.requires_grad_(True)  # no room for its grad: it would never train
    try:
        frozen(batch(0, 0)[0])
    except ValueError as err:
        said.append(str(err))
    return said + [_float_argument()]


class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, temperature: float):
        return x + torch.tanh(self.lin(x) / temperature)


class _ScaledBlocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_Scaled(), _Scaled()])

    def forward(self, x, temperature: float):
        for layer in self.layers:
            x = layer(x, temperature)
        return x


def _float_argument() -> str:
    """Resharding blocks' float argument changed between steps: torch's dynamo
    fails inside their checkpoints; fs.compile says why and what to do."""
    torch.manual_seed(0)
    model = fs.compile(fs.flex_shard(_ScaledBlocks()), backend="aot_eager")
    try:
        for temperature in (1.0, 1.5):
            model(torch.ones(2, 8), temperature).sum().backward()
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_whole_step_misuse_is_refused():
    said = run_world(2, misuse)[0]
    assert len(said) == 12, said
    assert "under set_requires_gradient_sync(False), which the compiled step does not follow" \
        in said[9]
    assert "parameter 'tok.weight' (bucket 'root') changed requires_grad to True after " \
           "flex_shard" in said[10]
    assert "a Python float argument whose value changed between calls" in said[11] and \
        "Pass it as a tensor" in said[11], said[11]
    assert "cudagraphs=True cannot capture the copies from host memory of bucket 'layers.0'" \
        in said[0]
    said = said[1:]
    assert "cudagraphs=True needs the params on a CUDA device" in said[0]
    assert "cudagraphs=True sets mode='reduce-overhead'; drop mode='max-autotune'" in said[1]
    assert "compile either the blocks or the whole model, not both" in said[2]
    assert "compiled already; call it once" in said[3]
    for message, method in zip(said[4:], ("set_requires_gradient_sync", "set_reshard_after_forward",
                                          "unshard", "set_gradient_divide_factor")):
        assert message.startswith(f"{method}: this model was compiled whole with fs.compile"), \
            message


def checkpoint_round_trip(directory: str) -> dict:
    """A compiled model's checkpoint: saved after a step, loaded into a fresh
    compiled model (names unchanged), the next step's loss equal; describe works."""
    import torch.distributed as dist

    rank = dist.get_rank()
    torch._dynamo.reset()

    def new():
        model = fs.compile(fs.flex_shard(make_model(seed=1)), fullgraph=True, backend="aot_eager")
        return model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)

    def step(model, opt, k):
        x, y = batch(k, rank)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    model, opt = new()
    step(model, opt, 0)
    fs.save_checkpoint(directory, model, opt, step=1)
    after = step(model, opt, 1)
    other, other_opt = new()
    loaded = fs.load_checkpoint(directory, other, other_opt)
    return {"step": loaded, "after": after, "again": step(other, other_opt, 1),
            "keys": sorted(fs.full_state_dict(other)) == sorted(make_model().state_dict()),
            "describe": str(fs.describe(other))}


def test_whole_step_checkpoint_and_describe(tmp_path):
    for out in run_world(2, checkpoint_round_trip, str(tmp_path / "ckpt"), timeout=400):
        assert out["step"] == 1 and out["keys"]
        assert out["again"] == out["after"]  # params and momentum restored exactly
        assert "layers.0" in out["describe"] and "root" in out["describe"]


def float8_eager_and_whole(param_dtype) -> tuple:
    """Rank body: torchao float8 training (fp8 gathers) eagerly and through
    fs.compile: (losses, first-step grads, full params) of each, and the whole
    step's graphs, gathered bytes, graph calls, breaks and what its forward saves."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from test_float8_gather import LR as F8_LR, STEPS as F8_STEPS, _grads, _wrap, data, float8_model

    rank, out = dist.get_rank(), {}
    torch._dynamo.reset()
    counters.clear()
    graphs, gathered = [], []
    for kind in ("eager", "whole"):
        model = _wrap("flexshard", float8_model(), param_dtype)
        if kind == "whole":
            fs.compile(model, fullgraph=True, backend=counting_backend(graphs, gathered))
        opt = torch.optim.SGD(model.parameters(), lr=F8_LR)
        losses, grads, calls = [], None, []
        for step in range(F8_STEPS):
            x, y = data(step, rank)
            loss = (model(x).float() - y).square().mean()
            calls.append(compiled_graph_calls(loss))
            loss.backward()
            grads = grads or {k: v.clone() for k, v in _grads(model).items()}
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        out[kind] = (losses, grads, {k: v.float() for k, v in full.items()}, calls)
    wires = {b.name: b.gather.padded_layout.segment_bytes for b in get_state(model).buckets}
    unsharded = {p.numel() for p in float8_model().layers[0].parameters() if p.dim() == 2}
    kept = _saved_numels(model, data(0, rank)[0]) & unsharded
    return out, graphs, gathered, wires, kept, _breaks()


def test_whole_step_torchao_float8_trains_as_eager():
    """torchao's float8 weights (fp8 all-gathers) in the graph, at an uneven
    world of 3 with bf16 params: eager flex_shard's losses, first-step grads and
    params (eager itself matches FSDP2 + torchao: test_float8_gather.py), fp8
    bytes on the wire, one amax all-reduce per bucket in forward and none in
    backward (the regather reuses forward's cast), no unsharded weight saved."""
    for out, graphs, gathered, wires, kept, breaks in run_world(
            3, float8_eager_and_whole, torch.bfloat16, timeout=400):
        (e_losses, e_grads, e_full, _), (w_losses, w_grads, w_full, calls) = \
            out["eager"], out["whole"]
        assert breaks == 0 and calls == [1] * len(calls), (breaks, calls)
        torch.testing.assert_close(torch.tensor(w_losses), torch.tensor(e_losses),
                                   rtol=1e-6, atol=0)
        for k, ref in e_grads.items():
            assert_rel_close(w_grads[k], ref, 1e-6, f"grad of {k}")
        for k, ref in e_full.items():
            assert_rel_close(w_full[k], ref, 1e-6, k)
        blocks = len(wires) - 1
        assert graphs == [
            ("forward", {"all_gather_into_tensor_coalesced": len(wires),
                         "reduce_scatter_tensor_coalesced": 0, "all_reduce": len(wires),
                         "all_reduce_coalesced": 0}),
            ("backward", {"all_gather_into_tensor_coalesced": blocks,
                          "reduce_scatter_tensor_coalesced": len(wires), "all_reduce": 0,
                          "all_reduce_coalesced": 0})], graphs
        # a block's weights (128 x 64, 64 x 128 over 3 ranks: pieces of at most 43 x 64
        # and 22 x 128) travel in fp8: one byte each, where bf16 would be two
        assert gathered == [("forward", sum(wires.values())),
                            ("backward", sum(wires.values()) - wires["root"])], (gathered, wires)
        fp8 = 43 * 64 + 22 * 128
        assert fp8 <= wires["layers.0.*"] < 2 * fp8, wires
        assert not kept, f"saved for backward: {kept}"
