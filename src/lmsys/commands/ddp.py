"""`lmsys ddp`: data-parallel training with hand-written DDP variants, ZeRO-1 and FSDP."""

from __future__ import annotations

from typing import Annotated, List, Optional

import typer

from lmsys.commands._common import (DtypeOpt, FormatOpt, OutputOpt, QuietOpt, check_counts, check_one_size,
                                    check_render_options,
                                    emit, run_on_ranks)

app = typer.Typer(help="Data parallelism: naive/flat/overlap/bucketed DDP, ZeRO-1, FSDP vs torch DDP and FSDP2.", no_args_is_help=True)


@app.command("train")
def train(
    strategy: Annotated[Optional[List[str]], typer.Option(help="naive | flat | overlap | bucketed | torch-ddp | fsdp | torch-fsdp | yours | yours-bucketed | yours-fsdp | yours-zero1 (the last four: your code through --adapters; yours-zero1 = lmsys's bucketed DDP with your sharded optimizer) | pkg.module:Class (your DDP-style wrapper); repeat or comma-separate to compare in one run; `list` lists them. Default: lmsys's and torch's (and, with --adapters, yours).")] = None,
    adapters: Annotated[Optional[str], typer.Option("--adapters", help="Your CS336 adapters module (a .py file or an importable module name): rows yours, yours-bucketed, yours-fsdp, yours-zero1 from what it implements.")] = None,
    model: Annotated[Optional[str], typer.Option("--model", help="lmsys | hf:llama | hf:gpt2 | hf:qwen2 | hf:mistral | pkg.module:Name (your model class or factory, built with --size's sizes); `list` lists them. Default: lmsys.")] = None,
    model_kwargs: Annotated[Optional[str], typer.Option("--model-kwargs", help="Extra keyword arguments for --model: YAML or JSON text, or a .yaml/.json file.")] = None,
    bucket_mb: Annotated[str, typer.Option(help="Bucket caps for bucketed, in MiB (as torch DDP's bucket_cap_mb), comma-separated: one row each.")] = "25",
    comm_dtype: Annotated[str, typer.Option(help="dtype bucketed DDP communicates gradients in: fp32 | bf16, comma-separated: one row each.")] = "fp32",
    lever: Annotated[str, typer.Option(help="DDP levers, each one more bucketed row on top of the first --bucket-mb and --comm-dtype: learned-order (buckets in the first backward's gradient order) | grad-views (gradients start each step as zeroed views of the buckets) | bucket-optimizer (an AdamW per bucket, stepped as soon as its all-reduce is done) | copy-engine (buckets all-reduced by the GPUs' copy engines over NVLink, no SMs taken from backward; GPUs of one host); comma-separated.")] = "",
    sm_carveout: Annotated[str, typer.Option(help="SM carveouts, each one more bucketed row on top of the first --bucket-mb and --comm-dtype: from the first bucket's all-reduce to the end of backward, cuBLAS matmuls leave this many SMs to NCCL (0 = only route matmuls through cuBLASLt); comma-separated. GPU only (no effect on a CPU).")] = "",
    nccl_ctas: Annotated[Optional[int], typer.Option(help="NCCL_MIN_CTAS = NCCL_MAX_CTAS for this run (fewer CTAs: less of the GPU taken from backward). Under torchrun set the variables yourself.")] = None,
    single_process: Annotated[bool, typer.Option("--single-process/--no-single-process", metavar="", help="Run the one-process rows (1-GPU step time, parity reference) when they fit in memory.")] = True,
    baseline: Annotated[Optional[bool], typer.Option("--baseline/--no-baseline", hidden=True, help="The former name of --single-process.")] = None,
    shard_optimizer: Annotated[bool, typer.Option("--shard-optimizer", metavar="", help="Wrap AdamW in ShardedOptimizer (ZeRO-1) for the DDP strategies.")] = False,
    size: Annotated[Optional[str], typer.Option(help="One model preset (tiny ... 10b) or a .yaml config, not a comma list (one model per run). Default: tiny with gloo, small with nccl.")] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", "--batch", help="Sequences per rank per step (one value: the rows compare strategies on one workload).")] = 4,
    context_length: Annotated[Optional[int], typer.Option("--context-length", "--seq-len", help="Sequence length (one value). Default: 512 with nccl, 128 with gloo.")] = None,
    dtype: DtypeOpt = "fp32",
    peak_tflops: Annotated[Optional[float], typer.Option("--peak-tflops", help="Dense peak TFLOP/s per GPU that MFU divides by, for a GPU lmsys.core.hardware's table does not know (default: the table's for --dtype; unknown GPU: no MFU).")] = None,
    steps: Annotated[int, typer.Option("--steps", "--iters", help="Timed steps per strategy.")] = 10,
    warmup: Annotated[int, typer.Option(help="Untimed steps before them (they train too: parity covers all).")] = 3,
    world_size: Annotated[Optional[str], typer.Option(help="Process counts, comma-separated (e.g. 2,4): one torchrun job and one report each. Default 2 (under torchrun: its WORLD_SIZE).")] = None,
    backend: Annotated[Optional[str], typer.Option(help="gloo | nccl (default: nccl when a GPU is visible, else gloo).")] = None,
    device: Annotated[str, typer.Option("--device", help="auto | cuda | cpu: cuda runs nccl, cpu runs gloo (auto: as --backend, else nccl when a GPU is visible).")] = "auto",
    quiet: QuietOpt = False,
    format: FormatOpt = None,
    output: OutputOpt = None,
):
    """Train the LM data-parallel with each strategy: ms/step, comm wait, memory, tokens/s, parity."""
    from dataclasses import asdict

    from lmsys.core.errors import LmsysError
    from lmsys.core.parsing import parse_int_list
    from lmsys.bench.ddp_runs import (SHARDABLE, check_levers_for_backend, parse_runs, run_line, set_nccl_ctas,
                                      shardable, train_notes)

    from lmsys.commands.listing import list_if_asked
    from lmsys.model.user import check_model, parse_model_kwargs

    list_if_asked(strategy=strategy, model=model)
    baseline = single_process if baseline is None else baseline
    check_render_options(format, output, device=device, dtype=dtype, quiet=quiet)  # before torch is imported
    from lmsys.core.hardware import check_peak

    check_peak(peak_tflops)
    check_counts(warmup=(warmup, 0), steps=(steps, 1), batch_size=(batch_size, 1))
    model = check_model(model) if model else None
    kwargs_json = parse_model_kwargs(model_kwargs)
    check_one_size(size, command="ddp train", why="one model per run")
    requested = parse_int_list(world_size, what="--world-size") if world_size is not None else None
    runs = parse_runs(strategy=strategy, bucket_mb=bucket_mb, comm_dtype=comm_dtype, lever=lever,
                      sm_carveout=sm_carveout, adapters=adapters)
    ctas = set_nccl_ctas(nccl_ctas)
    if shard_optimizer and not any(shardable(r.strategy) for r in runs):
        asked = ", ".join(dict.fromkeys(r.strategy for r in runs))
        raise LmsysError(f"--shard-optimizer applies to the DDP strategies ({', '.join(SHARDABLE)}, or your "
                         f"DDP-style pkg.module:Class), not to --strategy {asked}, which shards its own way "
                         "or brings its own optimizer")

    from lmsys.core.results import Report
    from lmsys.bench.ddp import resolve_model_size
    from lmsys.distributed import launch

    chosen_by = launch.backend_option(device, backend)
    backend = launch.resolve_backend(launch.backend_for_device(device, backend))
    world_sizes = launch.resolve_world_sizes(requested)
    launch.check_launch(backend, world_sizes, chosen_by=chosen_by)
    check_levers_for_backend(runs, backend)
    if warning := launch.warn_oversubscription(world_sizes, backend):
        typer.echo(warning, err=True)
    size, context_length = resolve_model_size(size, context_length, backend=backend, dtype=dtype, runs=runs,
                                              model=model, model_kwargs=kwargs_json)
    kwargs = dict(runs=[asdict(r) for r in runs], size=size, context_length=context_length, batch_size=batch_size,
                  dtype=dtype, steps=steps, warmup=warmup, shard_optimizer=shard_optimizer, baseline=baseline,
                  model=model, model_kwargs=kwargs_json, peak_tflops=peak_tflops)
    reports = []
    for n in world_sizes:  # one torchrun job and one report per world size
        result = run_on_ranks("lmsys.bench.ddp:train_job", kwargs, world_size=n, backend=backend,
                              description="ddp train")
        if result is None:  # a torchrun worker other than rank 0: rank 0 prints
            return
        meta = result["meta"]
        meta["run"] = run_line(backend=backend, world_size=n, batch_size=batch_size, dtype=dtype,
                               warmup=warmup, steps=steps, extra=ctas)
        notes = train_notes(runs, baseline=baseline) + result.get("notes", [])
        if not launch.under_torchrun() and (why := launch.oversubscribed(n, backend)):
            for row in result["rows"]:
                if "scaling eff %" in row:
                    row["scaling eff %"] = None
            notes.append(f"scaling eff % is left empty: {why}; a weak-scaling ratio would say more than "
                         "100 % or less for reasons that are not the strategy's.")
        title = "ddp train" if len(world_sizes) == 1 else f"ddp train: world size {n}"
        reports.append(Report(title, result["rows"], meta, notes))
    emit(reports, format, output)
    failed = [row["strategy"] for report in reports for row in report.rows if str(row.get("status", "")).startswith("FAIL")]
    if failed:
        typer.echo(f"parity FAIL: {', '.join(failed)}", err=True)
        raise typer.Exit(1)
