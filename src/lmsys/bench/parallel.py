"""The run behind `lmsys parallel train`: each mesh on the same model, data and numerics, against one process.

On every rank of the group, `parallel_job` runs, per mesh: build the full model from the seed,
`parallelize` it (TP -> PP -> DP), train `warmup + steps` steps on this dp rank's slice of the global
batches (lmsys.train.data's `BatchSource`, as `ddp train`'s), time the timed steps, then gather the shards on rank 0 and compare
the loss and every parameter with one process trained on the full global batch (`one_process_run`, on
rank 0, timed as the meshes are: its row comes first and each mesh row says its speed-up over it, so the
degenerate mesh dp = tp = pp = 1 is held against the plain step in the same process; not with
`parity=False`, as `plan validate` runs it: timing only).

Rows: impl, mesh, schedule, ms/step (median), tokens/s (all ranks), MFU, peak memory and parameters per
rank (max over ranks), communication ms per mesh dim, bubble % (idle over step time on the busiest
stage, median step) beside the ideal, activation MiB the schedule held (first step, max over ranks),
|Δloss| and max|Δθ| against the reference, × 1 process (its ms/step over the row's). A step is timed as `bench e2e` times its own: the one timer,
nothing synchronised inside or between steps, the same AdamW (fused on a GPU), so the degenerate mesh
dp = tp = pp = 1 runs bench e2e's step.
"""

from __future__ import annotations

import statistics
from typing import Optional

import torch
import torch.distributed as dist

from lmsys.core import progress
from lmsys.core.devices import environment, free_memory, peak_memory, reset_peak_memory, torch_dtype
from lmsys.core.parsing import MiB
from lmsys.core.results import NOT_MEASURED
from lmsys.distributed.launch import RankContext, barrier
from lmsys.distributed.mesh import build_mesh, parse_mesh
from lmsys.distributed.model_parallel.pipeline import ideal_bubble
from lmsys.model import describe
from lmsys.model.config import get_config
from lmsys.train import build_model
from lmsys.train.data import BatchSource, to_device
from lmsys.train.loop import mfu_percent, timed_loop, train_one_process
from lmsys.train.optim import DDP_TRAIN_LR, default_kind, make_optimizer
from lmsys.train.step import ParallelStep

ROW_KEYS = ("impl", "mesh", "dp strategy", "schedule", "ms/step", "tokens/s", "MFU %", "peak MiB/rank",
            "params/rank", "comm ms (tp)", "comm ms (pp)", "comm ms (dp)", "bubble %", "ideal bubble %",
            "act MiB held", "loss", "|Δloss|", "parity max|Δθ|", "× 1 process", "status")
COMM_DIMS = ("tp", "pp", "dp")


def parallel_job(ctx: RankContext, *, peak_tflops: Optional[float] = None, **kwargs) -> dict:
    """The job on each rank; MFU divides by `peak_tflops` per GPU (a --peak-tflops) or the GPU table's."""
    from lmsys.core.devices import given_peak

    with given_peak(peak_tflops):
        return _parallel_job(ctx, **kwargs)


def _parallel_job(ctx: RankContext, *, meshes: list[str], impls: list[str], dp_strategy: str, sequence_parallel: bool,
                 pp_schedule: str, virtual_stages: int, microbatches: int, size: str, context_length: int,
                 batch_size: int, dtype: str, steps: int, warmup: int, checkpoint: str = "none",
                 seed: int = 0, parity: bool = True, model: Optional[str] = None, model_kwargs: str = "",
                 tp_plan: Optional[str] = None) -> dict:
    from lmsys.model.user import with_model

    config = with_model(get_config(size).with_overrides(context_length=context_length), model, model_kwargs)
    total = warmup + steps
    references: dict[int, Optional[tuple]] = {}  # global batch -> (ms/step, losses, parameters) on rank 0
    rows, baselines, notes = [], [], []
    progress.plan_rows(len(meshes) * len(impls) + (len({batch_size * parse_mesh(m).dp for m in meshes}) if parity else 0))
    for text in meshes:
        spec = parse_mesh(text)
        global_batch = batch_size * spec.dp
        source = BatchSource(vocab_size=config.vocab_size, seq_len=context_length, global_batch=global_batch, seed=seed)
        if parity and ctx.is_main and global_batch not in references:  # parity=False: no one-process reference
            progress.start_row(f"1 process, batch {global_batch}")
            row, references[global_batch] = one_process_run(ctx, config, source, dtype=dtype, warmup=warmup,
                                                            total=total, seed=seed)
            baselines.append(row)
            if references[global_batch] is None:
                notes.append(f"1 process, batch {global_batch}: {row['status']}: parity and × 1 process are empty "
                             "for the meshes on that batch (nothing to compare with).")
        barrier(ctx)
        for impl in impls:
            progress.start_row(f"{text} {impl}")
            row = mesh_run(ctx, config, spec, source, impl=impl, dp_strategy=dp_strategy,
                           sequence_parallel=sequence_parallel, pp_schedule=pp_schedule,
                           virtual_stages=virtual_stages, microbatches=microbatches, dtype=dtype, warmup=warmup,
                           total=total, seed=seed, checkpoint=checkpoint, reference=references.get(global_batch) if ctx.is_main else None,
                           tp_plan=tp_plan)
            if ctx.is_main:
                rows.append(row)
            barrier(ctx)
    notes.append("comm ms (tp | pp | dp): per step, the median over the timed steps, the largest over ranks (CUDA "
                 "events on a GPU, the host clock on a CPU). tp: every tensor-parallel collective (forward, backward, "
                 "the loss's three, again in a checkpointed block's recompute); pp: the waits on the send/recv "
                 "batches holding a needed recv and on the last sends (idle, the peer's compute included); dp: "
                 "bucketed, the wait for the gradient sync after the last backward (what the backward did not "
                 "hide); fsdp, the waits for its all-gathers and reduce-scatters (on a CPU the collectives "
                 "themselves). n/m: not measured (torch's rows: their collectives, compute and saved activations "
                 "run inside DTensor, pipelining and FSDP2, out of reach of lmsys's timer); —: nothing to measure.")
    from lmsys.model.user import is_user_model

    if is_user_model(config):
        notes.append(f"--model {config.model}: torch's parallelisms applied from outside "
                     "(lmsys.distributed.model_parallel.user_parallel): tp by the model's plan (DTensor), pp traced "
                     "and split at its blocks (torch.distributed.pipelining), fsdp as FSDP2 on each block; "
                     "bucketed is lmsys's BucketedDDP, torch-ddp torch's DDP.")
    if warmup == 0:
        notes.append("act MiB held: counted in the first timed step (--warmup 0), whose time includes a hook "
                     "per saved tensor; with a warm-up step it is counted there.")
    if dtype == "bf16":
        notes.append("bf16: the reference runs under the same autocast; rounding differs with the summation order "
                     "(tests: one step's gradients within 2e-2 relative, |Δloss| < 2e-3; max|Δθ| is bounded only by "
                     "AdamW's step, 2·lr per step, as a near-zero gradient's sign may flip).")
    meta = environment(ctx.device)
    meta["model"] = f"{size}: {describe(config)}"
    return {"rows": rows, "baselines": baselines, "meta": meta, "notes": notes}


def one_process_run(ctx, config, source, *, dtype, warmup, total, seed) -> tuple[dict, Optional[tuple]]:
    """One process on the full global batch, with bench e2e's step (lmsys.train.loop's train_one_process:
    TrainStep, run_step, the one timer's regions from `warmup` on, nothing synchronised inside or between
    steps; the AdamW the mesh rows use; the batches on the device first): (its row, (median ms/step, losses
    per step, parameters on the host)); a caught OOM gives an OOM row and no reference."""
    from lmsys.core.devices import is_oom, oom_row

    free_memory(ctx.device)
    batches = None
    try:
        batches = [to_device(source.global_batch_at(i), ctx.device) for i in range(total)]
        run = train_one_process(config, batches, device=ctx.device, dtype=dtype, warmup=warmup, seed=seed,
                                kind=default_kind(ctx.device), keep_params=True, keep_losses=True)
    except Exception as exc:  # noqa: BLE001 - an OOM marks the row; anything else is a bug
        if not is_oom(exc):
            raise
        return oom_row("OOM (the full global batch on one device)", ROW_KEYS, impl="1 process", mesh="-",
                       **{"dp strategy": "-", "schedule": "-"}), None
    finally:
        batches = None
        free_memory(ctx.device)
    ms = statistics.median(run.timer.samples("step"))
    tokens = source.global_batch * config.context_length
    row = dict.fromkeys(ROW_KEYS)
    row.update({"impl": "1 process", "mesh": "-", "dp strategy": "-", "schedule": "-", "ms/step": ms,
                "tokens/s": tokens / (ms * 1e-3),
                "MFU %": mfu_percent(config, tokens=tokens, step_ms=ms, device=ctx.device, dtype=dtype, processes=1),
                "peak MiB/rank": None if run.peak_bytes is None else run.peak_bytes / MiB, "params/rank": run.n_params,
                "loss": run.losses[-1], "status": "ok"})
    return row, (ms, run.losses, run.params)


def mesh_run(ctx, config, spec, source, *, impl="lmsys", dp_strategy, sequence_parallel, pp_schedule, virtual_stages,
             microbatches, dtype, warmup, total, seed, reference, checkpoint="none", tp_plan=None) -> dict:
    from lmsys.distributed.parallelize import HAND_WRITTEN_DP, parallelize
    from lmsys.distributed.model_parallel.torch_parallel import TorchParallelModel, local_numel, not_composable
    from lmsys.model.user import is_user_model

    user = is_user_model(config)
    if user:  # a --model: torch's TP / pipelining / FSDP2 (lmsys's are written for its TransformerLM)
        from lmsys.distributed.model_parallel import user_parallel

        not_composable = user_parallel.not_composable  # noqa: F811 - the --model's own limits
        impl = "torch"

    schedule_label = pp_schedule + (f", V={virtual_stages}" if pp_schedule == "interleaved-1f1b" else "") + \
        f", M={microbatches}" + (", SP" if sequence_parallel and spec.tp > 1 else "") + \
        (f", checkpoint {checkpoint}" if checkpoint != "none" else "")
    if impl == "torch" and checkpoint != "none":
        return _status_row("torch", spec, dp_strategy, schedule_label,
                           "not run: --checkpoint applies to lmsys's parallelize only")
    if impl == "torch" and (why := not_composable(spec, dp_strategy)) is not None:
        return _status_row("torch", spec, dp_strategy, schedule_label, why)
    if user and (why := not_composable(spec, dp_strategy)) is not None:
        return _status_row("torch", spec, dp_strategy, schedule_label, why)
    if impl == "lmsys" and spec.dp > 1 and dp_strategy not in HAND_WRITTEN_DP:
        return _status_row("lmsys", spec, dp_strategy, schedule_label,
                           f"not run: {dp_strategy} is torch's wrapper, composed with torch's TP/PP in the "
                           f"--impl torch row; lmsys rows run bucketed or fsdp")
    mesh = build_mesh(spec, device_type=ctx.device.type)
    coords = spec.coords(ctx.rank)
    # what an earlier row left in reference cycles (checkpointed blocks' forward closures, torch's AdamW)
    # is freed only by the cyclic collector: collected first, so this row's peak is its own (it was 864 MiB
    # in plan validate's bf16 rows after the fp32 checkpointed one)
    free_memory(ctx.device)
    reset_peak_memory(ctx.device)
    model = build_model(config, device=ctx.device, seed=seed)
    shapes = {name: p.shape for name, p in model.named_parameters()}
    b = source.global_batch // spec.dp
    if user:
        from lmsys.model.user import tp_plan as plan_of

        example = torch.zeros(b, config.context_length, dtype=torch.long, device=ctx.device)
        pm = user_parallel.UserParallelModel(model, mesh, plan=plan_of(config, tp_plan), pp_schedule=pp_schedule,
                                             microbatches=microbatches, dp_strategy=dp_strategy, device=ctx.device,
                                             example=example)
    elif impl == "torch":
        pm = TorchParallelModel(model, mesh, sequence_parallel=sequence_parallel, pp_schedule=pp_schedule,
                                virtual_stages=virtual_stages, microbatches=microbatches, dp_strategy=dp_strategy,
                                device=ctx.device)
    else:
        pm = parallelize(model, mesh, sequence_parallel=sequence_parallel, pp_schedule=pp_schedule,
                         virtual_stages=virtual_stages, microbatches=microbatches,
                         tokens_per_microbatch=b // microbatches * config.context_length, dp_strategy=dp_strategy,
                         checkpoint=checkpoint)
    del model
    optimizer = make_optimizer(pm.parameters(), lr=DDP_TRAIN_LR, kind=default_kind(ctx.device))  # bench e2e's
    autocast_dtype = None if dtype == "fp32" else torch_dtype(dtype)
    autocast = (lambda: torch.autocast(ctx.device.type, dtype=autocast_dtype)) if autocast_dtype else None
    # every step's batch on the device before the loop, as bench e2e's one batch is (and ddp train's): a copy
    # from pageable host memory synchronises the stream, so drawn per step it left the host no lead
    batches = [to_device(source.local_batch_at(i, coords["dp"], spec.dp), ctx.device) for i in range(total)]
    timers, losses, act = timed_steps(pm, optimizer, batches, warmup=warmup, microbatches=microbatches,
                                      autocast=autocast, device=ctx.device)
    del batches
    losses = [None if x is None else float(x) for x in losses]
    wall = [t.samples("step")[0] * 1e-3 for t in timers]
    measured = impl == "lmsys"  # torch's schedules do not report their compute time
    busy = [sum(t.samples("compute")) * 1e-3 for t in timers] if measured else [None]
    comm = {d: statistics.median([sum(t.samples(d)) for t in timers]) if measured else None for d in COMM_DIMS}
    # the loss lives on the last stage (the same on its tp ranks): the mean over dp ranks -> rank 0
    # on the rank's device: NCCL reduces no CPU tensor
    last_loss = torch.zeros(total, dtype=torch.float64, device=ctx.device)
    if coords["pp"] == spec.pp - 1 and coords["tp"] == 0:
        last_loss = torch.tensor([float(x) for x in losses], dtype=torch.float64, device=ctx.device) / spec.dp
    dist.all_reduce(last_loss)
    # per-rank facts -> rank 0
    peak = peak_memory(ctx.device)
    n_params = sum(local_numel(p) for p in pm.parameters())
    step_ms = statistics.median(wall) * 1e3
    idle = [(w - bz) / w for w, bz in zip(wall, busy)] if measured else [0.0]
    mine = dict(busy=statistics.median(busy) if measured else 0.0, idle=statistics.median(idle),
                act=act if measured else None, peak=peak, params=n_params, ms=step_ms, comm=comm)
    facts = [None] * ctx.world_size
    dist.all_gather_object(facts, mine)
    full = pm.full_parameters(shapes)
    del pm, optimizer
    free_memory(ctx.device)
    if not ctx.is_main:
        return {}
    busiest = max(facts, key=lambda f: f["busy"])
    ms = max(f["ms"] for f in facts)
    tokens = source.global_batch * config.context_length
    row = dict.fromkeys(ROW_KEYS)
    peaks = [f["peak"] for f in facts if f["peak"] is not None]
    row.update({
        "impl": impl, "mesh": spec.label, "dp strategy": dp_strategy if spec.dp > 1 else "-",
        "schedule": schedule_label if spec.pp > 1 or microbatches > 1 else (", ".join(
            (["SP"] if sequence_parallel and spec.tp > 1 else []) + ([f"checkpoint {checkpoint}"] if checkpoint != "none"
                                                                     else [])) or "-"),
        "ms/step": ms,
        "tokens/s": tokens / (ms * 1e-3),  # the global batch's tokens per step / step time
        "MFU %": mfu_percent(config, tokens=tokens, step_ms=ms, device=ctx.device, dtype=dtype,
                             processes=ctx.world_size),
        "peak MiB/rank": max(peaks) / MiB if peaks else None,
        "params/rank": max(f["params"] for f in facts),
        **{f"comm ms ({d})": _comm_cell(facts, d, spec, measured=measured) for d in COMM_DIMS},
        # idle over step time on the stage with the most compute (the one that sets the pace)
        "bubble %": None if spec.pp == 1 else 100 * busiest["idle"] if measured else NOT_MEASURED,
        "ideal bubble %": 100 * ideal_bubble(pp_schedule, pp=spec.pp, microbatches=microbatches,
                                             virtual_stages=virtual_stages) if spec.pp > 1 else None,
        "act MiB held": max(f["act"] for f in facts) / MiB if measured else NOT_MEASURED,
        "loss": float(last_loss[-1]),
        "status": "ok",
    })
    if reference is not None:
        ref_ms, ref_losses, ref_params = reference
        row["|Δloss|"] = max(abs(a - b) for a, b in zip(last_loss.tolist(), ref_losses))
        row["parity max|Δθ|"] = max((full[n] - ref_params[n]).abs().max().item() for n in ref_params)
        row["× 1 process"] = ref_ms / ms
    return row


def timed_steps(pm, optimizer, batches, *, warmup: int, microbatches: int, autocast, device):
    """Train on `batches` (on the device already) with bench e2e's loop (lmsys.train.loop's timed_loop):
    `pm`'s ParallelStep, every step from `warmup` on timed in the one timer (CUDA events on a GPU),
    nothing synchronised inside or between steps, the gradients cleared (set to None) before each step.
    The region "step" holds the forward-backward and the optimizer; the model's own (compute, tp, pp, dp)
    go to the same timer. The activations are counted on the first step only (a hook per saved tensor; a
    warm-up step unless --warmup 0). Returns (a RegionTimer per timed step, the loss tensors of every
    step, the activation bytes of the first)."""
    step = ParallelStep(pm, optimizer, microbatches=microbatches, autocast=autocast, device=device)
    losses: list = []
    timers = timed_loop(step, batches, warmup=warmup, device=device, names={"step": "step"}, timer_per_step=True,
                        losses=losses)
    return timers, losses, step.activation_bytes


def _comm_cell(facts: list[dict], dim: str, spec, *, measured: bool):
    """The largest per-rank median of a dim's communication ms per step; None where the dim is 1 (nothing
    to measure), NOT_MEASURED in torch's rows (inside DTensor and pipelining, out of lmsys's timer)."""
    if getattr(spec, dim) == 1:
        return None
    return max(f["comm"][dim] for f in facts) if measured else NOT_MEASURED


def _status_row(impl: str, spec, dp_strategy: str, schedule: str, status: str) -> dict:
    row = dict.fromkeys(ROW_KEYS)
    row.update({"impl": impl, "mesh": spec.label, "dp strategy": dp_strategy, "schedule": schedule, "status": status})
    return row

