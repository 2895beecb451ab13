"""Quantized gathers (fs.QuantizedGather, a wire format with a scale per block of
rows): the gathered weight is bit-identical to quantizing the whole weight, for
every placement that cuts rows, every input dtype and both wire dtypes; training
with it matches one process that quantizes its weights the same way in forward;
the policy leaves out what it should and says so in fs.describe."""

from __future__ import annotations


import pytest
import torch
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode

import flexshard as fs
from flexshard.planning.layout import SlotPlan, bind_placements, plan_layout
from flexshard.placements import batch
from flexshard.placements.wire import Cast
from flexshard.planning.wire_plan import plan_wire
from flexshard.runtime.unsharded import ParamWire, plan_param_wires
from benchmarks.harness.meters import MemoryMeter
from harness import run_world
from reference import assemble_grads, average_grads, make_model, reference_run, train_sharded

QDTYPES = [torch.int8, torch.float8_e4m3fn]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _slot(shape, dtype, placement, world):
    bound = bind_placements([(torch.Size(shape), dtype.itemsize, placement)], world)[0]
    return SlotPlan("w", torch.Size(shape), dtype, bound,
                    tuple(bound.local_shape(torch.Size(shape), r, world) for r in range(world)))


def _gathered(full, slot, fmt, world):
    """Every rank encodes its piece into its segment; the segments back to back;
    the param decoded out of them, as a bucket's gather does."""
    wire = plan_wire([slot], [fmt], world)
    layout = plan_layout(wire.slots, [s.dtype for s in wire.slots], world)
    segments = []
    for r in range(world):
        segment = torch.zeros(layout.segment_bytes, dtype=torch.uint8)
        ParamWire(layout, wire, 0, r).encode(segment, slot.placement.shard(full, r, world))
        segments.append(segment)
    out, _ = ParamWire(layout, wire, 0, 0).decode(torch.cat(segments))
    return out


def _whole(full, fmt):
    """Quantize-then-dequantize of the whole weight on one rank."""
    return _gathered(full, _slot(full.shape, full.dtype, fs.Shard(0), 1), fmt, 1)


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("placement,world", [
    (fs.Shard(0), 4), (fs.RaggedShard(units=(3, 0, 5)), 3), (fs.RaggedShard(), 3),
    (fs.Owned(), 3)])
def test_gathered_weight_is_the_whole_weight_quantized(qdtype, dtype, placement, world):
    torch.manual_seed(0)
    full = (torch.randn(64, 80) * torch.logspace(-3, 2, 64)[:, None]).to(dtype)
    full[5] = 0  # an all-zero row keeps a finite scale and decodes to zeros
    slot = _slot(full.shape, dtype, placement, world)
    fmt = fs.QuantizedGather(qdtype).format("w", full.shape, dtype, dtype, slot.placement, world)
    assert fmt == fs.BlockQuantized(qdtype, dtype, 1)
    out = _gathered(full, slot, fmt, world)
    assert out.dtype == dtype
    assert torch.equal(out, _whole(full, fmt))
    assert torch.equal(out[5], torch.zeros_like(out[5]))
    # within half an int8 step of the row's scale, or e4m3's 3-bit mantissa (2**-9
    # of the scale below its normal range), plus the output dtype's own rounding
    rows = full.float()
    amax = rows.abs().amax(1, keepdim=True)
    bound = (amax / 127 * 0.5 if qdtype == torch.int8
             else rows.abs() * 2 ** -4 + amax / 448 * 2 ** -9)
    assert bool(((out.float() - rows).abs() <= bound * 1.001 + rows.abs() * 2 ** -8).all())


def test_blocks_of_rows_need_cuts_on_their_boundaries():
    policy = fs.QuantizedGather(torch.int8, block_rows=4, min_numel=1)
    shape = torch.Size([16, 8])
    aligned = _slot(shape, torch.float32, fs.RaggedShard(units=(8, 4, 4)), 3).placement
    cut = _slot(shape, torch.float32, fs.RaggedShard(units=(6, 5, 5)), 3).placement
    fmt = policy.format("w", shape, torch.float32, torch.float32, aligned, 3)
    assert fmt == fs.BlockQuantized(torch.int8, torch.float32, 4)
    assert policy.format("w", shape, torch.float32, torch.float32, cut, 3) is None
    full = torch.randn(shape)
    slot = _slot(shape, torch.float32, fs.RaggedShard(units=(8, 4, 4)), 3)
    assert torch.equal(_gathered(full, slot, fmt, 3), _whole(full, fmt))


def test_the_policy_leaves_out_norms_biases_small_and_column_split_params():
    policy = fs.QuantizedGather(torch.int8, min_numel=64)
    f32 = torch.float32
    big, shard0 = torch.Size([16, 8]), fs.Shard(0)
    assert policy.format("w", big, f32, f32, shard0, 2) is not None
    assert policy.format("bias", torch.Size([128]), f32, f32, shard0, 2) is None  # 1-D
    assert policy.format("w", torch.Size([4, 8]), f32, f32, shard0, 2) is None  # small
    assert policy.format("w", big, f32, f32, fs.Shard(1), 2) is None  # rows split
    assert policy.format("ids", big, torch.int64, torch.int64, shard0, 2) is None


@pytest.mark.parametrize("kwargs,match", [
    ({"dtype": torch.float16}, "dtype must be torch.int8 or torch.float8_e4m3fn"),
    ({"block_rows": 0}, "block_rows must be an int >= 1"),
    ({"min_numel": -1}, "min_numel must be an int >= 0"),
])
def test_bad_policy_values_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fs.QuantizedGather(**kwargs)


POLICY = fs.QuantizedGather(torch.int8, min_numel=256)
STEPS, LR = 4, 1e-2


def quantized_reference(world: int, policy) -> tuple:
    """One process, every rank's batch in turn, forward on each weight the
    policy quantizes replaced by its quantize-then-dequantize (the straight-
    through grads land on the fp32 weights): (losses, params, step-0 grads).
    One thread, as the harness's ranks: the same kernels round the same."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _quantized_reference(world, policy)
    finally:
        torch.set_num_threads(threads)


class _Quantizing(torch.nn.Module):
    """`model` whose weights in `formats` enter forward quantized then dequantized
    (straight-through: the grads land on the fp32 weights)."""

    def __init__(self, model: torch.nn.Module, formats: dict) -> None:
        super().__init__()
        self.model, self.formats = model, formats

    def forward(self, x):
        params = {k: p if self.formats[k] is None else
                  p + (_whole(p.detach(), self.formats[k]) - p).detach()
                  for k, p in self.model.named_parameters()}
        return functional_call(self.model, params, (x,))


def _quantized_reference(world: int, policy) -> tuple:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    formats = {k: policy.format(k, p.shape, p.dtype, p.dtype, fs.Shard(0), 1)
               for k, p in model.named_parameters()}
    quantizing, losses, first = _Quantizing(model, formats), [], None
    for step in range(STEPS):
        # each rank's batch on its own, the grads averaged in rank order: as the ranks round
        losses.append(average_grads(quantizing, step, world))
        if step == 0:
            first = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return losses, {k: p.detach() for k, p in model.named_parameters()}, first, formats


@pytest.mark.parametrize("world,placement", [(2, None), (3, None), (3, fs.RaggedShard()),
                                             (2, "owned_matrices"), (2, "offload")])
def test_training_matches_one_process_quantizing_its_weights(world, placement):
    # every resharding bucket decodes into params made once, refilled in backward
    config = {"mp_policy": fs.MixedPrecisionPolicy(gather_format=POLICY)}
    if placement == "owned_matrices":
        config["placement"] = owned_matrices
    elif placement == "offload":  # the batch quantizes the staged copy of the shards
        config["offload_policy"] = fs.OffloadPolicy()
    elif placement is not None:
        config["placement"] = placement
    results = run_world(world, train_sharded, STEPS, config)
    stats = results[0][3]
    resharding = [name for name, reshard, *_ in stats["buckets"] if reshard is True]
    assert len(resharding) >= 2 and set(resharding) <= set(stats["made_once"]), stats["made_once"]
    ref_losses, ref_params, ref_grads, formats = quantized_reference(world, POLICY)
    assert sum(f is not None for f in formats.values()) >= 4  # the block matrices
    plain_losses = reference_run(world, STEPS, lr=LR)[0]  # quantizing shows in the losses
    assert max(abs(a - b) for a, b in zip(plain_losses, ref_losses)) > 1e-4
    torch.testing.assert_close(torch.tensor(results[0][0]), torch.tensor(ref_losses),
                               rtol=1e-5, atol=1e-6)
    grads = assemble_grads(results)
    for k, g in ref_grads.items():
        torch.testing.assert_close(grads[k], g, rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    for k, v in ref_params.items():
        torch.testing.assert_close(results[0][1][k], v, rtol=1e-4, atol=1e-5)


def owned_matrices(fqn, param):
    return fs.Owned() if param.dim() > 1 else fs.RaggedShard()


def test_describe_shows_what_is_quantized_and_the_bytes():
    model = make_model()
    plain = fs.describe(model, mesh_shape=(1, 2))
    quant = fs.describe(model, mesh_shape=(1, 2),
                        mp_policy=fs.MixedPrecisionPolicy(gather_format=POLICY))
    assert sum(b.gather_wire_bytes for b in quant.buckets) < \
        0.5 * sum(b.gather_wire_bytes for b in plain.buckets)
    assert sum(b.quantized for b in quant.buckets) >= 4
    assert "quantized" in str(quant)


# A bucket's quantized params are quantized and dequantized together
# (BlockQuantized.encode_batch / decode_batch): the same bits as one at a time,
# in a number of kernels that does not grow with the params.


class _Kernels(TorchDispatchMode):
    """Ops that are not views: on a GPU, roughly the kernels launched."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += not func.is_view
        return func(*args, **(kwargs or {}))


def _bucket(shapes, dtype, placement, world, policy) -> tuple:
    """(slots, wire plan, gather layout) of a bucket of `shapes` under `policy`."""
    bound = bind_placements([(torch.Size(s), dtype.itemsize, placement) for s in shapes], world)
    slots = [SlotPlan(f"p{i}", torch.Size(s), dtype, pl,
                      tuple(pl.local_shape(torch.Size(s), r, world) for r in range(world)))
             for i, (s, pl) in enumerate(zip(shapes, bound))]
    formats = [policy.format(s.fqn, s.shape, dtype, dtype, s.placement, world) or Cast(dtype)
               for s in slots]
    wire = plan_wire(slots, formats, world)
    return slots, wire, plan_layout(wire.slots, [s.dtype for s in wire.slots], world)


def _packed(pieces) -> list:
    """The pieces as views of one buffer, back to back (as a bucket's storage holds them)."""
    flat = torch.cat([p.reshape(-1) for p in pieces])
    return [v.view(p.shape) for v, p in
            zip(flat.split_with_sizes([p.numel() for p in pieces]), pieces)]


def _encode_decode(shapes, dtype, placement, world, policy, batched: bool,
                   packed: bool = False) -> tuple:
    """(gathered buffer, [(param, bytes copied)], kernels of rank 0's encode, of its
    decode past the copy-out of each param's parts)."""
    slots, wire, layout = _bucket(shapes, dtype, placement, world, policy)
    torch.manual_seed(0)
    fulls = [(torch.randn(s.shape) * torch.logspace(-2, 2, s.shape[0]).view(-1, *[1] * (
        len(s.shape) - 1))).to(dtype) for s in slots]
    segments, kernels = [], []
    for r in range(world):
        wires = plan_param_wires(layout, wire, r)
        pieces = [s.placement.shard(f, r, world) for s, f in zip(slots, fulls)]
        pieces = _packed(pieces) if packed else pieces
        segment = torch.zeros(layout.segment_bytes, dtype=torch.uint8)
        with _Kernels() as mode:
            if batched:
                wires.encode(segment, pieces)
            else:
                for w, piece in zip(wires, pieces):
                    w.encode(segment, piece)
        segments.append(segment)
        kernels.append(mode.ops)
    gathered = torch.cat(segments)
    with _Kernels() as mode:
        outs = wires.decode(gathered) if batched else [w.decode(gathered) for w in wires]
    with _Kernels() as copy_out:  # the bucket's copy-out (copy plans), not the format's
        [w.fulls(gathered) for w in wires if not w.cast]
    return gathered, outs, kernels[0], mode.ops - copy_out.ops


PLACEMENTS = [(fs.Shard(0), 4), (fs.RaggedShard(units=(3, 0, 5)), 3), (fs.RaggedShard(), 3),
              (fs.Owned(), 3)]


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("placement,world", PLACEMENTS)
@pytest.mark.parametrize("packed", [False, True], ids=["apart", "packed"])
@pytest.mark.parametrize("limit", [batch.CHUNK_ELEMENTS, 2000], ids=["one-chunk", "chunks"])
def test_a_bucket_quantizes_and_dequantizes_at_once_bit_for_bit(qdtype, dtype, placement, world,
                                                                 packed, limit, monkeypatch):
    # a bias travels as itself; last, it leaves the matrices' pieces back to back
    # when packed (one view of them is quantized), else they are joined first;
    # a limit of 2000 elements cuts the bucket into chunks of one or two params
    monkeypatch.setattr(batch, "CHUNK_ELEMENTS", limit)
    shapes = [(64, 80), (48, 16), (96, 32), (32, 8, 4), (64,)]
    if not packed:
        shapes.insert(2, shapes.pop())
    policy = fs.QuantizedGather(qdtype, min_numel=256)
    batched = _encode_decode(shapes, dtype, placement, world, policy, True, packed)
    alone = _encode_decode(shapes, dtype, placement, world, policy, False, packed)
    assert torch.equal(batched[0], alone[0])  # every rank's gather input, byte for byte
    for (got, got_copied), (want, want_copied) in zip(batched[1], alone[1]):
        assert got.dtype == want.dtype and torch.equal(got, want) and got_copied == want_copied


def test_kernels_per_bucket_grow_with_its_chunks_not_its_params():
    # params of one row width lie in one chunk: a constant number of ops per
    # bucket whatever their number; params of two alternating widths are a chunk
    # each on the encode side, sorted into one chunk per width on the decode side
    counts = {}
    for widths in ((24,), (24, 32)):
        for n in counts_n():
            shapes = [(32 + 16 * (i % 3), widths[i % len(widths)]) for i in range(n)]
            policy = fs.QuantizedGather(torch.int8, min_numel=1)
            counts[widths, n] = {batched: _encode_decode(shapes, torch.float32, fs.Shard(0), 2,
                                                         policy, batched, packed=True)[2:]
                                 for batched in (True, False)}
    one, two = {n: counts[(24,), n] for n in counts_n()}, {n: counts[(24, 32), n] for n in counts_n()}
    assert two[1][True] == one[1][True] and one[1][True][0] <= 16, counts
    for n in (2, 4, 8):  # past one param the decode joins the params' wire data
        assert one[n][True] == one[2][True], (n, counts)
        assert one[n][False] == (n * one[1][False][0], n * one[1][False][1]), (n, counts)
        per_chunk = two[2][True][0] - two[1][True][0]
        assert two[n][True][0] == two[1][True][0] + (n - 1) * per_chunk, (n, counts)
    assert two[8][True][1] == two[4][True][1]  # one chunk per width
    assert one[8][True][0] * 4 < one[8][False][0] and one[8][True][1] * 2 < one[8][False][1]


def counts_n() -> tuple:
    return (1, 2, 4, 8)


def _temporaries(run, alive) -> int:
    """Peak bytes of the storages `run()` makes, past those of `alive`."""
    meter = MemoryMeter()
    meter.register(alive, "param")
    before = meter.live
    with meter:
        run()
    return meter.peak - before


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_a_bucket_is_quantized_in_chunks_of_small_float32_temporaries(qdtype):
    # twelve 512 x 512 float32 params, back to back as a bucket's storage holds
    # them (3 Mi elements): beside its output, the encode's float32 temporaries
    # are one chunk's (1 Mi elements: 4 MiB), never the bucket's (a copy of
    # |x|, the scales spread over every element and their int64 index: 64 MiB);
    # the decode's joined wire data is one chunk's too
    shapes = [torch.Size((512, 512))] * 12
    fmt = fs.QuantizedGather(qdtype).format("w", shapes[0], torch.float32, torch.bfloat16,
                                            fs.Shard(0), 1)
    formats, n = [fmt] * len(shapes), sum(s.numel() for s in shapes)
    pieces = _packed([torch.randn(s) for s in shapes])
    (data, scales), _ = fmt.encode_batch(formats, pieces, None, {})
    blocks = sum(s[0] for s in shapes)
    small = 8 * 4 * blocks  # aminmax's, the amaxes and the scales: a few floats per row
    assert _temporaries(lambda: fmt.encode_batch(formats, pieces, None, {}), pieces) <= \
        n * qdtype.itemsize + 4 * batch.CHUNK_ELEMENTS + small
    fulls = [(d.clone().view(s), sc.clone()) for d, sc, s in
             zip(data.split([s.numel() for s in shapes]), scales.split([s[0] for s in shapes]),
                 shapes)]
    out, _ = fmt.batch_out(formats, shapes, data.device)
    join = 2 if qdtype == torch.float8_e4m3fn else 1  # e4m3 is joined as bf16 (exact)
    assert _temporaries(lambda: fmt.decode_batch(formats, fulls, [None] * 12, {}, out=out),
                        [out] + [t for parts in fulls for t in parts]) <= \
        join * batch.CHUNK_ELEMENTS + small
