"""Benchmarks of flexshard against FSDP2: the shared machinery in benchmarks/harness/,
each study a module beside it (start with `python -m benchmarks.compare --help`)."""
