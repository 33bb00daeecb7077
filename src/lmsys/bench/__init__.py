"""Benchmark workloads and sweeps: the training step (shared with the profilers) and `bench e2e`."""
