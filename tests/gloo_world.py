"""Run a worker on a gloo process group of `world` CPU processes and return what rank 0 wrote (JSON),
computed once per (worker, world) per test session. The worker is `worker(rank, world, store_path,
out_path)`: it initialises the group from the file store and rank 0 writes its results to out_path."""

from __future__ import annotations

import json
import os
import tempfile

import torch.multiprocessing as mp

_CACHE: dict[tuple, dict] = {}


def run_world(worker, world: int) -> dict:
    key = (worker.__module__, worker.__qualname__, world)
    if key not in _CACHE:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "results.json")
            mp.spawn(worker, args=(world, os.path.join(tmp, "store"), out), nprocs=world, join=True)
            with open(out) as f:
                _CACHE[key] = json.load(f)
    return _CACHE[key]


def finish(rank: int, results: dict, out_path: str) -> None:
    """A worker's end: rank 0 writes `results` (JSON) for run_world, then every rank leaves the group."""
    import torch.distributed as dist

    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
