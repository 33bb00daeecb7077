"""`lmsys parallel`: tensor, sequence, pipeline and data parallelism on a device mesh."""

from __future__ import annotations

from typing import Annotated, List, Optional

import typer

from lmsys.commands._common import (DtypeOpt, FormatOpt, OutputOpt, QuietOpt, check_counts, check_one_size,
                                    check_render_options,
                                    emit, run_on_ranks)

app = typer.Typer(help="Tensor / sequence / pipeline parallelism on a device mesh (dp × tp × pp), with parity to one process.",
                  no_args_is_help=True)


@app.command("train")
def train(
    mesh: Annotated[Optional[List[str]], typer.Option(help="Mesh degrees, e.g. dp=2,tp=2,pp=1 (missing dims are 1; they multiply to the world size; tp varies fastest). Repeat to compare meshes. Default: tp=<world size>.")] = None,
    dp_strategy: Annotated[str, typer.Option(help="bucketed | fsdp | torch-ddp | torch-fsdp: what runs over the dp dim. lmsys rows: lmsys's bucketed DDP or FSDP; torch rows: DDP (bucketed, torch-ddp; tp=pp=1 only) or FSDP2 (fsdp, torch-fsdp).")] = "bucketed",
    sequence_parallel: Annotated[bool, typer.Option("--sequence-parallel", metavar="", help="Norms and residuals on sequence shards: all-gather / reduce-scatter instead of all-reduce.")] = False,
    pp_schedule: Annotated[str, typer.Option(help="gpipe | 1f1b | interleaved-1f1b.")] = "1f1b",
    virtual_stages: Annotated[int, typer.Option(help="Chunks per pipeline rank (interleaved-1f1b).")] = 1,
    microbatches: Annotated[int, typer.Option(help="Microbatches per step; --batch-size is split into them.")] = 4,
    checkpoint: Annotated[str, typer.Option(help="none | block: activation checkpointing of each block of each pipeline stage (applied after TP and PP; lmsys rows).")] = "none",
    impl: Annotated[str, typer.Option(help="lmsys | torch, comma-separated: one row each (torch: DTensor parallelize_module, torch.distributed.pipelining, FSDP2 / DDP over dp).")] = "lmsys",
    size: Annotated[Optional[str], typer.Option(help="One model preset or a .yaml config. Default: tiny with gloo, small with nccl.")] = None,
    model: Annotated[Optional[str], typer.Option("--model", help="lmsys | hf:llama | hf:gpt2 | hf:qwen2 | hf:mistral | pkg.module:Name or file.py:Name (your model, built with --size's sizes): run with torch's parallelisms (dp and FSDP always; pp split at its blocks; tp by its plan or --tp-plan). Default: lmsys.")] = None,
    model_kwargs: Annotated[Optional[str], typer.Option("--model-kwargs", help="Extra keyword arguments for --model: YAML or JSON text, or a .yaml/.json file.")] = None,
    tp_plan: Annotated[Optional[str], typer.Option("--tp-plan", help="FILE.yaml: the tensor-parallel plan of --model, module pattern -> colwise | rowwise (e.g. layers.*.attn.q: colwise); default: the plan the model declares (Hugging Face's base_model_tp_plan).")] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", "--batch", help="Sequences per data-parallel rank per step, split into the microbatches (one value: the rows compare meshes on one workload).")] = 4,
    context_length: Annotated[Optional[int], typer.Option("--context-length", "--seq-len", help="Sequence length (one value). Default: 512 with nccl, 128 with gloo.")] = None,
    dtype: DtypeOpt = "fp32",
    peak_tflops: Annotated[Optional[float], typer.Option("--peak-tflops", help="Dense peak TFLOP/s per GPU that MFU divides by, for a GPU lmsys.core.hardware's table does not know (default: the table's for --dtype; unknown GPU: no MFU).")] = None,
    steps: Annotated[int, typer.Option("--steps", "--iters", help="Timed steps per mesh.")] = 5,
    warmup: Annotated[int, typer.Option(help="Untimed steps before them (they train too: parity covers all).")] = 2,
    world_size: Annotated[Optional[int], typer.Option(help="Processes (default: the first mesh's size; under torchrun its WORLD_SIZE).")] = None,
    backend: Annotated[Optional[str], typer.Option(help="gloo | nccl (default: nccl when a GPU is visible, else gloo).")] = None,
    quiet: QuietOpt = False,
    format: FormatOpt = None,
    output: OutputOpt = None,
):
    """Train the LM on each mesh: ms/step, tokens/s, memory and parameters per rank, bubble, parity."""
    from lmsys.core.errors import LmsysError
    from lmsys.core.parsing import choose, parse_list
    from lmsys.distributed.mesh import check_plan, parse_mesh
    from lmsys.distributed.parallelize import CHECKPOINTS, DP_STRATEGIES
    from lmsys.model.config import get_config

    check_render_options(format, output, dtype=dtype, quiet=quiet)  # before torch is imported
    from lmsys.core.hardware import check_peak

    check_peak(peak_tflops)
    check_counts(warmup=(warmup, 0), steps=(steps, 1), batch_size=(batch_size, 1), microbatches=(microbatches, 1),
                 virtual_stages=(virtual_stages, 1))
    check_one_size(size, command="parallel train", why="one model per run")
    choose(dp_strategy, DP_STRATEGIES, what="--dp-strategy")
    choose(checkpoint, CHECKPOINTS, what="--checkpoint")
    impls = [choose(i, ("lmsys", "torch"), what="--impl") for i in parse_list(impl, str, what="--impl")]
    if dtype == "fp16":
        raise LmsysError("parallel train with fp16 needs a gradient scaler across stages, which it does not have; use bf16")
    if batch_size % microbatches:
        raise LmsysError(f"--batch-size {batch_size} does not split into --microbatches {microbatches}")
    specs = [parse_mesh(m) for m in (mesh or [])]
    import os

    under = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    n = int(os.environ["WORLD_SIZE"]) if under else (world_size or (specs[0].world_size if specs else 2))
    specs = specs or [parse_mesh(f"tp={n}")]
    from lmsys.model.user import check_model, check_parallel, parse_model_kwargs

    if tp_plan is not None and model in (None, "lmsys"):
        raise LmsysError("--tp-plan gives the tensor-parallel plan of a --model; lmsys's own model has its own")
    model = check_model(model) if model else None
    kwargs_json = parse_model_kwargs(model_kwargs)
    config = get_config(size or "tiny")
    for spec in specs:  # every mistake of item 6, before any process starts
        check_plan(spec, world_size=n, num_heads=config.num_heads, kv_heads=config.kv_heads, d_ff=config.d_ff,
                   vocab_size=config.vocab_size, num_layers=config.num_layers, schedule=pp_schedule,
                   microbatches=microbatches, virtual_stages=virtual_stages)

    from lmsys.core.results import Report
    from lmsys.distributed import launch
    from lmsys.model.config import resolve_size

    backend = launch.resolve_backend(backend)
    launch.check_launch(backend, [n])
    if warning := launch.warn_oversubscription([n], backend):
        typer.echo(warning, err=True)
    size, context_length = resolve_size(size, context_length, backend=backend, dtype=dtype)
    if model not in (None, "lmsys"):  # what the --model needs for each mesh, before any rank starts
        from lmsys.model.config import resolve_configs

        (_, user_config), = resolve_configs([size], context_length=context_length, model=model,
                                            model_kwargs=kwargs_json)
        for spec in specs:
            check_parallel(user_config, spec, plan_file=tp_plan, pp_schedule=pp_schedule)
    if sequence_parallel and any(context_length % s.tp for s in specs):
        raise LmsysError(f"--sequence-parallel: --context-length {context_length} is not divisible by every tp degree")
    kwargs = dict(meshes=[s.label for s in specs], impls=impls, dp_strategy=dp_strategy,
                  sequence_parallel=sequence_parallel, pp_schedule=pp_schedule, virtual_stages=virtual_stages,
                  microbatches=microbatches, size=size, context_length=context_length, batch_size=batch_size,
                  dtype=dtype, steps=steps, warmup=warmup, checkpoint=checkpoint,
                  peak_tflops=peak_tflops, model=model, model_kwargs=kwargs_json, tp_plan=tp_plan)
    result = run_on_ranks("lmsys.bench.parallel:parallel_job", kwargs, world_size=n, backend=backend,
                          description="parallel train")
    if result is None:  # a torchrun worker other than rank 0: rank 0 prints
        return
    meta = result["meta"]
    meta["run"] = (f"{backend}, world {n}, batch {batch_size}/dp rank in {microbatches} microbatches, {dtype}, "
                   f"{warmup} warm-up + {steps} timed steps")
    notes = result.get("notes", []) + [
        "parity: loss and parameters against one process trained on the full global batch (AdamW, same seed); "
        "fp32 differs by rounding (summation order), amplified by AdamW's normalisation to ~1e-5.",
        "1 process: that reference's own row (bench e2e's step on the full global batch, on rank 0's device, timed "
        "as the meshes are); × 1 process: its ms/step over the row's (the degenerate mesh: 1.0 when it costs "
        "nothing; n ranks on the same global batch: up to n).",
        "bubble %: idle (waiting on send/recv) over step time on the stage with the most compute; ideal: "
        "(p-1)/(m+p-1), ÷V interleaved.",
    ]
    emit([Report("parallel train", result.get("baselines", []) + result["rows"], meta, notes)], format, output)
