"""Ranks that disagree fail fast: flex_shard compares the ranks' bucket plans
with one small collective and raises on every rank, naming what differs."""

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import flexshard as fs
from flexshard.planning.fingerprint import (_FIELDS, BucketFingerprint, _describe, _field_digests,
                                   _first_difference, bucket_fingerprint, check_plans_agree)
from flexshard.runtime.state import find_state
from harness import expect_all_ranks_raise, run_world
from models import TinyGPT
from training_helpers import NoCollectives

pytestmark = pytest.mark.world

MISMATCH_TIMEOUT_S = 30.0  # far below the harness's process-group timeout: no hang


class CountingComm(fs.GlooComm):
    """A Comm that counts the collectives it issues."""

    def __init__(self):
        self.calls = []

    def all_gather(self, output, input, group, async_op=False):
        self.calls.append("all_gather")
        return super().all_gather(output, input, group, async_op)

    def reduce_scatter(self, output, input, group, async_op=False):
        self.calls.append("reduce_scatter")
        return super().reduce_scatter(output, input, group, async_op)

    def all_reduce(self, tensor, group, op=dist.ReduceOp.SUM):
        self.calls.append("all_reduce")
        return super().all_reduce(tensor, group, op)


# ---- bodies (run on every rank of the harness world)


def _matching_plans():
    torch.manual_seed(0)
    comm = CountingComm()
    fs.flex_shard(TinyGPT(), comm=comm)
    return comm.calls


def _wrap_checked(model, **kwargs):
    """flex_shard that must leave the module untouched when it raises."""
    before = {n: p for n, p in model.named_parameters()}
    try:
        fs.flex_shard(model, **kwargs)
    except ValueError:
        assert find_state(model) is None
        assert all(p is before[n] for n, p in model.named_parameters())
        raise


def _different_sizes():
    torch.manual_seed(0)
    _wrap_checked(TinyGPT(hidden=50 + dist.get_rank()))


def _different_buckets():
    torch.manual_seed(0)
    specs = None
    if dist.get_rank() == 1:
        specs = [fs.BucketSpec("layers.*", name="layers"),
                 fs.BucketSpec(["tok.*", "pos", "norm.*", "head.*"], name="root")]
    _wrap_checked(TinyGPT(), buckets=specs)


def _rank_dependent_placement():
    torch.manual_seed(0)
    rank = dist.get_rank()

    def choose(fqn, param):
        return fs.Shard(1) if fqn == "layers.1.up.weight" and rank == 1 else fs.Shard(0)

    _wrap_checked(TinyGPT(), placement=choose)


def _rank_dependent_units():
    torch.manual_seed(0)
    units = (1, 2) if dist.get_rank() == 0 else (2, 1)

    def choose(fqn, param):
        return fs.RaggedShard(units=units) if fqn == "head.weight" else fs.Shard(0)

    _wrap_checked(TinyGPT(), placement=choose)


def _different_policy():
    torch.manual_seed(0)
    dtype = torch.bfloat16 if dist.get_rank() == 0 else torch.float32
    _wrap_checked(TinyGPT(), mp_policy=fs.MixedPrecisionPolicy(param_dtype=dtype))


class _RankDependentFormat(fs.WirePolicy):
    """A policy whose repr is the same on every rank, its choice not."""

    def format(self, fqn, shape, dtype, gather_dtype, placement, world_size):
        if dist.get_rank() == 0 and fqn == "layers.0.up.weight":
            return fs.BlockQuantized(torch.int8, gather_dtype, 1)
        return None


def _rank_dependent_wire_format():
    torch.manual_seed(0)
    _wrap_checked(TinyGPT(), mp_policy=fs.MixedPrecisionPolicy(gather_format=_RankDependentFormat()))


def _frozen_on_one_rank():
    torch.manual_seed(0)
    model = TinyGPT()
    model.layers[1].proj.bias.requires_grad_(dist.get_rank() == 0)
    _wrap_checked(model)


def _extra_bucket_on_one_rank():
    torch.manual_seed(0)
    model = TinyGPT()
    specs = [fs.BucketSpec("layers.0.*"), fs.BucketSpec("layers.1.*"),
             fs.BucketSpec(["tok.*", "pos", "norm.*", "head.*"], name="root")]
    if dist.get_rank() == 1:
        model.extra = nn.Linear(3, 3)
        specs.append(fs.BucketSpec("extra.*", name="extra"))
    _wrap_checked(model, buckets=specs)


# ---- tests


def test_matching_plans_cost_one_small_collective():
    for calls in run_world(2, _matching_plans):
        assert calls == ["all_reduce"]


def test_world_size_one_issues_no_collective():
    torch.manual_seed(0)
    model = fs.flex_shard(TinyGPT(), comm=NoCollectives())
    assert find_state(model).world_size == 1


@pytest.mark.parametrize("body, match", [
    (_different_sizes, r"bucket 0 \('layers\.0' on rank \d\): field 'shapes' differs: rank (0|1) has "
                       r"'layers\.0\.up\.weight: \(5[01], 30\)' where rank (0|1) has "
                       r"'layers\.0\.up\.weight: \(5[01], 30\)'"),
    (_different_buckets, r"bucket 0 \('layers(\.0)?' on rank \d\): field 'name' differs: rank \d has "
                         r"'layers(\.0)?' where rank \d has 'layers(\.0)?'"),
    (_rank_dependent_placement, r"bucket 1 \('layers\.1' on rank \d\): field 'placements' differs: "
                                r"rank \d has 'layers\.1\.up\.weight: Shard\(dim=[01]\)'"),
    (_rank_dependent_units, r"bucket 2 \('root' on rank \d\): field 'placements' differs: rank \d has "
                            r"'head\.weight: RaggedShard\(dims=\(0,\), units=\((1, 2|2, 1)\)\)'"),
    (_different_policy, r"bucket 0 .*: field 'mp_policy' differs: .*param_dtype=torch\.(bfloat16|float32)"),
    (_rank_dependent_wire_format, r"bucket 0 \('layers\.0' on rank \d\): field 'wire_formats' "
                                  r"differs: rank \d has 'layers\.0\.up\.weight: "
                                  r"(BlockQuantized|Cast)"),
    (_frozen_on_one_rank, r"bucket 1 \('layers\.1' on rank \d\): field 'trainable' differs: rank \d "
                          r"has 'layers\.1\.proj\.bias: (True|False)'"),
    (_extra_bucket_on_one_rank, r"bucket 3 \(('extra' on|absent on) rank \d\): "
                                r"field 'name' differs: rank \d has '(extra|\(no bucket 3: 3 buckets in all\))'"),
])
def test_mismatch_raises_on_every_rank_naming_bucket_and_field(body, match):
    start = time.monotonic()
    fails = expect_all_ranks_raise(2, body, ValueError, match, timeout=MISMATCH_TIMEOUT_S)
    assert time.monotonic() - start < MISMATCH_TIMEOUT_S
    for rank, fail in enumerate(fails):
        assert f"rank {rank} has" in fail.message and f"where rank {1 - rank} has" in fail.message
        assert f"Rank(s) [{rank}] agree with rank {rank}" in fail.message


# ---- the description, without processes


def _plan(*shapes, name="b"):
    from flexshard.planning.layout import SlotPlan

    slots = [SlotPlan(f"w{i}", torch.Size(s), torch.float32, fs.Shard(0), (torch.Size(s),))
             for i, s in enumerate(shapes)]
    return [bucket_fingerprint(name, slots, [True] * len(slots), True, fs.MixedPrecisionPolicy())]


def _table(*plans):
    rows = max(len(p) for p in plans)
    return torch.stack([_field_digests(p, rows) for p in plans])


def test_first_difference_finds_bucket_and_field():
    a, b = _plan((4, 2), (3,)), _plan((4, 2), (5,))
    assert _first_difference(_table(a, a, b)) == (0, _FIELDS.index("shapes"))
    assert _first_difference(_table(a, a + _plan((1,)))) == (1, _FIELDS.index("name"))
    with pytest.raises(AssertionError, match="no bucket field"):
        _first_difference(_table(a, a))


def test_description_names_first_differing_line():
    a, b = _plan((4, 2), (3,)), _plan((4, 2), (5,))
    msg = _describe(a, 0, _FIELDS.index("shapes"), 2, [0, 2], 1, "\n".join(b[0].shapes))
    assert msg.startswith("flex_shard: the ranks' bucket plans differ at bucket 0 ('b' on rank 2): "
                          "field 'shapes' differs: rank 2 has 'w1: (3,)' where rank 1 has 'w1: (5,)'. "
                          "Rank(s) [0, 2] agree with rank 2.")


def test_fingerprint_ignores_object_addresses():
    class Opaque:  # a repr with an address, as a placement without a dataclass repr has
        pass

    one, two = Opaque(), Opaque()
    assert repr(one) != repr(two)
    fp = [bucket_fingerprint("b", [], [], x, fs.MixedPrecisionPolicy()) for x in (one, two)]
    assert fp[0] == fp[1] and isinstance(fp[0], BucketFingerprint)


def test_world_size_one_check_is_a_no_op():
    check_plans_agree(_plan((3,)), NoCollectives(), None, 0, 1, torch.device("cpu"))
