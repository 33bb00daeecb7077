"""`lmsys parallel`: tensor, sequence, pipeline and data parallelism on a device mesh."""

from __future__ import annotations

from typing import Annotated, List, Optional

import typer

from lmsys.commands._common import check_render_options, emit, run_on_ranks
from lmsys.commands.options import DtypeOpt, FormatOpt, ModelKwargsOpt, OutputOpt, PeakTflopsOpt, QuietOpt, opt

app = typer.Typer(help="Tensor / sequence / pipeline parallelism on a device mesh (dp × tp × pp), with parity to one process.",
                  no_args_is_help=True)


@app.command("train")
def train(
    mesh: Annotated[Optional[List[str]], opt("mesh", "Mesh degrees, e.g. dp=2,tp=2,pp=1 (missing dims are 1; they multiply to the world size; tp varies fastest). Repeat to compare meshes. Default: tp=<world size>.")] = None,
    dp_strategy: Annotated[str, opt("dp_strategy", "bucketed | fsdp | torch-ddp | torch-fsdp: what runs over the dp dim. lmsys rows: lmsys's bucketed DDP or FSDP; torch rows: DDP (bucketed, torch-ddp; tp=pp=1 only) or FSDP2 (fsdp, torch-fsdp).")] = "bucketed",
    sequence_parallel: Annotated[bool, opt("sequence_parallel", "Norms and residuals on sequence shards: all-gather / reduce-scatter instead of all-reduce.")] = False,
    pp_schedule: Annotated[str, opt("pp_schedule", "gpipe | 1f1b | interleaved-1f1b.")] = "1f1b",
    virtual_stages: Annotated[int, opt("virtual_stages", "Chunks per pipeline rank (interleaved-1f1b).")] = 1,
    microbatches: Annotated[int, opt("microbatches", "Microbatches per step; --batch-size is split into them.")] = 4,
    checkpoint: Annotated[str, opt("checkpoint", "none | block: activation checkpointing of each block of each pipeline stage (applied after TP and PP; lmsys rows).")] = "none",
    impl: Annotated[str, opt("impl", "lmsys | torch, comma-separated: one row each (torch: DTensor parallelize_module, torch.distributed.pipelining, FSDP2 / DDP over dp).")] = "lmsys",
    size: Annotated[Optional[str], opt("size", "One model preset or a .yaml config. Default: tiny with gloo, small with nccl.")] = None,
    model: Annotated[Optional[str], opt("model", "lmsys | hf:llama | hf:gpt2 | hf:qwen2 | hf:mistral | pkg.module:Name or file.py:Name (your model, built with --size's sizes): run with torch's parallelisms (dp and FSDP always; pp split at its blocks; tp by its plan or --tp-plan). Default: lmsys.")] = None,
    model_kwargs: ModelKwargsOpt = None,
    tp_plan: Annotated[Optional[str], typer.Option("--tp-plan", help="FILE.yaml: the tensor-parallel plan of --model, module pattern -> colwise | rowwise (e.g. layers.*.attn.q: colwise); default: the plan the model declares (Hugging Face's base_model_tp_plan).")] = None,
    batch_size: Annotated[int, opt("batch_size", "Sequences per data-parallel rank per step, split into the microbatches (one value: the rows compare meshes on one workload).")] = 4,
    context_length: Annotated[Optional[int], opt("context_length", "Sequence length (one value). Default: 512 with nccl, 128 with gloo.")] = None,
    dtype: DtypeOpt = "fp32",
    peak_tflops: PeakTflopsOpt = None,
    steps: Annotated[int, opt("steps", "Timed steps per mesh.")] = 5,
    warmup: Annotated[int, opt("warmup", "Untimed steps before them (they train too: parity covers all).")] = 2,
    world_size: Annotated[Optional[int], opt("world_size", "Processes (default: the first mesh's size; under torchrun its WORLD_SIZE).")] = None,
    backend: Annotated[Optional[str], opt("backend", "gloo | nccl (default: nccl when a GPU is visible, else gloo).")] = None,
    quiet: QuietOpt = False,
    format: FormatOpt = None,
    output: OutputOpt = None,
):
    """Train the LM on each mesh: ms/step, tokens/s, memory and parameters per rank, bubble, parity."""
    from lmsys.bench import parallel_runs

    check_render_options(format, output, dtype=dtype, quiet=quiet)  # before torch is imported
    plan = parallel_runs.resolve(
        mesh=mesh, dp_strategy=dp_strategy, sequence_parallel=sequence_parallel, pp_schedule=pp_schedule,
        virtual_stages=virtual_stages, microbatches=microbatches, checkpoint=checkpoint, impl=impl, size=size,
        model=model, model_kwargs=model_kwargs, tp_plan=tp_plan, batch_size=batch_size,
        context_length=context_length, dtype=dtype, peak_tflops=peak_tflops, steps=steps, warmup=warmup,
        world_size=world_size, backend=backend)
    if plan.warning:
        typer.echo(plan.warning, err=True)
    result = run_on_ranks("lmsys.bench.parallel:parallel_job", plan.kwargs, world_size=plan.world_size,
                          backend=plan.backend, description="parallel train")
    if result is None:  # a torchrun worker other than rank 0: rank 0 prints
        return
    emit([parallel_runs.train_report(plan, result)], format, output)
