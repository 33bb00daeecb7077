"""Kernel compiles started early on background threads, so that a process's first call does not pay them in
series (issue 26 item 8). `start` runs a list of compiles (each a JITFunction's `warmup`) in Triton's async
compile mode on a pool of daemon threads, then builds their launchers (triton 3.6 builds one per kernel with
gcc, lazily at its first launch); `wait_all` is what a real call runs first: it never finds a kernel half
compiled, and never compiles one a second time. `driver_in_background` starts Triton's CUDA driver (its
cuda_utils build) beside other work. Nothing runs with LMSYS_PRECOMPILE_BACKWARD=0, under torch.compile's
tracing or CUDA graph capture, off CUDA devices, or with a Triton without `AsyncCompileMode`; every error in
the background is dropped there (the real call meets it again).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import queue
import threading
from concurrent.futures import Executor, Future, as_completed, wait
from typing import Callable, Sequence

ENV = "LMSYS_PRECOMPILE_BACKWARD"
COMPILE_THREADS = 8  # a backward has at most 5 compiles: the preprocess, two candidates each of dQ and dK/dV
EXIT_WAIT_S = 10.0  # at exit, how long compiles already running may finish (queued ones are dropped)


class _DaemonPool(Executor):
    """A thread pool whose threads never keep the process alive: daemon threads, and at exit the queued work
    is cancelled and what runs gets EXIT_WAIT_S to finish (a thread left inside LLVM while the interpreter
    tears down could crash the exit)."""

    def __init__(self, workers: int, name: str):
        self._workers, self._name = workers, name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._running: set[Future] = set()
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                future.cancel()
                return future
            self._queue.put((future, fn, args, kwargs))
            if self._queue.qsize() > self._idle and len(self._threads) < self._workers:
                thread = threading.Thread(target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
        return future

    def _work(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            future, fn, args, kwargs = self._queue.get()
            with self._lock:
                self._idle -= 1
                if not future.set_running_or_notify_cancel():
                    continue
                self._running.add(future)
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(exc)
            with self._lock:
                self._running.discard(future)

    def close(self) -> None:
        """Cancel what is queued, and wait up to EXIT_WAIT_S for what runs."""
        with self._lock:
            self._closed = True
            running = list(self._running)
        with contextlib.suppress(queue.Empty):
            while True:
                self._queue.get_nowait()[0].cancel()
        wait(running, timeout=EXIT_WAIT_S)


@functools.cache
def _pools() -> tuple[_DaemonPool, _DaemonPool]:
    """(jobs, compiles): one thread that runs each job's warmups and waits for them, and the threads that
    compile. Apart, so that a job waiting for its compiles never holds a thread they need."""
    jobs, compiles = _DaemonPool(1, "lmsys-precompile"), _DaemonPool(COMPILE_THREADS, "lmsys-compile")
    atexit.register(lambda: (compiles.close(), jobs.close()))  # a job then stops waiting for its compiles
    return jobs, compiles


_inflight: set[Future] = set()
_inflight_lock = threading.Lock()


def allowed(device) -> bool:
    """Whether a background compile may start now for tensors on `device`: not switched off by
    LMSYS_PRECOMPILE_BACKWARD=0, a CUDA device, not inside torch.compile's tracing nor a CUDA graph capture."""
    if os.environ.get(ENV) == "0" or device.type != "cuda":
        return False
    import torch

    try:
        return not torch.compiler.is_compiling() and not torch.cuda.is_current_stream_capturing()
    except Exception:  # noqa: BLE001 - no answer: do nothing
        return False


def async_compile_mode():
    """Triton's AsyncCompileMode, or None where this Triton has none."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return None
    return AsyncCompileMode


def start(compiles: Sequence[Callable[[], object]], device) -> Future | None:
    """Run `compiles` on the background pool, Triton's compile work on its threads, under `device` (Triton
    reads the current device, one per thread); their launchers built as each compile ends. The future of the
    job (None where nothing starts); `wait_all` waits for it."""
    mode = async_compile_mode()
    if mode is None or not compiles:
        return None
    jobs, pool = _pools()
    job = jobs.submit(_job, list(compiles), device, mode, pool)
    with _inflight_lock:
        _inflight.add(job)
    job.add_done_callback(_done)
    return job


def _done(job: Future) -> None:
    with _inflight_lock:
        _inflight.discard(job)


def wait_all() -> None:
    """Wait for the jobs in flight (none, in a warm process: one set's truth value). A real launch runs this
    first: triton 3.6 keeps an async compile out of its kernel cache until the job finalizes it (a launch
    before would compile the kernel again), and 3.9 finalizes it from whichever thread asks first."""
    if _inflight:
        with _inflight_lock:
            jobs = list(_inflight)
        for job in jobs:
            with contextlib.suppress(Exception):
                job.result()


def _job(compiles: list, device, mode, pool) -> None:
    import torch

    launchers = []
    guard = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with contextlib.suppress(Exception), guard, mode(pool, ignore_errors=True):
        kernels = []
        for compile_one in compiles:
            with contextlib.suppress(Exception):
                kernels.append(compile_one())  # a FutureKernel; a compiled kernel where one was cached
        compiles.clear()  # the stand-in tensors go now, not when the compiles end
        raw = [f for f in (getattr(k, "future", None) for k in kernels) if isinstance(f, Future)]
        for done in as_completed(raw):
            if done.exception() is None:
                launchers.append(pool.submit(_build_launcher, done.result()))
    wait(launchers)


def _build_launcher(kernel) -> None:
    """Build `kernel`'s launcher as its first launch would (triton 3.6: a C module compiled with gcc and kept
    in Triton's cache dir, where that launch then finds it; 3.9: a generic launcher, nothing to build)."""
    import triton

    with contextlib.suppress(Exception):
        triton.runtime.driver.active.launcher_cls(kernel.src, kernel.metadata)


def driver_in_background() -> Future | None:
    """Start Triton's active driver (on CUDA: cuda_utils, built with gcc on a cold cache) on the background
    thread; the caller waits for it before it touches the driver itself (two threads building it at once
    would each make one). None where LMSYS_PRECOMPILE_BACKWARD=0 or without async compile."""
    if os.environ.get(ENV) == "0" or async_compile_mode() is None:
        return None

    def build():
        import triton

        return triton.runtime.driver.active.utils

    return _pools()[0].submit(build)
