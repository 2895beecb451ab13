"""Where a comparison runs: spawned process groups or torchrun's; the machine.

Where a comparison runs: a spawned process group per world size (or torchrun's),
one thread per rank, and the machine it ran on."""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import tempfile
import warnings

import torch
import torch.distributed as dist

from .comparison import cpu_cores, run_configs


def quiet() -> None:
    """Silence the warnings every configuration repeats (they say nothing about the numbers)."""
    for message in ("FSDP2-wrapped module", "Full backward hook is firing"):
        warnings.filterwarnings("ignore", message=message)


def backend(device: str) -> str:
    return "nccl" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "gloo"


def _worker(rank: int, ws: int, port: int, configs, steps, warmup, device, out_path) -> None:
    quiet()
    torch.set_num_threads(1)
    if backend(device) == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend(device), init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=ws,
                            timeout=datetime.timedelta(seconds=600))
    try:
        results = run_configs(configs, steps, warmup, device, verbose=True)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_world(ws: int, configs, steps: int, warmup: int, device: str) -> list:
    """Start `ws` processes in one new process group, run `configs`, return rank 0's results."""
    import torch.multiprocessing as mp

    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "results.json")
        mp.start_processes(_worker, args=(ws, _free_port(), configs, steps, warmup, device,
                                          out_path), nprocs=ws, start_method="spawn")
        with open(out_path) as f:
            return json.load(f)


def machine(device: str) -> dict:
    """What the numbers were measured on."""
    info = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "cpu_cores": cpu_cores(),
            "backend": backend(device), "threads_per_rank": 1,
            "load_average_start": list(os.getloadavg())}
    if backend(device) == "nccl":
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
