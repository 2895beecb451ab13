"""examples/domain_parallel.py at 4 ranks, (dp 2) x (model 2): activations split
unevenly over points, head-parallel attention through the all-to-all, params
flex-sharded over the whole world. Matches one process trained on the same data."""

from __future__ import annotations

import pytest
import torch

import flexshard as fs
from example_loader import load_example, single_thread
from harness import run_world

pytestmark = pytest.mark.world

STEPS = 4


def _example():
    return load_example("domain_parallel")


def _train(reshard_after_forward, optimizer):
    return _example().train(STEPS, reshard_after_forward=reshard_after_forward,
                            optimizer=optimizer)


def _reference(optimizer):
    return single_thread(_example().reference, STEPS, optimizer)


# SGD's steps scale with the gradient (AdamW's do not): it pins the divide factor.
@pytest.mark.parametrize("reshard_after_forward,optimizer", [(True, "adamw"), (False, "sgd")])
def test_matches_one_process(reshard_after_forward, optimizer):
    ref_losses, ref_params = _reference(optimizer)
    results = run_world(4, _train, reshard_after_forward, optimizer)
    holds = [line for _, _, line in results]
    assert holds[0].startswith("rank 0: dp 0, model 0: points 0..5 (6 of 10), heads 0..1 (2 of 3)")
    assert holds[3].startswith("rank 3: dp 1, model 1: points 6..9 (4 of 10), heads 2..2 (1 of 3)")
    assert ref_losses[-1] < ref_losses[0]  # it learns
    for rank, (losses, params, _) in enumerate(results):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses),
                                   rtol=1e-5, atol=1e-5, msg=lambda m, r=rank: f"rank {r} loss: {m}")
        assert params.keys() == ref_params.keys()
        for name, ref in ref_params.items():
            torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=1e-5,
                                       msg=lambda m, r=rank, n=name: f"rank {r} {n}: {m}")


class AllToAllCounter(fs.Comm):
    def __init__(self):
        self.all_to_alls = 0

    def all_to_all(self, *args, **kwargs):
        self.all_to_alls += 1
        return super().all_to_all(*args, **kwargs)


def _count_one_step(reshard_after_forward):
    comm = AllToAllCounter()
    _example().train(1, reshard_after_forward=reshard_after_forward, comm=comm)
    return comm.all_to_alls


def test_all_to_alls_per_step():
    """Two blocks, one all-to-all each way per attention, reversed in backward: 8.
    Reshard after forward regathers only the params in backward, never the
    block's forward, so its all-to-alls run once too."""
    assert run_world(4, _count_one_step, False) == [8] * 4
    assert run_world(4, _count_one_step, True) == [8] * 4
