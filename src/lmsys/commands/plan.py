"""`lmsys plan`: predict per-GPU memory and step time of a training run for any mesh and cluster."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from lmsys.commands._common import FormatOpt, OutputOpt, QuietOpt, check_counts, check_render_options, emit

app = typer.Typer(help="Plan a training run: memory and step time per mesh, calibration, validation.",
                  no_args_is_help=True)


@app.command("train")
def train(
    size: Annotated[str, typer.Option(help="One model: a preset (tiny, small, medium, large, xl, 2.7b, 10b; gpt-22b, gpt-175b, gpt-530b, gpt-1t), an lmsys .yaml, or a Llama-style .yaml/.json (vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads, max_position_embeddings).")] = "small",
    gpus: Annotated[Optional[int], typer.Option("--gpus", help="GPUs in the run (default 1, or the cluster file's).")] = None,
    gpus_per_node: Annotated[Optional[int], typer.Option("--gpus-per-node", help="GPUs per node (default 8, or the cluster file's).")] = None,
    gpu: Annotated[Optional[str], typer.Option("--gpu", help="The GPU: a table name (A100 40GB SXM, A100 80GB SXM, H100 SXM, H100 PCIe, H200 SXM, B200, ...) or torch's device name.")] = None,
    cluster: Annotated[Optional[Path], typer.Option("--cluster", help="A YAML file: gpu (a name, or a mapping of its figures), gpus, gpus_per_node, and any figure to override (network_GBps, hbm_GB, ...).")] = None,
    global_batch_tokens: Annotated[Optional[int], typer.Option("--global-batch-tokens", help="Tokens per optimizer step (a whole number of sequences).")] = None,
    global_batch: Annotated[Optional[int], typer.Option("--global-batch", help="Sequences per optimizer step (default: one per GPU).")] = None,
    context_length: Annotated[Optional[int], typer.Option("--context-length", "--seq-len", help="Sequence length, one value (default: the model's).")] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="fp32 | bf16 | fp16 (one per plan).")] = "bf16",
    master_weights: Annotated[bool, typer.Option("--master-weights/--no-master-weights", metavar="", help="bf16/fp16: 16-bit weights with fp32 master copy and gradients (18 B/parameter, Megatron-LM); off: fp32 weights under autocast (lmsys bench e2e's default).")] = True,
    mesh: Annotated[Optional[str], typer.Option("--mesh", help="Evaluate one mesh: dp=..,tp=..,pp=.. (and optionally zero=0..3, sp=on|off, schedule=1f1b|interleaved, chunks=, mb=, checkpoint=none|selective|full).")] = None,
    top: Annotated[int, typer.Option("--top", help="Show the K fastest layouts that fit.")] = 10,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Also draw the shown layouts' memory and time breakdowns into this PNG (matplotlib).")] = None,
    profile: Annotated[Optional[Path], typer.Option("--profile", help="A calibration profile from `lmsys plan calibrate`: its measured rates replace the table's peaks × efficiencies.")] = None,
    peak_tflops: Annotated[Optional[float], typer.Option("--peak-tflops", help="The dense peak MFU divides by (default: the GPU table's for --dtype).")] = None,
    format: FormatOpt = None,
    output: OutputOpt = None,
):
    """Rank the meshes that fit by predicted tokens/s: memory per GPU and step time, split by cause."""
    from lmsys.core.parsing import choose
    from lmsys.core.results import Report, check_output_path

    check_render_options(format, output)
    check_output_path(plot, what="--plot")
    choose(dtype, ("fp32", "bf16", "fp16"), what="--dtype")
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
        mesh=mesh, top=top, peak_tflops=peak_tflops)
    if plot is not None:
        from lmsys.plan.search import plot_plans

        plot_plans(plans, plot, title=f"{meta['model'].split(':')[0]} on {meta['cluster'].split(',')[0]}")
        notes.append(f"Plot written to {plot}.")
    from lmsys.plan.train import GROUPS

    emit(Report("plan train", rows, meta, notes, groups=GROUPS), format, output)


@app.command("calibrate")
def calibrate(
    size: Annotated[str, typer.Option(help="The one model whose GEMM and attention shapes are timed (a preset or .yaml, as plan train).")] = "tiny",
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

    shape = load_shape(size)

    from lmsys.core.devices import check_dtype_for_device, environment, resolve_device
    from lmsys.plan.calibrate import calibrate as run
    from lmsys.plan.profile import save_profile

    dev = resolve_device(device)
    dtypes = dtypes or (["fp32", "bf16"] if dev.type == "cuda" else ["fp32"])
    for d in dtypes:
        check_dtype_for_device(d, dev)
    from lmsys.core import progress

    with progress.display("plan calibrate"):
        prof, rows = run(shape, device=dev, dtypes=dtypes, batch_size=batch_size, warmup=warmup, steps=steps)
    save_profile(prof, profile)
    notes = [f"Profile written to {profile}; use it with `lmsys plan train --profile {profile}`."]
    if "busbw" not in prof:
        notes.append("All-reduce busbw not measured: fewer than 2 GPUs here (plan train keeps the table's links).")
    emit(Report("plan calibrate", rows, {**environment(dev), "model": shape.describe()}, notes), format, output)


@app.command("validate")
def validate(
    profile: Annotated[Path, typer.Option("--profile", help="The profile from `lmsys plan calibrate` on this machine.")],
    size: Annotated[Optional[str], typer.Option(help="Presets, comma list (default: small,medium,large,xl,2.7b on a GPU; tiny on a CPU).")] = None,
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="Comma list (default: fp32,bf16 on a GPU; fp32 on a CPU).")] = None,
    checkpoint: Annotated[str, typer.Option(help="Comma list of none, block (bench e2e's policies; block = full recomputation).")] = "none,block",
    batch_size: Annotated[int, typer.Option("--batch-size", "--batch", help="Sequences per step (one value).")] = 1,
    warmup: Annotated[int, typer.Option(help="Untimed steps first.")] = 1,
    steps: Annotated[int, typer.Option("--steps", "--iters", help="Timed steps.")] = 3,
    device: Annotated[str, typer.Option("--device", help="auto | cuda | cpu.")] = "auto",
    quiet: QuietOpt = False,
    format: FormatOpt = None,
    output: OutputOpt = None,
):
    """Run bench e2e here and print predicted beside measured step time and peak memory, with the errors."""
    from lmsys.core.parsing import choose, parse_list
    from lmsys.core.results import Report

    check_render_options(format, output, device=device, quiet=quiet)
    check_counts(batch_size=(batch_size, 1), warmup=(warmup, 0), steps=(steps, 1))
    checkpoints = [choose(c, ("none", "block"), what="--checkpoint") for c in parse_list(checkpoint, str, what="--checkpoint")]
    from lmsys.plan.profile import load_profile

    prof = load_profile(profile)

    from lmsys.core.devices import check_dtype_for_device, environment, resolve_device
    from lmsys.plan.calibrate import validate as run

    dev = resolve_device(device)
    sizes = parse_list(size, str, what="--size") if size else (
        ["small", "medium", "large", "xl", "2.7b"] if dev.type == "cuda" else ["tiny"])
    dtypes = parse_list(dtype, str, what="--dtype") if dtype else (["fp32", "bf16"] if dev.type == "cuda" else ["fp32"])
    for d in dtypes:
        check_dtype_for_device(d, dev)
    from lmsys.core import progress

    with progress.display("plan validate"):
        rows, summary = run(sizes=sizes, dtypes=dtypes, checkpoints=checkpoints, batch_size=batch_size,
                            warmup=warmup, steps=steps, device=dev, profile=prof)
    meta = {**environment(dev), "profile": f"{profile} ({prof['device']})"}
    notes = []
    for key, value in summary.items():
        what = key.replace(" error %", "")
        if value is None:
            notes.append(f"{what}: not measurable here" + (" (peak memory is tracked on CUDA only)" if what == "memory" else ""))
        else:
            notes.append(f"{what} error: mean |error| {value[0]:.1f} %, max {value[1]:.1f} %")
    emit(Report("plan validate", rows, meta, notes), format, output)
