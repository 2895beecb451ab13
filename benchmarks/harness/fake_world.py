"""One rank of an N-rank job in one process: flexshard against FSDP2, fake backend.

One rank of an N-rank job in one process: flexshard against FSDP2 under
torch.distributed's "fake" backend (issues 33 and 34).

Every kernel the rank runs, runs; collectives move nothing (their outputs keep
whatever their buffers held), so one device measures what one rank of an
N-device job computes, copies and holds: its shard sizes, its copy work, its
memory. Losses are meaningless (gathered weights are uninitialised memory);
correctness is the parity tests' job, this is the cost of a step.

    python -m benchmarks.gpu --fake-world 8 --device cpu --counts    # issue 34's CPU counts
    python -m benchmarks.gpu --fake-world 8                           # GPU: Llama-3-8B layers

Both sides train the same Hugging Face LlamaForCausalLM from the same weights
on the same batch, bf16 params and fp32 reduce, reshard after forward:
flexshard with its default buckets (one per decoder layer plus the root),
FSDP2 with `fully_shard` per decoder layer plus the root. A mode sets what
else the step does: "eager", "compile" (`model.layers[i] = torch.compile(layer)`),
"module-compile" (`layer.compile()`), "float8" / "float8-compile" (torchao's
float8 linears with fp8 all-gathers; FSDP2 also runs torchao's
`precompute_float8_dynamic_scale_for_fsdp` after each optimizer step);
"int8-gather" / "fp8-gather" (flexshard's `fs.QuantizedGather`, against
flexshard's own bf16 gathers: FSDP2 has none); "whole-compile" (`fs.compile(model,
fullgraph=True)`: the whole step one graph, gathers and reductions inside) and
"cudagraph" (the same under CUDA graphs) and "float8-whole" (the same with torchao's
float8 linears, against FSDP2 + torchao's compiled blocks), each against FSDP2's
compiled blocks.

For engine work, `count_step` counts one side's ops and copied bytes in one
call (its own fake world):

    from benchmarks.gpu import count_step
    c = count_step("flexshard", world=8)      # HF Llama hidden 384, 4 layers, seq 256
    c.ops, c.copy_bytes, c.by_op.get("aten::copy_", (0, 0))
    c.engine_copy_bytes                       # the copies inside FlexShard::* ranges
    count_step("flexshard", world=8, placement="ragged")   # FSDP2 stays Shard(0)

The counting itself is op_counter.py's; the benchmark's run over the modes is
fake_world_run.py's, its GPU time per region device_time.py's and its tables
fake_world_report.py's.
"""

from __future__ import annotations

import contextlib
import gc
import time
import warnings
from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

import flexshard as fs

from .meters import MemoryMeter
from .op_counter import Counts, GraphCounter, OpCounter
from .runners import flexshard_placement

SIDES = ("flexshard", "fsdp2", "flexshard-bf16")
MODES = ("eager", "compile", "module-compile", "float8", "float8-compile", "int8-gather",
         "fp8-gather", "whole-compile", "cudagraph", "float8-whole")
# flexshard's whole step in one graph (fs.compile; "cudagraph" under CUDA graphs, CUDA only;
# "float8-whole" with torchao's float8 linears) against FSDP2's compiled blocks (its hooks
# cannot be traced)
WHOLE = ("whole-compile", "cudagraph", "float8-whole")
COMPILED = ("compile", "module-compile", "float8-compile") + WHOLE


def compiled_mode(mode: str) -> bool:
    return mode in COMPILED
# flexshard's placements (benchmarks.harness.runners.flexshard_placement); FSDP2 stays Shard(0)
PLACEMENTS = ("shard", "ragged", "owned", "mixed", "shard1")
# flexshard's QuantizedGather: no FSDP2 counterpart, so its baseline is flexshard's bf16 gathers
QUANTIZED = {"int8-gather": torch.int8, "fp8-gather": torch.float8_e4m3fn}


def sides_of(mode: str) -> tuple:
    """(measured side, baseline side) of a mode: flexshard against FSDP2, or for a
    quantized-gather mode flexshard against its own bf16 gathers."""
    return ("flexshard", "flexshard-bf16") if mode in QUANTIZED else ("flexshard", "fsdp2")


class LlamaShape(NamedTuple):
    """A Llama's sizes and its batch (sequences per rank)."""

    vocab: int
    dim: int
    ffn: int
    heads: int
    kv_heads: int
    layers: int
    seq: int
    batch: int


PRESETS = {
    # issue 34's CPU target: hidden 384 (6 heads of 64, 2 KV heads as Llama-3's
    # grouped attention), SwiGLU 1024, sequence 256, one sequence per rank
    "cpu": LlamaShape(vocab=1024, dim=384, ffn=1024, heads=6, kv_heads=2, layers=4, seq=256,
                      batch=1),
    # Llama-3-8B's layers (8 of its 32) at sequence 4096: one rank of 8 fits 80 GB
    "8b": LlamaShape(vocab=128256, dim=4096, ffn=14336, heads=32, kv_heads=8, layers=8,
                     seq=4096, batch=1),
    "tiny": LlamaShape(vocab=128, dim=64, ffn=128, heads=4, kv_heads=2, layers=2, seq=32,
                       batch=1),
}


@contextlib.contextmanager
def fake_world(world: int, rank: int = 0, device: torch.device = torch.device("cpu")):
    """Rank `rank` of a fake process group of `world` ranks, its 1-D DeviceMesh yielded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    if dist.is_initialized():
        raise RuntimeError(
            f"fake_world: this process already has a {dist.get_backend()!r} process group; "
            "the fake world needs its own default group: run it in a fresh process "
            "(python -m benchmarks.gpu --fake-world N, or a subprocess)")
    if not 0 <= rank < world:
        raise ValueError(f"fake_world: rank {rank} is not in a world of {world} ranks")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield init_device_mesh(device.type, (world,))
    finally:
        dist.destroy_process_group()


CAUSAL_SDPA = "sdpa_is_causal"


def causal_sdpa() -> str:
    """transformers' SDPA attention registered under a name that is none of its mask
    functions, so the model builds no mask tensor and SDPA runs `is_causal` (flash
    attention, K/V heads not repeated) in every mode. Under "sdpa" a model compiled
    whole on torch < 2.14 builds an explicit causal mask inside the graph
    (masking_utils: dynamo reads `torch.compiler.is_exporting()` as True), which keeps
    SDPA off flash attention and repeats K/V over the query heads, where eager and
    compiled blocks build the mask outside graphs, find it all-causal and pass None: a
    cost of transformers under whole-model compile, plain model or sharded, not of the
    engine. The batches here have no padding, which this attention would ignore."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
    return CAUSAL_SDPA


def hf_llama(shape: LlamaShape, device: torch.device, seed: int = 0) -> nn.Module:
    """transformers' LlamaForCausalLM at `shape`, fp32, initialised from `seed` on
    `device`, its attention SDPA with `is_causal` in every mode (causal_sdpa)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.dim, intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, max_position_embeddings=shape.seq,
        rope_theta=500000.0, tie_word_embeddings=False, use_cache=False,
        attn_implementation=causal_sdpa())
    torch.manual_seed(seed)
    with torch.device(device):
        return transformers.LlamaForCausalLM(config)


def blocks(model: nn.Module) -> list:
    """(ModuleList, index) of every child of the model's outermost ModuleLists:
    the blocks both sides shard one by one (flexshard's default buckets)."""
    out, taken = [], []
    for name, sub in model.named_modules():
        if isinstance(sub, nn.ModuleList) and not any(name.startswith(t) for t in taken):
            out.extend((sub, i) for i in range(len(sub)))
            taken.append(f"{name}.")
    return out


def wrap(side: str, model: nn.Module, mesh, reshard: bool = True,
         gather_format=None, placement: str = "shard") -> nn.Module:
    """Shard `model` over `mesh` as `side` does by default: bf16 params, fp32 reduce
    (flexshard: its params placed by `placement`, one of PLACEMENTS, and its weights
    gathered in `gather_format`, if given; FSDP2: Shard(0) always, the one it has)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; use one of {PLACEMENTS}")
    if side.startswith("flexshard"):
        mp = fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                     gather_format=gather_format)
        return fs.flex_shard(model, mesh, placement=flexshard_placement(placement),
                             mp_policy=mp, reshard_after_forward=reshard)
    if side != "fsdp2":
        raise ValueError(f"unknown side {side!r}; use one of {SIDES}")
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for parent, i in blocks(model):
        fully_shard(parent[i], mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    return fully_shard(model, mesh=mesh, reshard_after_forward=None if reshard else False,
                       mp_policy=mp)


def to_float8(model: nn.Module) -> nn.Module:
    """torchao float8 linears with fp8 all-gathers (the head stays in high precision)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return convert_to_float8_training(model, config=config,
                                          module_filter_fn=lambda m, fqn: fqn != "lm_head")


def compile_blocks(model: nn.Module, how: str) -> None:
    """Compile each block: "compile" replaces it by torch.compile(block), "module-compile"
    calls block.compile() (nn.Module.compile, the block stays itself)."""
    for parent, i in blocks(model):
        if how == "compile":
            parent[i] = torch.compile(parent[i])
        else:
            parent[i].compile()


class Side:
    """One side of the comparison in one mode: its model, optimizer and step."""

    def __init__(self, side: str, mode: str, shape: LlamaShape, mesh, device: torch.device,
                 seed: int = 0, build: Optional[Callable[[], nn.Module]] = None,
                 reshard: bool = True, placement: str = "shard") -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; use one of {MODES}")
        self.kind, self.mode, self.device = side, mode, device
        model = build() if build is not None else hf_llama(shape, device, seed)
        if mode.startswith("float8"):
            model = to_float8(model)
        quantized = QUANTIZED.get(mode) if side == "flexshard" else None
        wire = fs.QuantizedGather(quantized) if quantized is not None else None
        self.model = wrap(side, model, mesh, reshard, gather_format=wire, placement=placement)
        if mode in WHOLE and side == "flexshard":
            fs.compile(self.model, fullgraph=True, cudagraphs=mode == "cudagraph")
        elif compiled_mode(mode):
            compile_blocks(self.model, "module-compile" if mode == "module-compile" else "compile")
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(seed)
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", shape.vocab)
        self.tokens = torch.randint(0, vocab, (shape.batch, shape.seq), generator=g).to(device)

    def forward_backward(self) -> torch.Tensor:
        loss = self.model(input_ids=self.tokens, labels=self.tokens).loss
        loss.backward()
        return loss

    def optimizer_step(self) -> None:
        self.opt.step()
        if self.kind == "fsdp2" and self.mode.startswith("float8"):
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(self.model)
        self.opt.zero_grad(set_to_none=True)

    def step(self) -> float:
        """One training step; its wall seconds (device synchronised)."""
        sync(self.device)
        start = time.perf_counter()
        self.forward_backward()
        self.optimizer_step()
        sync(self.device)
        return time.perf_counter() - start


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def counted(side: Side) -> Counts:
    """One forward+backward of `side` under OpCounter (its optimizer step outside)."""
    counter = OpCounter()
    with counter:
        side.forward_backward()
    side.optimizer_step()
    return Counts.of(counter)


def count_whole_step(shape: LlamaShape, mesh, device: torch.device, placement: str = "shard",
                     warmup: int = 1, float8: bool = False) -> tuple:
    """(flexshard's forward+backward compiled whole, the same of the plain model in
    bf16), each counted inside its graphs (GraphCounter): the engine's part is
    their difference. `float8`: both with torchao's float8 linears."""
    out = []
    for wrapped in (True, False):
        torch._dynamo.reset()
        graphs = GraphCounter()
        model = hf_llama(shape, device)
        if float8:
            model = to_float8(model)
        if wrapped:
            model = wrap("flexshard", model, mesh, placement=placement)
            fs.compile(model, fullgraph=True, backend=graphs.backend())
        else:
            model = torch.compile(model.to(torch.bfloat16), fullgraph=True,
                                  backend=graphs.backend())
        tokens = torch.randint(0, shape.vocab, (shape.batch, shape.seq)).to(device)

        def step():
            model(input_ids=tokens, labels=tokens).loss.backward()
            model.zero_grad(set_to_none=True)

        for _ in range(warmup):
            step()
        out.append(graphs.count(step))
        del model
        gc.collect()
    torch._dynamo.reset()
    return tuple(out)


def count_step(side: str = "flexshard", world: int = 8, *, shape: LlamaShape = PRESETS["cpu"],
               mode: str = "eager", build: Optional[Callable[[], nn.Module]] = None,
               warmup: int = 1, rank: int = 0, reshard: bool = True,
               placement: str = "shard") -> Counts:
    """Ops and copied bytes of one forward+backward of rank `rank` in a fake world of
    `world` ranks, after `warmup` steps: `side` (one of SIDES) shards an HF
    Llama of `shape` (or `build()`'s model: an HF causal LM, its blocks in a ModuleList),
    resharding after forward unless `reshard` is False; flexshard's params placed by
    `placement` (one of PLACEMENTS; FSDP2's are Shard(0) whatever it says). Creates its
    own fake world: call it in a process without a process group."""
    if compiled_mode(mode):
        raise ValueError(f"count_step: mode {mode!r} compiles the blocks, and under the "
                         "counting dispatch mode they would run eagerly; count an eager mode "
                         "('eager' or 'float8')")
    device = torch.device("cpu")
    with fake_world(world, rank, device) as mesh:
        s = Side(side, mode, shape, mesh, device, build=build, reshard=reshard,
                 placement=placement)
        for _ in range(warmup):
            s.step()
        counts = counted(s)
        del s
        gc.collect()
    return counts


def cpu_peak_bytes(side: Side) -> int:
    """Peak live bytes over one step on a CPU (meters.MemoryMeter: params, optimizer
    state and every storage the step touches, at the allocator's block size)."""
    meter = MemoryMeter()
    meter.register(side.model.parameters(), "param")
    meter.register([t for s in side.opt.state.values() for t in s.values()
                    if isinstance(t, torch.Tensor)], "opt_state")
    with meter:
        side.step()
    return meter.peak
