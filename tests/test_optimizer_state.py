"""Optimizer state through DCP's get_state_dict / set_state_dict: per-element
state (AdamW, SGD momentum, Muon momentum) reshards like the parameters."""

from __future__ import annotations

import pytest
import torch

import flexshard as fs
from ckpt_util import PLACEMENTS, LR, assert_rel_close, reference, train, wrapped
from harness import expect_all_ranks_raise, run_world
from reference import make_model


def optim_state(model, optimizers) -> dict:
    """fqn -> (bound placement, shape, {state name: this rank's tensor})."""
    from flexshard.runtime.state import get_state

    out = {}
    for bucket in get_state(model).buckets:
        for slot, p in zip(bucket.slots, bucket.params):
            for opt in optimizers:
                if p in opt.state:
                    out[slot.fqn] = (slot.placement, slot.shape,
                                     {k: v.clone() for k, v in opt.state[p].items()})
    return out


def assemble(per_rank: list) -> dict:
    out = {}
    for fqn, (placement, shape, st) in per_rank[0].items():
        out[fqn] = {k: v if k == "step" else placement.unshard([r[fqn][2][k] for r in per_rank],
                                                                shape)
                    for k, v in st.items()}
    return out


def _owned_matrices(fqn, param):
    """Muon's matrices whole (Owned), the rest RaggedShard."""
    return fs.Owned() if param.dim() == 2 else fs.RaggedShard()


def muon_and_sgd(placement_name, seed=0):
    """Muon on the matrices, SGD with momentum on the rest."""
    placement = _owned_matrices if placement_name == "owned matrices" \
        else PLACEMENTS[placement_name]
    model = fs.flex_shard(make_model(seed), placement=placement)
    named = list(model.named_parameters())
    muon = torch.optim.Muon([p for _, p in named if p.dim() == 2], lr=LR)
    sgd = torch.optim.SGD([p for _, p in named if p.dim() != 2], lr=LR, momentum=0.9)
    return model, [muon, sgd]


def _save_muon(path):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from models import batch, loss_fn

    model, opts = muon_and_sgd("owned")  # whole matrices: what Muon wants
    for step in (0, 1):
        x, y = batch(step, dist.get_rank())
        loss_fn(model(x), y).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    model_sd, optim_sd = get_state_dict(model, opts)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return optim_state(model, opts)


def _load_muon(path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opts = muon_and_sgd("owned matrices", seed=1)  # SGD's params: Owned -> RaggedShard
    model_sd, optim_sd = get_state_dict(model, opts)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, opts, model_state_dict=model_sd, optim_state_dict=optim_sd)
    return optim_state(model, opts)


def test_muon_and_sgd_momentum_reshard(tmp_path):
    saved = assemble(run_world(2, _save_muon, str(tmp_path)))
    loaded = assemble(run_world(3, _load_muon, str(tmp_path)))
    assert saved.keys() == loaded.keys()
    kinds = {fqn: sorted(st) for fqn, st in saved.items()}
    assert kinds["layers.0.up.weight"] == ["momentum_buffer"]  # Muon
    assert kinds["layers.0.up.bias"] == ["momentum_buffer"]  # SGD
    for fqn in saved:
        for name in saved[fqn]:
            assert torch.equal(saved[fqn][name], loaded[fqn][name]), f"{fqn}.{name}"


def _full_optimizer_state():
    """Full AdamW state from DSD (Shard(1)), then loaded as full tensors into
    an uneven model: the same state, resharded."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                         set_state_dict)

    model, opt = wrapped("shard1")
    train(model, opt, [0, 1], dist.get_rank())
    full = StateDictOptions(full_state_dict=True)
    model_sd, optim_sd = get_state_dict(model, opt, options=full)
    other, other_opt = wrapped("uneven", seed=1)
    set_state_dict(other, other_opt, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=full)
    exp_avg = {k: v["exp_avg"] for k, v in optim_sd["state"].items()}
    return exp_avg, optim_state(model, [opt]), optim_state(other, [other_opt])


def test_full_optimizer_state_dict():
    out = run_world(2, _full_optimizer_state)
    _, ref_state = reference([2, 2])
    for fqn, exp_avg in out[0][0].items():
        assert type(exp_avg) is torch.Tensor and exp_avg.shape == ref_state[fqn]["exp_avg"].shape
        assert_rel_close(exp_avg, ref_state[fqn]["exp_avg"], 1e-5, fqn)
    original, resharded = assemble([r[1] for r in out]), assemble([r[2] for r in out])
    for fqn in original:
        for name in original[fqn]:
            assert torch.equal(original[fqn][name], resharded[fqn][name]), f"{fqn}.{name}"


class RowScaled(torch.optim.SGD):
    """Keeps a per-row statistic: state that is not shaped like the parameter."""

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["row"] = torch.ones(p.shape[0] if p.dim() else 1)
        return super().step(closure)


def _row_state():
    import torch.distributed as dist

    model = fs.flex_shard(make_model())
    opt = RowScaled(model.parameters(), lr=LR)
    train(model, opt, [0], dist.get_rank())
    opt.state_dict()


def test_state_not_shaped_like_the_param_is_refused():
    expect_all_ranks_raise(2, _row_state, NotImplementedError,
                           r"optimizer state 'row' of parameter 'pos' has shape \((6|5),\), not "
                           r"the sharded parameter's \((6|5), 30\); flexshard reshards only "
                           r"per-element")


def _load_bad_optimizer_state():
    import torch.distributed as dist

    model, opt = wrapped("shard0")
    train(model, opt, [0], dist.get_rank())
    osd = opt.state_dict()
    osd["state"][0]["exp_avg"] = torch.zeros(3)  # state 0 is model.parameters()[0]: pos
    opt.load_state_dict(osd)


def test_optimizer_state_of_another_shape():
    expect_all_ranks_raise(2, _load_bad_optimizer_state, ValueError,
                           r"optimizer\.load_state_dict: 'pos\.exp_avg' has shape \(3,\) but the "
                           r"parameter is \(11, 30\)")


# Resuming into a new optimizer in memory: `new.load_state_dict(old.state_dict())`
# before new's first step (its state-dict hooks attach at that step).

RESUME_STEPS = (2, 2)  # steps before and after the resume


def _momentum_sgd(model) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def _resumed(placement_name: str, how: str):
    """Rank body: SGD with momentum, moved after RESUME_STEPS[0] steps into a
    new optimizer through the old one's state_dict() (`how`: as it is, or a
    copy.deepcopy of it: a rollback snapshot). Full params, and the types the
    new optimizer's state holds."""
    import copy

    import torch.distributed as dist

    before, after = RESUME_STEPS
    model = fs.flex_shard(make_model(), placement=PLACEMENTS[placement_name])
    opt = _momentum_sgd(model)
    train(model, opt, range(before), dist.get_rank())
    saved = opt.state_dict()
    new = _momentum_sgd(model)
    new.load_state_dict(copy.deepcopy(saved) if how == "deepcopy" else saved)
    train(model, new, range(before, before + after), dist.get_rank())
    types = {type(v) for s in new.state.values() for v in s.values()}
    return fs.full_state_dict(model), types


@pytest.mark.parametrize("how", ["as_is", "deepcopy"])
@pytest.mark.parametrize("placement_name", ["shard0", "uneven"])  # DTensor / ShardedPieces
def test_new_optimizer_resumes_as_the_uninterrupted_run(placement_name, how):
    from reference import reference_run

    _, ref_params, _ = reference_run(2, sum(RESUME_STEPS), make_opt=_momentum_sgd)
    for full, types in run_world(2, _resumed, placement_name, how):
        assert types == {torch.Tensor}  # this rank's pieces, as the old optimizer held them
        for k, ref in ref_params.items():
            assert_rel_close(full[k], ref, 1e-5, k)


def _fused_adamw_stepped_before_wrapping(placement_name: str) -> dict:
    """Rank body: a fused AdamW steps the plain model once (rank 0's batch, on
    every rank), then the model is wrapped and the same optimizer trains on:
    its full-shape state becomes this rank's pieces at its next step."""
    import torch.distributed as dist

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    train(model, opt, range(1), 0)
    fs.flex_shard(model, placement=PLACEMENTS[placement_name])
    train(model, opt, range(1, 3), dist.get_rank())
    return fs.full_state_dict(model)


@pytest.mark.parametrize("placement_name", ["shard0", "shard1"])
def test_fused_optimizer_state_kept_as_pieces_trains_as_one_process(placement_name):
    """Shard(1)'s piece of a full tensor is a strided view, which torch's fused
    AdamW reads as if dense: the kept pieces are dense, as the params are."""
    ref_params, _ = reference([1, 2, 2])  # step 0 on rank 0's batch, then both ranks'
    for full in run_world(2, _fused_adamw_stepped_before_wrapping, placement_name):
        for k, ref in ref_params.items():
            assert_rel_close(full[k], ref, 1e-5, k)


def _full_optimizer_state_of(placement_name: str) -> tuple:
    """Rank body: AdamW trained 2 steps; fs.full_optimizer_state_dict, and a
    fresh model + optimizer at this world loading it, trained one more step."""
    import copy

    import torch.distributed as dist

    model, opt = wrapped(placement_name)
    train(model, opt, range(2), dist.get_rank())
    full = fs.full_optimizer_state_dict(model, opt)
    again, again_opt = wrapped("shard0")  # another placement
    again.load_state_dict(fs.full_state_dict(model))
    again_opt.load_state_dict(copy.deepcopy(full))  # torch's load shares the tensors
    train(again, again_opt, range(2, 3), dist.get_rank())
    return full, fs.full_state_dict(again)


@pytest.mark.parametrize("placement_name", ["owned", "ragged", "uneven"])
def test_full_optimizer_state_dict_of_uneven_placements(placement_name):
    """A one-process optimizer's state dict, on every rank, for placements whose
    state-dict values are not DTensors (DSD's full_state_dict keeps them pieces);
    it loads into another placement and trains as one process."""
    _, ref_state = reference([2, 2])
    ref_params, _ = reference([2, 2, 2])
    names = [k for k, _ in make_model().named_parameters()]
    for full, params in run_world(2, _full_optimizer_state_of, placement_name):
        for index, fqn in enumerate(names):
            for name in ("exp_avg", "exp_avg_sq"):
                got, want = full["state"][index][name], ref_state[fqn][name]
                assert type(got) is torch.Tensor and got.shape == want.shape, (fqn, name)
                assert_rel_close(got, want, 1e-5, f"{fqn}.{name}")
        for k, ref in ref_params.items():
            assert_rel_close(params[k], ref, 1e-5, k)


class OwnerPreconditioned(torch.optim.SGD):
    """Keeps a Shampoo-like (n, n) statistic for the matrices this rank holds whole."""

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() == 2 and p.numel():
                    self.state[p]["L"] = torch.eye(p.shape[1])
        return super().step(closure)


def _export_one_owner_cannot(call: str, directory: str = ""):
    """Only the head's owner holds the (n, n) state: it alone refused, and the others
    waited in the export's collectives (a hang where the owner caught it)."""
    import torch.distributed as dist

    model = fs.flex_shard(make_model(), placement=lambda fqn, p: fs.Owned(1)
                          if fqn == "head.weight" else fs.Shard(0))
    opt = OwnerPreconditioned([model.head.weight], lr=LR)
    train(model, opt, [0], dist.get_rank())
    if call == "full":
        fs.full_optimizer_state_dict(model, opt)
    else:
        fs.save_checkpoint(directory, model, opt, step=1)


@pytest.mark.parametrize("call", ["full", "save"])
def test_state_one_rank_cannot_reshard_is_refused_on_every_rank(call, tmp_path):
    expect_all_ranks_raise(3, _export_one_owner_cannot, NotImplementedError,
                           r"(optimizer state 'L' of parameter 'head.weight'.*per-element|"
                           r"another rank's optimizer holds state flexshard cannot reshard)",
                           call, str(tmp_path), timeout=60)


def _export_filtered_lists():
    """An optimizer over this rank's non-empty pieces (they differ under Owned):
    each rank's export held only its own params, silently."""
    import torch.distributed as dist

    model = fs.flex_shard(make_model(), placement=fs.Owned())
    opt = torch.optim.SGD([p for p in model.parameters() if p.numel()], lr=LR)
    train(model, opt, [0], dist.get_rank())
    fs.full_optimizer_state_dict(model, opt)


def test_a_full_optimizer_export_of_per_rank_lists_is_refused_on_every_rank():
    expect_all_ranks_raise(3, _export_filtered_lists, ValueError,
                           r"fs\.full_optimizer_state_dict: the optimizer holds different params "
                           r"on different ranks .*not a list filtered by p\.numel\(\)", timeout=60)
