"""The three ways the benchmark trains one model: plain, FSDP2 and flexshard.

The three ways the benchmark trains one model: plain (unwrapped), FSDP2
(`fully_shard` per block plus root) and flexshard (one bucket per block plus
root, `fs.flex_shard`'s default buckets). Each runner owns its model copy,
its optimizers and its step."""

from __future__ import annotations

import math
import time
from typing import NamedTuple

import torch
import torch.nn as nn

from torch.distributed.fsdp import MixedPrecisionPolicy as FsdpMixedPrecision
from torch.distributed.fsdp import fully_shard

import flexshard as fs
from flexshard.optim import split_for_muon

from .fsdp_muon import MUON_DEFAULTS, GatheredMuon
from .meters import local
from .model import batch, build_model, loss_fn

ADAMW = dict(lr=1e-3, weight_decay=0.01)
DTYPES = {"fp32": None, "bf16": torch.bfloat16}


class StepTime(NamedTuple):
    loss: float
    step_s: float  # zero_grad + forward + backward + optimizer step
    optim_s: float  # optimizer step alone
    cpu_s: float  # CPU time of this process over the step (all its threads)


class Optimizers:
    """Several optimizers stepped as one (Muon on matrices, AdamW on the rest)."""

    def __init__(self, *optims: torch.optim.Optimizer) -> None:
        self.optims = [o for o in optims if o is not None]

    def step(self) -> None:
        for o in self.optims:
            o.step()

    def zero_grad(self) -> None:
        for o in self.optims:
            o.zero_grad(set_to_none=True)

    def state_tensors(self) -> list:
        return [t for o in self.optims for s in o.state.values()
                for t in s.values() if isinstance(t, torch.Tensor)]


def _placement(name: str):
    cls = getattr(fs, name, None)
    if cls is None:
        raise NotImplementedError(
            f"fs.{name} is not in this flexshard checkout (it comes with the placements work); "
            "merge main, or run only the 'shard' configurations (--placements shard)")
    return cls()


def _in_block(fqn: str) -> bool:
    """Whether `fqn` is in a block: `layers.N.` (this repository's models) or
    `model.layers.N.` (Hugging Face's Llama)."""
    return fqn.startswith("layers.") or ".layers." in fqn


def _mixed_choice(fqn: str, param: nn.Parameter):
    """Block matrices Owned, other matrices RaggedShard, vectors Shard(0)."""
    if param.ndim == 2 and _in_block(fqn):
        return _placement("Owned")
    if param.ndim == 2:
        return _placement("RaggedShard")
    return fs.Shard(0)


def _shard1_choice(fqn: str, param: nn.Parameter):
    """Matrices Shard(1) (a piece per rank per row: index plans), vectors Shard(0)."""
    return fs.Shard(1) if param.ndim == 2 else fs.Shard(0)


def flexshard_placement(name: str):
    """The `placement=` argument of flex_shard for a configuration's placement name."""
    choices = {"shard": lambda: fs.Shard(0), "ragged": lambda: _placement("RaggedShard"),
               "owned": lambda: _placement("Owned"), "mixed": lambda: _mixed_choice,
               "shard1": lambda: _shard1_choice}
    if name not in choices:
        raise ValueError(f"unknown placement {name!r}; use one of {sorted(choices)}")
    choice = choices[name]()
    if name == "mixed":
        _placement("Owned"), _placement("RaggedShard")  # fail now, not mid-wrap
    return choice


def muon_matrices(model: nn.Module) -> set:
    """FQNs of the 2-D block weights Muon updates (embeddings and head stay on AdamW)."""
    return {fqn for fqn, p in model.named_parameters() if p.ndim == 2 and _in_block(fqn)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gather_format(cfg):
    """flexshard's WirePolicy for the configuration (None: gather param_dtype)."""
    if cfg.gather == "param":
        return None
    return fs.QuantizedGather(torch.int8 if cfg.gather == "int8" else torch.float8_e4m3fn)


def _to_float8(model) -> None:
    """torchao's float8 linears whose weights all-gather as fp8 (its FSDP2 extension)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    convert_to_float8_training(model, config=Float8LinearConfig(
        enable_fsdp_float8_all_gather=True))


class Runner:
    """One model copy trained one way ("plain", "fsdp2" or "flexshard")."""

    def __init__(self, kind: str, cfg, mesh, device: torch.device, rank: int) -> None:
        self.kind, self.cfg, self.device, self.rank = kind, cfg, device, rank
        self.model = build_model(cfg.model).to(device)
        if cfg.float8:
            _to_float8(self.model)
        matrices = muon_matrices(self.model) if cfg.optimizer == "muon" else set()
        dtype = DTYPES[cfg.param_dtype]
        if kind == "fsdp2":
            self._wrap_fsdp2(mesh, dtype)
        elif kind == "flexshard":
            fs.flex_shard(self.model, mesh, placement=flexshard_placement(cfg.placement),
                          mp_policy=fs.MixedPrecisionPolicy(param_dtype=dtype,
                                                            gather_format=gather_format(cfg)),
                          reshard_after_forward=cfg.reshard,
                          comm=fs.GlooComm() if cfg.gloo == "rooted" else fs.Comm())
        elif kind != "plain" or dtype is not None:
            raise ValueError(f"no runner {kind!r} for param_dtype {cfg.param_dtype}")
        self.optim = self._optimizers(matrices)

    def _wrap_fsdp2(self, mesh, dtype) -> None:
        mp = FsdpMixedPrecision(param_dtype=dtype)
        for block in self.model.layers:
            fully_shard(block, mesh=mesh, reshard_after_forward=self.cfg.reshard, mp_policy=mp)
        # the root as FSDP2 defaults it (None: kept unsharded for backward), as flexshard does
        root_reshard = None if self.cfg.reshard else False
        fully_shard(self.model, mesh=mesh, reshard_after_forward=root_reshard, mp_policy=mp)

    def _optimizers(self, matrices: set) -> Optimizers:
        named = list(self.model.named_parameters())
        if self.kind == "flexshard" and matrices:
            # whole Owned matrices on their owner, shards of the rest (empty pieces left out)
            split = split_for_muon(self.model, lambda fqn, shape: fqn in matrices)
            mats, rest = split.matrices, split.others
        else:
            rest = [p for f, p in named if f not in matrices]
            mats = [p for f, p in named if f in matrices]
        muon_cls = GatheredMuon if self.kind == "fsdp2" else torch.optim.Muon
        muon = muon_cls(mats, **MUON_DEFAULTS) if mats else None
        return Optimizers(muon, torch.optim.AdamW(rest, **ADAMW) if rest else None)

    def params(self) -> list:
        """This rank's parameter tensors (local shards; plain tensors)."""
        return [local(p) for p in self.model.parameters()]

    def grads(self) -> list:
        return [local(p.grad) for p in self.model.parameters() if p.grad is not None]

    def forward_backward(self, step: int) -> torch.Tensor:
        x, y = batch(self.cfg.model, step, self.rank, self.device)
        loss = loss_fn(self.model(x), y)
        loss.backward()
        return loss

    def step(self, step: int) -> StepTime:
        _sync(self.device)
        c0, t0 = time.process_time(), time.perf_counter()
        self.optim.zero_grad()
        loss = self.forward_backward(step)
        _sync(self.device)
        t1 = time.perf_counter()
        self.optim.step()
        _sync(self.device)
        t2, c2 = time.perf_counter(), time.process_time()
        return StepTime(loss.item(), t2 - t0, t2 - t1, c2 - c0)

    def bucket_counters(self) -> dict:
        """flexshard only: bucket name -> its placements and counters (a copy)."""
        if self.kind != "flexshard":
            return {}
        from flexshard.runtime.state import get_state
        return {b.name: {"placements": sorted({type(s.placement).__name__ for s in b.slots}),
                         **vars(b.counters)}
                for b in get_state(self.model).buckets}

    def fsdp2_ideal(self, world_size: int) -> dict:
        """FSDP2 only: collective kind -> {wire bytes of one collective: bytes
        that had to move}, per parameter group (a block, or the root's own)."""
        if self.kind != "fsdp2":
            return {}
        blocks = list(self.model.layers)
        in_blocks = {id(p) for b in blocks for p in b.parameters()}
        groups = [list(b.parameters()) for b in blocks]
        groups.append([p for p in self.model.parameters() if id(p) not in in_blocks])
        dtype = DTYPES[self.cfg.param_dtype]
        sizes: dict = {"allgather_base": {}, "reduce_scatter_base": {}}
        for params in groups:
            wire, ideal = _padded(params, dtype, world_size, gather=True)
            sizes["allgather_base"][wire] = ideal
            wire, ideal = _padded(params, dtype, world_size, gather=False)
            sizes["reduce_scatter_base"][wire] = ideal
        return sizes


def _padded(params, dtype, world_size: int, gather: bool) -> tuple:
    """(wire, ideal) bytes of one FSDP2 collective over `params`: each
    parameter padded to a multiple of world_size rows, or not. A gather moves
    torchao's float8 weights as fp8 (one byte each)."""
    wire = ideal = 0
    for p in params:
        fp8 = gather and hasattr(getattr(p, "_local_tensor", p), "fsdp_pre_all_gather")
        itemsize = 1 if fp8 else (dtype or p.dtype).itemsize
        rest = math.prod(p.shape[1:])
        wire += -(-p.shape[0] // world_size) * world_size * rest * itemsize
        ideal += p.numel() * itemsize
    return wire, ideal
