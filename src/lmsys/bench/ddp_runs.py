"""What `ddp train` runs, decided before any process starts (torch-free, so option errors answer at once):
the strategies and their knobs (`RunSpec` rows), validated from the command line, and the notes under
the table."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from lmsys.core.errors import LmsysError
from lmsys.core.imports import is_import_path
from lmsys.core.parsing import choose, parse_list
from lmsys.distributed.data_parallel.strategies import BUCKET_LEVERS, STRATEGIES as REGISTRY, check_name
from lmsys.train.optim import DDP_TRAIN_LR

# The rows without --strategy: lmsys's own and torch's (with --adapters, the adapters' rows too)
STRATEGIES = tuple(name for name, s in REGISTRY.items() if not s.adapters)
ADAPTER_STRATEGIES = tuple(name for name, s in REGISTRY.items() if s.adapters)
# --shard-optimizer wraps their AdamW in ZeRO-1 (`shardable`: yours, yours-bucketed and a DDP-style import
# path too); the FSDPs shard their own way, yours-zero1 brings its own sharded optimizer
SHARDABLE = tuple(name for name, s in REGISTRY.items() if not s.shards_params and s.optimizer is None)
COMM_DTYPES = ("fp32", "bf16")


@dataclass(frozen=True)
class RunSpec:
    """One row of `ddp train`: a strategy and its knobs."""

    strategy: str
    bucket_mb: Optional[float] = None  # bucketed only
    comm_dtype: str = "fp32"  # bucketed only: dtype the gradients travel in
    lever: Optional[str] = None  # bucketed only: one of BUCKET_LEVERS on top of the plain row
    sm_carveout: Optional[int] = None  # bucketed only: SMs cuBLAS leaves to NCCL while buckets reduce
    adapters: Optional[str] = None  # the CS336 adapters module (a .py path or a module name), for yours-*

    @property
    def label(self) -> str:
        label = self.strategy
        if self.bucket_mb is not None and (is_import_path(self.strategy) or REGISTRY[self.strategy].bucketed):
            label += f" {self.bucket_mb:g} MiB" + (f" {self.comm_dtype} grads" if self.comm_dtype != "fp32" else "")
            label += f" +{self.lever}" if self.lever else ""
            label += f" +carveout {self.sm_carveout}" if self.sm_carveout is not None else ""
        return label


def shardable(name: str) -> bool:
    from lmsys.distributed.data_parallel.strategies import get

    strategy = get(name)
    return not strategy.shards_params and strategy.optimizer is None


def expand_runs(strategies: list[str], *, bucket_mbs: list[float], comm_dtypes: list[str],
                levers: Optional[list[str]] = None, carveouts: Optional[list[int]] = None,
                adapters: Optional[str] = None) -> list[RunSpec]:
    """bucketed: a row per comm dtype × cap, then each lever and each SM carveout on top of the first
    comm dtype and cap. yours-bucketed and a wrapper taking bucket_size_mb: a row per cap; yours-zero1
    runs on the first cap."""
    from lmsys.distributed.data_parallel.strategies import get

    runs = []
    for s in strategies:
        strategy = get(s)  # import paths are loaded here: their signature says whether they take buckets
        if strategy.levers:  # lmsys's BucketedDDP: comm dtypes, levers and carveouts too
            runs += [RunSpec(s, mb, cd) for cd in comm_dtypes for mb in bucket_mbs]
            runs += [RunSpec(s, bucket_mbs[0], comm_dtypes[0], lever) for lever in levers or []]
            runs += [RunSpec(s, bucket_mbs[0], comm_dtypes[0], sm_carveout=n) for n in carveouts or []]
        elif strategy.first_cap_only:
            runs.append(RunSpec(s, bucket_mbs[0], adapters=adapters))
        elif strategy.bucketed:
            runs += [RunSpec(s, mb, adapters=adapters) for mb in bucket_mbs]
        else:
            runs.append(RunSpec(s, adapters=adapters))
    return runs


def _unique(value, what: str, choices) -> list[str]:
    items = list(dict.fromkeys(parse_list(value, str, what=what)))
    for item in items:
        choose(item, choices, what=what)
    return items


def parse_runs(*, strategy, bucket_mb: str, comm_dtype: str, lever: str, sm_carveout: str = "",
               adapters: Optional[str] = None) -> list[RunSpec]:
    """The command line's strategy options -> the rows to run (every value checked, one-line errors)."""
    if strategy:
        strategies = list(dict.fromkeys(parse_list(strategy, str, what="--strategy")))
        for name in strategies:
            check_name(name, adapters=adapters)
    else:
        strategies = list(STRATEGIES) + (list(ADAPTER_STRATEGIES) if adapters else [])
    bucket_mbs = parse_list(bucket_mb, float, what="--bucket-mb")
    if any(not mb > 0 or mb == float("inf") for mb in bucket_mbs):
        raise LmsysError("--bucket-mb: every cap must be a positive number of MiB")
    comm_dtypes = _unique(comm_dtype, "--comm-dtype", COMM_DTYPES)
    levers = _unique(lever, "--lever", BUCKET_LEVERS) if lever else []
    if levers and not any(_takes_levers(s) for s in strategies):
        raise LmsysError("--lever applies to the bucketed strategy: add --strategy bucketed")
    if "copy-engine" in levers and comm_dtypes[0] != "fp32":
        raise LmsysError("--lever copy-engine reduces fp32 gradients: put fp32 first in --comm-dtype")
    carveouts = list(dict.fromkeys(parse_list(sm_carveout, int, what="--sm-carveout"))) if sm_carveout else []
    if any(n < 0 for n in carveouts):
        raise LmsysError("--sm-carveout: every value must be a number of SMs >= 0")
    if carveouts and not any(_takes_levers(s) for s in strategies):
        raise LmsysError("--sm-carveout applies to the bucketed strategy: add --strategy bucketed")
    if adapters is not None:  # a file that does not import is one line now, not one per rank later
        from lmsys.core.imports import load_module

        load_module(adapters, what="--adapters")
    return expand_runs(strategies, bucket_mbs=bucket_mbs, comm_dtypes=comm_dtypes, levers=levers,
                       carveouts=carveouts, adapters=adapters)


def _takes_levers(name: str) -> bool:
    """lmsys's BucketedDDP: --lever, --sm-carveout and --comm-dtype rows (no import path takes them)."""
    return name in REGISTRY and bool(REGISTRY[name].levers)


def check_levers_for_backend(runs: list[RunSpec], backend: str) -> None:
    """The copy-engine all-reduce moves bytes between GPUs: with gloo there are none."""
    if backend != "nccl" and any(r.lever == "copy-engine" for r in runs):
        raise LmsysError("--lever copy-engine needs GPUs (the nccl backend); this run uses gloo")


def set_nccl_ctas(ctas: Optional[int]) -> Optional[str]:
    """NCCL_MIN_CTAS = NCCL_MAX_CTAS = ctas in this process's environment (the ranks inherit it); what
    the run line says of it, or None."""
    if ctas is None:
        return None
    if ctas < 1:
        raise LmsysError(f"--nccl-ctas must be >= 1, got {ctas}")
    os.environ["NCCL_MIN_CTAS"] = os.environ["NCCL_MAX_CTAS"] = str(ctas)
    return f"NCCL_MIN_CTAS = NCCL_MAX_CTAS = {ctas}"


def run_line(*, backend: str, world_size: int, batch_size: int, dtype: str, warmup: int, steps: int,
             extra: Optional[str] = None) -> str:
    numerics = "fp32" if dtype == "fp32" else f"{dtype} autocast, fp32 master weights"
    line = (f"{backend}, world size {world_size}, batch {batch_size} per rank, {numerics}, "
            f"AdamW lr {DDP_TRAIN_LR:g}, warmup {warmup} + {steps} timed steps")
    return line + (f", {extra}" if extra else "")


def train_notes(runs: list[RunSpec], *, baseline: bool) -> list[str]:
    """The notes under a `ddp train` table: what each column means and what the baselines are."""
    strategies = {r.strategy for r in runs}
    notes = [
        "ms/step and phases: medians over the timed steps (rank 0). comm wait: time in "
        "finish_gradient_synchronization() after backward (torch-ddp and fsdp communicate inside backward).",
        "peak MiB/rank: max over ranks of torch's peak allocation (GPU only). optim MiB/rank: max over ranks "
        "of the optimizer's state tensors. tokens/s: all ranks' tokens. MFU %: model FLOPs (6·N per token "
        "+ attention, lmsys.core.flops) over the peak of all ranks' GPUs for the dtype (GPU only).",
        "scaling eff %: 1-process step time at the same per-rank batch / step time (weak scaling, 100 = perfect).",
        "parity max|Δθ|: largest parameter difference after all warmup + timed steps against one process "
        "trained on the full batch with the same seed and data.",
    ]
    notes += [f"{name}: {s.note}" for name, s in REGISTRY.items() if s.note and name in strategies]
    for name in sorted(strategies & set(ADAPTER_STRATEGIES)) + sorted(filter(is_import_path, strategies)):
        help = REGISTRY[name].help if name in REGISTRY else "your wrapper, Class(module[, bucket_size_mb])"
        notes.append(f"{name}: {help}.")
    if baseline:
        notes.append("A row FAILs (exit 1) when its parity exceeds the tolerance for its dtype (fp32: 1e-4; "
                     "bf16/fp16 autocast or bf16 gradients: 2·lr·steps) or, for strategies holding whole "
                     "gradients, when its gradients after the first backward differ from one process's by more "
                     "than 1e-4 (fp32) or 5e-2 (otherwise) of their largest magnitude; the status names the "
                     "worst parameter.")
    if not baseline:
        notes.append("--no-single-process: no one-process rows, so scaling eff % and parity are empty.")
    return notes


@dataclass
class DdpTrain:
    """What `ddp train` launches, its options checked (`resolve`): the job's kwargs, one launch per world size."""

    kwargs: dict
    runs: list
    backend: str
    world_sizes: list[int]
    batch_size: int
    dtype: str
    warmup: int
    steps: int
    baseline: bool
    ctas: Optional[str] = None
    warning: Optional[str] = None  # ranks that outnumber the cores: said on stderr before the run


def resolve(*, strategy, adapters, model: Optional[str], model_kwargs: Optional[str], bucket_mb: str, comm_dtype: str,
            lever: str, sm_carveout: str, nccl_ctas: Optional[int], baseline: bool, shard_optimizer: bool,
            size: Optional[str], batch_size: int, context_length: Optional[int], dtype: str,
            peak_tflops: Optional[float], steps: int, warmup: int, world_size: Optional[str],
            backend: Optional[str], device: str) -> DdpTrain:
    """Every option of `ddp train` checked in the launching process, the torch-free ones first (a typo answers
    before torch loads): counts, model, size, strategies and levers; then the backend, the world sizes and
    the model's size for the strategies."""
    from dataclasses import asdict

    from lmsys.core.hardware import check_peak
    from lmsys.core.parsing import check_counts, check_one_size, parse_int_list
    from lmsys.model.user import check_model, parse_model_kwargs

    check_peak(peak_tflops)
    check_counts(warmup=(warmup, 0), steps=(steps, 1), batch_size=(batch_size, 1))
    model = check_model(model) if model else None
    kwargs_json = parse_model_kwargs(model_kwargs)
    check_one_size(size, command="ddp train", why="one model per run")
    requested = parse_int_list(world_size, what="--world-size") if world_size is not None else None
    runs = parse_runs(strategy=strategy, bucket_mb=bucket_mb, comm_dtype=comm_dtype, lever=lever,
                      sm_carveout=sm_carveout, adapters=adapters)
    ctas = set_nccl_ctas(nccl_ctas)
    if shard_optimizer and not any(shardable(r.strategy) for r in runs):
        asked = ", ".join(dict.fromkeys(r.strategy for r in runs))
        raise LmsysError(f"--shard-optimizer applies to the DDP strategies ({', '.join(SHARDABLE)}, or your "
                         f"DDP-style pkg.module:Class), not to --strategy {asked}, which shards its own way "
                         "or brings its own optimizer")

    from lmsys.bench.ddp import resolve_model_size
    from lmsys.distributed import launch

    chosen_by = launch.backend_option(device, backend)
    backend = launch.resolve_backend(launch.backend_for_device(device, backend))
    world_sizes = launch.resolve_world_sizes(requested)
    launch.check_launch(backend, world_sizes, chosen_by=chosen_by)
    check_levers_for_backend(runs, backend)
    warning = launch.warn_oversubscription(world_sizes, backend)
    size, context_length = resolve_model_size(size, context_length, backend=backend, dtype=dtype, runs=runs,
                                              model=model, model_kwargs=kwargs_json)
    kwargs = dict(runs=[asdict(r) for r in runs], size=size, context_length=context_length, batch_size=batch_size,
                  dtype=dtype, steps=steps, warmup=warmup, shard_optimizer=shard_optimizer, baseline=baseline,
                  model=model, model_kwargs=kwargs_json, peak_tflops=peak_tflops)
    return DdpTrain(kwargs=kwargs, runs=runs, backend=backend, world_sizes=world_sizes, batch_size=batch_size,
                    dtype=dtype, warmup=warmup, steps=steps, baseline=baseline, ctas=ctas, warning=warning)


def train_report(plan: DdpTrain, world_size: int, result: dict):
    """One world size's Report from rank 0's result: its run line, the strategies' notes, and the scaling
    efficiency left empty where ranks outnumber the cores."""
    from lmsys.core.results import Report
    from lmsys.distributed import launch

    meta = result["meta"]
    meta["run"] = run_line(backend=plan.backend, world_size=world_size, batch_size=plan.batch_size, dtype=plan.dtype,
                           warmup=plan.warmup, steps=plan.steps, extra=plan.ctas)
    notes = train_notes(plan.runs, baseline=plan.baseline) + result.get("notes", [])
    if not launch.under_torchrun() and (why := launch.oversubscribed(world_size, plan.backend)):
        for row in result["rows"]:
            if "scaling eff %" in row:
                row["scaling eff %"] = None
        notes.append(f"scaling eff % is left empty: {why}; a weak-scaling ratio would say more than "
                     "100 % or less for reasons that are not the strategy's.")
    title = "ddp train" if len(plan.world_sizes) == 1 else f"ddp train: world size {world_size}"
    return Report(title, result["rows"], meta, notes)


def parity_failures(reports) -> list[str]:
    """The strategies whose parity check failed, in every report."""
    return [row["strategy"] for report in reports for row in report.rows
            if str(row.get("status", "")).startswith("FAIL")]
