"""Nsight Systems: find `nsys`, run `nsys profile` and `nsys stats`, parse the CSV reports.

How warm-up is kept out of the numbers: the workload process (`lmsys.profiling.nsys_target`) runs its
warm-up steps first, then calls cudaProfilerStart (torch.cuda.profiler.start), runs the measured steps
and calls cudaProfilerStop. `nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop`
records only what lies between, so every report (NVTX ranges, kernels, CUDA API calls) covers the
measured steps only, with no NVTX-name registration caveats (`--capture-range=nvtx` needs registered
strings or NSYS_NVTX_PROFILER_REGISTER_ONLY=0). A command given after `--` is profiled whole.

Which report answers what (`nsys stats --format csv`, one file per report):
- nvtx_sum: host-side duration of each range. The phase ranges (FWD_STEP, BWD_STEP, OPTIM_STEP)
  synchronise before they close, so their duration is the phase's wall time, GPU work included.
- nvtx_kern_sum: kernels per range, matched by launch: a kernel belongs to every range open on the
  launching thread when it was launched. Right for the attention parts (launched by the main thread).
- cuda_gpu_kern_sum: kernels overall. cuda_api_sum: CUDA API calls.
- nvtx_pushpop_trace + cuda_gpu_trace (a second `nsys stats` call, optional): the phase ranges' time
  windows and each kernel's execution interval. Autograd launches the backward's kernels from its own
  thread, outside BWD_STEP's thread, so launch matching finds no backward kernels; since the phases
  are synchronised and run one after another, a kernel that executes inside a phase's window belongs
  to that phase. Phase kernels come from these windows; other ranges from nvtx_kern_sum.
"""

from __future__ import annotations

import csv
import glob
import io
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from lmsys.core.errors import LmsysError
from lmsys.core.files import write_atomic
from lmsys.profiling.summary import RangeTime, Timed, TimeProfile, aggregate

DEFAULT_TRACE = "cuda,nvtx,osrt,cublas"
STATS_REPORTS = ("nvtx_sum", "nvtx_kern_sum", "cuda_gpu_kern_sum", "cuda_api_sum")
TRACE_REPORTS = ("nvtx_pushpop_trace", "cuda_gpu_trace")
# Where nsys is looked for after $NSYS and PATH (first match wins; newest version first).
SEARCH_GLOBS = (
    "/opt/nvidia/nsight-systems*/**/nsys",
    "/opt/nvidia/nsight-*/**/nsys",
    "/usr/local/cuda/bin/nsys",
    "/usr/local/cuda-*/bin/nsys",
)


# ------------------------------------------------------------------------------------- finding nsys


def _is_exe(path: str | Path) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def _install_rank(path: str) -> tuple[int, str]:
    """Prefer the CLI's usual homes (<install>/target-linux-x64/nsys, .../bin/nsys), then the newest
    version (the larger path, e.g. 2025.3.1 over 2024.6.2)."""
    parent = Path(path).parent.name
    return (2 if parent in ("target-linux-x64", "bin") else 1 if parent.startswith("target-linux") else 0, path)


def find_nsys(env: dict | None = None, search_globs: tuple[str, ...] | None = None) -> str:
    """$NSYS (when set, it must be nsys), then PATH, then the usual install places."""
    env = os.environ if env is None else env
    explicit = env.get("NSYS", "").strip()
    if explicit:
        if _is_exe(explicit):
            return explicit
        raise LmsysError(f"NSYS={explicit} is not an executable file; point it at nsys, or use --engine torch")
    on_path = shutil.which("nsys", path=env.get("PATH", ""))
    if on_path:
        return on_path
    for pattern in SEARCH_GLOBS if search_globs is None else search_globs:
        hits = [p for p in glob.glob(pattern, recursive=True) if _is_exe(p)]
        if hits:
            return max(hits, key=_install_rank)
    raise LmsysError(
        "nsys (Nsight Systems) not found in $NSYS, PATH, /opt/nvidia/nsight-*/**/nsys or /usr/local/cuda/bin; "
        "use --engine torch (torch.profiler), or set NSYS=/path/to/nsys"
    )


def nsys_version(nsys: str) -> str | None:
    out = _output([nsys, "--version"])
    if out is None:
        return None
    m = re.search(r"\d{4}\.\d+(?:\.\d+)*(?:[-.]\w+)*", out)
    return m.group(0) if m else (out.strip() or None)


# ------------------------------------------------------------------------------------ command lines


def profile_command(nsys: str, app: list[str], *, output: Path, trace: str = DEFAULT_TRACE,
                    capture_profiler_api: bool = False, extra: list[str] | None = None) -> list[str]:
    """`nsys profile` of `app`, writing `output`.nsys-rep. CPU sampling and context switches are off:
    the questions here are about GPU kernels and NVTX ranges, and it keeps reports small."""
    cmd = [nsys, "profile", f"--trace={trace}", f"--output={output}", "--force-overwrite=true",
           "--stats=false", "--sample=none", "--cpuctxsw=none"]
    if capture_profiler_api:
        cmd += ["--capture-range=cudaProfilerApi", "--capture-range-end=stop"]
    return cmd + list(extra or []) + list(app)


OPTIONAL_PROFILE_FLAGS = ("--stats", "--sample", "--cpuctxsw")


def supported_flags(nsys: str) -> set[str] | None:
    """The long options `nsys profile --help` lists (None when the help cannot be read)."""
    found = set(re.findall(r"(--[a-z][a-z0-9-]+)", _output([nsys, "profile", "--help"]) or ""))
    return found or None


def drop_unsupported(cmd: list[str], supported: set[str] | None) -> list[str]:
    """Leave out the optional flags this nsys does not know (they only trim the report)."""
    if supported is None:
        return cmd
    return [c for c in cmd if c.split("=", 1)[0] not in OPTIONAL_PROFILE_FLAGS or c.split("=", 1)[0] in supported]


def stats_command(nsys: str, report: Path, *, base: Path, reports: tuple[str, ...] = STATS_REPORTS) -> list[str]:
    """`nsys stats` writing one CSV per report: `base`_<report>.csv."""
    return [nsys, "stats", *(f"--report={r}" for r in reports), "--format=csv", f"--output={base}",
            "--force-export=true", str(report)]


def _run(cmd: list[str], *, env: dict | None = None, log: Path | None = None, timeout: float | None = None):
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                              timeout=timeout, errors="replace")
    except OSError as exc:
        raise LmsysError(f"cannot run {cmd[0]}: {exc.strerror or exc}") from None
    except subprocess.TimeoutExpired:
        raise LmsysError(f"{Path(cmd[0]).name} did not finish within {timeout:.0f} s") from None
    if log is not None:
        with open(log, "a") as f:
            f.write(f"$ {shlex.join(cmd)}\n{proc.stdout}\n[exit {proc.returncode}]\n\n")
    return proc


def _output(cmd: list[str]) -> str | None:
    """stdout + stderr of a short query (--version, --help, ldd), or None when it cannot run."""
    try:
        return _run(cmd, timeout=60).stdout
    except LmsysError:
        return None


# --------------------------------------------------------------------------- profile: run and check


@dataclass
class ProfileRun:
    command: list[str]
    returncode: int
    output: str  # nsys's stdout and stderr (and the application's), interleaved
    report: Path | None  # the .nsys-rep, when nsys wrote one
    qdstrm: Path | None  # a .qdstrm left behind when the importer failed


def run_profile(cmd: list[str], *, output: Path, env: dict | None = None, log: Path | None = None) -> ProfileRun:
    proc = _run(cmd, env=env, log=log)
    rep = Path(f"{output}.nsys-rep")
    qdstrm = Path(f"{output}.qdstrm")
    if not qdstrm.is_file():
        named = [Path(m) for m in re.findall(r"(\S+\.qdstrm)\b", proc.stdout)]
        qdstrm = next((p for p in named if p.is_file()), None)
    return ProfileRun(cmd, proc.returncode, proc.stdout, rep if rep.is_file() else None, qdstrm)


_SO_NOT_LOADED = re.compile(r"(lib[\w+.-]*?\.so(?:\.\d+)*)\s*:\s*cannot open shared object file")
_LDD_NOT_FOUND = re.compile(r"^\s*(\S+)\s+=>\s+not found", re.MULTILINE)


def missing_libraries(text: str) -> list[str]:
    """Library names from loader errors ('libdw.so.1: cannot open shared object file') or ldd output
    ('libdw.so.1 => not found'), in order, without repeats."""
    names = _SO_NOT_LOADED.findall(text) + _LDD_NOT_FOUND.findall(text)
    return list(dict.fromkeys(names))


def find_importer(nsys: str) -> str | None:
    """nsys's QdstrmImporter, which turns the raw .qdstrm into .nsys-rep: near nsys in its install."""
    root = Path(os.path.realpath(nsys)).parent  # e.g. <install>/target-linux-x64
    for base in (root, root.parent):  # the importer sits in <install>/host-linux-x64
        for dirpath, dirs, files in os.walk(base):
            if len(Path(dirpath).relative_to(base).parts) >= 2:
                dirs[:] = []  # two levels below the install at most
            for name in sorted(files):
                if name.startswith("QdstrmImporter"):
                    path = os.path.join(dirpath, name)
                    if _is_exe(path):
                        return path
    return None


def importer_missing_libraries(nsys: str) -> list[str]:
    """What nsys's importer cannot load, by `ldd` (empty when it cannot tell)."""
    importer = find_importer(nsys)
    if not importer or not shutil.which("ldd"):
        return []
    return missing_libraries(_output(["ldd", importer]) or "")


def check_importer(nsys: str) -> None:
    """Before profiling: an importer that cannot load its libraries would make nsys run the whole
    workload, write gigabytes of .qdstrm and fail at the end (seen: over 90 s for one CUDA call)."""
    libs = importer_missing_libraries(nsys)
    if libs:
        raise _importer_error(f"nsys would leave only a .qdstrm and no .nsys-rep: its importer cannot load "
                              f"{', '.join(libs)}")


def importer_failure(run: ProfileRun, nsys: str) -> LmsysError:
    """The error for 'nsys left only a .qdstrm': name the library its importer could not load."""
    libs = missing_libraries(run.output) or importer_missing_libraries(nsys)
    where = run.qdstrm.name if run.qdstrm else "a .qdstrm"
    if libs:
        why = f"its importer cannot load {', '.join(libs)}"
    else:
        why = ("its importer failed ('Importer error status'); on the lent GPU machines the cause was "
               "libdw.so.1 (elfutils) missing")
    return _importer_error(f"nsys left only {where} and no .nsys-rep: {why}")


def _importer_error(msg: str) -> LmsysError:
    hint = ("install libdw1 and libelf1 (elfutils), or unpack their .debs (apt-get download libdw1 libelf1; "
            "dpkg -x FILE DIR) and put DIR/usr/lib/x86_64-linux-gnu on LD_LIBRARY_PATH, then run again")
    return LmsysError(msg, hint=hint)


def last_error_line(text: str) -> str:
    """The most telling line of a failed run: an 'error:' line if there is one, else the last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.lower().startswith(("error", "fatal")) or "Error:" in ln]
    return (errors or lines or ["(no output)"])[-1]


# ------------------------------------------------------------------------------ stats: run and read


def run_stats(nsys: str, report: Path, *, base: Path, reports: tuple[str, ...] = STATS_REPORTS,
              log: Path | None = None, required: bool = True) -> dict[str, Path]:
    """Run `nsys stats`; return the CSV file of each report that produced one (empty reports are
    skipped by nsys and missing here)."""
    cmd = stats_command(nsys, report, base=base, reports=reports)
    proc = _run(cmd, log=log)
    found = {}
    for name in reports:
        exact = Path(f"{base}_{name}.csv")
        hits = [exact] if exact.is_file() else sorted(Path(base).parent.glob(f"{Path(base).name}_{name}*.csv"))
        if hits:
            found[name] = hits[0]
    if required and not found:
        raise LmsysError(f"nsys stats produced no CSV (exit {proc.returncode}): {last_error_line(proc.stdout)}")
    return found


_HEADER_HINTS = {"time (%)", "total time (ns)", "range", "nvtx range", "name", "kernel name", "start (ns)"}


def parse_csv(text: str) -> list[dict[str, str]]:
    """Rows of one `nsys stats --format csv` report. Lines before the header (notices such as
    'Processing [...] with [...]') are skipped; the table ends at the first blank line."""
    lines = text.splitlines()
    start = None
    for i, line in enumerate(lines):
        try:
            fields = next(csv.reader([line]))
        except (csv.Error, StopIteration):
            continue
        if len(fields) >= 2 and any(f.strip().lower() in _HEADER_HINTS for f in fields):
            start = i
            break
    if start is None:
        return []
    body = []
    for line in lines[start:]:
        if not line.strip():
            if body:
                break
            continue
        body.append(line)
    reader = csv.DictReader(io.StringIO("\n".join(body)))
    return [{(k or "").strip(): (v or "").strip() for k, v in row.items()} for row in reader]


def read_csv(path: str | Path) -> list[dict[str, str]]:
    return parse_csv(Path(path).read_text(errors="replace"))


_UNIT_NS = {"ns": 1.0, "us": 1e3, "μs": 1e3, "µs": 1e3, "ms": 1e6, "s": 1e9}


def _column(row: dict[str, str], *prefixes: str) -> tuple[str | None, float]:
    """The first column whose name starts with one of `prefixes` (case-insensitive), and the factor
    that turns its unit ('(ns)', '(us)', ...) into nanoseconds."""
    def bare(key: str) -> str:
        return re.sub(r"\s*\([^)]*\)\s*$", "", key).strip().lower()

    for prefix in prefixes:
        hits = [k for k in row if bare(k) == prefix.lower()] or [k for k in row if k.lower().startswith(prefix.lower())]
        if hits:
            m = re.search(r"\((\w+)\)\s*$", hits[0])
            return hits[0], _UNIT_NS.get(m.group(1), 1.0) if m else 1.0
    return None, 1.0


def _num(text: str | None) -> float:
    try:
        return float((text or "").replace(",", ""))
    except ValueError:
        return 0.0


def range_name(text: str) -> str:
    """nsys shows push/pop ranges of the default domain as ':NAME'; keep NAME."""
    return text[1:] if text.startswith(":") else text


def ranges_from_nvtx_sum(rows: list[dict[str, str]]) -> list[RangeTime]:
    merged: dict[str, RangeTime] = {}
    for row in rows:
        name_col, _ = _column(row, "Range", "Name")
        total_col, unit = _column(row, "Total Time", "Total Proj Time")
        inst_col, _ = _column(row, "Instances", "Range Instances", "NVTX Inst")
        if name_col is None or total_col is None:
            continue
        name = range_name(row[name_col])
        r = merged.setdefault(name, RangeTime(name, 0, 0.0))
        r.instances += int(_num(row.get(inst_col)))
        r.total_ns += _num(row[total_col]) * unit
    return list(merged.values())


def kernels_by_range(rows: list[dict[str, str]]) -> dict[str, list[Timed]]:
    """nvtx_kern_sum -> {range: kernels launched inside it}, merged over threads and styles."""
    out: dict[str, list[Timed]] = {}
    for row in rows:
        range_col, _ = _column(row, "NVTX Range", "Range")
        kernel_col, _ = _column(row, "Kernel Name", "Name")
        total_col, unit = _column(row, "Total Time")
        count_col, _ = _column(row, "Kern Inst", "Instances")
        if None in (range_col, kernel_col, total_col) or not row[range_col]:
            continue
        out.setdefault(range_name(row[range_col]), []).append(
            Timed(row[kernel_col], int(_num(row.get(count_col))), _num(row[total_col]) * unit))
    return {name: aggregate(items) for name, items in out.items()}


def timed_from_summary(rows: list[dict[str, str]]) -> list[Timed]:
    """cuda_gpu_kern_sum (Instances) or cuda_api_sum (Num Calls) -> items, largest first."""
    items = []
    for row in rows:
        name_col, _ = _column(row, "Name")
        total_col, unit = _column(row, "Total Time")
        count_col, _ = _column(row, "Instances", "Num Calls", "Calls", "Count")
        if name_col is None or total_col is None:
            continue
        items.append(Timed(row[name_col], int(_num(row.get(count_col))), _num(row[total_col]) * unit))
    return aggregate(items)


def _intervals(rows: list[dict[str, str]], *, name_prefixes=("Name",)) -> list[tuple[str, float, float]]:
    """(name, start ns, end ns) from a trace report: Start + End, or Start + Duration."""
    out = []
    for row in rows:
        name_col, _ = _column(row, *name_prefixes)
        start_col, s_unit = _column(row, "Start")
        end_col, e_unit = _column(row, "End")
        dur_col, d_unit = _column(row, "Duration")
        if name_col is None or start_col is None or (end_col is None and dur_col is None):
            continue
        start = _num(row[start_col]) * s_unit
        end = _num(row[end_col]) * e_unit if end_col else start + _num(row[dur_col]) * d_unit
        out.append((row[name_col], start, end))
    return out


def kernels_in_windows(range_rows: list[dict[str, str]], kernel_rows: list[dict[str, str]],
                       names: tuple[str, ...]) -> dict[str, list[Timed]]:
    """Kernels whose execution lies inside an instance of each named range (by time, any thread).
    Memory copies and sets ('[CUDA memcpy ...]') are not kernels and are left out."""
    windows = {n: [] for n in names}
    for name, start, end in _intervals(range_rows):
        name = range_name(name)
        if name in windows:
            windows[name].append((start, end))
    kernels = [(n, s, e) for n, s, e in _intervals(kernel_rows) if not n.startswith("[")]
    out = {}
    for name, spans in windows.items():
        if not spans:
            continue
        items = [Timed(k, 1, e - s) for k, s, e in kernels if any(a <= s and e <= b for a, b in spans)]
        out[name] = aggregate(items)
    return out


def summarize(stats: dict[str, list[dict[str, str]]], *, windowed: tuple[str, ...] = ()) -> TimeProfile:
    """The four reports (and, for `windowed` ranges, the two trace reports) -> a TimeProfile."""
    profile = TimeProfile(engine="nsys", unit="kernel")
    profile.ranges = ranges_from_nvtx_sum(stats.get("nvtx_sum", []))
    by_range = kernels_by_range(stats.get("nvtx_kern_sum", []))
    if windowed and stats.get("nvtx_pushpop_trace") and stats.get("cuda_gpu_trace"):
        by_range.update(kernels_in_windows(stats["nvtx_pushpop_trace"], stats["cuda_gpu_trace"], windowed))
    elif windowed:
        profile.notes.append("No kernel trace for the phase windows: BWD_STEP shows only kernels launched from "
                             "the main thread (autograd launches the rest from its own thread).")
    profile.by_range = by_range
    for r in profile.ranges:
        kernels = by_range.get(r.name)
        if kernels is not None:
            r.device_ns = sum(k.total_ns for k in kernels)
            r.kernels = sum(k.count for k in kernels)
        elif by_range:
            r.device_ns, r.kernels = 0.0, 0
    profile.top = timed_from_summary(stats.get("cuda_gpu_kern_sum", []))
    profile.api = timed_from_summary(stats.get("cuda_api_sum", []))
    return profile


def load_stats(files: dict[str, str | Path]) -> dict[str, list[dict[str, str]]]:
    return {name: read_csv(path) for name, path in files.items()}


# ------------------------------------------------------------------------------------ the two flows


def _child_env() -> dict:
    """The environment for the profiled process: lmsys importable even when run from a source tree."""
    import lmsys

    env = dict(os.environ)
    src = str(Path(lmsys.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    return env


def _profile(nsys: str, app: list[str], *, out_dir: Path, name: str, trace: str, extra: list[str],
             capture_profiler_api: bool, windowed: tuple[str, ...], result_file: Path | None,
             env: dict | None = None) -> TimeProfile:
    """`env`: variables added to the profiled process's environment. nsys writes the report and the stats CSVs under a hidden temporary name beside their final names;
    they are renamed only when all are complete, so an interrupt or a failure leaves nothing (and an older
    complete report stays as it was) at the final paths."""
    check_importer(nsys)
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / name
    output = out_dir / f".{name[:64]}.tmp-{os.getpid()}"
    log = out_dir / f"{name}.log"
    log.write_text("")
    try:
        cmd = profile_command(nsys, app, output=output, trace=trace, capture_profiler_api=capture_profiler_api,
                              extra=extra)
        n_app = len(app)
        cmd = drop_unsupported(cmd[:-n_app], supported_flags(nsys)) + cmd[-n_app:]
        run = run_profile(cmd, output=output, env={**_child_env(), **(env or {})}, log=log)
        if result_file is not None:
            import json

            result = json.loads(result_file.read_text()) if result_file.is_file() else None
            if result is None:
                raise LmsysError(f"the profiled step did not finish (nsys exit {run.returncode}): "
                                 f"{last_error_line(run.output)}; full output in {log}")
            if result.get("yours"):  # the user's model: a failed run (exit 1), said as in-process
                from lmsys.core.errors import RunFailed

                raise RunFailed(f"{result.get('error')}; full output in {log}")
            if result.get("status") != "ok":
                raise LmsysError(f"the profiled step failed: {result.get('error')}; full output in {log}")
        if run.report is None:
            if run.qdstrm is not None and run.qdstrm.parent == out_dir and run.qdstrm.name.startswith(output.name):
                run.qdstrm = run.qdstrm.replace(Path(f"{final}.qdstrm"))  # complete, only not imported: kept
            if run.qdstrm is not None or ".qdstrm" in run.output or "Importer error" in run.output:
                raise importer_failure(run, nsys)
            raise LmsysError(f"nsys profile wrote no .nsys-rep (exit {run.returncode}): "
                             f"{last_error_line(run.output)}; full output in {log}")
        base = out_dir / f"{output.name}_stats"
        files = run_stats(nsys, run.report, base=base, log=log)
        if windowed:
            files.update(run_stats(nsys, run.report, base=base, reports=TRACE_REPORTS, log=log, required=False))
        stats = load_stats(files)
        # Complete: the new files take the final names (old stats CSVs go first, so none is left from before).
        for stale in (*out_dir.glob(f"{glob.escape(name)}_stats_*.csv"), Path(f"{final}.qdstrm"),
                      Path(f"{final}.sqlite")):
            stale.unlink(missing_ok=True)
        report = run.report.replace(Path(f"{final}.nsys-rep"))
        files = {k: Path(v).replace(out_dir / Path(v).name.replace(output.name, name, 1)) for k, v in files.items()}
    finally:
        for leftover in out_dir.glob(f"{glob.escape(output.name)}[._]*"):
            leftover.unlink(missing_ok=True)
    stats_base = out_dir / f"{name}_stats"
    commands = [shlex.join([a.replace(str(output), str(final)) for a in cmd]),
                shlex.join(stats_command(nsys, report, base=stats_base))]
    if windowed:
        commands.append(shlex.join(stats_command(nsys, report, base=stats_base, reports=TRACE_REPORTS)))
    profile = summarize(stats, windowed=windowed)
    profile.files = {"report": str(report), **{f"{k}.csv": str(v) for k, v in files.items()}, "log": str(log)}
    profile.commands = commands
    return profile


def profile_e2e(nsys: str, *, config, batch_size: int, dtype: str, mode: str, warmup: int, steps: int,
                device: str, out_dir: Path, name: str, trace: str = DEFAULT_TRACE,
                extra: list[str] | None = None) -> TimeProfile:
    """The training step under nsys, measured steps only (see the module docstring)."""
    import json
    import sys

    from lmsys.profiling.phases import STEP_RANGES

    out_dir.mkdir(parents=True, exist_ok=True)
    spec_file = out_dir / f"{name}.spec.json"
    result_file = out_dir / f"{name}.result.json"
    result_file.unlink(missing_ok=True)
    spec = {"config": config.as_dict(), "batch_size": batch_size, "dtype": dtype, "mode": mode,
            "warmup": warmup, "steps": steps, "device": device, "result": str(result_file)}
    write_atomic(spec_file, json.dumps(spec, indent=2), what="--out-dir")
    app = [sys.executable, "-m", "lmsys.profiling.nsys_target", str(spec_file)]
    from lmsys.core import progress

    with progress.relayed() as env:  # the target's steps, in this process's progress display
        profile = _profile(nsys, app, out_dir=out_dir, name=name, trace=trace, extra=list(extra or []),
                           capture_profiler_api=True, windowed=STEP_RANGES, result_file=result_file, env=env)
    profile.files["spec"] = str(spec_file)
    return profile


def profile_app(nsys: str, app: list[str], *, out_dir: Path, name: str, trace: str = DEFAULT_TRACE,
                extra: list[str] | None = None) -> TimeProfile:
    """Any command under nsys, whole run (its own NVTX ranges, if any, become the range table)."""
    if not app:
        raise LmsysError("no command to profile after --")
    return _profile(nsys, app, out_dir=out_dir, name=name, trace=trace, extra=list(extra or []),
                    capture_profiler_api=False, windowed=(), result_file=None)
