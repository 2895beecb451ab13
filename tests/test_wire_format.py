"""Wire formats (the placement contract's WireFormat): a param whose gather sends
two parts of different dtypes, encoded from its piece and decoded from the
gathered parts, mixed with plain params of every placement in one bucket. The
format here is lossless (magnitude in the param's dtype, sign as uint8), so a
bucket gathering through it trains bitwise like one that casts, and both match
the single-process reference."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import flexshard as fs
from harness import run_world
from reference import check_parity, train_sharded

OFF = fs.OffloadPolicy(pin_memory=False)


@dataclass(frozen=True)
class SignSplit(fs.WireFormat):
    """|x| in the gather dtype and the sign bit as one uint8 per element: two
    parts split as the param is."""

    dtype: torch.dtype

    def parts(self, shape, placement, world_size):
        return (fs.WirePart(shape, self.dtype, placement),
                fs.WirePart(shape, torch.uint8, placement))

    def encode(self, piece, outs, mesh):
        outs[0].copy_(piece.abs())
        outs[1].copy_(piece < 0)

    def decode(self, fulls, meta):
        magnitude, negative = fulls
        return torch.where(negative.bool(), -magnitude, magnitude)


@dataclass(frozen=True)
class SplitMatrices(fs.WirePolicy):
    def format(self, fqn, shape, dtype, gather_dtype, placement, world_size):
        return SignSplit(gather_dtype) if len(shape) > 1 else None


SPLIT = fs.MixedPrecisionPolicy(gather_format=SplitMatrices())


def owned_matrices(fqn, param):
    return fs.Owned() if param.dim() > 1 else fs.RaggedShard()


def shard1_matrices(fqn, param):
    return fs.Shard(1) if param.dim() > 1 else fs.Shard(0)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("placement", [None, owned_matrices, shard1_matrices],
                         ids=["shard0", "owned", "shard1"])
def test_two_part_format_matches_the_reference(world, placement):
    config = {"mp_policy": SPLIT}
    if placement is not None:
        config["placement"] = placement
    check_parity(world, config)


def _pair(steps: int, config: dict) -> tuple:
    """Rank body: the same training with and without the format, and what the
    bucket's gather layout holds."""
    from flexshard.runtime.state import get_state

    plain = train_sharded(steps, config)
    split = train_sharded(steps, {**config, "mp_policy": SPLIT})
    model = fs.flex_shard(__import__("reference").make_model(), **{**config, "mp_policy": SPLIT})
    bucket = get_state(model).buckets[0]
    return plain, split, len(bucket.slots), len(bucket.gather.layout.regions)


@pytest.mark.parametrize("world,config", [
    (2, {"placement": owned_matrices, "reshard_after_forward": False}),
    (2, {"placement": fs.RaggedShard(), "offload_policy": OFF}),
    (4, {"placement": owned_matrices, "reshard_after_forward": 2}),
], ids=["owned-kept", "ragged-offload", "owned-int-reshard"])
def test_format_trains_bitwise_like_a_cast(world, config):
    """Losses, first-step grads and final params equal bit for bit (the int
    reshard's backward gathers from its kept slice of the parts); the gather
    layout holds one region per part (a matrix sends two)."""
    results = run_world(world, _pair, 3, config)
    for plain, split, slots, regions in results:
        assert plain[0] == split[0]
        for fqn, (_, _, grad) in plain[2].items():
            assert torch.equal(grad, split[2][fqn][2]), fqn
        assert regions > slots
    plain, split = results[0][0], results[0][1]
    for fqn, value in plain[1].items():
        assert torch.equal(value, split[1][fqn]), fqn


def test_a_policy_that_is_not_a_wire_policy_is_refused():
    with pytest.raises(TypeError, match="gather_format must be a fs.WirePolicy"):
        fs.MixedPrecisionPolicy(gather_format=SignSplit(torch.float32))


class _KeyOnly(fs.WireFormat):
    """A format that asks to be batched but cannot encode a batch."""

    def parts(self, shape, placement, world_size):
        return (fs.WirePart(torch.Size(shape), torch.float32, placement),)

    def encode(self, piece, outs, mesh=None):
        outs[0].copy_(piece)

    def decode(self, fulls, meta=None):
        return fulls[0]

    def batch_key(self):
        return "mine"


class _KeyOnlyPolicy(fs.WirePolicy):
    def format(self, fqn, shape, dtype, gather_dtype, placement, world_size):
        return _KeyOnly()


def test_a_batch_key_without_encode_batch_is_refused_at_wrap():
    mp = fs.MixedPrecisionPolicy(gather_format=_KeyOnlyPolicy())
    with pytest.raises(NotImplementedError, match=r"parameter '0\.weight': its wire format "
                                                  r"_KeyOnly returns a batch_key but defines no "
                                                  r"encode_batch; define encode_batch"):
        fs.flex_shard(torch.nn.Sequential(torch.nn.Linear(4, 4)), mp_policy=mp)
