"""flexshard against FSDP2 and the plain model on a GPU.

    python -m benchmarks.gpu                                    # 1.2 B Llama, one GPU
    python -m benchmarks.gpu --ac full --offload --profile runs/gpu-profile
    torchrun --nproc-per-node 8 -m benchmarks.gpu               # one process per GPU
    python -m benchmarks.gpu --device cpu --preset tiny --steps 2   # the CPU dry run
    python -m benchmarks.gpu --fake-world 8                     # one rank of 8, one GPU
    python -m benchmarks.gpu --fake-world 8 --device cpu --counts   # ops and copied bytes

`--fake-world N` measures one rank of an N-rank job in one process (torch's
"fake" backend, flexshard against FSDP2 on an HF Llama; Llama-3-8B layers on
a GPU): see harness/fake_world.py; `count_step` counts one side's ops and copied bytes.

The model is benchmarks/harness/model.py's Llama (RMSNorm, SwiGLU, rotary positions,
untied head) at the "1b" preset: hidden 2048, 16 layers of 16 heads, SwiGLU
width 8192, vocabulary 32768, sequence 2048: 1.21 B parameters. Each runner
keeps fp32 master weights and computes in bf16: flexshard and FSDP2 with
param_dtype=bf16 and reduce_dtype=fp32, one bucket / `fully_shard` per block
plus the root; the plain model (world size 1 only) under torch.autocast(bf16).
`--ac full` checkpoints every block (torch.utils.checkpoint, non-reentrant),
applied before wrapping as torchtitan does. `--compile blocks` compiles every
runner's blocks; `--compile whole` compiles the plain model whole and flexshard's
whole step (`fs.compile`, fullgraph), FSDP2's blocks (its hooks cannot be traced):
issue 46's one-rank target, flexshard within 5% of the plain model's tokens/s. Each
runner is built after a fresh dynamo cache; the report says how many graphs each
compiled in its timed steps (a recompile, or a runner silently run eagerly).

Phase 1, each runner alone on the device: warm-up steps, then the peak
`torch.cuda.max_memory_allocated` and `max_memory_reserved` over one more
step, both net of what was allocated before the runner was built (and, with
--profile, one profiled step: a Chrome trace and a summary of it, see
harness/trace.py). Phase 2 (`--timing alternate`, the default): every runner
built again, steps alternating (A B C, B C A, ...) so drift hits all alike;
`--timing sequential` times each runner in phase 1 instead (when three
copies of the model do not fit together). Tokens/s = tokens per step over the
median step time (slowest rank); MFU = model FLOPs (6 N + 12 L d s per token,
N without the embedding) per second over `--peak-tflops` (H100 SXM dense
bf16: 989) per GPU. The report ends with the targets, PASS or MISS: memory
<= FSDP2's, tokens/s >= FSDP2's and >= 0.98x the plain model's.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import statistics
import sys
import tempfile
import warnings
from pathlib import Path

if not __package__:  # `python benchmarks/<name>.py`: the checkout first, and import as a package
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    __package__ = "benchmarks"

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import flexshard as fs

from .harness import fake_world_report, fake_world_run
from .harness.fake_world import PRESETS as FAKE_PRESETS
from .harness.fake_world import MODES, PLACEMENTS, count_step  # noqa: F401  (re-exported)
from .harness.model import BenchLlama, ModelShape, loss_fn
from .harness.runners import StepTime, flexshard_placement
from .harness.timing import spread, time_steps
from .harness.trace import profile_step

PRESETS = {
    "1b": ModelShape(vocab=32768, dim=2048, heads=16, hidden=8192, layers=16, seq=2048, batch=2),
    "tiny": ModelShape(vocab=128, dim=64, heads=2, hidden=128, layers=2, seq=32, batch=2),
}
H100_BF16_DENSE_TFLOPS = 989.0
KINDS = ("plain", "fsdp2", "flexshard", "flexshard-offload")
# (name, numerator, denominator, measure, target, "<=" or ">=")
TARGETS = [("memory flexshard/fsdp2", "flexshard", "fsdp2", "max_allocated_bytes", 1.00, "<="),
           ("tokens/s flexshard/fsdp2", "flexshard", "fsdp2", "tokens_per_s", 1.00, ">="),
           ("tokens/s flexshard/plain", "flexshard", "plain", "tokens_per_s", 0.98, ">=")]


class Checkpointed(nn.Module):
    """A block whose forward is recomputed in backward (full activation checkpointing)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args):
        return checkpoint(self.block, *args, use_reentrant=False)


def build_model(shape: ModelShape, ac: str, device: torch.device, seed: int) -> nn.Module:
    """The Llama, initialised on `device` from `seed` (the same for every runner)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = BenchLlama(shape)
    if ac == "full":
        model.layers = nn.ModuleList(Checkpointed(b) for b in model.layers)
    return model


def flops_per_token(model: nn.Module, shape: ModelShape) -> float:
    """Training FLOPs per token: 6 N (N without the token embedding) plus the
    attention scores, 12 L d s (PaLM's count, as torchtitan's MFU)."""
    n = sum(p.numel() for p in model.parameters()) - model.tok.weight.numel()
    return 6.0 * n + 12.0 * shape.layers * shape.dim * shape.seq


class GpuRunner:
    """One model trained one way: plain, fsdp2, flexshard or flexshard-offload."""

    def __init__(self, kind: str, args, shape: ModelShape, mesh, device, batches) -> None:
        self.kind, self.device, self.batches = kind, device, batches
        self.model = build_model(shape, args.ac, device, args.seed)
        if kind == "fsdp2":
            self._wrap_fsdp2(mesh, not args.no_reshard)
        elif kind.startswith("flexshard"):
            fs.flex_shard(self.model, mesh, placement=flexshard_placement(args.placement),
                          mp_policy=fs.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                            reduce_dtype=torch.float32),
                          reshard_after_forward=not args.no_reshard,
                          offload_policy=fs.OffloadPolicy() if kind.endswith("offload") else None)
        self._compile(args.compile)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.01)

    def _compile(self, how: str) -> None:
        """--compile: none, every block, or the whole model where its runner allows."""
        if how == "none":
            return
        if how == "whole" and self.kind.startswith("flexshard"):
            fs.compile(self.model, fullgraph=True)
        elif how == "whole" and self.kind == "plain":
            self.model.compile(fullgraph=True)
        else:
            for block in self.model.layers:
                block.compile()

    def _wrap_fsdp2(self, mesh, reshard: bool) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in self.model.layers:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
        fully_shard(self.model, mesh=mesh, reshard_after_forward=None if reshard else False,
                    mp_policy=mp)

    def step(self, i: int) -> StepTime:
        import time

        x, y = self.batches[i % len(self.batches)]
        _sync(self.device)
        c0, t0 = time.process_time(), time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16,
                                  enabled=self.kind == "plain")
        with autocast:
            logits = self.model(x)
        loss = loss_fn(logits, y)
        self.graph_calls = compiled_graph_calls(loss)
        loss.backward()
        _sync(self.device)
        t1 = time.perf_counter()
        self.opt.step()
        _sync(self.device)
        t2, c2 = time.perf_counter(), time.process_time()
        return StepTime(loss.item(), t2 - t0, t2 - t1, c2 - c0)


def compiled_graph_calls(loss: torch.Tensor) -> int:
    """Calls of compiled graphs on the way to `loss` (AOTAutograd's autograd nodes):
    0 for a runner that ran eagerly."""
    from flexshard.compat import COMPILED_GRAPH_NODE

    todo, seen = [loss.grad_fn], {}
    while todo:
        node = todo.pop()
        if node is not None and id(node) not in seen:
            seen[id(node)] = node
            todo.extend(fn for fn, _ in node.next_functions)
    return sum(node.name() == COMPILED_GRAPH_NODE for node in seen.values())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_batches(shape: ModelShape, n: int, rank: int, device, seed: int) -> list:
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    out = []
    for _ in range(n):
        data = torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), generator=g)
        out.append((data[:, :-1].to(device), data[:, 1:].to(device)))
    return out


def _memory_now(device) -> tuple:
    if device.type != "cuda":
        return None, None
    return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)


def measure_alone(kind: str, args, shape, mesh, device, batches) -> dict:
    """Phase 1 for one runner: warm-up, peak memory over one step, optionally
    the sequential timing and a profiled step."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    base_alloc, base_reserved = _memory_now(device)
    torch._dynamo.reset()  # each runner compiles from a fresh cache (--compile)
    runner = GpuRunner(kind, args, shape, mesh, device, batches)
    for i in range(args.warmup):
        runner.step(i)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    runner.step(args.warmup)
    out = {"max_allocated_bytes": None, "max_reserved_bytes": None}
    out_calls = runner.graph_calls
    if device.type == "cuda":
        out = {"max_allocated_bytes": torch.cuda.max_memory_allocated(device) - base_alloc,
               "max_reserved_bytes": torch.cuda.max_memory_reserved(device) - base_reserved}
    out["compiled_graph_calls"] = out_calls
    if args.timing == "sequential":
        out["record"] = time_steps([runner], args.warmup + 1, args.steps, _world())
    if args.profile is not None and _rank() == 0:
        summary = profile_step(functools.partial(runner.step, 0), device, Path(args.profile), kind)
        print(summary.text(kind), flush=True)
    del runner
    return out


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def runner_kinds(args) -> list:
    kinds = list(args.runners or ("plain", "fsdp2", "flexshard"))
    if args.offload and "flexshard-offload" not in kinds:
        kinds.append("flexshard-offload")
    return [k for k in kinds if k != "plain" or _world() == 1]  # plain: one process only


def run(args, device: torch.device) -> dict:
    """Both phases for every runner; the report as a dict."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = PRESETS[args.preset]._replace(**{k: v for k, v in (("batch", args.batch),
                                                                ("seq", args.seq),
                                                                ("layers", args.layers)) if v})
    mesh = init_device_mesh(device.type, (_world(),))
    batches = make_batches(shape, max(4, args.warmup + args.steps + 1), _rank(), device, args.seed)
    kinds = runner_kinds(args)
    alone = {k: measure_alone(k, args, shape, mesh, device, batches) for k in kinds}
    gc.collect()  # the last phase-1 runner (wrapped modules hold reference cycles)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if args.timing == "alternate":
        torch._dynamo.reset()
        runners = []
        for k in kinds:  # each warmed up (compiled) before the next is built
            runners.append(GpuRunner(k, args, shape, mesh, device, batches))
            for i in range(args.warmup):
                runners[-1].step(i)
        graphs = _graphs_compiled()
        record = time_steps(runners, args.warmup, args.steps, _world())
        record["graphs_in_timed_steps"] = _graphs_compiled() - graphs
        del runners
    else:
        record = {k: alone[k].pop("record")[k] for k in kinds}
        record["graphs_in_timed_steps"] = None
    flops = flops_per_token(build_model(shape, "none", torch.device("meta"), args.seed), shape)
    return report(args, shape, device, kinds, alone, record, flops)


def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def report(args, shape, device, kinds, alone, record, flops: float) -> dict:
    tokens = shape.batch * shape.seq * _world()
    runners = {}
    for k in kinds:
        median = statistics.median(record[k]["step_s"])
        tok_s = tokens / median
        runners[k] = {"tokens_per_s": tok_s, "step_s": spread(record[k]["step_s"]),
                      "mfu": tok_s * flops / (args.peak_tflops * 1e12 * _world()),
                      "final_loss": record[k]["loss"][-1], **alone[k]}
    gaps = [abs(a - b) / abs(b) for a, b in zip(record.get("flexshard", {}).get("loss", []),
                                               record.get("fsdp2", {}).get("loss", []))]
    model = build_model(shape, "none", torch.device("meta"), args.seed)
    return {"machine": _machine(device), "model": {**shape._asdict(), "preset": args.preset,
                                                   "params": sum(p.numel() for p in model.parameters()),
                                                   "flops_per_token": flops},
            "config": {"device": device.type, "world_size": _world(), "ac": args.ac,
                       "placement": args.placement, "reshard_after_forward": not args.no_reshard,
                       "param_dtype": "bf16", "reduce_dtype": "fp32", "steps": args.steps,
                       "warmup": args.warmup, "timing": args.timing,
                       "peak_tflops": args.peak_tflops, "tokens_per_step": tokens,
                       "compile": args.compile},
            "graphs_in_timed_steps": record["graphs_in_timed_steps"],
            "runners": runners, "targets": targets(runners),
            "loss_gap_flexshard_fsdp2": max(gaps) if gaps else None}


def targets(runners: dict) -> list:
    """Each target's ratio and verdict; "n/a" where a runner or measure is missing."""
    rows = []
    for name, num, den, key, target, sense in TARGETS:
        a, b = runners.get(num, {}).get(key), runners.get(den, {}).get(key)
        if a is None or b is None:
            rows.append({"name": name, "value": None, "target": f"{sense} {target:.2f}",
                         "verdict": "n/a"})
            continue
        value = a / b
        ok = value <= target if sense == "<=" else value >= target
        rows.append({"name": name, "value": value, "target": f"{sense} {target:.2f}",
                     "verdict": "PASS" if ok else "MISS"})
    return rows


def _machine(device) -> dict:
    info = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "torch": torch.__version__, "device": str(device)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _gib(n) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


def text(result: dict) -> str:
    m, c = result["model"], result["config"]
    lines = [f"model: Llama {m['params'] / 1e6:,.1f} M params (dim {m['dim']}, {m['layers']} layers, "
             f"{m['heads']} heads, SwiGLU {m['hidden']}, vocab {m['vocab']}), seq {m['seq']}, "
             f"batch {m['batch']}/rank; {c['device']} x{c['world_size']}, bf16 params, fp32 reduce, "
             f"AC {c['ac']}, reshard {c['reshard_after_forward']}, timing {c['timing']}, "
             f"compile {c['compile']} (graphs compiled in the timed steps: "
             f"{result['graphs_in_timed_steps']})",
             "| runner | tokens/s | step s, median (min-max) | MFU | max allocated | max reserved "
             "| compiled graphs a step |", "|---|---|---|---|---|---|---|"]
    for kind, r in result["runners"].items():
        s = r["step_s"]
        lines.append(f"| {kind} | {r['tokens_per_s']:,.0f} | {s['median']:.4f} ({s['min']:.4f}-"
                     f"{s['max']:.4f}) | {100 * r['mfu']:.1f}% | {_gib(r['max_allocated_bytes'])} "
                     f"| {_gib(r['max_reserved_bytes'])} | {r.get('compiled_graph_calls', 'n/a')} |")
    for t in result["targets"]:
        value = "n/a" if t["value"] is None else f"{t['value']:.3f}x"
        lines.append(f"{t['name']}: {value} ({t['target']}) {t['verdict']}")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto = CUDA when available, else CPU (default auto)")
    p.add_argument("--preset", default=None,
                   help=f"model size: {sorted(PRESETS)} (default 1b); with --fake-world "
                        f"{sorted(FAKE_PRESETS)} (default cpu on a CPU, 8b on a GPU)")
    p.add_argument("--batch", type=int, default=None, help="sequences per rank (preset's)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (preset's)")
    p.add_argument("--layers", type=int, default=None, help="transformer blocks (preset's)")
    p.add_argument("--compile", choices=("none", "blocks", "whole"), default="none",
                   help="compile every runner's blocks, or the whole step where the runner "
                        "allows (plain, flexshard; FSDP2 its blocks) (default none)")
    p.add_argument("--ac", choices=("none", "full"), default="none",
                   help="activation checkpointing of every block (default none)")
    p.add_argument("--placement", choices=PLACEMENTS, default="shard",
                   help="flexshard's placement (default shard); with --fake-world FSDP2 "
                        "stays Shard(0), the one it has")
    p.add_argument("--no-reshard", action="store_true", help="keep blocks unsharded until backward")
    p.add_argument("--offload", action="store_true",
                   help="also run flexshard with fs.OffloadPolicy() (GPU memory saved)")
    p.add_argument("--runners", nargs="+", choices=KINDS, default=None,
                   help="which sides to run: plain, fsdp2, flexshard, flexshard-offload "
                        "(default plain fsdp2 flexshard)")
    p.add_argument("--timing", choices=("alternate", "sequential"), default="alternate",
                   help="alternate = one step of each side in turn (the same machine state); "
                        "sequential = all of one side's steps, then the next (default alternate)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per runner")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed steps before the timed ones (default 3)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the model initialisation and the data (default 0)")
    p.add_argument("--peak-tflops", type=float, default=H100_BF16_DENSE_TFLOPS,
                   help="the GPU's dense bf16 peak, for MFU (default: H100 SXM, 989)")
    p.add_argument("--profile", default=None, help="directory for one profiled step per runner")
    p.add_argument("--json", default=None, help="write the report here as JSON")
    fake = p.add_argument_group("fake world (one rank of an N-rank job in one process)")
    fake.add_argument("--fake-world", type=int, default=None, metavar="N",
                      help="measure rank --rank of N ranks: flexshard against FSDP2")
    fake.add_argument("--rank", type=int, default=0,
                      help="which rank of the fake world this process plays (default 0)")
    fake.add_argument("--counts", action="store_true",
                      help="count aten ops and bytes copied per forward+backward (eager modes)")
    fake.add_argument("--modes", nargs="+", choices=MODES, default=None,
                      help="default: eager on a CPU, every mode on a GPU")
    fake.add_argument("--out", default="runs/fake-world",
                      help="where the JSON report and GPU traces go (default runs/fake-world)")
    args = p.parse_args(argv)
    _check_fake_world(p, args)
    for name in ("steps", "warmup", "batch", "seq", "layers"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "warmup" else 1):
            p.error(f"--{name} must be >= {0 if name == 'warmup' else 1}, got {value}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device here; use --device cpu")
    return args


def _check_fake_world(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Defaults and refusals that depend on --fake-world; the preset's default."""
    if args.fake_world is None:
        args.preset = args.preset or "1b"
        if args.preset not in PRESETS:
            p.error(f"--preset {args.preset!r}: choose from {sorted(PRESETS)} "
                    f"({sorted(FAKE_PRESETS)} are --fake-world presets)")
        return
    if args.fake_world < 1 or not 0 <= args.rank < args.fake_world:
        p.error(f"--fake-world {args.fake_world} --rank {args.rank}: need N >= 1 and 0 <= rank < N")
    for flag, given in (("--runners", args.runners), ("--offload", args.offload),
                        ("--ac full", args.ac != "none"), ("--profile", args.profile),
                        ("--compile", args.compile != "none"),
                        ("--timing sequential", args.timing != "alternate"),
                        ("--no-reshard", args.no_reshard)):
        if given:
            p.error(f"{flag} is for the real-world mode; --fake-world compares flexshard's "
                    "default buckets with FSDP2, reshard after forward (drop the flag)")
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    args.preset = args.preset or ("8b" if cuda else "cpu")
    if args.preset not in FAKE_PRESETS:
        p.error(f"--preset {args.preset!r} with --fake-world: choose from {sorted(FAKE_PRESETS)}")
    args.modes = args.modes or ([m for m in MODES] if cuda else ["eager"])
    if "cudagraph" in args.modes and not cuda:
        p.error("--modes cudagraph runs CUDA graphs: it needs --device cuda")


def _init(device_arg: str) -> tuple:
    """(device, whether we created the process group): torchrun's group, else one rank."""
    use_cuda = device_arg == "cuda" or (device_arg == "auto" and torch.cuda.is_available())
    backend = "nccl" if use_cuda else "gloo"
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return device, False
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, device_id=device if use_cuda else None)
    else:
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        dist.init_process_group(backend, store=store, rank=0, world_size=1,
                                device_id=device if use_cuda else None)
    return device, True


def fake_world_main(args) -> int:
    """--fake-world N: both sides in each mode; markdown to stdout, JSON under --out."""
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    result = fake_world_run.run(args, device)
    print(fake_world_report.text(result), flush=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = Path(args.json) if args.json else Path(args.out) / f"{device.type}-{stamp}.json"
    print(f"wrote {fake_world_run.write(result, path)}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(all_gather_into|reduce_scatter)_tensor`")
    if args.fake_world is not None:
        return fake_world_main(args)
    device, owns = _init(args.device)
    try:
        result = run(args, device)
        if _rank() == 0:
            print(text(result), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(result, indent=1))
    finally:
        if owns:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
