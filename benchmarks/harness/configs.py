"""What one benchmark configuration is, and the default grid."""

from __future__ import annotations

from dataclasses import dataclass

PLACEMENTS = ("shard", "ragged", "owned", "mixed", "shard1")
PARAM_DTYPES = ("fp32", "bf16")
MODELS = ("odd", "even", "llama")
OPTIMIZERS = ("adamw", "muon")
GLOO = ("rooted", "plain")  # flexshard on gloo: fs.GlooComm() (the default) / fs.Comm(): runtime/gloo.py
GATHERS = ("param", "int8", "fp8")  # flexshard's all-gather: param_dtype, or fs.QuantizedGather


@dataclass(frozen=True)
class Config:
    """One side-by-side run: flexshard and FSDP2 (and plain at world size 1)."""

    world_size: int
    placement: str = "shard"  # flexshard's; FSDP2 can only Shard(0)
    param_dtype: str = "fp32"
    reshard: bool = True  # reshard_after_forward of the blocks
    model: str = "odd"
    optimizer: str = "adamw"  # "muon": Muon on block matrices, AdamW on the rest
    gloo: str = "rooted"  # flexshard's Comm on gloo: "rooted" (the default) or "plain"
    gather: str = "param"  # flexshard's gather format (FSDP2 always gathers param_dtype)
    float8: bool = False  # torchao float8 linears with the fp8 all-gather, in both runners

    def __post_init__(self) -> None:
        for field, allowed in (("placement", PLACEMENTS), ("param_dtype", PARAM_DTYPES),
                               ("model", MODELS), ("optimizer", OPTIMIZERS),
                               ("gloo", GLOO), ("gather", GATHERS)):
            if getattr(self, field) not in allowed:
                raise ValueError(f"Config.{field}={getattr(self, field)!r}; use one of {allowed}")
        if self.world_size < 1:
            raise ValueError(f"Config.world_size={self.world_size}; use 1 or more")
        if self.optimizer == "muon" and self.placement not in ("owned", "mixed"):
            raise ValueError(f"Muon needs whole matrices on a rank: placement {self.placement!r} "
                             "splits them; use 'owned' or 'mixed'")

    @property
    def name(self) -> str:
        parts = [self.placement, self.param_dtype, "reshard" if self.reshard else "keep",
                 self.model]
        if self.optimizer != "adamw":
            parts.append(self.optimizer)
        if self.gloo != "rooted":
            parts.append(f"{self.gloo}-gloo")
        if self.gather != "param":
            parts.append(f"{self.gather}-gather")
        if self.float8:
            parts.append("torchao-float8")
        return "/".join(parts)

    @property
    def needs(self) -> tuple:
        """The flexshard placements this configuration uses, by class name."""
        return {"shard": (), "ragged": ("RaggedShard",), "owned": ("Owned",),
                "mixed": ("Owned", "RaggedShard")}[self.placement]


def default_grid(world_sizes=(1, 2, 4)) -> list:
    """One baseline (Shard, fp32, reshard, odd shapes) and one change at a time."""
    variants = [
        dict(),
        dict(reshard=False),
        dict(param_dtype="bf16"),
        dict(model="even"),
        dict(placement="ragged"),
        dict(placement="ragged", model="even"),
        dict(placement="owned"),
        dict(placement="mixed"),
        dict(placement="mixed", param_dtype="bf16", reshard=False),
        dict(placement="mixed", optimizer="muon"),
    ]
    return [Config(ws, **v) for ws in world_sizes for v in variants]


def engine_grid(world_sizes=(2,), models=("llama",), reshards=(True,)) -> list:
    """Issue 12's targets: Shard(0), RaggedShard and Owned buckets, fp32 and bf16,
    reshard after forward on (and off, for the memory target), per model."""
    return [Config(ws, placement=p, param_dtype=d, model=m, reshard=r)
            for ws in world_sizes for m in models for r in reshards
            for p in ("shard", "ragged", "owned") for d in PARAM_DTYPES]


def gather_grid(world_sizes=(2,), models=("llama",), reshards=(True,)) -> list:
    """Quantized gathers (issue 27): Shard(0) buckets gathering the weights in
    param_dtype (fp32, bf16) or quantized (int8, fp8 with a scale per row), each
    beside FSDP2 gathering in param_dtype; then both libraries training torchao's
    float8 linears with its fp8 all-gather."""
    quantized = [Config(ws, param_dtype=d, model=m, reshard=r, gather=g)
                 for ws in world_sizes for m in models for r in reshards
                 for d in PARAM_DTYPES for g in GATHERS]
    return quantized + [Config(ws, param_dtype=d, model=m, reshard=r, float8=True)
                        for ws in world_sizes for m in models for r in reshards
                        for d in PARAM_DTYPES]


GRIDS = {"default": default_grid, "engine": engine_grid, "gather": gather_grid}
