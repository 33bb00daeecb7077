"""`lmsys plan`: predict per-GPU memory and step time of a training run for any mesh and cluster."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, List, Optional

import typer

from lmsys.commands._common import check_render_options, emit
from lmsys.commands.options import FormatOpt, OutputOpt, QuietOpt, opt

app = typer.Typer(help="Plan a training run: memory and step time per mesh, calibration, validation.",
                  no_args_is_help=True)


@app.command("train")
def train(
    size: Annotated[str, opt("size", "One model: a preset (tiny, small, medium, large, xl, 2.7b, 10b; gpt-22b, gpt-175b, gpt-530b, gpt-1t), an lmsys .yaml, or a Llama-style .yaml/.json (vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads, max_position_embeddings).")] = "small",
    gpus: Annotated[Optional[int], typer.Option("--gpus", help="GPUs in the run (default 1, or the cluster file's).")] = None,
    gpus_per_node: Annotated[Optional[int], typer.Option("--gpus-per-node", help="GPUs per node (default 8, or the cluster file's).")] = None,
    gpu: Annotated[Optional[str], typer.Option("--gpu", help="Required, unless --cluster or --profile names the GPU. The GPU: a table name (A100 40GB SXM, A100 80GB SXM, H100 SXM, H100 PCIe, H200 SXM, B200, ...) or torch's device name.")] = None,
    cluster: Annotated[Optional[Path], typer.Option("--cluster", help="A YAML file: gpu (a name, or a mapping of its figures), gpus, gpus_per_node, and any figure to override (network_GBps, hbm_GB, ...).")] = None,
    global_batch_tokens: Annotated[Optional[int], typer.Option("--global-batch-tokens", help="Tokens per optimizer step (a whole number of sequences).")] = None,
    global_batch: Annotated[Optional[int], typer.Option("--global-batch", help="Sequences per optimizer step (default: one per GPU).")] = None,
    context_length: Annotated[Optional[int], opt("context_length", "Sequence length, one value (default: the model's).")] = None,
    dtype: Annotated[str, opt("dtype", "fp32 | bf16 | fp16 (one per plan).")] = "bf16",
    master_weights: Annotated[bool, opt("master_weights_toggle", "bf16/fp16: 16-bit weights with fp32 master copy and gradients (18 B/parameter, Megatron-LM); off: fp32 weights under autocast (lmsys bench e2e's default).")] = True,
    mesh: Annotated[Optional[str], opt("mesh", "Evaluate one mesh: dp=..,tp=..,pp=.. (and optionally zero=0..3, sp=on|off, schedule=1f1b|interleaved, chunks=, mb=, checkpoint=none|selective|full|op, fsdp=flat-param|fsdp2: ZeRO-3 as a flat buffer or as torch's fully_shard).")] = None,
    top: Annotated[int, opt("top", "Show the K fastest layouts that fit.")] = 10,
    plot: Annotated[Optional[Path], opt("plot", "Also draw the shown layouts' memory and time breakdowns into this PNG (matplotlib).")] = None,
    profile: Annotated[Optional[Path], opt("profile", "A calibration profile from `lmsys plan calibrate`: its measured rates replace the table's peaks × efficiencies; for a device the GPU table lacks (a CPU), its memory and measured matmul rate (the MFU peak) stand in for --gpu.")] = None,
    peak_tflops: Annotated[Optional[float], opt("peak_tflops", "The dense peak MFU divides by (default: the GPU table's for --dtype).")] = None,
    stack: Annotated[str, typer.Option("--stack", help="The software stack modelled: production (naive attention run as a flash kernel, fused elementwise kernels) | eager (lmsys's own block: the model's attention, one kernel an op).")] = "production",
    format: FormatOpt = None,
    output: OutputOpt = None,
):
    """Rank the meshes that fit by predicted tokens/s: memory per GPU and step time, split by cause.

    Required: the GPU, by --gpu, --cluster or --profile (one of them); every other option has a default."""
    from lmsys.plan.train import train_report

    check_render_options(format, output)
    emit(train_report(size=size, gpus=gpus, gpus_per_node=gpus_per_node, gpu=gpu, cluster=cluster, profile=profile,
                      dtype=dtype, master_weights=master_weights, global_batch_tokens=global_batch_tokens,
                      global_batch=global_batch, context_length=context_length, mesh=mesh, top=top, plot=plot,
                      peak_tflops=peak_tflops, stack=stack), format, output)


@app.command("calibrate")
def calibrate(
    size: Annotated[str, opt("size", "The models whose matmul and attention shapes are timed: presets or .yaml files (as plan train), comma list; the first one's width sizes the host twin.")] = "tiny",
    dtype: Annotated[Optional[str], opt("dtype", "Comma list of fp32, bf16, fp16 (default: fp32 on a CPU, fp32,bf16 on a GPU).")] = None,
    batch_size: Annotated[int, opt("batch_size", "Sequences per timed matmul and attention call (one value).")] = 1,
    warmup: Annotated[int, opt("warmup", "Untimed calls first.")] = 2,
    steps: Annotated[int, opt("steps", "Timed calls (the median is kept).")] = 5,
    profile: Annotated[Path, opt("profile", "Write the profile here (.yaml or .json).")] = Path("lmsys-profile.yaml"),
    device: Annotated[str, opt("device", "auto | cuda | cpu.")] = "auto",
    sustain: Annotated[float, typer.Option("--sustain", help="Also the rate the GEMMs keep back to back: this many seconds of the largest first (the clock settles at the power limit), then about a second of each; 0: not measured.")] = 0.0,
    quiet: QuietOpt = False,
    format: FormatOpt = None,
    output: OutputOpt = None,
):
    """Measure this machine's matmul, attention, memory and all-reduce rates into a profile for plan train --profile."""
    from lmsys.plan import calibrate as cal

    check_render_options(format, output, device=device, quiet=quiet)
    resolved = cal.resolve(size=size, dtype=dtype, batch_size=batch_size, warmup=warmup, steps=steps, profile=profile,
                           device=device, sustain=sustain)
    emit(cal.calibrate_report(**resolved), format, output)


@app.command("breakdown")
def breakdown(
    size: Annotated[Optional[str], opt("size", "Presets or .yaml files, comma list (default: xl,2.7b on a GPU; tiny on a CPU).")] = None,
    dtype: Annotated[Optional[str], opt("dtype", "Comma list of fp32, bf16, fp16 (default: bf16,fp32 on a GPU; fp32 on a CPU).")] = None,
    batch_size: Annotated[int, opt("batch_size", "Sequences per step (one value).")] = 4,
    context_length: Annotated[Optional[int], opt("context_length", "Sequence length, one value (default: each preset's own).")] = None,
    profile: Annotated[Optional[Path], opt("profile", "A profile from `lmsys plan calibrate` on this machine (default: calibrate --size's models here first, without the all-reduce).")] = None,
    warmup: Annotated[int, opt("warmup", "Untimed steps first.")] = 3,
    steps: Annotated[int, opt("steps", "Timed steps (the median is kept).")] = 8,
    top: Annotated[int, opt("top", "The K largest kernels (CPU: ops) of each step, by name.")] = 10,
    device: Annotated[str, opt("device", "auto | cuda | cpu.")] = "auto",
    quiet: QuietOpt = False,
    format: FormatOpt = None,
    output: OutputOpt = None,
):
    """Where a bench e2e step's time goes, by kernel kind, beside what the time model predicts for each part."""
    from lmsys.plan import breakdown as bd

    check_render_options(format, output, device=device, quiet=quiet)
    resolved = bd.resolve(size=size, dtype=dtype, batch_size=batch_size, context_length=context_length,
                          profile=profile, warmup=warmup, steps=steps, top=top, device=device)
    emit(bd.breakdown_reports(**resolved), format, output)


@app.command("validate")
def validate(
    profile: Annotated[Optional[Path], opt("profile", "The profile from `lmsys plan calibrate` on this machine (needed unless --published).")] = None,
    published: Annotated[bool, typer.Option("--published", help="Predict published training runs instead of running anything here: the set shipped with lmsys, or the FILE given after it (same form); predicted beside published tokens/s per GPU, the error per row, mean and max.")] = False,
    published_file: Annotated[Optional[Path], typer.Argument(metavar="[FILE]", show_default=False, help="With --published: a runs file of the shipped set's form (default: the shipped set).")] = None,
    size: Annotated[Optional[str], opt("size", "bench e2e rows: presets, comma list (default: small,medium,large,xl,2.7b on a GPU; tiny on a CPU).")] = None,
    dtype: Annotated[Optional[str], opt("dtype", "Comma list, for every row (default: fp32,bf16 on a GPU; fp32 on a CPU).")] = None,
    checkpoint: Annotated[str, opt("checkpoint", "Comma list of none, block (bench e2e's and parallel train's policies; block = full recomputation).")] = "none,block",
    batch_size: Annotated[int, opt("batch_size", "Sequences per step (bench e2e rows); per micro-batch per data-parallel rank (parallel train rows); one value.")] = 1,
    warmup: Annotated[int, opt("warmup", "Untimed steps first.")] = 1,
    steps: Annotated[int, opt("steps", "Timed steps.")] = 3,
    mesh: Annotated[Optional[List[str]], opt("mesh", "parallel train rows: mesh degrees, e.g. dp=2,tp=2,pp=1 (missing dims are 1; each mesh runs on as many processes as its degrees multiply to). Repeat for more; `none` leaves the distributed rows out. Default: per world size n, dp=n, tp=n and pp=n (and dp=2,tp=n/2 from 4); one GPU: dp=1,tp=1,pp=1.")] = None,
    world_size: Annotated[Optional[str], opt("world_size", "World sizes of the default meshes, comma list (default: 2 processes with gloo; with nccl 2, 4, 8 ... up to the GPUs visible, 1 on one GPU). With --mesh, each mesh's size must be one of them.")] = None,
    parallel_size: Annotated[Optional[str], typer.Option("--parallel-size", help="parallel train rows: one model preset or .yaml (default: tiny with gloo, small with nccl, as parallel train).")] = None,
    microbatches: Annotated[int, opt("microbatches", "parallel train rows: micro-batches per step (of --batch-size sequences each).")] = 4,
    context_length: Annotated[Optional[int], opt("context_length", "Sequence length of every row, one value (default: each preset's own for bench e2e; 128 with gloo, 512 with nccl for parallel train, as parallel train).")] = None,
    dp_strategy: Annotated[str, opt("dp_strategy", "parallel train rows: bucketed | fsdp (lmsys's DDP or FSDP over the dp dim).")] = "bucketed",
    pp_schedule: Annotated[str, opt("pp_schedule", "parallel train rows: gpipe | 1f1b | interleaved-1f1b.")] = "1f1b",
    virtual_stages: Annotated[int, opt("virtual_stages", "parallel train rows: chunks per pipeline rank (interleaved-1f1b).")] = 1,
    sequence_parallel: Annotated[bool, opt("sequence_parallel", "parallel train rows: sequence parallelism on the tp dim.")] = False,
    backend: Annotated[Optional[str], opt("backend", "parallel train rows: gloo | nccl (default: as --device; nccl when a GPU is visible, else gloo).")] = None,
    host_rate: Annotated[str, typer.Option("--host-rate", help="The host's cost per dispatched op the predictions use: beside (measured before and after each size's rows, plan calibrate's twin: a host's speed drifts) | profile (the profile's).")] = "beside",
    repeats: Annotated[int, typer.Option("--repeats", help="Runs of each row, alternating with the host twins: the median run (odd N; even N: the mean of the middle two) against the prediction from the twins' median, with the runs' spread (a host-bound step moves by ±15 % from run to run on a shared host).")] = 1,
    device: Annotated[str, opt("device", "auto | cuda | cpu.")] = "auto",
    quiet: QuietOpt = False,
    format: FormatOpt = None,
    output: OutputOpt = None,
):
    """Run bench e2e and parallel train here and print predicted beside measured step time and peak memory, with the errors; with --published, predict published training runs beside their published tokens/s per GPU."""
    from lmsys.plan import validate as val

    check_render_options(format, output, device=device, quiet=quiet)
    run = val.resolve(profile=profile, published=published, published_file=published_file, size=size, dtype=dtype,
                      checkpoint=checkpoint, batch_size=batch_size, warmup=warmup, steps=steps, mesh=mesh,
                      world_size=world_size, parallel_size=parallel_size, microbatches=microbatches,
                      context_length=context_length, dp_strategy=dp_strategy, pp_schedule=pp_schedule,
                      virtual_stages=virtual_stages, sequence_parallel=sequence_parallel, backend=backend,
                      host_rate=host_rate, repeats=repeats, device=device)
    emit(val.validate_reports(run), format, output)
