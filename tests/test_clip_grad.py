"""fs.clip_grad_norm_: the global norm over sharded grads, one all-reduce."""

from __future__ import annotations

import math

import pytest
import torch

import flexshard as fs
from flexshard.runtime.state import find_state
from harness import expect_all_ranks_raise, run_world
from models import batch, loss_fn
from reference import make_model
from training_helpers import CountingComm, check_against_reference, train

STEPS = 3
MAX_NORM = 0.05  # below the TinyGPT grad norms of every order, so every step clips


def clip_step(clip, norm_type, norms):
    def step(model, i, x, y):
        loss = loss_fn(model(x), y)
        loss.backward()
        norms.append(float(clip(model, MAX_NORM, norm_type)))
        return loss
    return step


def clipped_training(norm_type) -> tuple:
    """Rank body: train with fs.clip_grad_norm_; (losses, params, norms, all-reduces)."""
    comm = CountingComm()
    model = fs.flex_shard(make_model(), comm=comm)
    comm.reset()  # flex_shard's own check that the ranks agree all-reduces too
    norms = []
    losses = train(model, STEPS, clip_step(fs.clip_grad_norm_, norm_type, norms))
    # train() all-reduces the loss outside comm; the clips are the only comm all-reduces.
    return losses, fs.full_state_dict(model), norms, comm.calls["all_reduce"]


@pytest.mark.parametrize("world,norm_type", [(2, 2.0), (2, 1.0), (2, math.inf), (3, 2.0)])
def test_clip_parity(world, norm_type):
    results = run_world(world, clipped_training, norm_type)
    losses, full, norms, all_reduces = results[0]
    ref_norms = []
    step = clip_step(lambda m, *a: torch.nn.utils.clip_grad_norm_(m.parameters(), *a),
                     norm_type, ref_norms)
    check_against_reference(losses, full, world, STEPS, step_fn=step)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0)
    assert all(n > MAX_NORM for n in ref_norms), "the test must actually clip"
    for _, _, rank_norms, rank_all_reduces in results:
        assert rank_norms == norms  # the same norm on every rank
        assert rank_all_reduces == STEPS  # one all-reduce per clip


def single_process_clip() -> tuple:
    model = fs.flex_shard(make_model())
    x, y = batch(0, 0)
    loss_fn(model(x), y).backward()
    return fs.clip_grad_norm_(model, MAX_NORM, 3.0)


def test_world_size_one_and_general_p():
    model = make_model()
    x, y = batch(0, 0)
    loss_fn(model(x), y).backward()
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, 3.0)
    torch.testing.assert_close(single_process_clip(), expected, rtol=1e-5, atol=0)


def nonfinite():
    model = fs.flex_shard(make_model())
    x, y = batch(0, torch.distributed.get_rank())
    loss_fn(model(x), y).backward()
    next(model.parameters()).grad[0] = float("inf")
    fs.clip_grad_norm_(model, 1.0, error_if_nonfinite=True)


def bad_clip(max_norm, norm_type):
    fs.clip_grad_norm_(fs.flex_shard(make_model()), max_norm, norm_type)


def test_clip_rejects_bad_input():
    expect_all_ranks_raise(2, bad_clip, ValueError, r"norm_type must be > 0 .* got 0", 1.0, 0)
    expect_all_ranks_raise(2, bad_clip, ValueError, r"max_norm must be >= 0, got -1", -1, 2.0)
    expect_all_ranks_raise(2, bad_clip, TypeError, r"max_norm must be a number, got 'a'", "a", 2.0)
    # Rank 0's piece is inf; the global norm says so on every rank.
    expect_all_ranks_raise(2, nonfinite, RuntimeError, r"total norm of order 2.0 .* is inf")
    with pytest.raises(TypeError, match="not wrapped by flex_shard"):
        fs.clip_grad_norm_(make_model(), 1.0)


# The spellings of a grad's norm in code written for unsharded models, and the
# hand-written clipping loop older code uses, on sharded grads: global, as on one process.

WORLD, LR = 2, 0.05
NORMS = {  # name -> a full norm of a sharded grad, global (a collective)
    "g.norm()": lambda g: g.norm(),
    "torch.norm(g)": lambda g: torch.norm(g),
    "g.norm(p='fro')": lambda g: g.norm(p="fro"),
    "g.norm(inf)": lambda g: g.norm(math.inf),
    "vector_norm(g, 1)": lambda g: torch.linalg.vector_norm(g, 1),
    "linalg.norm(g)": lambda g: torch.linalg.norm(g),
    "linalg.norm(g, 'fro')": lambda g: torch.linalg.norm(g, "fro"),
    "matrix_norm(g)": lambda g: torch.linalg.matrix_norm(g),
    "g.data.norm()": lambda g: g.data.norm(),
    "g.detach().norm()": lambda g: g.detach().norm(),
    "g.detach().data.norm(2)": lambda g: g.detach().data.norm(2),
}
VECTOR_NORMS = {  # of a 1-D grad, torch.linalg.norm is a vector p-norm
    "linalg.norm(b, 1)": lambda b: torch.linalg.norm(b, 1),
    "linalg.norm(b, -inf)": lambda b: torch.linalg.norm(b, -math.inf),
    "b.data.norm()": lambda b: b.data.norm(),
}
LOCAL = lambda g: g.pow(2).sum()  # noqa: E731 - an elementwise reduction: this rank's piece


def spelled_norms(model) -> dict:
    g, b = model.layers[0].up.weight.grad, model.layers[0].up.bias.grad
    norms = {name: float(f(g)) for name, f in NORMS.items()}
    norms.update({name: float(f(b)) for name, f in VECTOR_NORMS.items()})
    return {**norms, "local": float(LOCAL(g))}


def spelled_norms_body() -> dict:
    model = fs.flex_shard(make_model())
    x, y = batch(0, torch.distributed.get_rank())
    loss_fn(model(x), y).backward()
    return spelled_norms(model)


def test_each_spelling_of_a_grad_norm_is_global():
    model = make_model()
    xs, ys = zip(*(batch(0, r) for r in range(WORLD)))
    loss_fn(model(torch.cat(xs)), torch.cat(ys)).backward()
    want = spelled_norms(model)
    results = run_world(WORLD, spelled_norms_body)
    for name in [*NORMS, *VECTOR_NORMS]:
        for rank, got in enumerate(results):
            assert got[name] == pytest.approx(want[name], rel=1e-5), f"{name} on rank {rank}"
    # Sums, maxes and the like stay the piece's (docs/api.md): the ranks' add up.
    assert sum(got["local"] for got in results) == pytest.approx(want["local"], rel=1e-5)
    assert all(got["local"] < want["local"] for got in results)


HAND_NORMS = {"data": lambda g: g.data.norm(2), "detach": lambda g: g.detach().norm(2),
              "linalg": torch.linalg.norm}


def hand_clipped_sgd(model, batches, spelling: str) -> list:
    """SGD steps clipped the pre-clip_grad_norm_ way: the total norm from each
    grad's, then every grad scaled in place through .data; the totals."""
    opt, norm, totals = torch.optim.SGD(model.parameters(), lr=LR), HAND_NORMS[spelling], []
    for step in range(STEPS):
        x, y = batches(step)
        loss_fn(model(x), y).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        total = sum(norm(g).item() ** 2 for g in grads) ** 0.5
        assert total > MAX_NORM, "the test must clip"
        for g in grads:
            g.data.mul_(MAX_NORM / (total + 1e-6))
        opt.step()
        opt.zero_grad()
        totals.append(total)
    return totals


def hand_clipped_body(spelling: str) -> tuple:
    model = fs.flex_shard(make_model())
    rank = torch.distributed.get_rank()
    return hand_clipped_sgd(model, lambda step: batch(step, rank), spelling), \
        fs.full_state_dict(model)


def _all_batches(step: int) -> tuple:
    xs, ys = zip(*(batch(step, r) for r in range(WORLD)))
    return torch.cat(xs), torch.cat(ys)


@pytest.mark.parametrize("spelling", sorted(HAND_NORMS))
def test_hand_written_clipping_loop_trains_as_one_process(spelling):
    model = make_model()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the harness workers: same kernels, same rounding
    try:
        ref_totals = hand_clipped_sgd(model, _all_batches, spelling)
    finally:
        torch.set_num_threads(threads)
    for rank, (totals, full) in enumerate(run_world(WORLD, hand_clipped_body, spelling)):
        torch.testing.assert_close(torch.tensor(totals), torch.tensor(ref_totals), rtol=1e-5,
                                   atol=0, msg=lambda m: f"rank {rank}: {m}")
        for k, v in model.named_parameters():
            torch.testing.assert_close(full[k], v.detach(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank}, {k}: {m}")


def matrix_norm_of_order(kind: str, ord_) -> None:
    model = fs.flex_shard(make_model())
    x, y = batch(0, torch.distributed.get_rank())
    loss_fn(model(x), y).backward()
    g = model.layers[0].up.weight.grad
    torch.linalg.norm(g, ord_) if kind == "norm" else torch.linalg.matrix_norm(g, ord_)


def test_matrix_norms_other_than_frobenius_refuse():
    for kind, ord_ in [("norm", 2), ("matrix_norm", "nuc")]:
        expect_all_ranks_raise(
            WORLD, matrix_norm_of_order, NotImplementedError,
            rf"torch\.linalg\.{kind}\(grad, ord={ord_!r}\) of param 'layers\.0\.up\.weight' "
            rf"\(bucket '[^']+'\): a matrix norm of order {ord_!r} cannot be completed from "
            r"the ranks' pieces of a sharded grad.*Use ord='fro' for the global Frobenius "
            r"norm, or take this norm of the full gradient, p\.grad\.full_tensor\(\)",
            kind, ord_)



def _subset_norms(model, pick) -> dict:
    """torch's clip_grad_norm_ and get_total_norm over each of `pick(model)`'s
    lists of params."""
    out = {}
    for name, params in pick(model).items():
        grads = [p.grad for p in params if p.grad is not None]
        out[name] = float(torch.nn.utils.get_total_norm(grads, 2.0))
        out[name + " clip"] = float(torch.nn.utils.clip_grad_norm_(params, 1e6))
    return out


def _is_block_matrix(fqn, shape) -> bool:
    return fqn.startswith("layers") and len(shape) == 2


def _muon_lists(model) -> dict:
    if find_state(model) is None:  # the one-process model
        named = list(model.named_parameters())
        return {"matrices": [p for n, p in named if _is_block_matrix(n, p.shape)],
                "others": [p for n, p in named if not _is_block_matrix(n, p.shape)]}
    split = fs.optim.split_for_muon(model, _is_block_matrix)
    return {"matrices": split.matrices, "others": split.others}


def muon_lists_body() -> dict:
    model = fs.flex_shard(make_model(), placement=fs.Owned())
    for step in range(2):  # the second call finds the grads already ShardedGrads
        x, y = batch(step, torch.distributed.get_rank())
        loss_fn(model(x), y).backward()
        norms = _subset_norms(model, _muon_lists)
        model.zero_grad()
    return norms


def test_clipping_each_optimizers_params_of_a_muon_split():
    """Clipping per optimizer (Lightning's way) over fs.optim.split_for_muon's
    lists, under Owned at 3 ranks (each rank holds other matrices whole): each
    norm is the whole list's, on every rank, and nothing hangs."""
    world, model = 3, make_model()
    xs, ys = zip(*(batch(1, r) for r in range(world)))
    loss_fn(model(torch.cat(xs)), torch.cat(ys)).backward()
    want = _subset_norms(model, _muon_lists)
    for rank, got in enumerate(run_world(world, muon_lists_body)):
        for name, value in want.items():
            assert got[name] == pytest.approx(value, rel=1e-5), f"{name} on rank {rank}"


# A param with fewer rows than ranks leaves some rank an empty piece, whose inf-norm
# torch refuses (max of nothing): that rank adds nothing (0; inf for -inf) and the
# others must not wait for it in the all-reduce.

EMPTY_WORLD = 3
INF_NORMS = {
    "fs.clip_grad_norm_": lambda m: fs.clip_grad_norm_(m, 1e9, math.inf),
    "clip_grad_norm_": lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9, math.inf),
    "get_total_norm foreach": lambda m: torch.nn.utils.get_total_norm(
        [p.grad for p in m.parameters()], math.inf, foreach=True),
    "vector_norm(bias, inf)": lambda m: torch.linalg.vector_norm(m[2].bias.grad, math.inf),
    "linalg.norm(bias, -inf)": lambda m: torch.linalg.norm(m[2].bias.grad, -math.inf),
    "fs.grad_norms(bias, -inf)": lambda m: fs.grad_norms(m, -math.inf)["2.bias"],
}


def small_head() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 21), torch.nn.Tanh(), torch.nn.Linear(21, 2))


def head_batch(rank: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))


def inf_norms(model, wrapped: bool = True) -> dict:
    return {name: float(f(model)) for name, f in INF_NORMS.items()
            if wrapped or not name.startswith("fs.")}


def inf_norms_body(placement) -> dict:
    model = fs.flex_shard(small_head(), placement=placement)
    model(head_batch(torch.distributed.get_rank())).square().mean().backward()
    return inf_norms(model)


@pytest.mark.parametrize("placement", [fs.Shard(0), fs.Owned(), fs.RaggedShard(units=(0, 1, 1))],
                         ids=["shard", "owned", "ragged"])
def test_inf_norms_with_an_empty_piece_are_global(placement):
    model = small_head()
    model(torch.cat([head_batch(r) for r in range(EMPTY_WORLD)])).square().mean().backward()
    want = inf_norms(model, wrapped=False)
    want["fs.clip_grad_norm_"] = want["clip_grad_norm_"]
    want["fs.grad_norms(bias, -inf)"] = want["linalg.norm(bias, -inf)"]
    for rank, got in enumerate(run_world(EMPTY_WORLD, inf_norms_body, placement, timeout=60)):
        assert got == pytest.approx(want, rel=1e-6), f"rank {rank}"


class _CompiledStep:
    """SGD with momentum whose step is torch.compile'd, given plain grads: dynamo
    cannot trace the ShardedGrad subclass (docs/troubleshooting.md)."""

    def __init__(self, model) -> None:
        self.params = [p for p in model.parameters() if p.numel()]
        self.opt = torch.optim.SGD(self.params, lr=1e-2, momentum=0.9)
        self.graph_runs = 0
        self._step = torch.compile(self.opt.step, backend=self._counting)

    def _counting(self, gm, example_inputs):
        def run(*args):
            self.graph_runs += 1
            return gm(*args)
        return run

    def step(self) -> None:
        for p in self.params:
            p.grad = None if p.grad is None else p.grad.as_subclass(torch.Tensor)
        runs = self.graph_runs
        self._step()
        assert self.graph_runs > runs, "the optimizer step ran eagerly"

    def zero_grad(self) -> None:
        self.opt.zero_grad()


def compiled_sgd(model) -> _CompiledStep:
    return _CompiledStep(model)


def test_a_compiled_optimizer_step_given_plain_grads_trains_as_one_process():
    from reference import check_parity

    check_parity(2, {}, steps=3, make_opt=compiled_sgd)


def clip_a_list_filtered_by_numel() -> float:
    """torch's clip_grad_norm_ over the params with a piece on this rank: Owned norms
    and biases and a RaggedShard with an empty piece make the lists differ by rank."""
    import torch.distributed as dist
    import torch.nn as nn

    world = dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 7), nn.LayerNorm(7), nn.Linear(7, 13), nn.Linear(13, 1))
    fs.flex_shard(model, placement=lambda fqn, p: fs.Owned() if p.dim() == 1
                  else fs.RaggedShard(units=tuple(range(world))))
    model(torch.randn(4, 8)).sum().backward()
    mine = [p for p in model.parameters() if p.numel() > 0]
    return torch.nn.utils.clip_grad_norm_(mine, 1.0).item()


def test_ranks_clipping_different_params_raise_on_every_rank():
    """It returned a wrong norm on one rank, which clipped by it and went on, while
    the others waited in their norms' all-reduces until it exited."""
    expect_all_ranks_raise(3, clip_a_list_filtered_by_numel, RuntimeError,
                           r"the ranks took the norms of different gradients in one collective "
                           r"\(rank \d: \d+, param .*fs\.clip_grad_norm_", timeout=60)


def clip_lists_one_longer_on_the_owner() -> list:
    """torch's clip over the params with a piece here, where only rank 0's list is
    longer (1.weight has one row, 1.bias is Owned by 0): on CPU torch takes one
    norm per grad, so the others' lists are rank 0's, cut short."""
    import torch.distributed as dist
    import torch.nn as nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 7), nn.Linear(7, 1))
    fs.flex_shard(model, placement=lambda fqn, p: fs.Owned(0) if fqn == "1.bias"
                  else fs.Shard(0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    norms = []
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
        mine = [p for p in model.parameters() if p.numel() > 0]
        assert len(mine) == (4 if dist.get_rank() == 0 else 2)
        norms.append(torch.nn.utils.clip_grad_norm_(mine, 1.0).item())
        opt.step()
        opt.zero_grad()
    return norms


def test_a_rank_with_a_longer_list_of_norms_raises_with_the_others():
    """Ranks 1 and 2 returned a wrong norm and exited while rank 0 waited in the norm
    of a grad they never took (a hang in a training loop). Now rank 0's extra norm
    meets their next forward's check, and every rank raises."""
    expect_all_ranks_raise(3, clip_lists_one_longer_on_the_owner, RuntimeError,
                           r"is in (a norm of sharded grads .*|the model's forward) while another "
                           r"rank of the model is in .*fs\.clip_grad_norm_", timeout=60)


def norms_after_reassigning_grads() -> list:
    """(global norm before, after each `p.grad = <arithmetic on p.grad>`): a user's
    gradient scaling or noise. The result was a plain tensor, and torch's norms of it
    this rank's piece's (0.64 / 0.44 where 0.78 is right), so ranks clipped apart."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = fs.flex_shard(make_model())
    x, y = batch(0, dist.get_rank())
    loss_fn(model(x), y).backward()
    grads = lambda: [p.grad for p in model.parameters()]  # noqa: E731
    out = [torch.nn.utils.get_total_norm(grads()).item()]
    for change in (lambda g: g / 2, lambda g: 3 * g, lambda g: g + g, lambda g: -g,
                   lambda g: torch.mul(g, 0.5), lambda g: g.div(2) - g * 0.25):
        for p in model.parameters():
            p.grad = change(p.grad)
        out.append(torch.nn.utils.get_total_norm(grads()).item())
    return out


def test_grads_reassigned_by_arithmetic_keep_global_norms():
    factors = [1, 0.5, 3, 2, 1, 0.5, 0.25]
    for norms in run_world(2, norms_after_reassigning_grads):
        expected = norms[0]
        for got, factor in zip(norms, factors):
            expected *= factor
            assert got == pytest.approx(expected, rel=1e-5), norms
