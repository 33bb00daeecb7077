"""The one launcher for multi-process work: torchrun starts the processes, this module runs a job on them.

`run(target, kwargs, world_size=N, backend=...)` runs the job function `target` ("module:function",
called as `function(ctx, **kwargs)` with a `RankContext`) on every rank of a process group:

- Not under torchrun: re-executes through `python -m torch.distributed.run --standalone
  --nproc-per-node N -m lmsys.distributed.launch SPEC` as a subprocess (torchrun picks a free port).
  Rank 0 writes the job's return value as JSON to a temporary file and the parent returns it, so the
  parent renders with the one renderer. A rank that raises writes its error next to it; the parent
  raises `RankFailedError` naming the first rank that failed (or re-raises a user error as LmsysError).
- Under torchrun (RANK and WORLD_SIZE set, e.g. a multi-node `torchrun --nnodes ... -m lmsys ...`):
  joins that group, runs the job in this process and returns the result on rank 0, None elsewhere.

Backends: gloo with CPU tensors; nccl with one GPU per rank, chosen by LOCAL_RANK. The process group
gets a timeout (LMSYS_DIST_TIMEOUT_S, default 600 s), so a collective waiting on a dead rank ends with
an error; torchrun also stops the surviving ranks as soon as one exits with an error. torchrun gets a
parent-death signal (SIGTERM) and each rank one from torchrun (SIGKILL): a `kill -9` of lmsys ends the
whole job within seconds, and torchrun, outliving it, removes the run folder.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from lmsys.core.errors import LmsysError
from lmsys.core.parsing import choose
from lmsys.core import progress
from lmsys.core.files import write_atomic

BACKENDS = ("gloo", "nccl")
DEFAULT_TIMEOUT_S = 600.0
MAX_TIMEOUT_S = 7 * 86400.0  # a week: any finite bound keeps timedelta and the ms the backends take in range
ENV_TIMEOUT = "LMSYS_DIST_TIMEOUT_S"


class RankFailedError(RuntimeError):
    """A rank of a launched job failed (its exception, or it died); carries that rank's message."""

    def __init__(self, message: str, *, rank: Optional[int] = None):
        super().__init__(message)
        self.message = message
        self.rank = rank


class RankError(RuntimeError):
    """A failure a rank reports in one line, without a traceback (e.g. running out of memory): the
    parent's RankFailedError carries the message as it is."""


@dataclass(frozen=True)
class RankContext:
    """What a job needs to know about its place in the group."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: Any  # torch.device: cuda:LOCAL_RANK for nccl, cpu for gloo

    @property
    def is_main(self) -> bool:
        return self.rank == 0


# ---------------------------------------------------------------------------------------- validation


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def resolve_backend(name: Optional[str]) -> str:
    """None or 'auto' -> nccl when a GPU is visible, else gloo; anything else must be a known backend."""
    import torch

    if name is None or name == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return choose(name, BACKENDS, what="--backend")


def backend_for_device(device: Optional[str], backend: Optional[str]) -> Optional[str]:
    """--device as the shared option says it: cpu -> gloo, cuda -> nccl; with --backend too they must agree.
    'auto' (or None) leaves --backend as given."""
    if device in (None, "auto"):
        return backend
    implied = "gloo" if device == "cpu" else "nccl"
    if backend not in (None, "auto") and backend != implied:
        raise LmsysError(f"--device {device} runs {implied}, but --backend {backend} was given",
                         hint="give one of them (--device cpu = --backend gloo, --device cuda = --backend nccl)")
    return implied


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def oversubscribed(world_size: int, backend: str) -> Optional[str]:
    """Why times at this world size are not scaling numbers (gloo ranks outnumber the CPU cores, so each
    gets under one core), or None."""
    cores = _cores()
    if backend == "gloo" and world_size > cores:
        return (f"{world_size} processes on {cores} CPU core(s): they share cores, so times measure "
                "scheduling as much as communication")
    return None


def warn_oversubscription(world_sizes: list[int], backend: str) -> Optional[str]:
    """One line when gloo ranks outnumber the CPU cores (each gets under one core: times are not
    bandwidth any more), else None."""
    worst = max(world_sizes)
    if under_torchrun() or not (why := oversubscribed(worst, backend)):
        return None
    return f"warning: --world-size {worst} runs {why}"


def check_rank_memory(bytes_per_rank: int, world_sizes: list[int], backend: str, *, what: str) -> None:
    """Refuse before any rank starts when the ranks' buffers cannot fit: gloo ranks share this host's
    RAM (available now), nccl ranks each take one GPU's memory (free now on GPU 0)."""
    from lmsys.core.parsing import format_bytes

    if backend == "nccl":
        import torch

        free, _ = torch.cuda.mem_get_info(0)
        need, where = bytes_per_rank, f"GPU 0 has {format_bytes(free)} free"
    else:
        from lmsys.model.memory import available_ram

        free = available_ram()
        ranks = 1 if under_torchrun() else max(world_sizes)  # under torchrun, only this node's rank is known
        need, where = bytes_per_rank * ranks, f"{format_bytes(free)} of RAM is available for {ranks} rank(s)"
    if free is not None and need > free:
        from lmsys.core.parsing import about_bytes

        raise LmsysError(f"{what} needs {about_bytes(need)} ({format_bytes(bytes_per_rank)} per rank); "
                         f"{where}", hint="give smaller sizes or fewer ranks")


def resolve_world_sizes(requested: Optional[list[int]], *, default: int = 2) -> list[int]:
    """The world sizes to run. Under torchrun only the group's own size is possible."""
    if under_torchrun():
        actual = int(os.environ["WORLD_SIZE"])
        if requested and requested != [actual]:
            raise LmsysError(f"--world-size {','.join(map(str, requested))} does not match torchrun's "
                             f"WORLD_SIZE={actual}", hint="under torchrun, leave --world-size out")
        return [actual]
    return requested or [default]


def backend_option(device: Optional[str], backend: Optional[str]) -> Optional[str]:
    """The option the user gave that chose the backend (`--device cuda`, `--backend nccl`), for messages."""
    if device not in (None, "auto"):
        return f"--device {device}"
    if backend not in (None, "auto"):
        return f"--backend {backend}"
    return None


def check_launch(backend: str, world_sizes: list[int], *, chosen_by: Optional[str] = None) -> None:
    """User errors before anything starts: nccl needs CUDA and one GPU per local rank. `chosen_by` names
    the option that picked the backend (messages name what the user gave)."""
    import torch

    choose(backend, BACKENDS, what="--backend")
    timeout_seconds()  # LMSYS_DIST_TIMEOUT_S checked here, in the parent, not once per rank
    for n in world_sizes:
        if n < 1:
            raise LmsysError(f"--world-size must be >= 1, got {n}")  # as parse_int_list says it
    if backend != "nccl":
        return
    if not torch.cuda.is_available():
        given = chosen_by or "--backend nccl"
        raise LmsysError(f"{given} needs CUDA GPUs, and PyTorch sees none",
                         hint="use --device cpu (gloo)" if given.startswith("--device") else "use --backend gloo")
    visible = torch.cuda.device_count()
    if under_torchrun():
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        if local > visible:
            raise LmsysError(f"nccl: {local} ranks on this node but only {visible} GPU(s) visible")
        return
    if max(world_sizes) > visible:
        raise LmsysError(f"--world-size {max(world_sizes)} with nccl needs {max(world_sizes)} GPUs; "
                         f"{visible} visible", hint="one rank per GPU; use --backend gloo for CPU processes")


def timeout_seconds() -> float:
    text = os.environ.get(ENV_TIMEOUT)
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        raise LmsysError(f"{ENV_TIMEOUT}={text!r} is not a number of seconds") from None
    if not 0 < value <= MAX_TIMEOUT_S:  # nan fails this too; inf would overflow the ranks' timedelta
        raise LmsysError(f"{ENV_TIMEOUT} must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], got {text}")
    return value


# ------------------------------------------------------------------------------------------- running


def run(target: str, kwargs: dict, *, world_size: int, backend: str) -> Any:
    """Run `target(ctx, **kwargs)` on `world_size` ranks; rank 0's return value (JSON-able), or None on
    the other ranks when this process already is a torchrun worker."""
    if under_torchrun():
        return run_in_group(target, kwargs, backend=backend)
    return _launch(target, kwargs, world_size=world_size, backend=backend)


def run_in_group(target: str, kwargs: dict, *, backend: str) -> Any:
    """Join (or reuse) the process group, run the job, return its value on rank 0 and None elsewhere."""
    import torch.distributed as dist

    owns_group = not dist.is_initialized()
    ctx = init_group(backend) if owns_group else current_context(backend)
    result = _resolve(target)(ctx, **kwargs)
    if owns_group:
        dist.destroy_process_group()
    return result if ctx.is_main else None


def init_group(backend: str) -> RankContext:
    """init_process_group from torchrun's environment (env://), with a timeout; nccl binds LOCAL_RANK's GPU."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    if backend == "nccl":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on the lent machines
    ctx = current_context(backend, initialised=False)
    timeout = timedelta(seconds=timeout_seconds())
    if backend == "nccl":
        torch.cuda.set_device(ctx.device)
        dist.init_process_group("nccl", timeout=timeout, device_id=ctx.device)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    return ctx


def current_context(backend: str, *, initialised: bool = True) -> RankContext:
    import torch
    import torch.distributed as dist

    if initialised:
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    return RankContext(rank=rank, world_size=world, local_rank=local_rank, backend=backend, device=device)


def barrier(ctx: RankContext) -> None:
    import torch.distributed as dist

    if ctx.backend == "nccl":
        dist.barrier(device_ids=[ctx.local_rank])
    else:
        dist.barrier()


def _resolve(target: str):
    module_name, _, func_name = target.partition(":")
    return getattr(importlib.import_module(module_name), func_name)


def child_environment(backend: str, world_size: int) -> dict[str, str]:
    """The environment torchrun and its workers get: lmsys importable, threads split, NVLS off."""
    import lmsys

    env = dict(os.environ)
    src = str(Path(lmsys.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    # torchrun would set 1 and warn; give each rank its share of the cores instead.
    env.setdefault("OMP_NUM_THREADS", str(default_rank_threads(world_size)))
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    return env


def default_rank_threads(world_size: int) -> int:
    """The threads each launched rank computes with when OMP_NUM_THREADS is not set: its share of the cores."""
    return max(1, (os.cpu_count() or 1) // world_size)


def rank_threads(world_size: int) -> int:
    """The threads each launched rank computes with (OMP_NUM_THREADS as child_environment passes it on)."""
    text = os.environ.get("OMP_NUM_THREADS")
    return int(text) if text and text.isdigit() and int(text) > 0 else default_rank_threads(world_size)


def _launch(target: str, kwargs: dict, *, world_size: int, backend: str) -> Any:
    """torchrun in its own process group, its working files (and torchelastic's) in a folder this process
    owns. Its stderr (torchrun's and the ranks') goes to a log there, so a failure is one line; with
    LMSYS_DEBUG=1 it streams through. A signal to this process (or an exception) stops the whole group:
    SIGTERM, then SIGKILL after a grace period; the folder is removed in every case."""
    tmp = Path(tempfile.mkdtemp(prefix="lmsys-run-"))
    try:
        spec_path = tmp / "spec.json"
        result_path = tmp / "result.json"
        log_path = tmp / "torchrun.log"
        spec = {"target": target, "kwargs": kwargs, "backend": backend, "result": str(result_path)}
        spec_path.write_text(json.dumps(spec))
        cmd = [sys.executable, "-m", "lmsys.distributed.launch", TORCHRUN_FLAG, "--standalone",
               f"--nproc-per-node={world_size}", "--monitor-interval=0.1",
               "-m", "lmsys.distributed.launch", str(spec_path)]
        env = child_environment(backend, world_size)
        env["TMPDIR"] = str(tmp)  # torchelastic_* (tempfile.mkdtemp) lands here, and goes with it
        env[ENV_PARENT] = str(os.getpid())
        relay = progress.Relay(tmp)  # rank 0's progress lines, shown by this process's display (if any)
        env.pop(progress.ENV, None)
        env.update(relay.env())
        debug = os.environ.get("LMSYS_DEBUG") == "1"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stderr=None if debug else log,
                                    start_new_session=True, preexec_fn=_die_with_parent_sigterm)
            try:
                while True:
                    try:
                        returncode = proc.wait(timeout=0.2)
                        break
                    except subprocess.TimeoutExpired:
                        relay.poll()
                relay.poll()
            finally:  # normal end: reap stragglers at once; a signal or an exception: stop the group
                with _signals_held():
                    stop_group(proc, grace_s=0.0 if proc.returncode is not None else GRACE_S)
        if returncode != 0:
            raise _failure(tmp, returncode, world_size, log_path=None if debug else log_path)
        if not result_path.exists():
            raise RankFailedError("the job ended without rank 0 writing its result", rank=0)
        return json.loads(result_path.read_text())
    finally:
        with _signals_held():
            shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def _signals_held():
    """Ignore SIGINT/SIGTERM while the group is stopped and the folder removed (a second Ctrl-C must
    not abandon the cleanup); the pending exception still ends the command afterwards."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


GRACE_S = 4.0  # seconds between SIGTERM and SIGKILL when stopping a torchrun group


def stop_group(proc: subprocess.Popen, *, grace_s: float = GRACE_S) -> None:
    """End torchrun's process group (torchrun and every rank): SIGTERM (ranks exit quietly), then SIGKILL
    whatever is left after `grace_s`. A no-op for a group that is already gone."""
    import signal

    pgid = proc.pid  # start_new_session: the group id is torchrun's pid
    if not _group_alive(pgid):
        proc.poll()
        return
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _group_alive(pgid):
        proc.poll()
        time.sleep(0.05)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _group_alive(pgid: int) -> bool:
    """Whether any live (non-zombie) process is left in the group."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    for entry in Path("/proc").iterdir() if Path("/proc/self/stat").exists() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # state ppid pgrp ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return not Path("/proc/self/stat").exists()


def _log_tail(log_path: Optional[Path]) -> str:
    """The last line of the captured log that says something (a rank's exception, torchrun's reason)."""
    if log_path is None or not log_path.exists():
        return ""
    lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    for line in reversed(lines):
        if not line.startswith(("[rank", "File ", "^", "~", "Traceback", "=", "[W", "[I", "W0", "I0")) \
                and ("Error" in line or "error" in line or "Killed" in line or "signal" in line):
            return line[:300]
    return ""


def _failure(tmp: Path, returncode: int, world_size: int, *, log_path: Optional[Path] = None) -> Exception:
    """The first rank's error (by time); a user error comes back as LmsysError. Ranks that left no
    report died silently (a signal, os._exit) or were stopped by torchrun after another rank failed."""
    errors = []
    for path in tmp.glob("result.json.rank*.error"):
        try:
            errors.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    silent = sorted(set(range(world_size)) - {e["rank"] for e in errors})
    if not errors:
        tail = _log_tail(log_path)
        where = (f"; last error in torchrun's log: {tail}" if tail else "") + (
            "; run with LMSYS_DEBUG=1 to see every rank's output" if log_path is not None else "; see its output above")
        return RankFailedError(f"a rank died without reporting an error (torchrun exit code {returncode}){where}")
    first = min(errors, key=lambda e: e["time"])
    if first.get("user_error"):
        return LmsysError(first["message"], hint=first.get("hint"))
    if first.get("one_line"):
        message = first["message"]
    else:
        message = f"rank {first['rank']} failed: {first['type']}: {first['message']}"
    if silent:
        message += (f" (no report from rank {', '.join(map(str, silent))}: it died, or torchrun stopped it "
                    "after the failure)")
    return RankFailedError(message, rank=first["rank"])


TORCHRUN_FLAG = "--torchrun"
ENV_PARENT = "LMSYS_PARENT_PID"  # the process a launched torchrun (or rank) must not outlive
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(signum: int) -> None:
    """Ask Linux to send `signum` to this process when its parent dies, even by SIGKILL (prctl
    PR_SET_PDEATHSIG). A no-op where prctl is missing: stop_group and the signal handlers still work."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _die_with_parent_sigterm() -> None:  # Popen's preexec_fn: runs in torchrun's process before exec
    import signal

    die_with_parent(signal.SIGTERM)  # SIGTERM: torchrun stops its ranks before it exits


def _parent_gone(expected: Optional[str]) -> bool:
    """Whether the process that should be this one's parent (pid `expected`) is gone."""
    return expected is not None and os.getppid() != int(expected)


def torchrun_main(argv: list[str]) -> None:
    """torchrun, quiet about a failed worker: the worker already reported its error (one line or its
    traceback) and the parent names it; torchrun's own ChildFailedError dump and agent log lines would
    only bury it. Exit code 1 as torchrun's. When the lmsys process that started it dies (even by
    SIGKILL: the parent-death signal is SIGTERM), torchrun stops its ranks and, outliving that process,
    removes the run folder."""
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main

    launcher = os.environ.get(ENV_PARENT)
    try:
        if _parent_gone(launcher):  # it died before the death signal was armed
            sys.exit(1)
        os.environ[ENV_PARENT] = str(os.getpid())  # the ranks check this process is still theirs
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
        try:
            main(argv)
        except ChildFailedError:
            sys.exit(1)
    finally:
        if _parent_gone(launcher):
            shutil.rmtree(Path(argv[-1]).parent, ignore_errors=True)


def _reported_elsewhere(spec: dict, rank: int) -> bool:
    """Another rank already recorded a failure: this one is most likely its consequence (a collective
    whose peer is gone), and its traceback is noise."""
    folder = Path(spec["result"]).parent
    return any(p.name != f"result.json.rank{rank}.error" for p in folder.glob("result.json.rank*.error"))


def worker_main(argv: list[str]) -> None:
    """Entry point of each torchrun worker: run the job, rank 0 writes the result, a failure is recorded."""
    import signal

    die_with_parent(signal.SIGKILL)  # torchrun gone (even by SIGKILL): so is this rank
    if _parent_gone(os.environ.get(ENV_PARENT)):
        os._exit(1)
    spec = json.loads(Path(argv[0]).read_text())
    rank = int(os.environ.get("RANK", "0"))
    try:
        result = run_in_group(spec["target"], spec["kwargs"], backend=spec["backend"])
    except BaseException as exc:  # noqa: BLE001 - every failure is recorded, then the worker exits
        from lmsys.core.imports import describe_user_failure

        yours = describe_user_failure(exc)  # the user's code failed, or called sys.exit: one line naming it
        record = {"rank": rank, "type": type(exc).__name__, "message": yours or str(exc), "time": time.time(),
                  "user_error": isinstance(exc, LmsysError), "hint": getattr(exc, "hint", None),
                  "one_line": isinstance(exc, RankError) or yours is not None}
        consequence = _reported_elsewhere(spec, rank)
        write_atomic(f"{spec['result']}.rank{rank}.error", json.dumps(record))
        if isinstance(exc, LmsysError):
            print(f"[rank {rank}] error: {exc.message}", file=sys.stderr)
        elif isinstance(exc, RankError):
            print(f"[rank {rank}] {exc}", file=sys.stderr)
        elif yours is not None and not consequence:
            print(f"[rank {rank}] error: {yours}", file=sys.stderr)
        elif consequence:
            print(f"[rank {rank}] stopped after another rank's failure: {type(exc).__name__}", file=sys.stderr)
        else:
            print(f"[rank {rank}] " + "".join(traceback.format_exception(exc)), file=sys.stderr, end="")
        sys.stderr.flush()
        os._exit(1)  # no process-group teardown: it could wait on the ranks that are gone
    if rank == 0:
        write_atomic(spec["result"], json.dumps(result))


if __name__ == "__main__":
    from lmsys.distributed import launch as _launch_module  # one copy of this module's classes

    if sys.argv[1:2] == [TORCHRUN_FLAG]:
        _launch_module.torchrun_main(sys.argv[2:])
    else:
        _launch_module.worker_main(sys.argv[1:])
