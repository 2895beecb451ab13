"""Benchmarks of flexshard against FSDP2 (run `python -m benchmarks.compare --help`)."""
