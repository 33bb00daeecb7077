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
