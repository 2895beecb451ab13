"""torch optimizers whose step reads a whole param (Muon, Adafactor) or every
param at once (LBFGS): refused at their first step on pieces that would train
wrong, on every rank, before the step runs; Adafactor on Owned params trains as
one process."""

from __future__ import annotations

import pytest
import torch

import flexshard as fs
from flexshard.runtime.state import find_state
from harness import expect_all_ranks_raise
from models import batch, loss_fn
from reference import LR, check_parity, make_model

pytestmark = pytest.mark.world

WORLD = 2


def _step_once(case: str) -> None:
    placement, make_opt, *_ = CASES[case]
    model = fs.flex_shard(make_model(), placement=placement)
    opt = make_opt(model)
    x, y = batch(0, torch.distributed.get_rank())

    def closure():
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss
    closure()
    opt.step(closure)


def _muon(model) -> torch.optim.Optimizer:
    return torch.optim.Muon([p for p in model.parameters() if p.dim() == 2], lr=LR)


def _adafactor(model) -> torch.optim.Optimizer:
    return torch.optim.Adafactor(model.parameters(), lr=LR)


def _lbfgs(model) -> torch.optim.Optimizer:
    return torch.optim.LBFGS(model.parameters(), lr=LR)


CASES = {
    "muon on rows": (fs.Shard(0), _muon, ValueError,
                     r"torch\.optim\.Muon orthogonalizes each matrix as a whole, but parameter "
                     r"'\w+' in bucket '\w+' is split across ranks \(Shard\(dim=0\)\).*"
                     r"placement fs\.Owned\(\)"),
    "adafactor on ragged rows": (
        fs.RaggedShard(), _adafactor, ValueError,
        r"torch\.optim\.Adafactor factors each param's second moment.*is split across ranks"),
    "adafactor on empty pieces": (
        fs.Owned(), _adafactor, ValueError,
        r"parameter '[\w.]+' in bucket '[\w.]+' is an empty piece on this rank.*"
        r"\[p for p in params if p\.numel\(\)\]"),
    "lbfgs": (fs.Owned(), _lbfgs, NotImplementedError,
              r"torch\.optim\.LBFGS flattens every param's grad into one vector.*each rank "
              r"sees only its own pieces.*run LBFGS on one process"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_at_the_first_step_on_every_rank(case):
    *_, exc, match = CASES[case]
    expect_all_ranks_raise(WORLD, _step_once, exc, match, case)


def adafactor_on_non_empty_pieces(model) -> torch.optim.Optimizer:
    params = model.parameters()
    if find_state(model) is not None:  # Owned: this rank's whole params only
        params = [p for p in params if p.numel()]
    return torch.optim.Adafactor(params, lr=LR)


@pytest.mark.parametrize("world", [2, 3])
def test_adafactor_on_owned_params_trains_as_one_process(world):
    check_parity(world, {"placement": fs.Owned()}, make_opt=adafactor_on_non_empty_pieces)


def _muon_group_added_after_a_step() -> None:
    """Muon over Owned matrices steps once; then a group of Shard(0) matrices is added
    (unfreezing layers): the check ran at the first step only, and Muon stepped each
    rank's rows as whole matrices, silently."""
    model = fs.flex_shard(make_model(), placement=lambda fqn, p: fs.Owned()
                          if fqn.startswith("layers.0.") else fs.Shard(0))
    owned = [p for n, p in model.named_parameters() if n.startswith("layers.0.") and p.dim() == 2]
    opt = torch.optim.Muon(owned, lr=LR)
    x, y = batch(0, torch.distributed.get_rank())
    for step in range(2):
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if step == 0:
            opt.add_param_group({"params": [p for n, p in model.named_parameters()
                                            if n.startswith("layers.1.") and p.dim() == 2]})


def test_a_group_added_after_the_first_step_is_checked_at_the_next():
    expect_all_ranks_raise(WORLD, _muon_group_added_after_a_step, ValueError,
                           r"torch\.optim\.Muon orthogonalizes each matrix as a whole, but "
                           r"parameter 'layers\.1\.[\w.]+' in bucket '[\w.]+' is split")
