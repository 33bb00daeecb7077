"""`lmsys ddp`: data-parallel training with hand-written DDP variants, ZeRO-1 and FSDP."""

from __future__ import annotations

from typing import Annotated, List, Optional

import typer

from lmsys.commands._common import DtypeOpt, FormatOpt, OutputOpt, check_counts, check_render_options, emit, run_on_ranks

app = typer.Typer(help="Data parallelism: naive/flat/overlap/bucketed DDP, ZeRO-1, FSDP vs torch DDP.", no_args_is_help=True)


@app.command("train")
def train(
    strategy: Annotated[Optional[List[str]], typer.Option(help="naive | flat | overlap | bucketed | torch-ddp | fsdp; repeat or comma-separate to compare in one run. Default: all.")] = None,
    bucket_mb: Annotated[str, typer.Option(help="Bucket caps for bucketed, in MiB (as torch DDP's bucket_cap_mb), comma-separated: one row each.")] = "25",
    comm_dtype: Annotated[str, typer.Option(help="dtype bucketed DDP communicates gradients in: fp32 | bf16, comma-separated: one row each.")] = "fp32",
    shard_optimizer: Annotated[bool, typer.Option("--shard-optimizer", help="Wrap AdamW in ShardedOptimizer (ZeRO-1) for the DDP strategies.")] = False,
    size: Annotated[Optional[str], typer.Option(help="Model preset (tiny ... 10b) or a .yaml config. Default: tiny with gloo, small with nccl.")] = None,
    batch_size: Annotated[int, typer.Option(help="Sequences per rank per step.")] = 4,
    context_length: Annotated[Optional[int], typer.Option(help="Sequence length. Default: 512 with nccl, 128 with gloo.")] = None,
    dtype: DtypeOpt = "fp32",
    steps: Annotated[int, typer.Option(help="Timed steps per strategy.")] = 10,
    warmup: Annotated[int, typer.Option(help="Untimed steps before them (they train too: parity covers all).")] = 3,
    world_size: Annotated[Optional[int], typer.Option(help="Processes (default 2; under torchrun: its WORLD_SIZE).")] = None,
    backend: Annotated[Optional[str], typer.Option(help="gloo | nccl (default: nccl when a GPU is visible, else gloo).")] = None,
    format: FormatOpt = "table",
    output: OutputOpt = None,
):
    """Train the LM data-parallel with each strategy: ms/step, comm wait, memory, tokens/s, parity."""
    from dataclasses import asdict

    from lmsys.core.devices import check_dtype_for_device, resolve_device
    from lmsys.core.errors import LmsysError
    from lmsys.core.parsing import choose, parse_list
    from lmsys.core.results import Report
    from lmsys.distributed import launch
    from lmsys.distributed.train import COMM_DTYPES, LEARNING_RATE, STRATEGIES, expand_runs
    from lmsys.model.config import get_config

    check_render_options(format, output)
    check_counts(warmup=(warmup, 0), steps=(steps, 1), batch_size=(batch_size, 1))
    strategies = list(dict.fromkeys(parse_list(strategy, str, what="--strategy"))) if strategy else list(STRATEGIES)
    for s in strategies:
        choose(s, STRATEGIES, what="--strategy")
    bucket_mbs = parse_list(bucket_mb, float, what="--bucket-mb")
    if any(not mb > 0 or mb == float("inf") for mb in bucket_mbs):
        raise LmsysError("--bucket-mb: every cap must be a positive number of MiB")
    comm_dtypes = list(dict.fromkeys(parse_list(comm_dtype, str, what="--comm-dtype")))
    for cd in comm_dtypes:
        choose(cd, COMM_DTYPES, what="--comm-dtype")

    backend = launch.resolve_backend(backend)
    world_sizes = launch.resolve_world_sizes([world_size] if world_size is not None else None)
    launch.check_launch(backend, world_sizes)
    check_dtype_for_device(dtype, resolve_device("cuda" if backend == "nccl" else "cpu"))
    if dtype == "fp16" and "fsdp" in strategies:
        raise LmsysError("fsdp with fp16 needs a sharded gradient scaler, which lmsys does not have; use bf16")
    size = size or ("small" if backend == "nccl" else "tiny")
    if context_length is None:  # an explicit 0 must reach the check below, not become the default
        context_length = 512 if backend == "nccl" else 128
    if context_length < 1:
        raise LmsysError(f"--context-length must be positive, got {context_length}")
    get_config(size).with_overrides(context_length=context_length)  # a bad size fails here, not on every rank

    runs = expand_runs(strategies, bucket_mbs=bucket_mbs, comm_dtypes=comm_dtypes)
    kwargs = dict(runs=[asdict(r) for r in runs], size=size, context_length=context_length, batch_size=batch_size,
                  dtype=dtype, steps=steps, warmup=warmup, shard_optimizer=shard_optimizer)
    result = run_on_ranks("lmsys.distributed.train:train_job", kwargs, world_size=world_sizes[0], backend=backend)
    if result is None:  # a torchrun worker other than rank 0: rank 0 prints
        return
    meta = result["meta"]
    numerics = "fp32" if dtype == "fp32" else f"{dtype} autocast, fp32 master weights"
    meta["run"] = (f"{backend}, world size {world_sizes[0]}, batch {batch_size} per rank, {numerics}, "
                   f"AdamW lr {LEARNING_RATE:g}, warmup {warmup} + {steps} timed steps")
    notes = [
        "ms/step and phases: medians over the timed steps (rank 0). comm wait: time in "
        "finish_gradient_synchronization() after backward (torch-ddp and fsdp communicate inside backward).",
        "peak MiB/rank: max over ranks of torch's peak allocation (GPU only). tokens/s: all ranks' tokens.",
        "scaling eff %: 1-process step time at the same per-rank batch / step time (weak scaling, 100 = perfect).",
        "parity max|Δθ|: largest parameter difference after all warmup + timed steps against one process "
        "trained on the full batch with the same seed and data.",
    ]
    if "torch-ddp" in strategies:
        notes.append("torch-ddp: torch.nn.parallel.DistributedDataParallel with its defaults (25 MiB buckets).")
    emit(Report("ddp train", result["rows"], meta, notes), format, output)
