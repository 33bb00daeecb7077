"""Benchmark sweeps: `bench e2e`, `bench attention`, the `comm` collectives and the precision experiments;
the runners of the multi-process training commands: `ddp.py` (`ddp train`; `ddp_runs.py`, torch-free: the
rows it runs, decided before any process starts) and `parallel.py` (`parallel train`)."""
