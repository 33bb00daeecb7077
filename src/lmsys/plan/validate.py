"""`plan validate`: run the measured counterparts on this machine and hold the planner's predictions against them.

Two kinds of rows, each predicted with a calibration profile (`lmsys plan calibrate`) and measured through
the library functions the commands call:
- bench e2e (`e2e_rows`): lmsys.bench.e2e's train mode over sizes × dtypes × checkpoint policies, one
  process (the planner's degenerate layout; block checkpointing = full recomputation).
- parallel train (`mesh_rows`): lmsys.bench.parallel's job (what `lmsys parallel train`
  runs; its dp-only meshes run lmsys's bucketed DDP or FSDP, `ddp train`'s bucketed and fsdp wrappers)
  over the meshes × dtypes × checkpoint policies, one launch of lmsys's one launcher per world size, the
  one-process parity reference left out (timing only). Each row is predicted for its exact layout: dp, tp
  and pp degrees, sequence parallelism, the pipeline schedule and its chunks, micro-batch size and count,
  the dp strategy (bucketed: ZeRO-0; lmsys's FSDP, which keeps a unit gathered from its first forward of
  a step to the gradient sync: ZeRO-2's memory, weights whole and gradients and optimizer sharded) and
  the recomputation.
A row that cannot run here (nccl without GPUs, a world size above the GPUs visible, a mesh the model
does not divide) says why in its status; the others run.

On a CPU the gloo ranks share the cores: each computes with `launch.rank_threads(n)` threads where the
profile was measured with `threads`, so its compute and memory rates (not the host's per-op cost) are
taken as the profile's × rank threads / profile threads (one assumption for every row: rates linear in
threads). Peak memory is tracked on CUDA only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from lmsys.core import progress
from lmsys.core.errors import LmsysError

DP_ZERO = {"bucketed": 0, "fsdp": 2}  # parallel train's lmsys dp strategies -> the planner's ZeRO stage
PLANNER_SCHEDULE = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved-1f1b": "interleaved"}


@dataclass(frozen=True)
class MeshPlan:
    """The distributed rows to run: meshes (labels `parse_mesh` reads) and what parallel train takes."""

    meshes: list[str]
    size: str
    context_length: int
    backend: str
    micro_batch: int  # sequences per micro-batch per dp rank
    microbatches: int
    dp_strategy: str = "bucketed"
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    sequence_parallel: bool = False


# -------------------------------------------------------------------------------------------- options

def default_world_sizes(backend: str) -> list[int]:
    """gloo: 2 processes; nccl: 1, 2, 4, 8 ... up to the GPUs visible (1 GPU: 1)."""
    if backend != "nccl":
        return [2]
    import torch

    n, sizes = 2, []
    while n <= torch.cuda.device_count():
        sizes.append(n)
        n *= 2
    return sizes or [1]


def default_meshes(world_size: int) -> list[str]:
    """One world size's meshes: each parallelism alone (dp, tp, pp = n), and dp=2 × tp=n/2 from 4 ranks;
    one rank: the degenerate mesh."""
    n = world_size
    if n == 1:
        return ["dp=1,tp=1,pp=1"]
    meshes = [f"dp={n},tp=1,pp=1", f"dp=1,tp={n},pp=1", f"dp=1,tp=1,pp={n}"]
    if n >= 4 and n % 2 == 0:
        meshes.append(f"dp=2,tp={n // 2},pp=1")
    return meshes


def resolve_meshes(given: Optional[list[str]], *, world_sizes: Optional[list[int]], backend: str) -> list[str]:
    """--mesh (repeatable; `none`: no distributed rows) and --world-size -> mesh labels, checked for their
    syntax here (torch-free); what each mesh needs of the model and the machine is its row's status."""
    from lmsys.distributed.mesh import parse_mesh

    if given and any(m.strip().lower() == "none" for m in given):
        if len(given) > 1:
            raise LmsysError("--mesh none leaves out the distributed rows; give it alone")
        return []
    if not given:
        return [m for n in (world_sizes or default_world_sizes(backend)) for m in default_meshes(n)]
    specs = [parse_mesh(m) for m in given]
    if world_sizes:
        for spec in specs:
            if spec.world_size not in world_sizes:
                raise LmsysError(f"--mesh {spec.label} runs {spec.world_size} processes, not one of --world-size "
                                 f"{','.join(map(str, world_sizes))}", hint="leave --world-size out with --mesh")
    return list(dict.fromkeys(spec.label for spec in specs))


@dataclass
class ValidateRun:
    """What `plan validate` runs, its options checked (`resolve`): the published set, or the rows here."""

    published: bool = False
    published_file: Optional[str] = None
    profile_path: Optional[str] = None
    profile: Optional[dict] = None
    device: object = None
    backend: Optional[str] = None
    sizes: list = None
    dtypes: list = None
    checkpoints: list = None
    batch_size: int = 1
    warmup: int = 1
    steps: int = 3
    context_length: Optional[int] = None
    mesh_plan: Optional[MeshPlan] = None
    host_rate: str = "beside"
    repeats: int = 1


def resolve(*, profile, published: bool, published_file, size: Optional[str], dtype: Optional[str], checkpoint: str,
            batch_size: int, warmup: int, steps: int, mesh: Optional[list[str]], world_size: Optional[str],
            parallel_size: Optional[str], microbatches: int, context_length: Optional[int], dp_strategy: str,
            pp_schedule: str, virtual_stages: int, sequence_parallel: bool, backend: Optional[str], host_rate: str,
            repeats: int, device: str) -> ValidateRun:
    """Every option of `plan validate` checked, in the order the command always checked them: the torch-free
    ones first (a typo answers before torch loads), then the device, the backend and the meshes."""
    from lmsys.core.parsing import check_counts, choose, parse_int_list, parse_list
    from lmsys.distributed.data_parallel.strategies import HAND_WRITTEN_DP

    if published_file is not None and not published:
        raise LmsysError(f"{published_file}: a runs FILE is read only with --published (lmsys plan validate --published FILE)")
    if published:
        return ValidateRun(published=True, published_file=published_file)
    if profile is None:
        raise LmsysError("plan validate needs --profile FILE (from `lmsys plan calibrate` on this machine), "
                         "or --published [FILE] to predict published runs",
                         hint="lmsys plan validate --help lists the options")
    check_counts(batch_size=(batch_size, 1), warmup=(warmup, 0), steps=(steps, 1), microbatches=(microbatches, 1),
                 virtual_stages=(virtual_stages, 1), repeats=(repeats, 1))
    if context_length is not None:
        check_counts(context_length=(context_length, 1))
    checkpoints = [choose(c, ("none", "block"), what="--checkpoint") for c in parse_list(checkpoint, str, what="--checkpoint")]
    choose(dp_strategy, HAND_WRITTEN_DP, what="--dp-strategy")
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

    from lmsys.core.devices import check_dtype_for_device, resolve_device
    from lmsys.distributed import launch
    from lmsys.model.config import default_context_length, default_size, get_config

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
    meshes = resolve_meshes(mesh, world_sizes=world_sizes, backend=backend)
    mesh_plan = None
    if meshes:
        rank_device = "cuda" if backend == "nccl" else "cpu"
        psize = parallel_size or default_size(rank_device)
        get_config(psize)  # a bad preset or .yaml: one line now
        mesh_plan = MeshPlan(meshes=meshes, size=psize, context_length=context_length or default_context_length(rank_device),
                             backend=backend, micro_batch=batch_size, microbatches=microbatches,
                             dp_strategy=dp_strategy, pp_schedule=pp_schedule, virtual_stages=virtual_stages,
                             sequence_parallel=sequence_parallel)
    return ValidateRun(profile_path=str(profile), profile=prof, device=dev, backend=backend, sizes=sizes,
                       dtypes=dtypes, checkpoints=checkpoints, batch_size=batch_size, warmup=warmup, steps=steps,
                       context_length=context_length, mesh_plan=mesh_plan, host_rate=host_rate, repeats=repeats)


def validate_reports(run: ValidateRun):
    """Run what `resolve` chose and return the reports `plan validate` prints (the published set: one)."""
    from lmsys.core.devices import environment
    from lmsys.core.results import Report

    if run.published:
        from lmsys.plan.published import published_report

        rows, meta, notes = published_report(run.published_file)
        return Report("plan validate: published runs", rows, meta, notes)
    repeats, warmup, steps, dev, prof = run.repeats, run.warmup, run.steps, run.device, run.profile
    with progress.display("plan validate"):
        e2e, meshes = validate(sizes=run.sizes, dtypes=run.dtypes, checkpoints=run.checkpoints,
                               batch_size=run.batch_size, warmup=warmup, steps=steps, device=dev, profile=prof,
                               context_length=run.context_length, mesh_plan=run.mesh_plan,
                               host_rate=run.host_rate, repeats=repeats)
    meta = {**environment(dev), "profile": f"{run.profile_path} ({prof['device']})"}
    again = (f" {repeats} runs of each row, alternating with the host twins: the median of their medians, "
             "and their time spread (max - min) / median.") if repeats > 1 else ""
    reports = [Report("plan validate", e2e, meta, error_notes(summary(e2e), memory_here=dev.type == "cuda")
                      + [f"measured: bench e2e's train step, the median of {steps} timed steps after {warmup} warm-up; "
                         "peak memory over the step." + again, HOST_NOTE[run.host_rate]])]
    if run.mesh_plan is not None:
        reports.append(_mesh_report(run, meshes, meta))
    return reports


def _mesh_report(run: ValidateRun, rows: list[dict], meta: dict):
    from lmsys.core.results import Report
    from lmsys.distributed import launch

    mp, backend, repeats, prof = run.mesh_plan, run.backend, run.repeats, run.profile
    line = (f"{backend}, {mp.size} at context {mp.context_length}, {mp.micro_batch} sequence(s) × {mp.microbatches} "
            f"micro-batches per dp rank, dp strategy {mp.dp_strategy}, {run.warmup} warm-up + {run.steps} timed steps; "
            "lmsys.bench.parallel's job, one launch per world size"
            + (f" in each of {repeats} rounds (the median)" if repeats > 1 else "") + ", no parity reference")
    notes = error_notes(summary(rows), memory_here=backend == "nccl") + [
        "predicted: the planner for each row's layout (dp, tp, pp, schedule and chunks, micro-batch size and count, "
        "dp strategy: bucketed = ZeRO-0, lmsys's FSDP = ZeRO-2 (gathered from its first forward to the gradient "
        "sync), block = full recomputation), collectives from the profile's measured all-reduce times where it has "
        "them.", HOST_NOTE[run.host_rate].replace("each size's rows", "the launches"),
    ]
    if backend == "gloo" and prof.get("threads"):
        scales = sorted({(n, launch.rank_threads(n)) for n in {row["world size"] for row in rows}})
        notes.append(f"CPU: the profile was measured with {prof['threads']} thread(s); each gloo rank computes with "
                     + ", ".join(f"{t} at world size {n}" for n, t in scales)
                     + ": its compute and memory rates are scaled by that ratio (rates linear in threads).")
    return Report("plan validate: parallel train", rows, {**meta, "run": line}, notes)


HOST_NOTE = {
    "beside": "host µs/op: the host's cost per dispatched op that row's prediction used, measured in this process "
              "before and after each size's rows and between their repeats (plan calibrate's twins at its width), "
              "the median; --host-rate profile takes the profile's.",
    "profile": "host µs/op: the profile's (--host-rate profile).",
}


def error_notes(summary: dict, *, memory_here: bool) -> list[str]:
    """One note per error column of `summary(rows)`: its mean and max |error|, or why it is not measurable."""
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


# ------------------------------------------------------------------------------------------- running

def validate(*, sizes: list[str], dtypes: list[str], checkpoints: list[str], batch_size: int, warmup: int, steps: int,
             device, profile: dict, context_length: Optional[int] = None,
             mesh_plan: Optional[MeshPlan] = None, host_rate: str = "beside",
             repeats: int = 1) -> tuple[list[dict], list[dict]]:
    """(bench e2e rows, parallel train rows); `summary(rows)` gives each table's errors. `repeats`: each row
    measured that many times, alternating with the host twins (`beside`), its median held against the
    prediction from the twins' median."""
    e2e = e2e_rows(sizes=sizes, dtypes=dtypes, checkpoints=checkpoints, batch_size=batch_size, warmup=warmup,
                   steps=steps, device=device, profile=profile, context_length=context_length, host_rate=host_rate,
                   repeats=repeats)
    meshes = [] if mesh_plan is None or not mesh_plan.meshes else mesh_rows(
        mesh_plan, dtypes=dtypes, checkpoints=checkpoints, warmup=warmup, steps=steps, profile=profile,
        host_rate=host_rate, repeats=repeats)
    return e2e, meshes


def e2e_rows(*, sizes: list[str], dtypes: list[str], checkpoints: list[str], batch_size: int, warmup: int,
             steps: int, device, profile: dict, context_length: Optional[int] = None,
             host_rate: str = "beside", repeats: int = 1) -> list[dict]:
    """bench e2e (mode train) over sizes × dtypes × checkpoint policies, each predicted with `profile`;
    host_rate "beside": with the host's cost per op measured before and after each size's rows (`beside`),
    and between its `repeats` runs."""
    from lmsys.bench import e2e
    from lmsys.model.config import get_config, resolve_configs
    from lmsys.plan import memory as mem
    from lmsys.plan.calibrate import plain_step_options
    from lmsys.plan.shape import from_model_config

    rows: list[dict] = []
    progress.plan_rows(len(dtypes) * len(sizes))
    for dtype in dtypes:
        options = plain_step_options(device, dtype)
        attn_impl = options.pop("attn_impl")
        for size in sizes:
            progress.start_row(f"{size} {dtype}")
            seq = context_length or get_config(size).context_length
            (name, cfg), = resolve_configs([size], context_length=seq, attn_impl=attn_impl)
            workloads = e2e.resolve_workloads([(name, cfg)], checkpoints=checkpoints, batch_size=batch_size,
                                              dtype=dtype, cuda_graphs=False, **options)
            shape = from_model_config(cfg, name=name)
            runs = []
            with beside(shape, profile, device=device, dtype=dtype, on=host_rate == "beside") as host:
                for r in range(repeats):
                    if r:
                        host.sample()
                    runs.append(list(e2e.run_e2e(workloads, modes=["train"], warmup=warmup, steps=steps,
                                                 device=device)))
            for i, (_, workload) in enumerate(workloads):
                ms, peak, status, spread = _combine([run[i] for run in runs], mib_key="peak step MiB")
                lay = mem.Layout(micro_batch=batch_size, checkpoint="full" if workload.checkpoint != "none" else "none")
                row = {"size": name, "dtype": dtype, "checkpoint": workload.checkpoint}
                row.update(_compare(shape, lay, dtype=dtype, profile=host.profile, gpus_per_node=1, scale=1.0,
                                    ms=ms, peak_mib=peak))
                if repeats > 1:
                    row["time spread %"] = spread
                row["host µs/op"] = host.profile["launch_us"][dtype]
                row["status"] = status
                rows.append(row)
    return rows


def _combine(runs: list[dict], *, ms_key: Optional[str] = None, mib_key: str) -> tuple:
    """One row's repeated measurements -> (the median of their step-time medians, the largest peak MiB,
    status, spread: (max - min) / median of the step times, in %); a run that failed fails the row."""
    import statistics

    failed = [r for r in runs if r.get("status") != "ok"]
    if failed:
        return None, None, failed[0].get("status") or "error: no result", None
    times = [r[ms_key] if ms_key else r["ms/step"].median for r in runs]
    median = statistics.median(times)
    peaks = [r[mib_key] for r in runs if r.get(mib_key) is not None]
    return median, max(peaks) if peaks else None, "ok", 100 * (max(times) - min(times)) / median if median else None


def mesh_rows(plan: MeshPlan, *, dtypes: list[str], checkpoints: list[str], warmup: int, steps: int,
              profile: dict, host_rate: str = "beside", repeats: int = 1) -> list[dict]:
    """parallel train's job over plan.meshes × dtypes × checkpoints: one launch per world size (the
    meshes that can run there; `repeats` rounds of them), each row predicted for its layout (host_rate
    "beside": with the host's cost per op measured before, between and after the rounds, in this process);
    rows that cannot run say why."""
    from lmsys.distributed.mesh import parse_mesh
    from lmsys.model.config import get_config

    config = get_config(plan.size).with_overrides(context_length=plan.context_length)
    runnable: dict[int, list[str]] = {}
    why_not: dict[str, str] = {}
    for label in plan.meshes:
        spec = parse_mesh(label)
        why = cannot_run(spec, plan, config=config)
        if why:
            why_not[label] = why
        else:
            runnable.setdefault(spec.world_size, []).append(label)
    measured: dict[tuple[str, str, str], list[dict]] = {}
    import torch

    shape = _shape(config, plan.size)
    device = torch.device("cuda" if plan.backend == "nccl" else "cpu")
    hosts = {dtype: beside(shape, profile, device=device, dtype=dtype, on=host_rate == "beside" and bool(runnable))
             for dtype in dtypes if dtype != "fp16"}
    for host in hosts.values():
        host.__enter__()
    for r in range(repeats):
        for host in hosts.values() if r else ():
            host.sample()
        for n, labels in sorted(runnable.items()):
            jobs = [(dtype, ckpt) for dtype in dtypes for ckpt in checkpoints if dtype != "fp16"]
            for (dtype, ckpt), rows in zip(jobs, _launch(plan, labels, jobs, world_size=n, warmup=warmup, steps=steps)):
                for label, row in zip(labels, rows):
                    measured.setdefault((label, dtype, ckpt), []).append(row)
    for host in hosts.values():
        host.__exit__(None)
    out = []
    for label in plan.meshes:
        spec = parse_mesh(label)
        for dtype in dtypes:
            for ckpt in checkpoints:
                why = why_not.get(label) or ("cannot run: parallel train with fp16 needs a gradient scaler across "
                                             "stages, which it does not have; use bf16" if dtype == "fp16" else None)
                got = measured.get((label, dtype, ckpt)) or [{}]
                row = {"world size": spec.world_size, "mesh": spec.label,
                       "dp strategy": plan.dp_strategy if spec.dp > 1 else "-",
                       "schedule": _schedule_label(plan, spec), "dtype": dtype, "checkpoint": ckpt}
                ms, peak, status, spread = _combine(got, ms_key="ms/step", mib_key="peak MiB/rank")
                host = hosts.get(dtype)
                row.update(_compare(shape, layout(spec, plan, checkpoint=ckpt), dtype=dtype,
                                    profile=host.profile if host else profile, gpus_per_node=spec.world_size,
                                    scale=thread_scale(profile, plan.backend, spec.world_size), ms=ms, peak_mib=peak))
                if repeats > 1:
                    row["time spread %"] = spread
                row["host µs/op"] = ((host.profile if host else profile).get("launch_us") or {}).get(dtype)
                row["status"] = why or status
                out.append(row)
    return out


def cannot_run(spec, plan: MeshPlan, *, config) -> Optional[str]:
    """Why a mesh cannot run here (its row's status), or None: the backend and the GPUs it needs, then
    everything `parallel train` checks before it starts (degrees against the model, the schedule)."""
    import torch

    from lmsys.distributed.mesh import check_plan

    n = spec.world_size
    if plan.backend == "nccl":
        if not torch.cuda.is_available():
            return "cannot run: nccl needs CUDA GPUs, and PyTorch sees none (gloo runs on the CPU)"
        if n > torch.cuda.device_count():
            return f"cannot run: world size {n} with nccl needs {n} GPUs (one per rank); {torch.cuda.device_count()} visible"
    try:
        check_plan(spec, world_size=n, num_heads=config.num_heads, kv_heads=config.kv_heads, d_ff=config.d_ff,
                   vocab_size=config.vocab_size, num_layers=config.num_layers, schedule=plan.pp_schedule,
                   microbatches=plan.microbatches, virtual_stages=plan.virtual_stages)
    except LmsysError as exc:
        return f"cannot run: {exc.message}"
    if plan.sequence_parallel and spec.tp > 1 and plan.context_length % spec.tp:
        return f"cannot run: sequence parallelism: tp={spec.tp} does not divide the context {plan.context_length}"
    return None


def _launch(plan: MeshPlan, labels: list[str], jobs: list[tuple[str, str]], *, world_size: int, warmup: int,
            steps: int) -> list[list[dict]]:
    """One launch of `validate_job` at `world_size`: per (dtype, checkpoint), parallel train's rows for
    `labels`. A failed launch: every row says why."""
    from lmsys.distributed import launch

    runs = [dict(meshes=labels, impls=["lmsys"], dp_strategy=plan.dp_strategy,
                 sequence_parallel=plan.sequence_parallel, pp_schedule=plan.pp_schedule,
                 virtual_stages=plan.virtual_stages, microbatches=plan.microbatches, size=plan.size,
                 context_length=plan.context_length, batch_size=plan.micro_batch * plan.microbatches, dtype=dtype,
                 steps=steps, warmup=warmup, checkpoint=ckpt, parity=False) for dtype, ckpt in jobs]
    try:
        result = launch.run("lmsys.plan.validate:validate_job", dict(runs=runs), world_size=world_size,
                            backend=plan.backend)
    except LmsysError as exc:
        return [[{"status": f"cannot run: {exc.message}"}] * len(labels) for _ in jobs]
    except launch.RankFailedError as exc:
        return [[{"status": f"error: {exc.message}"}] * len(labels) for _ in jobs]
    return result["runs"]


def validate_job(ctx, *, runs: list[dict]) -> dict:
    """On every rank of one launch: parallel train's job once per run (a dtype and checkpoint policy over
    the world size's meshes); rank 0's rows per run."""
    from lmsys.bench.parallel import parallel_job

    return {"runs": [parallel_job(ctx, **run)["rows"] for run in runs]}


# ------------------------------------------------------------------------------- the host beside a run

class beside:
    """`with beside(shape, profile, device=, dtype=) as host:` around a run: plan calibrate's host twins (at
    `shape`'s width) measured before and after it (and at each `host.sample()` between repeats), and
    `host.profile`, the profile with their median per-op costs and op counts for `dtype`. The host's speed
    is a property of the moment, not of the machine: on the shared hosts GPUs are lent on, the same
    host-bound step moved by ±15 % over eight runs seconds apart in one process, and a twin beside each run
    did not track it; the median of several runs against the twins' median came within 10 % on one host,
    and not on another, where the twins ran 15-20 % fast (docs/benchmarks/plan.md, 2026-12-04).
    on=False: the profile's."""

    def __init__(self, shape, profile: dict, *, device, dtype: str, on: bool = True):
        self.shape, self.profile, self.device, self.dtype, self.on = shape, profile, device, dtype, on
        self.samples: list[tuple] = []

    def sample(self) -> None:
        """One more twin measurement (between a row's repeated runs)."""
        if self.on:
            from lmsys.plan.calibrate import measure_host

            self.samples.append(measure_host(self.shape, device=self.device, dtype=self.dtype, warmup=2, steps=20)[:3])

    def __enter__(self):
        self.sample()
        return self

    def __exit__(self, kind, *exc):
        if not self.on or kind is not None:
            return False
        import statistics

        self.sample()
        d, ops = self.dtype, self.samples[0][2]
        us = statistics.median(s[0] for s in self.samples)
        again = statistics.median(s[1] for s in self.samples)
        self.profile = {**self.profile, "launch_us": {**(self.profile.get("launch_us") or {}), d: us},
                        "launch_us_recompute": {**(self.profile.get("launch_us_recompute") or {}), d: again},
                        "ops": {**(self.profile.get("ops") or {}), d: ops}}
        return False


# ----------------------------------------------------------------------------------------- predicting

def layout(spec, plan: MeshPlan, *, checkpoint: str):
    """The planner's Layout of a parallel train row: its degrees, schedule, micro-batches, dp strategy
    (bucketed: ZeRO-0; lmsys's FSDP: ZeRO-2, see the module docstring) and recomputation (block = full)."""
    from lmsys.plan.memory import Layout

    pp = spec.pp
    # pp = 1: parallel train's 1f1b runs each micro-batch's forward and backward in turn (the planner's
    # 'none'); its gpipe runs every forward first, holding all the micro-batches at once
    schedule = PLANNER_SCHEDULE[plan.pp_schedule] if pp > 1 or plan.pp_schedule == "gpipe" else "none"
    chunks = plan.virtual_stages if schedule == "interleaved" else 1
    return Layout(dp=spec.dp, tp=spec.tp, pp=pp, zero=DP_ZERO[plan.dp_strategy] if spec.dp > 1 else 0,
                  sp=plan.sequence_parallel and spec.tp > 1, schedule=schedule, chunks=chunks,
                  micro_batch=plan.micro_batch, microbatches=plan.microbatches,
                  checkpoint="full" if checkpoint == "block" else "none")


def thread_scale(profile: dict, backend: str, world_size: int) -> float:
    """On a CPU, a rank's compute rates over the profile's: its threads over those it was measured with."""
    from lmsys.distributed.launch import rank_threads

    if backend == "nccl" or not profile.get("threads"):
        return 1.0
    return rank_threads(world_size) / float(profile["threads"])


def rates_for(profile: dict, dtype: str, *, scale: float = 1.0):
    """The profile's rates for `dtype` (links it did not measure: the GPU table's, where it knows the
    device), compute and memory rates × `scale`."""
    from lmsys.core.hardware import find_gpu
    from lmsys.plan.profile import rates as profile_rates
    from lmsys.plan.time import table_rates

    gpu = find_gpu(profile["device"])
    fallback = table_rates(gpu, dtype) if gpu is not None and gpu.peak(dtype) is not None else None
    rates = profile_rates(profile, dtype, fallback=fallback)
    if scale == 1.0:
        return rates
    return replace(rates, matmul_tflops=rates.matmul_tflops * scale, attention_tflops=rates.attention_tflops * scale,
                   hbm_GBps=rates.hbm_GBps * scale,
                   elementwise_GBps=rates.elementwise_GBps and rates.elementwise_GBps * scale,
                   optimizer_GBps=rates.optimizer_GBps and rates.optimizer_GBps * scale,
                   gemm=_scaled(rates.gemm, scale), scores=_scaled(rates.scores, scale))


def _scaled(points: tuple, scale: float) -> tuple:
    """Rates by shape (3 sizes, forward, backward) with the rates × scale."""
    return tuple((*p[:3], p[3] * scale, p[4] * scale) for p in points)


HOST_MARGIN = 1.25  # a row is host-bound when a host this much slower than its twins would add time to it:
# the twins ran up to 20 % fast against the step on some H200 hosts (docs/benchmarks/plan.md, 2026-12-04)


def _compare(shape, lay, *, dtype: str, profile: dict, gpus_per_node: int, scale: float, ms: Optional[float],
             peak_mib: Optional[float]) -> dict:
    from lmsys.core.parsing import MiB
    from lmsys.plan import memory as mem
    from lmsys.plan.time import step_time

    prec = mem.precision(dtype, master_weights=False)  # autocast over fp32 weights, as bench e2e and parallel train
    predicted_ms = predicted_mib = bound = None
    try:
        rates = rates_for(profile, dtype, scale=scale)
        predicted_ms = step_time(shape, lay, prec, rates, gpus_per_node=gpus_per_node).total
        slower = replace(rates, launch_us=rates.launch_us * HOST_MARGIN, launch_us_recompute=None
                         if rates.launch_us_recompute is None else rates.launch_us_recompute * HOST_MARGIN)
        bound = "host" if step_time(shape, lay, prec, slower, gpus_per_node=gpus_per_node).host > 0 else "device"
        predicted_mib = mem.memory(shape, lay, prec, capacity=float("inf")).total / MiB
    except LmsysError:  # e.g. the profile has no bandwidth for this group: measured, not predicted
        pass
    return {"predicted ms": predicted_ms, "measured ms": ms, "time error %": _err(predicted_ms, ms), "bound": bound,
            "predicted MiB": predicted_mib, "measured MiB": peak_mib, "memory error %": _err(predicted_mib, peak_mib)}


def _shape(config, name: str):
    from lmsys.plan.shape import from_model_config

    return from_model_config(config, name=name)


def _schedule_label(plan: MeshPlan, spec) -> str:
    """The pipeline schedule (pp > 1), micro-batches and sequence parallelism of a row, as parallel train says them."""
    parts = []
    if spec.pp > 1:
        parts.append(plan.pp_schedule + (f", V={plan.virtual_stages}" if plan.pp_schedule == "interleaved-1f1b" else ""))
    if spec.pp > 1 or plan.microbatches > 1:
        parts.append(f"M={plan.microbatches}")
    if plan.sequence_parallel and spec.tp > 1:
        parts.append("SP")
    return ", ".join(parts) or "-"


def _err(predicted: Optional[float], measured: Optional[float]) -> Optional[float]:
    return None if predicted is None or measured in (None, 0) else 100 * (predicted - measured) / measured


def summary(rows: list[dict]) -> dict:
    """{"time error %" / "memory error %": (mean |error|, max |error|) over the rows that have one, or None};
    where some rows are host-bound (`_compare`'s `bound`: a host HOST_MARGIN slower than the one measured
    would set their pace, and it drifts with a shared host's load) and some are not, also "device-bound
    time error %" over the others; where host-bound rows ran more than once, "host-bound time spread %"
    (mean, max) of their runs' spread: how far the measured time itself moved, which bounds how closely any
    prediction can be held to it (on the H200 hosts of 2026-12-04: up to 110 % within one row's three runs,
    and the same row 1.3-2.0x apart between runs of one command minutes apart: docs/benchmarks/plan.md)."""
    def mean_max(errs):
        return (sum(errs) / len(errs), max(errs)) if errs else None

    out = {key: mean_max([abs(r[key]) for r in rows if r.get(key) is not None])
           for key in ("time error %", "memory error %")}
    timed = [r for r in rows if r.get("time error %") is not None]
    device = [abs(r["time error %"]) for r in timed if r.get("bound") == "device"]
    if device and len(device) < len(timed):
        out["device-bound time error %"] = mean_max(device)
    spread = [r["time spread %"] for r in timed if r.get("bound") == "host" and r.get("time spread %") is not None]
    if spread:
        out["host-bound time spread %"] = mean_max(spread)
    return out
