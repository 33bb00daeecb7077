"""Benchmark sweeps: `bench e2e`, `bench attention` and the precision experiments."""
