"""`parallel train`'s options checked before any rank starts (`resolve`) and rank 0's result made into its
report (`train_report`). Torch-free at import: lmsys.bench.parallel, the job the ranks run, imports torch."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from lmsys.core.errors import LmsysError

IMPLS = ("lmsys", "torch")


@dataclass
class ParallelTrain:
    """What `parallel train` launches: the job's kwargs, its world size and backend."""

    kwargs: dict
    world_size: int
    backend: str
    warning: Optional[str] = None  # ranks that outnumber the cores: said on stderr before the run


def resolve(*, mesh: Optional[list[str]], dp_strategy: str, sequence_parallel: bool, pp_schedule: str,
            virtual_stages: int, microbatches: int, checkpoint: str, impl: str, size: Optional[str],
            model: Optional[str], model_kwargs: Optional[str], tp_plan: Optional[str], batch_size: int,
            context_length: Optional[int], dtype: str, peak_tflops: Optional[float], steps: int, warmup: int,
            world_size: Optional[int], backend: Optional[str]) -> ParallelTrain:
    """Every mistake of `parallel train`'s options, before any process starts: the torch-free ones first (a
    typo answers before torch loads), each mesh against the model, then the backend and the --model's plan."""
    from lmsys.core.hardware import check_peak
    from lmsys.core.parsing import check_counts, check_one_size, choose, parse_list
    from lmsys.distributed.data_parallel.strategies import MESH_DP as DP_STRATEGIES
    from lmsys.distributed.mesh import CHECKPOINTS, check_plan, parse_mesh
    from lmsys.model.config import get_config

    check_peak(peak_tflops)
    check_counts(warmup=(warmup, 0), steps=(steps, 1), batch_size=(batch_size, 1), microbatches=(microbatches, 1),
                 virtual_stages=(virtual_stages, 1))
    check_one_size(size, command="parallel train", why="one model per run")
    choose(dp_strategy, DP_STRATEGIES, what="--dp-strategy")
    choose(checkpoint, CHECKPOINTS, what="--checkpoint")
    impls = [choose(i, IMPLS, what="--impl") for i in parse_list(impl, str, what="--impl")]
    if dtype == "fp16":
        raise LmsysError("parallel train with fp16 needs a gradient scaler across stages, which it does not have; use bf16")
    if batch_size % microbatches:
        raise LmsysError(f"--batch-size {batch_size} does not split into --microbatches {microbatches}")
    specs = [parse_mesh(m) for m in (mesh or [])]
    under = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    n = int(os.environ["WORLD_SIZE"]) if under else (world_size or (specs[0].world_size if specs else 2))
    specs = specs or [parse_mesh(f"tp={n}")]
    from lmsys.model.user import check_model, check_parallel, is_lmsys_model, parse_model_kwargs

    if tp_plan is not None and is_lmsys_model(model):
        raise LmsysError("--tp-plan gives the tensor-parallel plan of a --model; lmsys's own model has its own")
    model = check_model(model) if model else None
    kwargs_json = parse_model_kwargs(model_kwargs)
    config = get_config(size or "tiny")
    for spec in specs:  # every mistake of item 6, before any process starts
        check_plan(spec, world_size=n, num_heads=config.num_heads, kv_heads=config.kv_heads, d_ff=config.d_ff,
                   vocab_size=config.vocab_size, num_layers=config.num_layers, schedule=pp_schedule,
                   microbatches=microbatches, virtual_stages=virtual_stages)

    from lmsys.distributed import launch
    from lmsys.model.config import resolve_size

    backend = launch.resolve_backend(backend)
    launch.check_launch(backend, [n])
    warning = launch.warn_oversubscription([n], backend)
    size, context_length = resolve_size(size, context_length, backend=backend, dtype=dtype)
    if not is_lmsys_model(model):  # what the --model needs for each mesh, before any rank starts
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
    return ParallelTrain(kwargs=kwargs, world_size=n, backend=backend, warning=warning)


def train_report(plan: ParallelTrain, result: dict):
    """The Report of rank 0's result: the one-process rows first, then the meshes'."""
    from lmsys.core.results import Report

    k = plan.kwargs
    meta = result["meta"]
    meta["run"] = (f"{plan.backend}, world {plan.world_size}, batch {k['batch_size']}/dp rank in {k['microbatches']} "
                   f"microbatches, {k['dtype']}, {k['warmup']} warm-up + {k['steps']} timed steps")
    notes = result.get("notes", []) + [
        "parity: loss and parameters against one process trained on the full global batch (AdamW, same seed); "
        "fp32 differs by rounding (summation order), amplified by AdamW's normalisation to ~1e-5.",
        "1 process: that reference's own row (bench e2e's step on the full global batch, on rank 0's device, timed "
        "as the meshes are); × 1 process: its ms/step over the row's (the degenerate mesh: 1.0 when it costs "
        "nothing; n ranks on the same global batch: up to n).",
        "bubble %: idle (waiting on send/recv) over step time on the stage with the most compute; ideal: "
        "(p-1)/(m+p-1), ÷V interleaved.",
    ]
    return Report("parallel train", result.get("baselines", []) + result["rows"], meta, notes)
