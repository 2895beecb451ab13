"""A user's own placement (examples/custom_placement.py), written against the
contract alone, trains with the same parity as the built-in ones."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import flexshard as fs
from harness import run_world
from reference import assert_one_collective_per_bucket, check_parity

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import custom_placement  # noqa: E402
from custom_placement import BlockRows  # noqa: E402

pytestmark = pytest.mark.world


def test_blocks_stay_whole():
    placement = BlockRows(4)
    for n in range(0, 30):
        for world in (1, 2, 3, 4):
            rows = placement.rows(torch.Size((n,)), world)
            assert sum(length for _, length in rows) == n
            starts = [s for s, length in rows if length]
            assert all(s % 4 == 0 for s in starts)  # every piece starts on a block boundary
            full = torch.arange(float(n))
            pieces = [placement.shard(full, r, world) for r in range(world)]
            assert torch.equal(placement.unshard(pieces, full.shape), full)


def test_errors():
    with pytest.raises(ValueError, match=r"BlockRows\(block=0\): block must be an int >= 1"):
        BlockRows(0)
    with pytest.raises(ValueError, match=r"BlockRows cannot split a 0-dim tensor; use fs\.Owned"):
        BlockRows(2).check(torch.Size(()), 2)


def test_is_only_the_contract():
    assert issubclass(BlockRows, fs.Placement)
    assert set(BlockRows.__abstractmethods__) == set()
    assert set(fs.Placement.__abstractmethods__) <= set(vars(BlockRows))


@pytest.mark.parametrize("world,reshard", [(2, True), (3, False)])
def test_parity(world, reshard):
    results = check_parity(world, {"placement": BlockRows(4), "reshard_after_forward": reshard},
                           count_comms=True)
    assert_one_collective_per_bucket(results)


def _run_example():
    return custom_placement.train(steps=8)


def test_example_trains():
    losses = run_world(2, _run_example)
    assert losses[0] == losses[1]
    assert losses[0][-1] < 0.5 * losses[0][0]
