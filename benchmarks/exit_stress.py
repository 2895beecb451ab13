"""Clean exits under torchrun: N runs of each script, flexshard and FSDP2 interleaved.

A finished run must exit 0; a run that prints "terminate called" (SIGABRT at
interpreter exit) or exits non-zero counts as an abort. The "+300" cases end the
quickstart with 300 all-reduces, which makes an abort at exit likely when the
process group is left to interpreter finalization (flexshard/runtime/teardown.py). `--load K` starts K
busy-looping processes for the duration, to reproduce a loaded machine.

    PYTHONPATH=$PWD python -m benchmarks.exit_stress --runs 12 --load 2

Prints one line per case: aborts / runs. Logs of failing runs go under
runs/exit_stress/ (ignored by git).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "exit_scripts")
CASES = {  # name -> argv after torchrun's own (a "{dir}" is replaced by a fresh directory)
    "quickstart flexshard": ["quickstart.py", "flexshard"],
    "quickstart fsdp2": ["quickstart.py", "fsdp2"],
    "quickstart+300 flexshard": ["quickstart.py", "flexshard", "300"],
    "quickstart+300 fsdp2": ["quickstart.py", "fsdp2", "300"],
    "dcp save/load flexshard": ["dcp_roundtrip.py", "flexshard", "{dir}"],
    "dcp save/load fsdp2": ["dcp_roundtrip.py", "fsdp2", "{dir}"],
}


def _spin(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10000))


def run_once(argv: list, nproc: int, timeout: float) -> tuple:
    """(ok, output) of one torchrun of `argv` (a timeout is not ok, and says so)."""
    directory = tempfile.mkdtemp(prefix="exit-stress-")
    argv = [a.replace("{dir}", directory) for a in argv]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", os.path.join(SCRIPTS, argv[0]), *argv[1:]]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        out, rc = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = f"timeout after {timeout}s\n{e.stdout or ''}{e.stderr or ''}", -1
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return rc == 0 and "terminate called" not in out, out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=12)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--load", type=int, default=0, help="busy processes beside the runs")
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--log-dir", default=os.path.join("runs", "exit_stress"))
    args = parser.parse_args(argv)
    stop = mp.Event()
    spinners = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(args.load)]
    for p in spinners:
        p.start()
    aborts = {case: 0 for case in args.cases}
    timeouts = {case: 0 for case in args.cases}
    os.makedirs(args.log_dir, exist_ok=True)
    start = time.time()
    try:
        for i in range(args.runs):
            for case in args.cases:  # interleaved: both libraries see the same load
                ok, out = run_once(CASES[case], args.nproc, args.timeout)
                if not ok:
                    bucket = timeouts if out.startswith("timeout after") else aborts
                    bucket[case] += 1
                    name = case.replace(" ", "_").replace("/", "-")
                    with open(os.path.join(args.log_dir, f"{name}-{i}.log"), "w") as f:
                        f.write(out)
            print(f"round {i + 1}/{args.runs}: " + ", ".join(
                f"{c} {aborts[c]}" for c in args.cases), flush=True)
    finally:
        stop.set()
        for p in spinners:
            p.join()
    print(f"{args.runs} runs per case, {args.nproc} ranks, {args.load} busy processes, "
          f"{time.time() - start:.0f} s")
    for case in args.cases:
        print(f"{case:<28} aborts {aborts[case]}/{args.runs}, timeouts {timeouts[case]}")
    return aborts


if __name__ == "__main__":
    main()
