"""`lmsys plan`: predict per-GPU memory and step time of a training run for any mesh and cluster."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, List, Optional

import typer

from lmsys.commands._common import FormatOpt, OutputOpt, QuietOpt, check_counts, check_render_options, emit

app = typer.Typer(help="Plan a training run: memory and step time per mesh, calibration, validation.",
                  no_args_is_help=True)


@app.command("train")
def train(
    size: Annotated[str, typer.Option(help="One model: a preset (tiny, small, medium, large, xl, 2.7b, 10b; gpt-22b, gpt-175b, gpt-530b, gpt-1t), an lmsys .yaml, or a Llama-style .yaml/.json (vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads, max_position_embeddings).")] = "small",
    gpus: Annotated[Optional[int], typer.Option("--gpus", help="GPUs in the run (default 1, or the cluster file's).")] = None,
    gpus_per_node: Annotated[Optional[int], typer.Option("--gpus-per-node", help="GPUs per node (default 8, or the cluster file's).")] = None,
    gpu: Annotated[Optional[str], typer.Option("--gpu", help="Required, unless --cluster or --profile names the GPU. The GPU: a table name (A100 40GB SXM, A100 80GB SXM, H100 SXM, H100 PCIe, H200 SXM, B200, ...) or torch's device name.")] = None,
    cluster: Annotated[Optional[Path], typer.Option("--cluster", help="A YAML file: gpu (a name, or a mapping of its figures), gpus, gpus_per_node, and any figure to override (network_GBps, hbm_GB, ...).")] = None,
    global_batch_tokens: Annotated[Optional[int], typer.Option("--global-batch-tokens", help="Tokens per optimizer step (a whole number of sequences).")] = None,
    global_batch: Annotated[Optional[int], typer.Option("--global-batch", help="Sequences per optimizer step (default: one per GPU).")] = None,
    context_length: Annotated[Optional[int], typer.Option("--context-length", "--seq-len", help="Sequence length, one value (default: the model's).")] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="fp32 | bf16 | fp16 (one per plan).")] = "bf16",
    master_weights: Annotated[bool, typer.Option("--master-weights/--no-master-weights", metavar="", help="bf16/fp16: 16-bit weights with fp32 master copy and gradients (18 B/parameter, Megatron-LM); off: fp32 weights under autocast (lmsys bench e2e's default).")] = True,
    mesh: Annotated[Optional[str], typer.Option("--mesh", help="Evaluate one mesh: dp=..,tp=..,pp=.. (and optionally zero=0..3, sp=on|off, schedule=1f1b|interleaved, chunks=, mb=, checkpoint=none|selective|full|op).")] = None,
    top: Annotated[int, typer.Option("--top", help="Show the K fastest layouts that fit.")] = 10,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Also draw the shown layouts' memory and time breakdowns into this PNG (matplotlib).")] = None,
    profile: Annotated[Optional[Path], typer.Option("--profile", help="A calibration profile from `lmsys plan calibrate`: its measured rates replace the table's peaks × efficiencies; for a device the GPU table lacks (a CPU), its memory and measured matmul rate (the MFU peak) stand in for --gpu.")] = None,
    peak_tflops: Annotated[Optional[float], typer.Option("--peak-tflops", help="The dense peak MFU divides by (default: the GPU table's for --dtype).")] = None,
    stack: Annotated[str, typer.Option("--stack", help="The software stack modelled: production (naive attention run as a flash kernel, fused elementwise kernels) | eager (lmsys's own block: the model's attention, one kernel an op).")] = "production",
    format: FormatOpt = None,
    output: OutputOpt = None,
):
    """Rank the meshes that fit by predicted tokens/s: memory per GPU and step time, split by cause.

    Required: the GPU, by --gpu, --cluster or --profile (one of them); every other option has a default."""
    from lmsys.core.parsing import choose
    from lmsys.core.results import Report, check_output_path

    check_render_options(format, output)
    check_output_path(plot, what="--plot")
    choose(dtype, ("fp32", "bf16", "fp16"), what="--dtype")
    choose(stack, ("production", "eager"), what="--stack")
    check_counts(top=(top, 1))
    from lmsys.core.hardware import check_peak

    check_peak(peak_tflops)
    given = dict(gpus=gpus, gpus_per_node=gpus_per_node, context_length=context_length, global_batch=global_batch,
                 global_batch_tokens=global_batch_tokens)
    check_counts(**{name: (value, 1) for name, value in given.items() if value is not None})

    from lmsys.plan.train import plan_train

    rows, meta, plans, notes = plan_train(
        size=size, gpus=gpus, gpus_per_node=gpus_per_node, gpu=gpu, cluster=str(cluster) if cluster else None,
        profile=str(profile) if profile else None, dtype=dtype, master_weights=master_weights,
        global_batch_tokens=global_batch_tokens, global_batch=global_batch, context_length=context_length,
        mesh=mesh, top=top, peak_tflops=peak_tflops, stack=stack)
    if plot is not None:
        from lmsys.plan.search import plot_plans

        plot_plans(plans, plot, title=f"{meta['model'].split(':')[0]} on {meta['cluster'].split(',')[0]}")
        notes.append(f"Plot written to {plot}.")
    from lmsys.plan.train import GROUPS

    emit(Report("plan train", rows, meta, notes, groups=GROUPS), format, output)


@app.command("calibrate")
def calibrate(
    size: Annotated[str, typer.Option(help="The models whose matmul and attention shapes are timed: presets or .yaml files (as plan train), comma list; the first one's width sizes the host twin.")] = "tiny",
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="Comma list of fp32, bf16, fp16 (default: fp32 on a CPU, fp32,bf16 on a GPU).")] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", "--batch", help="Sequences per timed matmul and attention call (one value).")] = 1,
    warmup: Annotated[int, typer.Option(help="Untimed calls first.")] = 2,
    steps: Annotated[int, typer.Option("--steps", "--iters", help="Timed calls (the median is kept).")] = 5,
    profile: Annotated[Path, typer.Option("--profile", help="Write the profile here (.yaml or .json).")] = Path("lmsys-profile.yaml"),
    device: Annotated[str, typer.Option("--device", help="auto | cuda | cpu.")] = "auto",
    quiet: QuietOpt = False,
    format: FormatOpt = None,
    output: OutputOpt = None,
):
    """Measure this machine's matmul, attention, memory and all-reduce rates into a profile for plan train --profile."""
    from lmsys.core.parsing import choose, parse_list
    from lmsys.core.results import Report, check_output_path

    check_render_options(format, output, device=device, quiet=quiet)
    check_output_path(profile, what="--profile")
    check_counts(batch_size=(batch_size, 1), warmup=(warmup, 0), steps=(steps, 1))
    dtypes = [choose(d, ("fp32", "bf16", "fp16"), what="--dtype") for d in parse_list(dtype, str, what="--dtype")] \
        if dtype else None

    from lmsys.plan.shape import load_shape

    shapes = [load_shape(name) for name in dict.fromkeys(parse_list(size, str, what="--size"))]

    from lmsys.core.devices import check_dtype_for_device, environment, resolve_device
    from lmsys.plan.calibrate import calibrate as run
    from lmsys.plan.profile import save_profile

    dev = resolve_device(device)
    dtypes = dtypes or (["fp32", "bf16"] if dev.type == "cuda" else ["fp32"])
    for d in dtypes:
        check_dtype_for_device(d, dev)
    from lmsys.core import progress

    with progress.display("plan calibrate"):
        prof, rows = run(shapes, device=dev, dtypes=dtypes, batch_size=batch_size, warmup=warmup, steps=steps)
    save_profile(prof, profile)
    notes = [f"Profile written to {profile}; use it with `lmsys plan train --profile {profile}`."]
    if "busbw" not in prof:
        notes.append("All-reduce busbw not measured: fewer than 2 GPUs here (plan train keeps the table's links).")
    else:
        notes.append(f"all-reduce rows: GB/s is busbw (nccl-tests: algbw · 2(n−1)/n), through the job `lmsys comm "
                     f"all-reduce` runs; latency_us = the smallest size's median time, {prof['latency_us']:.1f} µs. "
                     "plan train and validate take collective times from these points.")
    emit(Report("plan calibrate", rows, {**environment(dev), "model": "; ".join(shape.describe() for shape in shapes)}, notes), format, output)


@app.command("breakdown")
def breakdown(
    size: Annotated[Optional[str], typer.Option(help="Presets or .yaml files, comma list (default: xl,2.7b on a GPU; tiny on a CPU).")] = None,
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="Comma list of fp32, bf16, fp16 (default: bf16,fp32 on a GPU; fp32 on a CPU).")] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", "--batch", help="Sequences per step (one value).")] = 4,
    context_length: Annotated[Optional[int], typer.Option("--context-length", "--seq-len", help="Sequence length, one value (default: each preset's own).")] = None,
    profile: Annotated[Optional[Path], typer.Option("--profile", help="A profile from `lmsys plan calibrate` on this machine (default: calibrate --size's models here first, without the all-reduce).")] = None,
    warmup: Annotated[int, typer.Option(help="Untimed steps first.")] = 3,
    steps: Annotated[int, typer.Option("--steps", "--iters", help="Timed steps (the median is kept).")] = 8,
    top: Annotated[int, typer.Option("--top", help="The K largest kernels (CPU: ops) of each step, by name.")] = 10,
    device: Annotated[str, typer.Option("--device", help="auto | cuda | cpu.")] = "auto",
    quiet: QuietOpt = False,
    format: FormatOpt = None,
    output: OutputOpt = None,
):
    """Where a bench e2e step's time goes, by kernel kind, beside what the time model predicts for each part."""
    from lmsys.core.parsing import choose, parse_list

    check_render_options(format, output, device=device, quiet=quiet)
    check_counts(batch_size=(batch_size, 1), warmup=(warmup, 0), steps=(steps, 1), top=(top, 1))
    if context_length is not None:
        check_counts(context_length=(context_length, 1))
    dtypes = [choose(d, ("fp32", "bf16", "fp16"), what="--dtype") for d in parse_list(dtype, str, what="--dtype")] \
        if dtype else None
    prof = None
    if profile is not None:
        from lmsys.plan.profile import load_profile

        prof = load_profile(profile)
    from lmsys.core.devices import check_dtype_for_device, resolve_device
    from lmsys.model.config import get_config

    dev = resolve_device(device)
    sizes = parse_list(size, str, what="--size") if size else (["xl", "2.7b"] if dev.type == "cuda" else ["tiny"])
    for s in sizes:
        get_config(s)  # a bad preset or .yaml: one line now
    dtypes = dtypes or (["bf16", "fp32"] if dev.type == "cuda" else ["fp32"])
    for d in dtypes:
        check_dtype_for_device(d, dev)
    from lmsys.core import progress
    from lmsys.plan.breakdown import run_breakdown

    with progress.display("plan breakdown"):
        reports = run_breakdown(sizes, dtypes=dtypes, batch_size=batch_size, device=dev, profile=prof,
                                profile_path=str(profile) if profile else None, warmup=warmup, steps=steps,
                                context_length=context_length, top=top)
    emit(reports, format, output)


@app.command("validate")
def validate(
    profile: Annotated[Optional[Path], typer.Option("--profile", help="The profile from `lmsys plan calibrate` on this machine (needed unless --published).")] = None,
    published: Annotated[bool, typer.Option("--published", help="Predict published training runs instead of running anything here: the set shipped with lmsys, or the FILE given after it (same form); predicted beside published tokens/s per GPU, the error per row, mean and max.")] = False,
    published_file: Annotated[Optional[Path], typer.Argument(metavar="[FILE]", show_default=False, help="With --published: a runs file of the shipped set's form (default: the shipped set).")] = None,
    size: Annotated[Optional[str], typer.Option(help="bench e2e rows: presets, comma list (default: small,medium,large,xl,2.7b on a GPU; tiny on a CPU).")] = None,
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="Comma list, for every row (default: fp32,bf16 on a GPU; fp32 on a CPU).")] = None,
    checkpoint: Annotated[str, typer.Option(help="Comma list of none, block (bench e2e's and parallel train's policies; block = full recomputation).")] = "none,block",
    batch_size: Annotated[int, typer.Option("--batch-size", "--batch", help="Sequences per step (bench e2e rows); per micro-batch per data-parallel rank (parallel train rows); one value.")] = 1,
    warmup: Annotated[int, typer.Option(help="Untimed steps first.")] = 1,
    steps: Annotated[int, typer.Option("--steps", "--iters", help="Timed steps.")] = 3,
    mesh: Annotated[Optional[List[str]], typer.Option(help="parallel train rows: mesh degrees, e.g. dp=2,tp=2,pp=1 (missing dims are 1; each mesh runs on as many processes as its degrees multiply to). Repeat for more; `none` leaves the distributed rows out. Default: per world size n, dp=n, tp=n and pp=n (and dp=2,tp=n/2 from 4); one GPU: dp=1,tp=1,pp=1.")] = None,
    world_size: Annotated[Optional[str], typer.Option(help="World sizes of the default meshes, comma list (default: 2 processes with gloo; with nccl 2, 4, 8 ... up to the GPUs visible, 1 on one GPU). With --mesh, each mesh's size must be one of them.")] = None,
    parallel_size: Annotated[Optional[str], typer.Option("--parallel-size", help="parallel train rows: one model preset or .yaml (default: tiny with gloo, small with nccl, as parallel train).")] = None,
    microbatches: Annotated[int, typer.Option(help="parallel train rows: micro-batches per step (of --batch-size sequences each).")] = 4,
    context_length: Annotated[Optional[int], typer.Option("--context-length", "--seq-len", help="Sequence length of every row, one value (default: each preset's own for bench e2e; 128 with gloo, 512 with nccl for parallel train, as parallel train).")] = None,
    dp_strategy: Annotated[str, typer.Option(help="parallel train rows: bucketed | fsdp (lmsys's DDP or FSDP over the dp dim).")] = "bucketed",
    pp_schedule: Annotated[str, typer.Option(help="parallel train rows: gpipe | 1f1b | interleaved-1f1b.")] = "1f1b",
    virtual_stages: Annotated[int, typer.Option(help="parallel train rows: chunks per pipeline rank (interleaved-1f1b).")] = 1,
    sequence_parallel: Annotated[bool, typer.Option("--sequence-parallel", metavar="", help="parallel train rows: sequence parallelism on the tp dim.")] = False,
    backend: Annotated[Optional[str], typer.Option(help="parallel train rows: gloo | nccl (default: as --device; nccl when a GPU is visible, else gloo).")] = None,
    host_rate: Annotated[str, typer.Option("--host-rate", help="The host's cost per dispatched op the predictions use: beside (measured before and after each size's rows, plan calibrate's twin: a host's speed drifts) | profile (the profile's).")] = "beside",
    repeats: Annotated[int, typer.Option("--repeats", help="Runs of each row, alternating with the host twins: the median run (odd N; even N: the mean of the middle two) against the prediction from the twins' median, with the runs' spread (a host-bound step moves by ±15 % from run to run on a shared host).")] = 1,
    device: Annotated[str, typer.Option("--device", help="auto | cuda | cpu.")] = "auto",
    quiet: QuietOpt = False,
    format: FormatOpt = None,
    output: OutputOpt = None,
):
    """Run bench e2e and parallel train here and print predicted beside measured step time and peak memory, with the errors; with --published, predict published training runs beside their published tokens/s per GPU."""
    from lmsys.core.errors import LmsysError
    from lmsys.core.parsing import choose, parse_int_list, parse_list
    from lmsys.core.results import Report

    check_render_options(format, output, device=device, quiet=quiet)
    if published_file is not None and not published:
        raise LmsysError(f"{published_file}: a runs FILE is read only with --published (lmsys plan validate --published FILE)")
    if published:
        from lmsys.plan.published import published_report

        rows, meta, notes = published_report(published_file)
        emit(Report("plan validate: published runs", rows, meta, notes), format, output)
        return
    if profile is None:
        raise LmsysError("plan validate needs --profile FILE (from `lmsys plan calibrate` on this machine), "
                         "or --published [FILE] to predict published runs",
                         hint="lmsys plan validate --help lists the options")
    check_counts(batch_size=(batch_size, 1), warmup=(warmup, 0), steps=(steps, 1), microbatches=(microbatches, 1),
                 virtual_stages=(virtual_stages, 1), repeats=(repeats, 1))
    if context_length is not None:
        check_counts(context_length=(context_length, 1))
    checkpoints = [choose(c, ("none", "block"), what="--checkpoint") for c in parse_list(checkpoint, str, what="--checkpoint")]
    choose(dp_strategy, ("bucketed", "fsdp"), what="--dp-strategy")
    choose(host_rate, ("beside", "profile"), what="--host-rate")
    from lmsys.distributed.mesh import PP_SCHEDULES

    choose(pp_schedule, PP_SCHEDULES, what="--pp-schedule")
    if parallel_size is not None and "," in parallel_size:
        raise LmsysError(f"--parallel-size {parallel_size}: one preset or .yaml config, not a list (the parallel "
                         "train rows run one model)")
    world_sizes = parse_int_list(world_size, what="--world-size") if world_size is not None else None
    if world_sizes and min(world_sizes) < 1:
        raise LmsysError(f"--world-size must be >= 1, got {min(world_sizes)}")
    from lmsys.plan.profile import load_profile

    prof = load_profile(profile)

    from lmsys.core.devices import check_dtype_for_device, environment, resolve_device
    from lmsys.distributed import launch
    from lmsys.model.config import default_context_length, default_size, get_config
    from lmsys.plan import validate as val

    if launch.under_torchrun():
        raise LmsysError("plan validate launches its own processes for the parallel train rows; run it without torchrun")
    dev = resolve_device(device)
    backend = launch.resolve_backend(launch.backend_for_device(device, backend))
    launch.timeout_seconds()  # LMSYS_DIST_TIMEOUT_S checked once, here
    sizes = parse_list(size, str, what="--size") if size else (
        ["small", "medium", "large", "xl", "2.7b"] if dev.type == "cuda" else ["tiny"])
    dtypes = parse_list(dtype, str, what="--dtype") if dtype else (["fp32", "bf16"] if dev.type == "cuda" else ["fp32"])
    for d in dtypes:
        check_dtype_for_device(d, dev)
    meshes = val.resolve_meshes(mesh, world_sizes=world_sizes, backend=backend)
    mesh_plan = None
    if meshes:
        rank_device = "cuda" if backend == "nccl" else "cpu"
        psize = parallel_size or default_size(rank_device)
        get_config(psize)  # a bad preset or .yaml: one line now
        mesh_plan = val.MeshPlan(meshes=meshes, size=psize, context_length=context_length or default_context_length(rank_device),
                                 backend=backend, micro_batch=batch_size, microbatches=microbatches,
                                 dp_strategy=dp_strategy, pp_schedule=pp_schedule, virtual_stages=virtual_stages,
                                 sequence_parallel=sequence_parallel)
    from lmsys.core import progress

    with progress.display("plan validate"):
        e2e_rows, mesh_rows = val.validate(sizes=sizes, dtypes=dtypes, checkpoints=checkpoints, batch_size=batch_size,
                                           warmup=warmup, steps=steps, device=dev, profile=prof,
                                           context_length=context_length, mesh_plan=mesh_plan, host_rate=host_rate,
                                           repeats=repeats)
    meta = {**environment(dev), "profile": f"{profile} ({prof['device']})"}
    again = (f" {repeats} runs of each row, alternating with the host twins: the median of their medians, "
             "and their time spread (max - min) / median.") if repeats > 1 else ""
    reports = [Report("plan validate", e2e_rows, meta, _error_notes(val.summary(e2e_rows), memory_here=dev.type == "cuda")
                      + [f"measured: bench e2e's train step, the median of {steps} timed steps after {warmup} warm-up; "
                         "peak memory over the step." + again, HOST_NOTE[host_rate]])]
    if mesh_plan is not None:
        mp = mesh_plan
        run = (f"{backend}, {mp.size} at context {mp.context_length}, {mp.micro_batch} sequence(s) × {mp.microbatches} "
               f"micro-batches per dp rank, dp strategy {mp.dp_strategy}, {warmup} warm-up + {steps} timed steps; "
               "lmsys.bench.parallel's job, one launch per world size"
               + (f" in each of {repeats} rounds (the median)" if repeats > 1 else "") + ", no parity reference")
        notes = _error_notes(val.summary(mesh_rows), memory_here=backend == "nccl") + [
            "predicted: the planner for each row's layout (dp, tp, pp, schedule and chunks, micro-batch size and count, "
            "dp strategy: bucketed = ZeRO-0, lmsys's FSDP = ZeRO-2 (gathered from its first forward to the gradient "
            "sync), block = full recomputation), collectives from the profile's measured all-reduce times where it has "
            "them.", HOST_NOTE[host_rate].replace("each size's rows", "the launches"),
        ]
        if backend == "gloo" and prof.get("threads"):
            scales = sorted({(n, launch.rank_threads(n)) for n in {row["world size"] for row in mesh_rows}})
            notes.append(f"CPU: the profile was measured with {prof['threads']} thread(s); each gloo rank computes with "
                         + ", ".join(f"{t} at world size {n}" for n, t in scales)
                         + ": its compute and memory rates are scaled by that ratio (rates linear in threads).")
        reports.append(Report("plan validate: parallel train", mesh_rows, {**meta, "run": run}, notes))
    emit(reports, format, output)


HOST_NOTE = {
    "beside": "host µs/op: the host's cost per dispatched op that row's prediction used, measured in this process "
              "before and after each size's rows and between their repeats (plan calibrate's twins at its width), "
              "the median; --host-rate profile takes the profile's.",
    "profile": "host µs/op: the profile's (--host-rate profile).",
}


def _error_notes(summary: dict, *, memory_here: bool) -> list[str]:
    notes = []
    for key, value in summary.items():
        what = key.replace(" error %", "")
        if value is None:
            notes.append(f"{what}: not measurable here" + (" (peak memory is tracked on CUDA only)"
                                                           if what == "memory" and not memory_here else ""))
        elif key == "host-bound time spread %":
            notes.append(f"host-bound rows: their runs' time spread mean {value[0]:.1f} %, max {value[1]:.1f} %. Their "
                         "pace is the host CPU's of the moment; a measured time that moves this much between runs "
                         "cannot be predicted more closely than it repeats.")
        else:
            notes.append(f"{what} error: mean |error| {value[0]:.1f} %, max {value[1]:.1f} %")
    return notes
