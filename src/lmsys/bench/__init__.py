"""Benchmark workloads and sweeps: the training step (shared with the profilers) and `bench e2e`."""

MODES = ("fwd", "fwd-bwd", "train")  # what one step runs; here, torch-free, for the CLI-time importers
