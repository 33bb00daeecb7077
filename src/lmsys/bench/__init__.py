"""Benchmark sweeps: `bench e2e`, `bench attention`, the `comm` collectives and the precision experiments."""
