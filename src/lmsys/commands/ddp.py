"""`lmsys ddp`: data-parallel training with hand-written DDP variants, ZeRO-1 and FSDP."""

from __future__ import annotations

from typing import Annotated, List, Optional

import typer

from lmsys.commands._common import check_render_options, emit, run_on_ranks
from lmsys.commands.options import DtypeOpt, FormatOpt, ModelKwargsOpt, OutputOpt, PeakTflopsOpt, QuietOpt, opt

app = typer.Typer(help="Data parallelism: naive/flat/overlap/bucketed DDP, ZeRO-1, FSDP vs torch DDP and FSDP2.", no_args_is_help=True)


@app.command("train")
def train(
    strategy: Annotated[Optional[List[str]], typer.Option(help="naive | flat | overlap | bucketed | torch-ddp | fsdp | torch-fsdp | yours | yours-bucketed | yours-fsdp | yours-zero1 (the last four: your code through --adapters; yours-zero1 = lmsys's bucketed DDP with your sharded optimizer) | pkg.module:Class (your DDP-style wrapper); repeat or comma-separate to compare in one run; `list` lists them. Default: lmsys's and torch's (and, with --adapters, yours).")] = None,
    adapters: Annotated[Optional[str], opt("adapters", "Your CS336 adapters module (a .py file or an importable module name): rows yours, yours-bucketed, yours-fsdp, yours-zero1 from what it implements.")] = None,
    model: Annotated[Optional[str], opt("model", "lmsys | hf:llama | hf:gpt2 | hf:qwen2 | hf:mistral | pkg.module:Name (your model class or factory, built with --size's sizes); `list` lists them. Default: lmsys.")] = None,
    model_kwargs: ModelKwargsOpt = None,
    bucket_mb: Annotated[str, typer.Option(help="Bucket caps for bucketed, in MiB (as torch DDP's bucket_cap_mb), comma-separated: one row each.")] = "25",
    comm_dtype: Annotated[str, typer.Option(help="dtype bucketed DDP communicates gradients in: fp32 | bf16, comma-separated: one row each.")] = "fp32",
    lever: Annotated[str, typer.Option(help="DDP levers, each one more bucketed row on top of the first --bucket-mb and --comm-dtype: learned-order (buckets in the first backward's gradient order) | grad-views (gradients start each step as zeroed views of the buckets) | bucket-optimizer (an AdamW per bucket, stepped as soon as its all-reduce is done) | copy-engine (buckets all-reduced by the GPUs' copy engines over NVLink, no SMs taken from backward; GPUs of one host); comma-separated.")] = "",
    sm_carveout: Annotated[str, opt("sm_carveout", "SM carveouts, each one more bucketed row on top of the first --bucket-mb and --comm-dtype: from the first bucket's all-reduce to the end of backward, cuBLAS matmuls leave this many SMs to NCCL (0 = only route matmuls through cuBLASLt); comma-separated. GPU only (no effect on a CPU).")] = "",
    nccl_ctas: Annotated[Optional[int], typer.Option(help="NCCL_MIN_CTAS = NCCL_MAX_CTAS for this run (fewer CTAs: less of the GPU taken from backward). Under torchrun set the variables yourself.")] = None,
    single_process: Annotated[bool, typer.Option("--single-process/--no-single-process", metavar="", help="Run the one-process rows (1-GPU step time, parity reference) when they fit in memory.")] = True,
    baseline: Annotated[Optional[bool], opt("baseline_toggle", "The former name of --single-process.", hidden=True, metavar=None)] = None,
    shard_optimizer: Annotated[bool, typer.Option("--shard-optimizer", metavar="", help="Wrap AdamW in ShardedOptimizer (ZeRO-1) for the DDP strategies.")] = False,
    size: Annotated[Optional[str], opt("size", "One model preset (tiny ... 10b) or a .yaml config, not a comma list (one model per run). Default: tiny with gloo, small with nccl.")] = None,
    batch_size: Annotated[int, opt("batch_size", "Sequences per rank per step (one value: the rows compare strategies on one workload).")] = 4,
    context_length: Annotated[Optional[int], opt("context_length", "Sequence length (one value). Default: 512 with nccl, 128 with gloo.")] = None,
    dtype: DtypeOpt = "fp32",
    peak_tflops: PeakTflopsOpt = None,
    steps: Annotated[int, opt("steps", "Timed steps per strategy.")] = 10,
    warmup: Annotated[int, opt("warmup", "Untimed steps before them (they train too: parity covers all).")] = 3,
    world_size: Annotated[Optional[str], opt("world_size", "Process counts, comma-separated (e.g. 2,4): one torchrun job and one report each. Default 2 (under torchrun: its WORLD_SIZE).")] = None,
    backend: Annotated[Optional[str], opt("backend", "gloo | nccl (default: nccl when a GPU is visible, else gloo).")] = None,
    device: Annotated[str, opt("device", "auto | cuda | cpu: cuda runs nccl, cpu runs gloo (auto: as --backend, else nccl when a GPU is visible).")] = "auto",
    quiet: QuietOpt = False,
    format: FormatOpt = None,
    output: OutputOpt = None,
):
    """Train the LM data-parallel with each strategy: ms/step, comm wait, memory, tokens/s, parity."""
    from lmsys.bench import ddp_runs
    from lmsys.commands.listing import list_if_asked

    list_if_asked(strategy=strategy, model=model)
    check_render_options(format, output, device=device, dtype=dtype, quiet=quiet)  # before torch is imported
    plan = ddp_runs.resolve(
        strategy=strategy, adapters=adapters, model=model, model_kwargs=model_kwargs, bucket_mb=bucket_mb,
        comm_dtype=comm_dtype, lever=lever, sm_carveout=sm_carveout, nccl_ctas=nccl_ctas,
        baseline=single_process if baseline is None else baseline, shard_optimizer=shard_optimizer, size=size,
        batch_size=batch_size, context_length=context_length, dtype=dtype, peak_tflops=peak_tflops, steps=steps,
        warmup=warmup, world_size=world_size, backend=backend, device=device)
    if plan.warning:
        typer.echo(plan.warning, err=True)
    reports = []
    for n in plan.world_sizes:  # one torchrun job and one report per world size
        result = run_on_ranks("lmsys.bench.ddp:train_job", plan.kwargs, world_size=n, backend=plan.backend,
                              description="ddp train")
        if result is None:  # a torchrun worker other than rank 0: rank 0 prints
            return
        reports.append(ddp_runs.train_report(plan, n, result))
    emit(reports, format, output)
    if failed := ddp_runs.parity_failures(reports):
        typer.echo(f"parity FAIL: {', '.join(failed)}", err=True)
        raise typer.Exit(1)
