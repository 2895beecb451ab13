"""CPU offload (fs.OffloadPolicy): sharded params, their grads and the optimizer
state in host memory, staged to the compute device for each gather and copied
back after each reduce-scatter. On CPU the compute device is CPU too, and the
same path runs with CPU-to-CPU copies (a staged buffer separate from the storage).
Parity against the single-process reference, exact copy counters, bad input."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import flexshard as fs
from harness import run_world
from models import batch, loss_fn
from reference import check_parity, make_model
from training_helpers import accumulate_two_halves, check_against_reference, train

OFF = fs.OffloadPolicy(pin_memory=True)
BF16 = fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def owned_matrices(fqn, param):
    return fs.Owned() if param.dim() > 1 else fs.RaggedShard()


def half_offloaded() -> list:
    """Block 0 and the root bucket offloaded, block 1 not (it opts out)."""
    return [fs.BucketSpec("layers.0.*"),
            fs.BucketSpec("layers.1.*", offload_policy=False, name="kept"),
            fs.BucketSpec(["tok.*", "pos", "norm.*", "head.*"], name="root")]


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("reshard", [True, False])
def test_shard0(world, reshard):
    check_parity(world, {"offload_policy": OFF, "reshard_after_forward": reshard})


@pytest.mark.parametrize("world", [1, 2])
def test_owned_and_ragged(world):
    check_parity(world, {"offload_policy": OFF, "placement": owned_matrices})


@pytest.mark.parametrize("reshard", [True, False])
def test_ragged_two_ranks(reshard):
    check_parity(2, {"offload_policy": OFF, "placement": fs.RaggedShard(),
                     "reshard_after_forward": reshard})


@pytest.mark.parametrize("world", [1, 2])
def test_mixed_model_only_some_buckets_offload(world):
    check_parity(world, {"offload_policy": OFF, "buckets": half_offloaded()})


def test_bucket_spec_alone_offloads():
    """flex_shard offloads nothing; one BucketSpec asks for it."""
    buckets = [fs.BucketSpec("layers.0.*", offload_policy=OFF), fs.BucketSpec("layers.1.*"),
               fs.BucketSpec(["tok.*", "pos", "norm.*", "head.*"], name="root")]
    check_parity(2, {"buckets": buckets})


def test_bf16_cast_two_ranks():
    check_parity(2, {"offload_policy": OFF, "mp_policy": BF16}, param_dtype=torch.bfloat16)


def _counted_steps(config: dict, steps: int) -> list:
    """Rank body: train `steps`, then per bucket what it moved in one more step
    and what the layouts say it must move."""
    import torch.distributed as dist

    from flexshard.runtime.state import get_state

    model = fs.flex_shard(make_model(), **config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, steps, opt=opt)
    buckets = get_state(model).buckets
    for b in buckets:
        b.counters.reset()
    train(model, 1, opt=opt, first_step=steps)
    rank = dist.get_rank()
    out = []
    for b in buckets:
        grad_bytes = sum(math.prod(b.slots[i].local_shapes[rank]) * b.slots[i].dtype.itemsize
                         for i in b.grad_slots)
        out.append({"name": b.name, "offloaded": b.offload is not None,
                    "storage_device": b.storage.buffer.device.type,
                    "param_devices": {p.device.type for p in b.params},
                    "grad_devices": {p.grad.device.type for p in b.params if p.grad is not None},
                    "storage": b.storage.buffer.numel(), "grad_bytes": grad_bytes,
                    **vars(b.counters)})
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_counters_exact(world):
    """Per step, an offloaded bucket copies its whole storage buffer to the
    compute device once per gather and its trainable sharded grads back once per
    reduction; a bucket that is not offloaded copies nothing either way."""
    results = run_world(world, _counted_steps,
                        {"offload_policy": OFF, "buckets": half_offloaded()}, 2)
    for rank_rows in results:
        for row in rank_rows:
            if row["offloaded"]:
                assert row["gathers"] >= 1 and row["reduces"] == 1, row
                assert row["h2d_bytes"] == row["gathers"] * row["storage"], row
                assert row["d2h_bytes"] == row["reduces"] * row["grad_bytes"], row
            else:
                assert row["h2d_bytes"] == row["d2h_bytes"] == 0, row
    # Gathers per step follow the bucket's role alone: forward, plus backward's
    # regather for a resharding block; the root bucket does not reshard.
    names = {row["name"]: row for row in results[0]}
    assert names["layers.0.*"]["gathers"] == 2 and names["root"]["gathers"] == 1
    assert names["kept"]["gathers"] == (2 if world > 1 else 0)  # world 1 fp32: no hooks at all


def test_offloaded_params_grads_and_state_live_on_cpu():
    results = run_world(1, _counted_steps, {"offload_policy": OFF}, 1)
    for row in results[0]:
        assert row["offloaded"] and row["storage_device"] == "cpu"
        assert row["param_devices"] == {"cpu"} and row["grad_devices"] <= {"cpu"}


def test_staged_buffer_is_not_the_storage():
    """At world size 1 without a cast the gather output of an offloaded bucket
    is the staged buffer: the unsharded params never view the storage."""
    from flexshard.runtime.state import get_state

    model = fs.flex_shard(make_model(), offload_policy=OFF)
    bucket = get_state(model).buckets[0]
    outs = bucket.gather.gather()
    storage = bucket.storage.buffer.untyped_storage().data_ptr()
    assert all(o.untyped_storage().data_ptr() != storage for o in outs)
    assert bucket.counters.h2d_bytes == bucket.storage.layout.segment_bytes


def test_no_sync_accumulation():
    """Unreduced sums stay on the compute device; the reduced grads reach host
    memory once per synced step."""
    results = run_world(2, _train_with_step, {"offload_policy": OFF}, 3, accumulate_two_halves)
    losses, full = results[0]
    check_against_reference(losses, full, 2, 3, step_fn=accumulate_two_halves)


def _train_with_step(config, steps, step_fn):
    import torch.distributed as dist

    model = fs.flex_shard(make_model(), **config)
    losses = train(model, steps, step_fn=step_fn)
    full = fs.full_state_dict(model)
    return losses, full if dist.get_rank() == 0 else None


def _clip_body():
    model = fs.flex_shard(make_model(), offload_policy=OFF, buckets=half_offloaded())
    x, y = batch(0, 0)
    loss_fn(model(x), y).backward()
    return fs.clip_grad_norm_(model, 0.5).item()


def test_clip_grad_norm_over_host_and_device_grads():
    ref = make_model()
    x, y = batch(0, 0)
    loss_fn(ref(x), y).backward()
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5).item()
    (got,) = run_world(1, _clip_body)
    assert got == pytest.approx(expected, rel=1e-5)


def test_meta_init_then_to_empty():
    """Built on meta, wrapped, to_empty(cpu): the storage is allocated in host
    memory and init_parameters gives the unsharded model's values."""
    from models import TinyGPT
    from test_meta_init import init_weights

    from flexshard.runtime.state import get_state

    with torch.device("meta"):
        model = fs.flex_shard(TinyGPT(), offload_policy=OFF)
    assert all(b.storage.buffer.is_meta for b in get_state(model).buckets)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_parameters(init_weights)
    for b in get_state(model).buckets:
        assert b.storage.buffer.device.type == "cpu" and b.compute_device.type == "cpu"
    with torch.device("meta"):
        ref = TinyGPT()
    ref.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        ref.apply(init_weights)  # children first, as init_parameters(init_fn)
    full = fs.full_state_dict(model)
    for k, v in ref.named_parameters():
        torch.testing.assert_close(full[k], v.detach(), rtol=0, atol=0, msg=k)


def _dry_and_wrapped(options: dict) -> tuple:
    import torch.distributed as dist

    model = make_model()
    dry = fs.describe(model, mesh_shape=(1, dist.get_world_size()), **options)
    fs.flex_shard(model, **options)
    return dry, fs.describe(model)


@pytest.mark.parametrize("world", [1, 2])
def test_dry_run_with_offload_matches_the_wrap(world):
    """The dry run takes offload_policy and plans what flex_shard builds: at world
    size 1 an offloaded bucket is hooked (its params are not on the compute device)."""
    options = {"offload_policy": OFF, "buckets": half_offloaded()}
    for dry, wrapped in run_world(world, _dry_and_wrapped, options):
        assert wrapped == dry
        hooked = {b.name: b.module is not None for b in dry.buckets}
        assert hooked == {"layers.0.*": True, "kept": world > 1, "root": True}


# Bad input.

def test_pin_memory_must_be_bool():
    with pytest.raises(TypeError, match=r"OffloadPolicy.pin_memory must be a bool, got 'yes'"):
        fs.OffloadPolicy(pin_memory="yes")


def test_flex_shard_offload_policy_type():
    with pytest.raises(TypeError, match=r"flex_shard: offload_policy must be a fs.OffloadPolicy "
                                        r"or None \(no offload\), got True"):
        fs.flex_shard(make_model(), offload_policy=True)


def test_bucket_spec_offload_policy_type():
    with pytest.raises(TypeError, match=r"BucketSpec 'layers.0.\*': offload_policy must be a "
                                        r"fs.OffloadPolicy, None \(inherit\) or False .*got 'cpu'"):
        fs.BucketSpec("layers.0.*", offload_policy="cpu")


def test_describe_offload_policy_type():
    with pytest.raises(TypeError, match=r"offload_policy must be a fs.OffloadPolicy"):
        fs.describe(make_model(), mesh_shape=(1, 2), offload_policy="cpu")


def test_pin_memory_without_cuda_is_ignored_silently():
    """pin_memory pins only for a CUDA compute device; on CPU there is nothing
    to pin for: no warning, an unpinned host buffer, the same results."""
    from flexshard.runtime.state import get_state

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = fs.flex_shard(make_model(), offload_policy=fs.OffloadPolicy(pin_memory=True))
    for b in get_state(model).buckets:
        assert not b.offload.pin and b.storage.buffer.device.type == "cpu"


# The stream model of an offloaded bucket (design.md, "CPU offload"), recorded on CPU.

def _recorded_bucket(mp=None):
    from test_streams import SHAPES, RecordingContext, StreamComm

    from flexshard.runtime.bucket import Bucket
    from flexshard.planning.layout import SlotPlan, bind_placements

    class SyncRecording(RecordingContext):
        def synchronize(self, event):
            self.log.append(("host_wait", "host", event))

    shapes = [torch.Size(s) for s in SHAPES]
    bound = bind_placements([(s, 4, fs.Shard(0)) for s in shapes], 4)
    slots = [SlotPlan(f"p{i}", s, torch.float32, pl, tuple(pl.local_shape(s, r, 4) for r in range(4)))
             for i, (s, pl) in enumerate(zip(shapes, bound))]
    comm = StreamComm()
    bucket = Bucket("block", slots, [True] * len(slots), mp or fs.MixedPrecisionPolicy(), False,
                    None, 0, 4, comm, torch.device("cpu"), offload_policy=OFF)
    ctx = SyncRecording(torch.device("cpu"))
    bucket.devices.set(torch.device("cpu"), ctx)
    comm.ctx = ctx
    return bucket, ctx


@pytest.mark.parametrize("mp", [None, BF16])
def test_staging_runs_on_copy_in_before_the_gather(mp):
    from test_streams import OpLog, _waits_before

    bucket, ctx = _recorded_bucket(mp)
    with OpLog(ctx):
        bucket.gather.gather()
    log = ctx.log
    copies = [i for i, x in enumerate(log) if x[:2] == ("op", "copy_in")]
    gather = next(i for i, x in enumerate(log) if x == ("comm", "gather", "all_gather"))
    # the H2D copy of the whole storage, then (bf16) one cast of every param (foreach)
    assert [log[i][2] for i in copies] == ["copy_"] + ([] if mp is None else ["_foreach_copy_"])
    assert all(_waits_before(log, i, "copy_in", "compute") for i in copies)
    assert copies[-1] < gather and _waits_before(log, gather, "gather", "copy_in")
    assert not any(x[0] == "host_wait" for x in log)  # a gather never blocks the host


def test_grads_come_back_on_the_reduce_stream_and_the_host_waits_only_when_asked():
    from test_streams import OpLog

    bucket, ctx = _recorded_bucket()
    grads = [torch.ones(s.shape) for s in bucket.slots]
    with OpLog(ctx):
        sharded = bucket.grads.finish(bucket.grads.start(grads))
    log = ctx.log
    scatter = next(i for i, x in enumerate(log) if x == ("comm", "reduce", "reduce_scatter"))
    finish = max(i for i, x in enumerate(log) if x[:2] == ("wait", "reduce"))  # GradReduce.finish's
    d2h = [i for i, x in enumerate(log) if x == ("op", "reduce", "_foreach_copy_") and i > finish]
    assert scatter < finish
    assert len(d2h) == 1  # every sharded grad copied back in one op
    last = max(i for i, x in enumerate(log) if x[0] == "record" and x[1] == "reduce")
    assert d2h[-1] < last and bucket.offload.grads_copied == log[last][2]
    assert ("wait", "compute", log[last][2]) in log[last:]
    assert not any(x[0] == "host_wait" for x in log)
    bucket.grads.host_wait()
    assert log[-1] == ("host_wait", "host", log[last][2])
    for g, slot in zip(sharded, bucket.slots):
        assert g.device.type == "cpu" and tuple(g.shape) == tuple(slot.local_shapes[0])
        assert g.untyped_storage().data_ptr() != bucket.storage.buffer.untyped_storage().data_ptr()


def test_delivery_runs_host_waits_before_the_host_reads_grads():
    from flexshard.runtime.grad_reduce import Delivery

    seen = []
    delivery = Delivery()
    delivery.add([torch.ones(2)], lambda: seen.append("first"))
    assert seen == []  # nothing read yet
    delivery.add([torch.ones(2)], lambda: seen.append("second"))
    assert seen == ["first", "second"]  # summing reads both
    delivery.add([torch.ones(2)], lambda: seen.append("third"))
    (total,) = delivery.take()
    assert seen == ["first", "second", "third"] and torch.equal(total, torch.full((2,), 3.0))


def test_training_example_with_offload_matches_without(tmp_path):
    """examples/train.py --offload at 2 ranks: the same loss curve as without."""
    from test_train_example import _main_in_world, losses_of

    argv = ["--steps", "3", "--plot", str(tmp_path / "l.png")]
    plain = run_world(2, _main_in_world, argv, timeout=120)[0]
    offloaded = run_world(2, _main_in_world, [*argv, "--offload"], timeout=120)[0]
    assert "offload True" in offloaded and "offload False" in plain
    assert losses_of(offloaded) == losses_of(plain)


def _checkpoint_round_trip(directory: str) -> tuple:
    """Rank body: 2 steps offloaded, save; a fresh offloaded model loads it and
    both take 2 more steps: (losses of the original, losses of the loaded)."""
    import torch.distributed as dist

    runs = []
    for load in (False, True):
        model = fs.flex_shard(make_model(seed=1 if load else 0), offload_policy=OFF,
                              placement=owned_matrices)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if load:
            step = fs.load_checkpoint(directory, model, opt)
        else:
            train(model, 2, opt=opt)
            fs.save_checkpoint(directory, model, opt, step=2)
            step = 2
        runs.append(train(model, 2, opt=opt, first_step=step))
        assert all(p.device.type == "cpu" for p in model.parameters())
        dist.barrier()
    return tuple(runs)


def test_checkpoint_round_trip(tmp_path):
    """An offloaded model's DCP checkpoint (params and AdamW state in host memory)
    loads into a fresh offloaded model, which then trains identically."""
    for original, loaded in run_world(2, _checkpoint_round_trip, str(tmp_path)):
        assert original == loaded


def _hsdp_offloaded(shape) -> tuple:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", tuple(shape), mesh_dim_names=("replicate", "shard"))
    model = fs.flex_shard(make_model(), mesh, offload_policy=OFF, placement=fs.RaggedShard())
    losses = train(model, 3)
    full = fs.full_state_dict(model)
    return losses, full if dist.get_rank() == 0 else None


@pytest.mark.parametrize("shape", [(2, 1), (1, 2)])
def test_hsdp_offloaded(shape):
    """Under HSDP the replicas' all-reduce runs on the compute device, before the
    grads come back to host memory."""
    losses, full = run_world(2, _hsdp_offloaded, shape)[0]
    check_against_reference(losses, full, 2, 3)


def _int_reshard_offloaded() -> tuple:
    """Rank body at 4 ranks: reshard_after_forward=2 (backward gathers from the
    slice kept on the compute device, not from the host storage)."""
    from flexshard.runtime.state import get_state

    model = fs.flex_shard(make_model(), offload_policy=OFF, reshard_after_forward=2)
    losses = train(model, 3)
    buckets = get_state(model).buckets
    counters = [(b.counters.gathers, b.counters.post_forward_gathers, b.counters.h2d_bytes,
                 b.storage.buffer.numel()) for b in buckets]
    return losses, fs.full_state_dict(model), counters


def test_int_reshard_offloaded():
    """A gather that starts from the post-forward slice stages nothing to the device:
    H2D bytes count only the gathers that read the host storage."""
    results = run_world(4, _int_reshard_offloaded, timeout=300)
    losses, full, _ = results[0]
    check_against_reference(losses, full, 4, 3)
    for _, _, counters in results:
        assert any(pf for _, pf, _, _ in counters)  # some gathers came from kept slices
        for gathers, post_forward, h2d, storage in counters:
            assert h2d == (gathers - post_forward) * storage
