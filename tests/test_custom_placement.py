"""A user's own placement (examples/custom_placement.py), written against the
contract alone, trains with the same parity as the built-in ones; one that breaks
the contract is refused at wrap time, on every rank, naming the rule."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import flexshard as fs
from harness import expect_all_ranks_raise, run_world
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


@dataclass(frozen=True)
class Flawed(fs.Placement):
    """Halves of dim 0 over 2 ranks, with one flaw (a user's mistake)."""

    flaw: str

    def check(self, shape, world_size): pass
    def bind(self, shape, itemsize, world_size, rank_bytes): return self

    def local_shape(self, shape, rank, world_size):
        if self.flaw == "count":  # every rank the whole tensor: pieces that overlap
            return torch.Size(shape)
        if self.flaw == "rank_major":
            return torch.Size((shape[0], shape[1] // 2))
        return torch.Size((shape[0] // 2, *shape[1:]))

    def shard(self, full, rank, world_size):
        half = full.shape[0] // 2
        if self.flaw == "count":
            return full
        if self.flaw == "rank_major":  # columns, while rank_major() says True
            return full.narrow(1, rank * (full.shape[1] // 2), full.shape[1] // 2)
        if self.flaw == "shape":
            return full.narrow(0, rank * half, half - rank)
        return full.narrow(0, 0 if self.flaw == "overlap" else rank * half, half)

    def unshard(self, pieces, shape):
        if self.flaw == "rank_major":
            return torch.cat(list(pieces), dim=1)
        return torch.cat(list(pieces)[::-1] if self.flaw == "unshard" else list(pieces))

    def rank_major(self, shape):
        return self.flaw != "overlap"


FLAWS = {  # flaw -> (out_features of the Linear, the message)
    "shape": (16, r"shard\(\) returned a piece of shape \(7, 8\) for rank 1, but local_shape\(\) "
                  r"says \(8, 8\); make shard\(\) and local_shape\(\) agree"),
    "count": (16, r"local_shape\(\) gives the 2 ranks 256 elements of a \(16, 8\) tensor of 128; "
                  r"each element must lie in exactly one rank's piece"),
    "overlap": (16, r"the ranks' pieces overlap or leave elements out"),
    "unshard": (16, r"unshard\(\) of the ranks' pieces does not give the tensor back"),
    # a weight above the index check's size: found from the meta device's views
    "rank_major": (2 ** 14, r"rank_major\(\) is True, but the pieces flattened and joined in "
                            r"rank order are not the tensor flattened; return False"),
}


def _wrap_flawed(flaw: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, FLAWS[flaw][0]))
    fs.flex_shard(model, placement=lambda fqn, p: Flawed(flaw) if p.dim() == 2 else fs.Shard(0))


def _wrap_with_the_class():
    fs.flex_shard(torch.nn.Linear(8, 8), placement=fs.Shard)


@pytest.mark.parametrize("flaw", list(FLAWS))
def test_a_placement_breaking_the_contract_is_refused_on_every_rank(flaw):
    expect_all_ranks_raise(2, _wrap_flawed, ValueError,
                           r"parameter '0\.weight' in bucket 'root': Flawed\(flaw='" + flaw
                           + r"'\): " + FLAWS[flaw][1], flaw)


def test_a_placement_class_instead_of_an_instance_is_refused():
    expect_all_ranks_raise(2, _wrap_with_the_class, TypeError,
                           r"the placement of bucket 'root' is the class Shard, not a placement: "
                           r"pass an instance, such as Shard\(\) or fs\.Shard\(0\)")
