"""The stream model (runtime/comm.py, design.md "Streams and buffers"), checked
on CPU through a device context that records every stream switch, event
record and event wait, and which stream each op and collective ran on."""

from __future__ import annotations

import itertools
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flexshard as fs
from benchmarks.hot_path import LocalComm, make_bucket
from flexshard.runtime.comm import DeviceContexts, HostContext

SHAPES = [(16, 4), (8,)]


class RecordingContext(HostContext):
    """Program order, as on CPU, with a log of ("record", stream, event),
    ("wait", stream, event), ("adopt", stream) and ("op"/"comm", stream, name)."""

    def __init__(self, device) -> None:
        super().__init__(device)
        self.log, self.stack, self.compute = [], [], "compute"
        self._ids = itertools.count()

    def current(self):
        return self.stack[-1] if self.stack else self.compute

    @contextmanager
    def on(self, stream):
        self.stack.append(stream)
        try:
            yield
        finally:
            self.stack.pop()

    def record(self, stream=None):
        event = next(self._ids)
        self.log.append(("record", stream or self.current(), event))
        return event

    def wait(self, event, stream=None):
        self.log.append(("wait", stream or self.current(), event))

    def adopt(self, tensor, stream):
        self.log.append(("adopt", stream))


# the copies (one fused op per bucket and direction where the layout allows:
# planning/fused.py) and the arithmetic on the data path
DATA_OPS = ("copy_", "index_copy_", "index", "_foreach_copy_", "split_with_sizes_copy",
            "_chunk_cat", "mul_", "div_", "add_")


class OpLog(TorchDispatchMode):
    def __init__(self, ctx: RecordingContext) -> None:
        super().__init__()
        self.ctx = ctx

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in DATA_OPS:
            self.ctx.log.append(("op", self.ctx.current(), func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


class StreamComm(LocalComm):
    def __init__(self) -> None:
        super().__init__()
        self.ctx = None

    def all_gather(self, output, input, group, async_op=False):
        self.ctx.log.append(("comm", self.ctx.current(), "all_gather"))
        return super().all_gather(output, input, group, async_op)

    def reduce_scatter(self, output, input, group, async_op=False, op=None):
        self.ctx.log.append(("comm", self.ctx.current(), "reduce_scatter"))
        return super().reduce_scatter(output, input, group, async_op)


def _bucket(mp=None):
    comm = StreamComm()
    bucket = make_bucket(4, fs.Shard(0), SHAPES, mp=mp, comm=comm)
    ctx = RecordingContext(bucket.storage.buffer.device)
    bucket.devices.set(bucket.storage.buffer.device, ctx)
    comm.ctx = ctx
    return bucket, ctx


def _waits_before(log, index, stream, event_stream) -> bool:
    """Whether `stream` waited, before log[index], on an event recorded on `event_stream`
    earlier still."""
    recorded = {e for kind, s, e in log[:index] if kind == "record" and s == event_stream}
    return any(kind == "wait" and s == stream and e in recorded
               for kind, s, e in [x for x in log[:index] if len(x) == 3])


def test_gather_runs_copy_in_then_gather_on_side_streams_and_compute_waits():
    bucket, ctx = _bucket(fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    with OpLog(ctx):
        bucket.gather.gather()
    log = ctx.log
    copy_in = [i for i, x in enumerate(log) if x[:2] == ("op", "copy_in")]
    gather = next(i for i, x in enumerate(log) if x == ("comm", "gather", "all_gather"))
    copy_out = [i for i, x in enumerate(log) if x[:2] == ("op", "compute")]
    # one fused op each (as FSDP2's): the cast on the copy-in stream, the split where
    # the params are consumed
    assert [log[i][2] for i in copy_in] == ["_foreach_copy_"]
    assert [log[i][2] for i in copy_out] == ["split_with_sizes_copy"]
    assert all(_waits_before(log, i, "copy_in", "compute") for i in copy_in)
    assert copy_in[-1] < gather and _waits_before(log, gather, "gather", "copy_in")
    assert all(_waits_before(log, i, "compute", "gather") for i in copy_out)
    assert {x[1] for x in log if x[0] == "wait"} <= {"copy_in", "gather", "compute"}


def test_reduce_packs_after_the_grads_and_compute_waits_for_the_sharded_grads():
    bucket, ctx = _bucket(fs.MixedPrecisionPolicy(reduce_dtype=torch.bfloat16))
    grads = [torch.ones(s.shape) for s in bucket.slots]
    with OpLog(ctx):
        bucket.grads.finish(bucket.grads.start(grads))
    log = ctx.log
    scatter = next(i for i, x in enumerate(log) if x == ("comm", "reduce", "reduce_scatter"))
    packs = [i for i, x in enumerate(log[:scatter]) if x[:2] == ("op", "reduce") and x[2] != "mul_"]
    assert [log[i][2] for i in packs] == ["_chunk_cat"]  # every grad, cast, in one op
    assert all(_waits_before(log, i, "reduce", "compute") for i in packs)
    # the mean: a pre-divide on the reduce stream (gloo-like Comm: no AVG)
    assert any(x == ("op", "reduce", "mul_") for x in log[:scatter])
    casts = [log[i][2] for i, x in enumerate(log) if x[:2] == ("op", "reduce") and i > scatter]
    # bf16 reduce, fp32 params: one cast, on the reduce stream (copy_: the test Comm's own)
    assert [c for c in casts if c != "copy_"] == ["_foreach_copy_"]
    last_reduce = max(i for i, x in enumerate(log) if x[0] == "record" and x[1] == "reduce")
    assert any(x[0] == "wait" and x[1] == "compute" and x[2] == log[last_reduce][2]
               for x in log[last_reduce:])
    assert not any(x[0] == "op" and x[1] == "compute" for x in log)  # nothing on compute


def test_grads_are_let_go_after_the_pack_and_only_the_reduce_input_is_held():
    """The unsharded grads die when _Unshard.backward returns: GradReduce.pack makes
    the compute stream wait for the pack (not for the collective) before it
    returns, and the launch (deferred in backward until autograd let go of the
    grads) comes after that wait; the PendingReduce holds the reduce input alone."""
    bucket, ctx = _bucket()
    grads = [torch.ones(s.shape) for s in bucket.slots]
    with OpLog(ctx):
        pending = bucket.grads.start(grads)
    log = ctx.log
    scatter = next(i for i, x in enumerate(log) if x == ("comm", "reduce", "reduce_scatter"))
    packed = max(i for i, x in enumerate(log[:scatter]) if x[:2] == ("record", "reduce"))
    assert max(i for i, x in enumerate(log[:scatter]) if x[:2] == ("op", "reduce")) < packed
    assert ("wait", "compute", log[packed][2]) in log[packed:scatter]
    held = pending.held
    assert len(held) == 1 and held[0].numel() * held[0].element_size() == \
        bucket.grads.layout.wire_bytes
    assert not any(g is h for g in grads for h in pending.held)


def test_a_gather_consumed_on_another_stream_is_waited_there_and_adopted():
    """unshard(async_op=True) under one stream, forward (UnshardHandle.wait) under another."""
    bucket, ctx = _bucket()
    bucket.start_gather()
    ctx.compute = "forward"
    bucket.gather.gather()
    done = next(e for kind, s, e in [x for x in ctx.log if len(x) == 3]
                if kind == "record" and s == "gather")
    assert ("wait", "forward", done) in ctx.log
    assert ("adopt", "forward") in ctx.log


def test_same_stream_consumption_adopts_nothing():
    bucket, ctx = _bucket()
    bucket.start_gather()
    bucket.gather.gather()
    assert not any(x[0] == "adopt" for x in ctx.log)


def test_no_sync_pack_is_waited_before_the_grads_can_die():
    bucket, ctx = _bucket()
    bucket.grads.requires_gradient_sync = False
    assert bucket.grads.start([torch.ones(s.shape) for s in bucket.slots]) is None
    last = max(i for i, x in enumerate(ctx.log) if x[0] == "record" and x[1] == "reduce")
    assert ("wait", "compute", ctx.log[last][2]) in ctx.log[last:]


def test_buckets_of_one_model_share_one_context_per_device():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    fs.flex_shard(model, buckets=[fs.BucketSpec("0.*"), fs.BucketSpec("1.*")],
                  mp_policy=fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    from flexshard.runtime.state import get_state

    buckets = get_state(model).buckets
    assert buckets[0].device_ctx is buckets[1].device_ctx
    assert type(buckets[0].device_ctx) is HostContext
    assert isinstance(DeviceContexts().get(torch.device("cpu")), HostContext)
