"""What `profile nsys` runs and prints: the engine chosen (nsys or torch.profiler), the step profiled,
and the reports (time per range, top kernels or operators, the attention split) with their notes."""

from __future__ import annotations

from pathlib import Path

from lmsys.core.errors import LmsysError
from lmsys.core.results import Report
from lmsys.profiling.summary import SPLIT_FLOP_NOTE, range_rows, split_rows, top_rows

ENGINES = ("nsys", "torch")


def app_name(command: list[str]) -> str:
    """nsys_<program>: the report's base name for `profile nsys -- COMMAND`."""
    return "nsys_" + "".join(ch if ch.isalnum() else "_" for ch in Path(command[0]).name)


def step_name(engine: str, name: str, *, context_length: int, batch_size: int, dtype: str, mode: str,
              annotated: bool) -> str:
    base = f"{engine}_{Path(name).stem}_ctx{context_length}_b{batch_size}_{dtype}_{mode}"
    return base + ("_attn" if annotated else "")


def check_engine(engine: str, device) -> None:
    if engine == "nsys" and device.type != "cuda":
        raise LmsysError("--engine nsys profiles CUDA kernels and needs a GPU (none in use here); use --engine torch")


def profile_step(engine: str, nsys_path: str | None, config, device, *, batch_size: int, dtype: str, mode: str,
                 warmup: int, steps: int, out_dir: Path, name: str, trace: str, extra: list[str]):
    """The training step of `config` under nsys (a child process) or torch.profiler (this process)."""
    if engine == "nsys":
        from lmsys.profiling import nsys

        return nsys.profile_e2e(nsys_path, config=config, batch_size=batch_size, dtype=dtype, mode=mode,
                                warmup=warmup, steps=steps, device=str(device), out_dir=out_dir, name=name,
                                trace=trace, extra=extra)
    from lmsys.profiling import torch_engine
    from lmsys.train import Workload

    return torch_engine.profile_e2e(Workload(config, batch_size=batch_size, dtype=dtype), device, mode=mode,
                                    warmup=warmup, steps=steps, out_dir=out_dir, name=name)


def range_notes(prof) -> list[str]:
    notes = list(prof.notes)
    if prof.engine == "nsys":
        notes.append("total/avg: range duration on the host (nsys nvtx_sum); FWD/BWD/OPTIM_STEP synchronise "
                     "before closing, so theirs is the phase's wall time. GPU kernel ms: kernels executing "
                     "inside the phase's window, or for other ranges launched inside it (nvtx_kern_sum).")
    else:
        notes.append("total/avg: record_function duration (the phases synchronise before closing). "
                     + ("GPU kernel ms: kernels launched by operators inside the range."
                        if prof.unit == "kernel" else "On a CPU there are no kernels: the tables list PyTorch operators."))
    if not prof.ranges:
        notes.append("No NVTX ranges were recorded.")
    return notes


def time_reports(prof, *, meta: dict, range_name: str, top: int, shape) -> list[Report]:
    """Time per range, top kernels (or operators) overall and in `range_name`, the attention split
    (with FLOP rates when `shape` = (B, H, S, d) is known), the top CUDA API calls, and the files."""
    gpu = prof.unit == "kernel"
    reports = [Report(f"profile {prof.engine}: time per range", range_rows(prof), meta, range_notes(prof))]
    what = "kernels" if gpu else "operators (self CPU time)"
    reports.append(Report(f"top {top} {what}, all measured steps", top_rows(prof.top, unit=prof.unit, top=top)))
    in_range = prof.by_range.get(range_name)
    if in_range is not None:
        reports.append(Report(f"top {top} {what} in {range_name}", top_rows(in_range, unit=prof.unit, top=top),
                              notes=["%: share of the range's total."]))
    else:
        known = ", ".join(sorted(prof.by_range)) or "none"
        reports[-1].notes.append(f"No {what} recorded in range {range_name!r} (ranges with {what}: {known}).")
    split = split_rows(prof, shape=shape)
    if split:
        basis = "GPU kernel time inside each range" if gpu else "range duration on the CPU"
        notes = [f"time: {basis}. Forward only (autograd runs the backward outside these ranges)."]
        if shape is not None:
            notes.append(SPLIT_FLOP_NOTE)
        reports.append(Report("attention: matmul vs softmax", split, notes=notes))
    if prof.api:
        reports.append(Report("CUDA API calls (top 5)", top_rows(prof.api, unit="API call", top=5)))
    files = [f"{role}: {path}" for role, path in prof.files.items()]
    reports[-1].notes += ["Files: " + "; ".join(files)] + [f"$ {c}" for c in prof.commands]
    return reports


def step_meta(meta: dict, name: str, config, *, batch_size: int, dtype: str, mode: str, warmup: int, steps: int,
              engine: str, nsys: str | None, prof=None) -> dict:
    """The header. The attention: lmsys's model's --impl; a --model's, what its kernels (or, on a CPU, its
    operators) in `prof` show it ran (lmsys.profiling.summary.attention_seen)."""
    from lmsys.model import describe
    from lmsys.model.user import is_user_model
    from lmsys.profiling.summary import attention_seen

    meta[name] = describe(config)
    attention = config.attn_impl
    if is_user_model(config):
        seen = attention_seen(prof) if prof is not None else None
        where = "kernels" if prof is not None and prof.unit == "kernel" else "operators"
        attention = (f"{seen}, from its {where}" if seen else
                     f"the model's own (none of its {where} is an SDPA, flash or softmax one lmsys knows)")
    meta["run"] = (f"batch {batch_size}, {dtype}, mode {mode}, attention {attention}, warmup {warmup} "
                   f"(not recorded), {steps} measured steps, engine {engine}")
    if nsys is not None:
        meta["nsys"] = nsys
    return meta


# ------------------------------------------------------------------------------------- the command's

def one_config(size: str | None, device, *, context_length: int, attn_impl: str | None = None,
               model: str | None = None, model_kwargs: str = ""):
    """(name, config) of the one model a profile looks at: --size (default: the device's) at this length."""
    from lmsys.model.config import default_size, resolve_configs

    name = size or default_size(device.type)
    return resolve_configs([name], context_length=context_length, attn_impl=attn_impl, model=model,
                           model_kwargs=model_kwargs)[0]


def resolve(*, command: list[str] | None, size: str | None, context_length: int, batch_size: int, dtype: str,
            mode: str, warmup: int, steps: int, device: str, engine: str, trace: str, range_name: str, top: int,
            annotate_attention: bool, model: str | None, model_kwargs: str | None, nsys_args: str,
            out_dir: Path) -> dict:
    """Every option of `profile nsys` checked, the torch-free ones first (a typo answers before torch loads),
    as `nsys_reports`' arguments; --out-dir created and probed before any work."""
    import shlex

    from lmsys.core.files import check_output_dir
    from lmsys.core.parsing import check_counts, check_one_size, choose
    from lmsys.model.user import check_model, is_lmsys_model, parse_model_kwargs
    from lmsys.profiling import nsys
    from lmsys.profiling.phases import check_mode

    model, kwargs_json = (check_model(model) if model else None), parse_model_kwargs(model_kwargs)
    check_counts(warmup=(warmup, 0), steps=(steps, 1), batch_size=(batch_size, 1), top=(top, 1))
    check_one_size(size, command="profile nsys", why=ONE_AT_A_TIME)
    check_mode(mode)
    choose(engine, ENGINES, what="--engine")
    try:
        extra = shlex.split(nsys_args)
    except ValueError as exc:  # e.g. an unclosed quote
        raise LmsysError(f"--nsys-args: cannot split {nsys_args!r} ({exc})") from None
    if engine == "torch" and nsys_args:
        raise LmsysError("--nsys-args applies to --engine nsys; --engine torch runs torch.profiler")
    if annotate_attention and not is_lmsys_model(model):
        raise LmsysError(f"--annotate-attention swaps the attention inside lmsys's model; --model {model} runs "
                         "its own")
    shown = dict(range_name=range_name, top=top, out_dir=out_dir, trace=trace, extra=extra)
    if command:  # `profile nsys -- COMMAND`: nsys around the user's program
        if engine != "nsys":
            raise LmsysError("a command after -- is profiled with --engine nsys; --engine torch runs the training step")
        nsys_path = nsys.find_nsys()
        check_output_dir(out_dir, what="--out-dir")
        return dict(command=list(command), nsys_path=nsys_path, **shown)
    from lmsys.core.devices import check_dtype_for_device, resolve_device

    nsys_path = nsys.find_nsys() if engine == "nsys" else None
    dev = resolve_device(device)
    check_engine(engine, dev)
    check_dtype_for_device(dtype, dev)
    name, cfg = one_config(size, dev, context_length=context_length,
                           attn_impl="annotated" if annotate_attention else None, model=model,
                           model_kwargs=kwargs_json)
    check_output_dir(out_dir, what="--out-dir")
    return dict(engine=engine, nsys_path=nsys_path, name=name, config=cfg, device=dev, batch_size=batch_size,
                dtype=dtype, mode=mode, warmup=warmup, steps=steps, context_length=context_length,
                annotated=annotate_attention, **shown)


ONE_AT_A_TIME = "a profile looks at one configuration at a time"


def nsys_reports(*, command: list[str] | None = None, nsys_path: str | None, range_name: str, top: int,
                 out_dir: Path, trace: str, extra: list[str], **step) -> tuple[list[Report], str]:
    """`profile nsys`: (its reports, the line naming the file to open): the user's command under nsys, or
    the training step under nsys or torch.profiler."""
    import shlex

    from lmsys.profiling import nsys

    if command:
        prof = nsys.profile_app(nsys_path, command, out_dir=out_dir, name=app_name(command), trace=trace, extra=extra)
        meta = {"command": shlex.join(command), "nsys": f"{nsys.nsys_version(nsys_path)} ({nsys_path})"}
        return time_reports(prof, meta=meta, range_name=range_name, top=top, shape=None), \
            f"nsys report: {prof.files['report']}"
    from lmsys.core import progress
    from lmsys.core.devices import environment

    engine, name, cfg, dev = step["engine"], step["name"], step["config"], step["device"]
    run = dict(batch_size=step["batch_size"], dtype=step["dtype"], mode=step["mode"])
    context_length, warmup, steps = step["context_length"], step["warmup"], step["steps"]
    base = step_name(engine, name, context_length=context_length, annotated=step["annotated"], **run)
    with progress.display(f"profile nsys --engine {engine}"):
        prof = profile_step(engine, nsys_path, cfg, dev, warmup=warmup, steps=steps, out_dir=out_dir,
                            name=base, trace=trace, extra=extra, **run)
    version = f"{nsys.nsys_version(nsys_path)} ({nsys_path})" if nsys_path else None
    meta = step_meta(environment(dev), name, cfg, warmup=warmup, steps=steps, engine=engine, nsys=version,
                     prof=prof, **run)
    shape = (run["batch_size"], cfg.num_heads, context_length, cfg.d_head)
    where = f"nsys report: {prof.files['report']}" if engine == "nsys" else f"chrome trace: {prof.files['trace']}"
    return time_reports(prof, meta=meta, range_name=range_name, top=top, shape=shape), where
