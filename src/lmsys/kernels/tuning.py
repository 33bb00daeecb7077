"""Autotuning by shape class, the choices kept on disk across processes.

A `Tuner` picks one of a few candidate launch configs (triton.Config) per key, a shape class that the
caller builds (bucketed lengths: a new length in a known class reuses the choice): the only candidate
untimed, else the fastest by `bench` (median of triton.testing.do_bench) on the caller's inputs. Choices
live in memory and in one JSON file per stamp (the versions and kernel source they hold for) under
`cache_dir()`; a file that cannot be read or parsed is ignored, and files are replaced atomically
(concurrent writers: the last one wins). Before timing, the candidates are compiled together on threads
(`compile_together`: Triton's async compile mode) where the caller gives a way to compile one. Limits: the caller resets what a timed run accumulates into; no
timing under CUDA graph capture. `persist_triton_key` keeps Triton's own per-process hash on disk too.
"""

from __future__ import annotations

import contextlib
import functools
from concurrent.futures import ThreadPoolExecutor
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Callable, Sequence

FORMAT = 1  # of the JSON file; part of its stamp
BENCH_WARMUP_MS, BENCH_REP_MS = 5, 25  # do_bench's budgets per candidate (Triton's autotuner: 25, 100)


def cache_dir() -> Path:
    """$LMSYS_CACHE_DIR, else $XDG_CACHE_HOME/lmsys, else ~/.cache/lmsys."""
    if os.environ.get("LMSYS_CACHE_DIR"):
        return Path(os.environ["LMSYS_CACHE_DIR"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "lmsys"
    return Path.home() / ".cache" / "lmsys"


def bucket(n: int, *, floor: int, cap: int) -> int:
    """n's class: the largest power of two <= n, held within [floor, cap] (both powers of two)."""
    return min(max(1 << (max(n, 1).bit_length() - 1), floor), cap)


def bench(fn: Callable[[], None]) -> float:
    """Milliseconds one call of `fn` takes: the median of triton.testing.do_bench."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=BENCH_WARMUP_MS, rep=BENCH_REP_MS, return_mode="median")


def config_json(config) -> dict:
    """A triton.Config as the JSON file stores it."""
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


def _fastest(candidates: Sequence, run: Callable[[object], None]):
    """The candidate `run` is fastest with; one that fails to compile or launch (a resource the estimate
    missed) is passed over, as Triton's autotuner did; when all fail, the first one's error."""
    times, errors = [], []
    for config in candidates:
        try:
            times.append(bench(functools.partial(run, config)))  # .args[0]: the config
        except Exception as exc:  # noqa: BLE001 - re-raised below when no candidate ran
            times.append(float("inf"))
            errors.append(exc)
    if len(errors) == len(candidates):
        raise errors[0]
    return candidates[times.index(min(times))]


def compile_together(compiles: Sequence[Callable[[], None]]) -> None:
    """Run `compiles` (each compiles one kernel without launching it, e.g. a JITFunction's `warmup`) with
    Triton's compile work on threads, so that what releases the GIL (ptxas, the LLVM and MLIR passes) runs
    side by side; a compile that fails is left for the timed run to meet again (it is passed over there).
    LMSYS_TUNE_COMPILE_THREADS=0, or a Triton without `AsyncCompileMode`, compiles nothing here."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return
    if len(compiles) < 2 or os.environ.get("LMSYS_TUNE_COMPILE_THREADS") == "0":
        return
    with ThreadPoolExecutor(len(compiles)) as pool:
        # a failing candidate's error comes back when it is timed, and does not stop the others here
        with contextlib.suppress(Exception), AsyncCompileMode(pool):
            for compile_one in compiles:
                with contextlib.suppress(Exception):
                    compile_one()


@functools.cache
def persist_triton_key() -> None:
    """Before its first disk-cache lookup in a process, Triton hashes its sources and libtriton
    (`triton.runtime.cache.triton_key`: 0.39 s on an H200 host, most of a warm-disk first call). Keep that
    hash on disk under cache_dir(), keyed by Triton's version and the size and mtime of every file it
    reads, and hand it to Triton the way Triton's own preload workers do (the module attribute
    `get_cache_key` looks up). Once per process; nothing where Triton's layout is not that one, and the
    hash computed as before where the file is missing, unreadable or of another key."""
    try:
        import triton
        import triton.runtime.cache as cache
    except ImportError:
        return
    compute = getattr(cache, "triton_key", None)
    lookup = getattr(getattr(cache, "get_cache_key", None), "__code__", None)
    if compute is None or lookup is None or "triton_key" not in lookup.co_names:
        return
    root = Path(triton.__file__).parent
    files = [Path(cache.__file__), *sorted(p for d in ("compiler", "backends", "language") for p in (root / d).rglob("*.py")),
             *sorted((root / "_C").glob("libtriton.*"))]
    try:
        facts = [triton.__version__, *((str(p), st.st_size, st.st_mtime_ns) for p in files for st in (p.stat(),))]
    except OSError:
        return
    path = cache_dir() / f"triton-key-{hashlib.sha256(repr(facts).encode()).hexdigest()[:24]}.txt"
    try:
        key = path.read_text()
    except OSError:
        key = ""
    if not key.startswith(triton.__version__):  # missing or torn: Triton's keys start with its version
        key = compute()
        with contextlib.suppress(OSError):
            _replace(path, key)
    cache.triton_key = functools.partial(str, key)


def _replace(path: Path, text: str) -> None:
    """Write `text` to `path` atomically (a temporary file beside it, then os.replace)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class Tuner:
    """Choices by key for one kernel family `name`; `stamp()` says what they hold for (versions, source)."""

    def __init__(self, name: str, stamp: Callable[[], dict]):
        self.name, self.stamp = name, stamp
        self.memory: dict = {}  # key -> chosen config, this process

    def path(self) -> Path:
        """The JSON file of the current stamp."""
        digest = hashlib.sha256(json.dumps(self._stamp(), sort_keys=True).encode()).hexdigest()[:16]
        return cache_dir() / f"{self.name}-{digest}.json"

    def choose(self, key: tuple, candidates: Sequence, run: Callable[[object], None],
               compile_one: Callable[[object], None] | None = None):
        """The config for `key` among `candidates` (in order of preference): remembered, else the only one,
        else the one the disk file names, else the fastest of `run(config)` timed by `bench` (then stored),
        the candidates compiled together first by `compile_one(config)` when it is given."""
        chosen = self.memory.get(key)
        if chosen is not None:
            return chosen
        chosen = self.known(key, candidates)
        if chosen is None:
            if compile_one is not None:
                compile_together([functools.partial(compile_one, c) for c in candidates])
            chosen = _fastest(candidates, run)
            self._write("|".join(map(str, key)), config_json(chosen))
        self.memory[key] = chosen
        return chosen

    def known(self, key: tuple, candidates: Sequence):
        """What `choose` returns without timing: the remembered config, else the only candidate, else the one
        the disk file names; None where it would time. Changes nothing (a background precompile asks it)."""
        chosen = self.memory.get(key)
        if chosen is None and len(candidates) == 1:
            chosen = candidates[0]
        elif chosen is None:
            stored = self._read().get("|".join(map(str, key)))
            chosen = next((c for c in candidates if config_json(c) == stored), None)
        return chosen

    def _stamp(self) -> dict:
        return {"format": FORMAT, **self.stamp()}

    def _read(self) -> dict:
        """The stored choices, {} when the file is missing, unreadable, corrupt or of another stamp."""
        try:
            data = json.loads(self.path().read_text())
        except (OSError, ValueError):
            return {}
        entries = data.get("entries") if isinstance(data, dict) and data.get("stamp") == self._stamp() else None
        return entries if isinstance(entries, dict) else {}

    def _write(self, text: str, value: dict) -> None:
        """Add one choice to the file (read again first: other processes' choices stay), atomically; a
        cache dir that cannot be written keeps the choice in memory only."""
        entries = {**self._read(), text: value}
        with contextlib.suppress(OSError):
            _replace(self.path(), json.dumps({"stamp": self._stamp(), "entries": entries}, indent=1, sort_keys=True))
