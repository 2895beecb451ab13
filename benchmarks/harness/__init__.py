"""The benchmarks' shared machinery; the studies beside it in benchmarks/ import it.

Models and how they train: model.py (the benchmark's GPTs and Llama), runners.py
(plain, FSDP2, flexshard), fsdp_muon.py (Muon for FSDP2's sharded matrices).
Meters: meters.py (traffic, copies, live storages), op_counter.py (ops and copied
bytes, per library region), allocator.py (the CPU allocator's peak), trace.py (a
profiled step's Chrome trace and its summary).
The comparison behind `python -m benchmarks.compare`: configs.py (configurations,
grids), comparison.py (one configuration's run), timing.py (paired steps, slowest
rank), measure.py (the instrumented step), worlds.py (spawned or torchrun process
groups), report.py (results.json, markdown, chart).
The fake world behind `python -m benchmarks.gpu --fake-world N`: fake_world.py (one
rank of N in one process, both sides, `count_step`), fake_world_run.py (every mode
timed and measured), device_time.py (GPU time per copy and label),
fake_world_report.py (its tables).
"""
