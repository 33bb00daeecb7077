"""The `comm` commands' options checked before any rank starts (`resolve`) and the ranks' results made into
one report (`comm_report`). Torch-free at import: lmsys.bench.comm, the job the ranks run, imports torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lmsys.core.errors import LmsysError


@dataclass
class CommRun:
    """What a `comm` command launches: the job's kwargs, one launch per world size."""

    collective: str
    job: dict
    backend: str
    world_sizes: list[int]
    dtypes: list[str]
    warmup: int
    iters: int
    baseline: bool
    warning: Optional[str] = None  # ranks that outnumber the cores: said on stderr before the run


def resolve(collective: str, *, backend: Optional[str], world_size: Optional[str], sizes: str, dtype: str,
            warmup: int, iters: int, baseline: bool, device: str) -> CommRun:
    """Every option checked, the torch-free ones first (a typo answers before torch loads): counts, dtypes,
    message sizes, world sizes; then the backend, the ranks and the memory the biggest size needs."""
    from lmsys.core.parsing import check_counts, check_dtypes, check_message_sizes, parse_bytes, parse_int_list, parse_list

    check_counts(warmup=(warmup, 0), steps=(iters, 1))
    dtypes = check_dtypes(dtype)
    labels = parse_list(sizes, str, what="--sizes")
    nbytes = [parse_bytes(label, what="--sizes") for label in labels]
    for one in dtypes:
        check_message_sizes(labels, nbytes, one)
    requested = parse_int_list(world_size, what="--world-size") if world_size is not None else None
    if collective == "send-recv" and (odd := [n for n in requested or (2,) if n % 2]):
        raise LmsysError(f"--world-size: send-recv pairs ranks 0-1, 2-3, ..., so every world size must be even, "
                         f"got {odd[0]}")

    from lmsys.distributed import launch

    chosen_by = launch.backend_option(device, backend)
    backend = launch.resolve_backend(launch.backend_for_device(device, backend))
    world_sizes = launch.resolve_world_sizes(requested)
    launch.check_launch(backend, world_sizes, chosen_by=chosen_by)
    if 1 in world_sizes:
        raise LmsysError("--world-size 1: a collective over one rank moves no data (busbw 0), so there is no "
                         "bandwidth to measure", hint="give 2 or more ranks")
    biggest = max(range(len(nbytes)), key=nbytes.__getitem__)  # buffers + the result check's copy: 2x
    launch.check_rank_memory(2 * nbytes[biggest], world_sizes, backend, what=f"--sizes {labels[biggest]}")
    job = dict(collective=collective, sizes=nbytes, labels=labels, dtype=dtypes, warmup=warmup, iters=iters,
               baseline=baseline)
    return CommRun(collective=collective, job=job, backend=backend, world_sizes=world_sizes, dtypes=dtypes,
                   warmup=warmup, iters=iters, baseline=baseline,
                   warning=launch.warn_oversubscription(world_sizes, backend))


def comm_report(run: CommRun, results: list[dict]):
    """One Report of every world size's rows (rank 0's results, in launch order)."""
    from lmsys.bench.comm import collective_notes
    from lmsys.core.results import Report

    rows = [row for result in results for row in result["rows"]]
    meta = next((result["meta"] for result in results if result["meta"]), {})
    meta["run"] = (f"{run.backend}, {','.join(run.dtypes)}, warmup {run.warmup}, steps {run.iters}; per round: "
                   f"barrier, a one-element all-reduce, {run.collective}, max over ranks")
    title = "comm allreduce" if run.collective == "all-reduce" else f"comm {run.collective}"  # the command's name
    return Report(title, rows, meta, collective_notes(run.collective, baseline=run.baseline))
