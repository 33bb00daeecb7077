"""The training run behind `lmsys ddp train`: every strategy on the same model, data and numerics.

On each rank of a group (see launch.py), `train_job`:
1. on rank 0 alone (the others wait at a barrier): trains the model in one process on the per-rank
   batch (the 1-GPU step time that scaling efficiency is measured against), then on the full batch
   (all ranks' batches together: the parity reference), keeping the final parameters on the host;
2. for every strategy: builds the model from the same seed, wraps it, trains `warmup + steps` steps on
   this rank's slice of the same batches, times the timed steps with the one timer, and compares the
   final parameters with the reference (max |Δθ|).

Data: a fixed pool of random token sequences; each step draws a shuffled global batch from it (same
draw on every rank and in the reference); rank r trains on rows [r·B, (r+1)·B) of it.

Rows: strategy, ms/step (median), forward / backward / comm-wait / optimizer medians, peak memory
(max over ranks), tokens/s over all ranks, weak-scaling efficiency (1-GPU step time / step time: same
per-rank batch, 100 % is perfect) and parity.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from lmsys.train.step import TIMER_NAMES, TrainStep, make_optimizer, no_range, run_step
from lmsys.core.devices import environment, free_memory, peak_memory, reset_peak_memory, torch_dtype
from lmsys.core.parsing import MiB
from lmsys.core.timing import RegionTimer, Stats, synchronize
from lmsys.distributed.launch import RankContext, barrier
from lmsys.model import describe
from lmsys.model.config import ModelConfig, get_config

STRATEGIES = ("naive", "flat", "overlap", "bucketed", "torch-ddp", "fsdp")
COMM_DTYPES = ("fp32", "bf16")
LEARNING_RATE = 1e-3


@dataclass(frozen=True)
class RunSpec:
    """One row of `ddp train`: a strategy and its knobs."""

    strategy: str
    bucket_mb: Optional[float] = None  # bucketed only
    comm_dtype: str = "fp32"  # bucketed only: dtype the gradients travel in


def expand_runs(strategies: list[str], *, bucket_mbs: list[float], comm_dtypes: list[str]) -> list[RunSpec]:
    runs = []
    for s in strategies:
        if s == "bucketed":
            runs += [RunSpec(s, mb, cd) for cd in comm_dtypes for mb in bucket_mbs]
        else:
            runs.append(RunSpec(s))
    return runs


class BatchSource:
    """A fixed pool of sequences; step i draws a shuffled global batch (deterministic in seed and i)."""

    def __init__(self, *, vocab_size: int, seq_len: int, global_batch: int, seed: int, pool_factor: int = 4):
        gen = torch.Generator().manual_seed(seed)
        self.pool = torch.randint(0, vocab_size, (global_batch * pool_factor, seq_len + 1), generator=gen)
        self.global_batch = global_batch
        self.seed = seed

    def global_batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        rows = torch.randperm(self.pool.shape[0], generator=gen)[:self.global_batch]
        seqs = self.pool[rows]
        return seqs[:, :-1], seqs[:, 1:]  # inputs, next-token targets: [G, S] each

    def local_batch_at(self, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = self.global_batch_at(step)
        b = self.global_batch // world
        return inputs[rank * b:(rank + 1) * b], targets[rank * b:(rank + 1) * b]


def train_job(ctx: RankContext, *, runs: list[dict], size: str, context_length: int, batch_size: int,
              dtype: str, steps: int, warmup: int, shard_optimizer: bool, seed: int = 0) -> dict:
    config = get_config(size).with_overrides(context_length=context_length)
    source = BatchSource(vocab_size=config.vocab_size, seq_len=context_length,
                         global_batch=batch_size * ctx.world_size, seed=seed)
    total = warmup + steps
    rows: list[dict] = []
    reference = None
    single_ms = None
    if ctx.is_main:  # one process: the 1-GPU step time, then the full-batch parity reference
        batches = [_to(source.local_batch_at(i, 0, ctx.world_size), ctx.device) for i in range(total)]
        row, _ = single_process_run(config, batches, device=ctx.device, dtype=dtype, warmup=warmup,
                                    seed=seed, label=f"1 process, batch {batch_size}", keep_params=False)
        rows.append(row)
        single_ms = row["ms/step"]
        batches = [_to(source.global_batch_at(i), ctx.device) for i in range(total)]
        _, reference = single_process_run(config, batches, device=ctx.device, dtype=dtype, warmup=warmup,
                                          seed=seed, label="reference", keep_params=True)
        del batches
    barrier(ctx)

    batches = [_to(source.local_batch_at(i, ctx.rank, ctx.world_size), ctx.device) for i in range(total)]
    for spec in (RunSpec(**r) for r in runs):
        row = strategy_run(ctx, config, spec, batches, dtype=dtype, warmup=warmup,
                           shard_optimizer=shard_optimizer, seed=seed, reference=reference, single_ms=single_ms)
        if ctx.is_main:
            rows.append(row)
        barrier(ctx)
    meta = environment(ctx.device)
    meta["model"] = f"{size}: {describe(config)}"
    return {"rows": rows, "meta": meta}


def _to(batch, device):
    return tuple(t.to(device) for t in batch)


def build_model(config: ModelConfig, *, device, seed: int):
    from lmsys.model.transformer import TransformerLM

    torch.manual_seed(seed)
    return TransformerLM(config, device=device)


def train_loop(model, optimizer, batches, *, device, dtype: str, warmup: int) -> RegionTimer:
    """warmup + timed steps; regions: step (forward, backward, comm wait, optimizer)."""
    step = TrainStep(model, optimizer, device=device, dtype=dtype)
    timer = RegionTimer(device)
    names = {**TIMER_NAMES, "after_backward": "comm wait"}
    for i, (inputs, targets) in enumerate(batches):
        run_step(step, inputs, targets, range_fn=timer.region if i >= warmup else no_range, names=names,
                 before=getattr(model, "on_train_batch_start", None),
                 after_backward=getattr(model, "finish_gradient_synchronization", None))
    synchronize(device)
    return timer


def single_process_run(config, batches, *, device, dtype, warmup, seed, label, keep_params: bool):
    """(row, final parameters on the host, or None)."""
    free_memory(device)
    reset_peak_memory(device)
    model = build_model(config, device=device, seed=seed)
    optimizer = make_optimizer(model.parameters(), lr=LEARNING_RATE)
    timer = train_loop(model, optimizer, batches, device=device, dtype=dtype, warmup=warmup)
    peak = peak_memory(device)
    pin = torch.device(device).type == "cuda"  # pinned: fast copies back for every parity check
    params = None
    if keep_params:
        params = {name: (p.detach().cpu().pin_memory() if pin else p.detach().clone())
                  for name, p in model.named_parameters()}
    del model, optimizer
    free_memory(device)
    stats = timer.stats()
    tokens = batches[0][0].numel()
    row = _timing_row(label, stats, tokens=tokens, peak=peak, optimizer="AdamW")
    return row, params


def strategy_run(ctx: RankContext, config: ModelConfig, spec: RunSpec, batches, *, dtype, warmup,
                 shard_optimizer: bool, seed: int, reference, single_ms: Optional[float]) -> dict:
    free_memory(ctx.device)
    reset_peak_memory(ctx.device)
    model = build_model(config, device=ctx.device, seed=seed)
    wrapped = wrap_model(model, spec, ctx, dtype=dtype)
    sharded = shard_optimizer and spec.strategy != "fsdp"
    optimizer = make_optimizer(wrapped.parameters(), lr=LEARNING_RATE, sharded=sharded)
    timer = train_loop(wrapped, optimizer, batches, device=ctx.device, dtype=dtype, warmup=warmup)
    peak = _max_over_ranks(ctx, peak_memory(ctx.device))
    final = final_parameters(wrapped, spec)
    parity = None
    if ctx.is_main:  # on the device, one synchronisation at the end
        diffs = [(final[name].float() - ref.to(ctx.device, non_blocking=True).float()).abs().max()
                 for name, ref in reference.items()]
        parity = torch.stack(diffs).max().item()
    del model, wrapped, optimizer, final
    gc.collect()
    free_memory(ctx.device)
    stats = timer.stats()
    label = spec.strategy
    if spec.strategy == "bucketed":
        label += f" {spec.bucket_mb:g} MiB" + (f" {spec.comm_dtype} grads" if spec.comm_dtype != "fp32" else "")
    optimizer_name = ("AdamW, ZeRO-1 sharded" if sharded else
                      "AdamW on shards" if spec.strategy == "fsdp" else "AdamW")
    return _timing_row(label, stats, tokens=batches[0][0].numel() * ctx.world_size, peak=peak,
                       optimizer=optimizer_name, parity=parity, single_ms=single_ms)


def wrap_model(model, spec: RunSpec, ctx: RankContext, *, dtype: str):
    from lmsys.distributed import ddp

    if spec.strategy == "naive":
        return ddp.NaiveDDP(model)
    if spec.strategy == "flat":
        return ddp.FlatDDP(model)
    if spec.strategy == "overlap":
        return ddp.OverlapDDP(model)
    if spec.strategy == "bucketed":
        comm = None if spec.comm_dtype == "fp32" else torch_dtype(spec.comm_dtype)
        return ddp.BucketedDDP(model, spec.bucket_mb, comm_dtype=comm)
    if spec.strategy == "torch-ddp":
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [ctx.local_rank] if ctx.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)
    if spec.strategy == "fsdp":
        from lmsys.distributed.fsdp import FSDP

        return FSDP(model, compute_dtype=None if dtype == "fp32" else torch_dtype(dtype))
    raise ValueError(f"unknown strategy {spec.strategy!r}")


def final_parameters(wrapped, spec: RunSpec) -> dict[str, torch.Tensor]:
    """Full parameters by the model's names (FSDP gathers them: a collective on every rank)."""
    if spec.strategy == "fsdp":
        return wrapped.gather_full_params()
    return {name: p.detach() for name, p in wrapped.module.named_parameters()}


def _max_over_ranks(ctx: RankContext, value: Optional[int]) -> Optional[int]:
    if value is None:
        return None
    t = torch.tensor([value], dtype=torch.int64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _timing_row(label: str, stats: dict[str, Stats], *, tokens: int, peak: Optional[int], optimizer: str,
                parity: Optional[float] = None, single_ms: Optional[float] = None) -> dict:
    step_ms = stats["step"].median

    def median(name):
        return stats[name].median if name in stats else None

    return {
        "strategy": label,
        "optimizer": optimizer,
        "ms/step": step_ms,
        "forward ms": median("forward"),
        "backward ms": median("backward"),
        "comm wait ms": median("comm wait"),
        "optimizer ms": median("optimizer"),
        "peak MiB/rank": None if peak is None else peak / MiB,
        "tokens/s": tokens / (step_ms * 1e-3),  # all ranks' tokens per step / step time
        # weak scaling: same per-rank batch, so perfect scaling keeps the 1-process step time
        "scaling eff %": None if single_ms is None else 100 * single_ms / step_ms,
        "parity max|Δθ|": parity,
    }
