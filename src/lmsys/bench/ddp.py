"""The training run behind `lmsys ddp train`: every strategy on the same model, data and numerics.

On each rank of a group (see launch.py), `train_job`:
1. on rank 0 alone (the others wait at a barrier): trains the model in one process on the per-rank
   batch (the 1-GPU step time that scaling efficiency is measured against), then on the full batch
   (all ranks' batches together: the parity reference), keeping the final parameters on the host;
2. for every strategy: builds the model on each rank from a seed of its own (seed + rank, as CS336's
   tests seed them: a wrapper that does not broadcast rank 0's weights cannot pass; the reference starts
   from rank 0's), wraps it, checks that every rank now holds rank 0's weights, trains `warmup + steps`
   steps on this rank's slice of the same batches, times the timed steps with the one timer, and compares
   the first step's gradients and the final parameters with the reference (max |Δθ|). A failure names its
   likely cause from the numbers (`diagnose_gradients`): no broadcast, gradients world-size × the
   reference (not averaged), some parameters' gradients never all-reduced (a bucket that never fires),
   parameters that drift only after the optimizer (a sharded optimizer that does not broadcast). A
   sharded optimizer whose state is spread unevenly over the ranks gets a note with the largest share.

Data: a fixed pool of random token sequences; each step draws a shuffled global batch from it (same
draw on every rank and in the reference); rank r trains on rows [r·B, (r+1)·B) of it.

Rows: strategy, ms/step (median), forward / backward / comm-wait / optimizer medians, peak memory
(max over ranks), tokens/s over all ranks, weak-scaling efficiency (1-GPU step time / step time: same
per-rank batch, 100 % is perfect) and parity.
"""

from __future__ import annotations

import gc
from typing import Optional

import torch
import torch.distributed as dist

from lmsys.core import progress
from lmsys.core.devices import environment, free_memory, peak_memory, reset_peak_memory
from lmsys.core.imports import NotImplementedByUser
from lmsys.core.parsing import MiB
from lmsys.core.timing import Stats
from lmsys.bench.ddp_runs import RunSpec
from lmsys.distributed.data_parallel.strategies import (final_parameters, get as get_strategy, gradients,
                                                        make_strategy_optimizer, optimizer_label, step_hooks,
                                                        wrap_model)
from lmsys.distributed.data_parallel.zero1 import optimizer_state_bytes
from lmsys.distributed.launch import RankContext, barrier
from lmsys.model import describe
from lmsys.model.config import ModelConfig, get_config
from lmsys.model.user import with_model
from lmsys.train.build import build_model
from lmsys.train.optim import DDP_TRAIN_LR
from lmsys.train.data import BatchSource, to_device
from lmsys.train.loop import mfu_percent, train_loop, train_one_process


def resolve_model_size(size: Optional[str], context_length: Optional[int], *, backend: str, dtype: str,
                       runs: list[RunSpec], model: Optional[str] = None, model_kwargs: str = "") -> tuple[str, int]:
    """(size, context length) of the model `ddp train` builds, resolved and checked once in the
    launching process (not on every rank): lmsys.model.config.resolve_size's checks, and the dtype for
    the strategies."""
    from lmsys.core.devices import check_dtype_for_device, resolve_device
    from lmsys.core.errors import LmsysError
    from lmsys.model.config import resolve_size

    check_dtype_for_device(dtype, resolve_device("cuda" if backend == "nccl" else "cpu"))  # this first
    if dtype == "fp16" and any(get_strategy(r.strategy).shards_params for r in runs):
        raise LmsysError("fsdp with fp16 needs a sharded gradient scaler, which lmsys does not have; use bf16")
    return resolve_size(size, context_length, backend=backend, dtype=dtype, model=model, model_kwargs=model_kwargs)


def train_job(ctx: RankContext, *, peak_tflops: Optional[float] = None, **kwargs) -> dict:
    """The job on each rank; MFU divides by `peak_tflops` per GPU (a --peak-tflops) or the GPU table's."""
    from lmsys.core.devices import given_peak

    with given_peak(peak_tflops):
        return _train_job(ctx, **kwargs)


def _train_job(ctx: RankContext, *, runs: list[dict], size: str, context_length: int, batch_size: int,
              dtype: str, steps: int, warmup: int, shard_optimizer: bool, seed: int = 0,
              baseline: bool = True, model: Optional[str] = None, model_kwargs: str = "") -> dict:
    config = with_model(get_config(size).with_overrides(context_length=context_length), model, model_kwargs)
    source = BatchSource(vocab_size=config.vocab_size, seq_len=context_length,
                         global_batch=batch_size * ctx.world_size, seed=seed)
    total = warmup + steps
    rows: list[dict] = []
    reference, single_ms, notes = None, None, []
    progress.plan_rows(len(runs) + (2 if baseline else 0))
    if ctx.is_main and baseline:  # one process: the 1-GPU step time, then the full-batch parity reference
        rows, single_ms, reference, notes = baseline_runs(ctx, config, source, batch_size=batch_size,
                                                          dtype=dtype, warmup=warmup, total=total, seed=seed)
    barrier(ctx)

    batches = [to_device(source.local_batch_at(i, ctx.rank, ctx.world_size), ctx.device) for i in range(total)]
    for spec in (RunSpec(**r) for r in runs):
        progress.start_row(spec.strategy)
        row = strategy_run(ctx, config, spec, batches, dtype=dtype, warmup=warmup,
                           shard_optimizer=shard_optimizer, seed=seed, reference=reference, single_ms=single_ms,
                           tolerance=parity_tolerance(dtype, spec, total=total), notes=notes)
        if ctx.is_main:
            rows.append(row)
        barrier(ctx)
    meta = environment(ctx.device)
    meta["model"] = f"{size}: {describe(config)}"
    return {"rows": rows, "meta": meta, "notes": notes}


def baseline_runs(ctx: RankContext, config, source, *, batch_size, dtype, warmup, total, seed):
    """(rows, 1-process ms/step or None, reference parameters or None, notes). Each one-process run
    happens only when the memory estimate fits the budget; a caught OOM is the backstop."""
    from lmsys.core.devices import oom_row
    from lmsys.distributed.memory import fits

    label = f"1 process, batch {batch_size}"
    rows, notes, single_ms, reference = [], [], None, None
    ok, why = fits(config, batch_size=batch_size, dtype=dtype, device=ctx.device)
    progress.start_row(label)
    local_grads = {}
    if ok:
        batches = [to_device(source.local_batch_at(i, 0, ctx.world_size), ctx.device) for i in range(total)]
        # rank 0's own first-step gradients (a gradient never all-reduced equals them); copied inside step 1,
        # which is untimed only with a warm-up
        row, kept = _guarded_single_run(config, batches, ctx=ctx, dtype=dtype, warmup=warmup, seed=seed,
                                        label=label, keep_params=False, keep_grads=warmup > 0, estimate=why)
        local_grads = kept[1] if kept is not None else {}
        del batches
    else:
        row = oom_row(f"OOM: {why}", ROW_KEYS, strategy=label, optimizer="AdamW")
    rows.append(row)
    if row["status"] == "ok":
        single_ms = row["ms/step"]
    else:
        notes.append(f"{label}: {row['status']}; it was not run to the end, so scaling eff % is empty "
                     "(nothing to compare with). The strategies still ran.")
    full = batch_size * ctx.world_size
    progress.start_row("reference")
    ok, why = fits(config, batch_size=full, dtype=dtype, device=ctx.device)
    if ok:
        batches = [to_device(source.global_batch_at(i), ctx.device) for i in range(total)]
        ref_row, reference = _guarded_single_run(config, batches, ctx=ctx, dtype=dtype, warmup=warmup,
                                                 seed=seed, label="reference", keep_params=True, estimate=why)
        if reference is not None:
            reference = (*reference, local_grads)
        why = ref_row["status"]
        del batches
    if reference is None:
        notes.append(f"parity max|Δθ| is empty: the reference (one process on the full batch of {full}) "
                     f"does not fit ({why.removeprefix('OOM: ')}), so there is nothing to compare with.")
    return rows, single_ms, reference, notes


def _guarded_single_run(config, batches, *, ctx, dtype, warmup, seed, label, keep_params, estimate,
                        keep_grads=None):
    """single_process_run; torch's OOM becomes an `OOM` row (and no parameters). `estimate`: what the
    memory estimate said (`fits`), for that row."""
    from lmsys.core.devices import oom_row
    from lmsys.distributed.memory import PhaseTracker, requested_bytes

    try:
        PhaseTracker(ctx.rank).enter("baseline")  # LMSYS_INJECT_OOM=0:baseline tests this path
        return single_process_run(config, batches, device=ctx.device, dtype=dtype, warmup=warmup,
                                  seed=seed, label=label, keep_params=keep_params,
                                  keep_grads=keep_params if keep_grads is None else keep_grads)
    except torch.OutOfMemoryError as exc:
        asked = requested_bytes(exc)
        status = f"OOM (caught{', tried to allocate ' + asked if asked else ''}; the estimate said {estimate})"
    free_memory(ctx.device)
    return oom_row(status, ROW_KEYS, strategy=label, optimizer="AdamW"), None


def single_process_run(config, batches, *, device, dtype, warmup, seed, label, keep_params: bool,
                       keep_grads: Optional[bool] = None):
    """(row, (final parameters or None, first-step gradients) on the host, or None when neither is kept):
    lmsys.train.loop's train_one_process with the strategies' AdamW (foreach)."""
    keep_grads = keep_params if keep_grads is None else keep_grads
    run = train_one_process(config, batches, device=device, dtype=dtype, warmup=warmup, seed=seed,
                          keep_params=keep_params, keep_first_grads=keep_grads)
    stats = run.timer.stats()
    tokens = batches[0][0].numel()
    util = mfu_percent(config, tokens=tokens, step_ms=stats["step"].median, device=device, dtype=dtype, processes=1)
    row = _timing_row(label, stats, tokens=tokens, peak=run.peak_bytes, optimizer="AdamW",
                      optim_bytes=run.optimizer_bytes, mfu=util)
    return row, ((run.params, run.first_grads) if keep_params or keep_grads else None)


def parity_tolerance(dtype: str, spec: RunSpec, *, total: int) -> tuple[float, float]:
    """(max |Δθ|, max |Δg| / max |g|) a row may reach: fp32 only sums in another order; with bf16 or fp16
    (autocast, or bf16 gradients) AdamW moves a weight by up to ~lr per step whatever its gradient, so
    rounding that flips a tiny gradient's sign shows at the lr scale."""
    if dtype == "fp32" and spec.comm_dtype == "fp32":
        return 1e-4, 1e-4
    return 2 * DDP_TRAIN_LR * total, 5e-2


def strategy_run(ctx: RankContext, config: ModelConfig, spec: RunSpec, batches, *, dtype, warmup,
                 shard_optimizer: bool, seed: int, reference, single_ms: Optional[float],
                 tolerance: tuple[float, float] = (float("inf"), float("inf")), notes: Optional[list] = None
                 ) -> dict:
    """One strategy's row. Rank r builds the model from seed + r (rank 0's is the reference's start)."""
    from lmsys.distributed.memory import PhaseTracker, RankOutOfMemory

    free_memory(ctx.device)
    reset_peak_memory(ctx.device)
    tracker = PhaseTracker(ctx.rank)
    strategy = get_strategy(spec.strategy)
    sharded = shard_optimizer and not strategy.shards_params and strategy.optimizer is None
    shards_state = sharded or strategy.shards_optimizer
    first_grads = {}
    unbroadcast = None
    model = wrapped = optimizer = None
    try:
        tracker.enter("build")
        model = build_model(config, device=ctx.device, seed=seed + ctx.rank)  # each rank its own weights
        wrapped = wrap_model(model, spec, ctx, dtype=dtype)
        if not strategy.shards_params:  # a collective on every rank
            unbroadcast = ranks_disagree(ctx, wrapped)
        optimizer = make_strategy_optimizer(wrapped, spec, sharded=sharded)
        tracker.watch(wrapped, optimizer)
        before, after_backward = step_hooks(wrapped, optimizer, spec)

        def keep_grads():
            grads = gradients(wrapped, spec) if ctx.is_main and reference is not None else None
            first_grads.update({n: g.detach().clone() for n, g in (grads or {}).items() if g is not None})

        timer = train_loop(wrapped, optimizer, batches, device=ctx.device, dtype=dtype, warmup=warmup,
                           before=before, after_backward=after_backward, on_first_grads=keep_grads,
                           tracker=tracker)
        final = final_parameters(wrapped, spec)
    except torch.OutOfMemoryError as exc:
        raise RankOutOfMemory(rank=ctx.rank, phase=tracker.phase, what=spec.label, exc=exc) from None
    except NotImplementedByUser as exc:  # every rank runs the same code: they all get here
        tracker.close()
        del model, wrapped, optimizer
        gc.collect()
        free_memory(ctx.device)
        row = dict.fromkeys(ROW_KEYS)
        row.update({"strategy": spec.label, "status": exc.status})
        return row
    tracker.close()
    peak = peak_memory(ctx.device)
    if peak is not None:  # plus what torch's allocator does not see (the copy-engine lever's buffer)
        peak += getattr(wrapped, "unaccounted_bytes", 0)
    peak = _max_over_ranks(ctx, peak)
    per_rank = _gather_ints(ctx, optimizer_state_bytes(optimizer))
    optim_bytes = max(per_rank)
    if ctx.is_main and shards_state and notes is not None:
        uneven = uneven_state(per_rank)
        if uneven:
            notes.append(f"{spec.label}: {uneven}")
    parity, status = None, "ok"
    if ctx.is_main and reference is not None:
        parity, status = compare_with_reference(final, first_grads, reference, device=ctx.device,
                                                tolerance=tolerance, world_size=ctx.world_size,
                                                shards_optimizer=shards_state)
    if ctx.is_main and unbroadcast is not None:  # the cause before any of its consequences
        status = f"FAIL: {unbroadcast}"
    del model, wrapped, optimizer, final
    gc.collect()
    free_memory(ctx.device)
    stats = timer.stats()
    tokens = batches[0][0].numel() * ctx.world_size
    util = mfu_percent(config, tokens=tokens, step_ms=stats["step"].median, device=ctx.device, dtype=dtype,
                       processes=ctx.world_size)
    row = _timing_row(spec.label, stats, tokens=tokens, peak=peak, optimizer=optimizer_label(spec, sharded=sharded),
                      parity=parity, single_ms=single_ms, optim_bytes=optim_bytes, mfu=util)
    row["status"] = status
    return row


def compare_with_reference(final: dict, grads: dict, reference, *, device, tolerance, world_size: int = 1,
                           shards_optimizer: bool = False) -> tuple[float, str]:
    """(max |Δθ| over all parameters, status): `ok`, or FAIL naming the worst parameter (or gradient after
    the first step, relative to the largest reference gradient) beyond `tolerance`, and the likely cause
    (`diagnose_gradients`; parameters off with gradients right: they drift only after the optimizer).
    `reference`: (parameters, first-step gradients[, rank 0's own first-step gradients])."""
    params, ref_grads, *rest = reference
    local_grads = rest[0] if rest else {}
    missing = sorted(set(params) - set(final))
    if missing:
        return None, f"FAIL: no parameter {missing[0]!r} among the trained ones ({len(final)} names)"
    diffs = {name: (final[name].float() - ref.to(device, non_blocking=True).float()).abs().max()
             for name, ref in params.items()}  # on the device, one synchronisation at the end
    values = torch.stack(list(diffs.values())).cpu()
    worst = int(values.argmax())
    parity, name = values[worst].item(), list(diffs)[worst]
    theta_tol, grad_tol = tolerance
    compared = bool(grads and ref_grads)
    if compared:  # first: a wrong gradient is the cause, the parameters only follow it
        scale = max(g.abs().max().item() for g in ref_grads.values()) or 1.0
        errors = {n: (grads[n].float() - g.to(device).float()).abs().max().item() / scale
                  for n, g in ref_grads.items() if n in grads}
        if errors:
            bad = max(errors, key=errors.get)
            if not errors[bad] <= grad_tol:
                cause = diagnose_gradients(grads, ref_grads, local_grads, errors, tolerance=grad_tol,
                                           world_size=world_size, device=device)
                return parity, (f"FAIL: grad of {bad} after step 1 off by {errors[bad]:.3g} of max|g| > {grad_tol:g}"
                                + (f": {cause}" if cause else ""))
        absent = [n for n in ref_grads if n not in grads]
        if absent:
            return parity, (f"FAIL: no gradient for {absent[0]} after step 1 ({len(absent)} of {len(ref_grads)} "
                            "parameters): its hook or bucket never fired")
    if not parity <= theta_tol:
        cause = ""
        if compared:
            cause = (": the gradients match the reference after step 1, the parameters drift only after the "
                     "optimizer" + (" (a sharded optimizer that does not broadcast its updated parameters)"
                                    if shards_optimizer else ""))
        return parity, f"FAIL: {name} |Δθ| {parity:.3g} > {theta_tol:g}{cause}"
    return parity, "ok"


def diagnose_gradients(grads: dict, ref_grads: dict, local_grads: dict, errors: dict, *, tolerance: float,
                       world_size: int, device) -> str:
    """The likely cause of wrong first-step gradients on rank 0, from the numbers: all of them one constant
    times the reference (world size ×: summed, not averaged), some wrong and the rest exact (their bucket
    never fired; confirmed when they equal rank 0's own gradients `local_grads`), all of them rank 0's own
    (never all-reduced); '' when none of these fits."""
    names = [n for n in ref_grads if n in grads]
    dot = rr = gg = 0.0
    for n in names:
        g, r = grads[n].double(), ref_grads[n].to(device).double()
        dot, rr, gg = dot + (g * r).sum().item(), rr + (r * r).sum().item(), gg + (g * g).sum().item()
    if rr > 0 and gg > 0:
        factor = dot / rr
        residual = max(gg - factor * dot, 0.0) ** 0.5 / gg ** 0.5  # |g - f·r| / |g|, f the least-squares fit
        if residual <= max(tolerance, 1e-3):
            if world_size > 1 and abs(factor - world_size) <= 0.01 * world_size:
                return (f"the gradients are {factor:.3g}x the reference, the world size {world_size}: summed "
                        "across ranks, not averaged (divide by the world size)")
            if world_size > 1 and abs(factor * world_size - 1) <= 0.01:
                return f"the gradients are 1/{world_size} of the reference: divided by the world size twice"
            return f"the gradients are {factor:.3g}x the reference: off by a constant factor"
    bad = [n for n in names if not errors[n] <= tolerance]
    own = []
    if local_grads:
        scale = max(g.abs().max().item() for g in ref_grads.values()) or 1.0
        own = [n for n in bad if n in local_grads and
               (grads[n].float() - local_grads[n].to(device).float()).abs().max().item() / scale <= tolerance]
    if len(bad) < len(names):
        what = f"{len(bad)} of {len(names)} parameters' gradients are wrong, the rest match the reference"
        if own and len(own) == len(bad):
            what += " and these are rank 0's own (never all-reduced)"
        return what + f": a bucket that never fires, or parameters left out of the sync (first: {bad[0]})"
    if own and len(own) == len(bad):
        return "every gradient is rank 0's own: none was all-reduced (finish_gradient_synchronization does nothing?)"
    return ""


def ranks_disagree(ctx: RankContext, wrapped) -> Optional[str]:
    """After wrapping, before the first step: each rank's per-parameter sums gathered to every rank; None
    when every rank holds rank 0's weights, else why not (on every rank: the same collective answer)."""
    from lmsys.distributed.data_parallel.strategies import inner_module

    named = [(n, p) for n, p in inner_module(wrapped).named_parameters()]
    sums = torch.stack([p.detach().double().sum() for _, p in named]) if named else \
        torch.zeros(1, dtype=torch.float64, device=ctx.device)
    gathered = [torch.empty_like(sums) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, sums)
    for rank, other in enumerate(gathered[1:], 1):
        off = (other - gathered[0]).abs() > 1e-9 * gathered[0].abs().clamp_min(1.0)
        if bool(off.any()):
            first = named[int(off.nonzero()[0, 0])][0] if named else "?"
            return (f"weights differ across ranks before the first step (rank {rank}'s {first} is not rank 0's, "
                    f"{int(off.sum())} of {off.numel()} parameters): no broadcast of rank 0's initial weights")
    return None


def uneven_state(per_rank: list[int], *, slack: float = 1.25) -> str:
    """A sharded optimizer's state spread over the ranks: '' when even (the largest share within `slack` of
    1/world), else what the largest rank holds."""
    total = sum(per_rank)
    if total <= 0 or len(per_rank) < 2:
        return ""
    rank = max(range(len(per_rank)), key=per_rank.__getitem__)
    share = per_rank[rank] / total
    even = 1 / len(per_rank)
    if share <= slack * even:
        return ""
    return (f"optimizer state is spread unevenly: rank {rank} holds {100 * share:.0f} % of it (an even split: "
            f"{100 * even:.0f} %): sharding saves that rank little memory")


def _gather_ints(ctx: RankContext, value: Optional[int]) -> list[int]:
    """Every rank's `value` (None as 0), in rank order."""
    t = torch.tensor([value or 0], dtype=torch.int64, device=ctx.device)
    out = [torch.empty_like(t) for _ in range(ctx.world_size)]
    dist.all_gather(out, t)
    return [int(x.item()) for x in out]


def _max_over_ranks(ctx: RankContext, value: Optional[int]) -> Optional[int]:
    if value is None:
        return None
    t = torch.tensor([value], dtype=torch.int64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


ROW_KEYS = ("strategy", "optimizer", "ms/step", "forward ms", "backward ms", "comm wait ms", "optimizer ms",
            "peak MiB/rank", "optim MiB/rank", "tokens/s", "MFU %", "scaling eff %", "parity max|Δθ|", "status")


def _timing_row(label: str, stats: dict[str, Stats], *, tokens: int, peak: Optional[int], optimizer: str,
                parity: Optional[float] = None, single_ms: Optional[float] = None,
                optim_bytes: Optional[int] = None, mfu: Optional[float] = None) -> dict:
    step_ms = stats["step"].median

    def median(name):
        return stats[name].median if name in stats else None

    row = {
        "strategy": label,
        "optimizer": optimizer,
        "ms/step": step_ms,
        "forward ms": median("forward"),
        "backward ms": median("backward"),
        "comm wait ms": median("comm wait"),
        "optimizer ms": median("optimizer"),
        "peak MiB/rank": None if peak is None else peak / MiB,
        "optim MiB/rank": None if optim_bytes is None else optim_bytes / MiB,
        "tokens/s": tokens / (step_ms * 1e-3),  # all ranks' tokens per step / step time
        "MFU %": mfu,
        # weak scaling: same per-rank batch, so perfect scaling keeps the 1-process step time
        "scaling eff %": None if single_ms is None else 100 * single_ms / step_ms,
        "parity max|Δθ|": parity,
        "status": "ok",
    }
    assert tuple(row) == ROW_KEYS
    return row
