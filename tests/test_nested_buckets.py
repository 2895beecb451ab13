"""Buckets run by nested modules (a Linear's bucket inside its block's bucket):
each bucket regathers once in backward, and training is correct."""

from __future__ import annotations

from torch.distributed.tensor.debug import CommDebugMode

import flexshard as fs
from harness import run_world
from test_comm_counts import _counts
from reference import check_parity

NESTED = ["layers.0.up.*", "layers.0.down.*", "layers.0.[nqp]*", "layers.1.*",
          "tok.*", "pos", "norm.*", "head.*"]


def test_nested_buckets_parity():
    check_parity(2, {"buckets": [fs.BucketSpec(p) for p in NESTED]})


def nested_counts() -> tuple:
    import torch.distributed as dist
    from flexshard.runtime.state import get_state
    from models import batch, loss_fn
    from reference import make_model

    model = fs.flex_shard(make_model(), buckets=[fs.BucketSpec(p) for p in NESTED])
    x, y = batch(0, dist.get_rank())
    with CommDebugMode() as mode:
        loss_fn(model(x), y).backward()
    buckets = get_state(model).buckets
    return (_counts(mode), len(buckets), sum(b.gather.reshard_after_forward for b in buckets),
            fs.describe(model).gathers_per_step)


def test_nested_buckets_gather_once_each_in_backward():
    for (gathers, reduces, other), n, resharding, planned in run_world(2, nested_counts):
        # 'pos' is registered on the root, so only its bucket keeps its params.
        assert (n, resharding) == (8, 7)
        # Every resharding bucket is regathered once in backward, whether its module
        # is nested in another's or not: before the backward of a module whose
        # output needs a grad (as FSDP2's), so also the embedding's 'tok.*', whose
        # backward reads no param.
        assert (gathers, reduces, other) == (n + resharding, n, 1)  # 1: RankAgreement
        assert planned == gathers
