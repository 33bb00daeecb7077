"""Progress on long work, on stderr only, never with `--quiet`: on a terminal one Rich display with rows done
of rows planned and the steps of the row that runs; where stderr is not a terminal (CI logs, nohup, `| tee`)
plain lines, one per finished row and one per EVERY seconds of a long row, none in a run's first EVERY
seconds (a short run's log stays clean). Nothing on stdout.

Commands open the display (`rows`, around their sweep). Library loops only say where they are
(`plan_steps`, `step`, and for a job that plans its own rows `plan_rows`, `start_row`): without a display
these are no-ops, so library code stays silent. Ranks have no terminal: on rank 0 under lmsys's launcher
(LMSYS_PROGRESS_FILE set) the same calls append one line each to a file in the run folder, which the
launching process tails into its display (`relay`). Torch-free.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator, Optional, TypeVar

T = TypeVar("T")

ENV = "LMSYS_PROGRESS_FILE"  # set by the launcher for rank 0 when the launching process shows a display
_quiet = False
_display: Optional["Display"] = None


EVERY_ENV = "LMSYS_PROGRESS_EVERY"  # seconds between plain progress lines (default 10)


def every() -> float:
    """Seconds between plain progress lines, and before the first: LMSYS_PROGRESS_EVERY, else 10."""
    try:
        return max(0.0, float(os.environ.get(EVERY_ENV, "10")))
    except ValueError:
        return 10.0


def set_quiet(quiet: bool) -> None:
    """--quiet: no display for the rest of this process."""
    global _quiet
    _quiet = bool(quiet)


def shown() -> bool:
    """Whether the Rich display would be drawn: stderr is a terminal and --quiet was not given."""
    try:
        return not _quiet and sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def logged() -> bool:
    """Whether plain progress lines would be written: stderr is not a terminal, --quiet was not given, and
    this process is not a rank or child whose progress the launching process shows (nor a rank other than 0
    under the user's own torchrun)."""
    return not _quiet and not shown() and ENV not in os.environ and os.environ.get("RANK", "0") == "0"


class Display:
    """Two bars: rows (done of planned) and the steps of the row that runs."""

    def __init__(self, description: str, total_rows: Optional[int]):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=Console(file=sys.stderr), transient=True)
        self.rows = self.progress.add_task(f"{description}: rows", total=total_rows)
        self.steps = self.progress.add_task("  steps", total=None, visible=False)
        self.description = description

    def apply(self, kind: str, value: str = "") -> None:
        """One progress event: rows N | row LABEL | steps N LABEL | step [N]."""
        p = self.progress
        if kind == "rows":
            p.update(self.rows, total=int(value))
        elif kind == "row":  # a row starts: the one before it is done
            if getattr(self, "_row_open", False):
                p.advance(self.rows)
            self._row_open = True
            p.update(self.rows, description=f"{self.description}: {value}" if value else p.tasks[self.rows].description)
        elif kind == "steps":
            total, _, label = value.partition(" ")
            p.update(self.steps, total=int(total), completed=0, visible=True, description=f"  {label or 'steps'}")
        elif kind == "step":
            p.advance(self.steps, int(value or 1))

    def finish_row(self) -> None:
        """A row of the command's own sweep is done (the steps bar goes until the next one plans its loop)."""
        self.progress.advance(self.rows)
        self.progress.update(self.steps, visible=False)

    def tick(self) -> None:
        pass  # Rich redraws on its own


class Lines:
    """The display where stderr is not a terminal: plain lines, nothing in the run's first `every()` seconds,
    then a line for each finished row and one for each `every()` seconds spent in a row (where its steps or
    the relay say so). Same events as Display."""

    def __init__(self, description: str, total_rows: Optional[int], *, clock=time.monotonic):
        self.description, self.total, self.clock = description, total_rows, clock
        self.start = self.last = self.row_start = clock()
        self.done, self.label, self.open = 0, "", False
        self.steps_total, self.steps_label, self.steps_done = None, "steps", 0

    def _say(self, text: str) -> None:
        self.last = self.clock()
        try:
            print(f"{self.description}: {text}", file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass  # progress is never worth a failure

    def _of(self, n: int) -> str:
        return f"{n}/{self.total}" if self.total else str(n)

    def _due(self, now: float) -> bool:
        return now - self.start >= every()

    def finish_row(self) -> None:
        now = self.clock()
        self.done += 1
        self.open = False
        if self._due(now):
            what = f" ({self.label})" if self.label else ""
            self._say(f"row {self._of(self.done)} done{what} in {now - self.row_start:.1f} s, "
                      f"{now - self.start:.0f} s so far")
        self.row_start, self.label, self.steps_total, self.steps_done = now, "", None, 0

    def apply(self, kind: str, value: str = "") -> None:
        if kind == "rows":
            self.total = int(value)
        elif kind == "row":  # a row starts: the one before it is done
            if self.open:
                self.finish_row()
            self.open, self.label, self.row_start = True, value, self.clock()
        elif kind == "steps":
            total, _, label = value.partition(" ")
            self.steps_total, self.steps_label, self.steps_done = int(total), label or "steps", 0
        elif kind == "step":
            self.steps_done += int(value or 1)
        self.tick()

    def tick(self) -> None:
        """A line when the row has gone on for another `every()` seconds without one."""
        now = self.clock()
        if not self._due(now) or now - self.last < every():
            return
        if not (self.open or self.steps_total):  # a job still starting (its processes, imports)
            self._say(f"starting, {now - self.start:.0f} s so far")
            return
        what = f" ({self.label})" if self.label else ""
        steps = f", {self.steps_done}/{self.steps_total} {self.steps_label}" if self.steps_total else ""
        self._say(f"row {self._of(self.done + 1)}{what} running for {now - self.row_start:.0f} s{steps}")

    def close(self) -> None:
        if self.open:  # the last row a job started (rows come from its events)
            self.finish_row()


def _emit(kind: str, value: str = "") -> None:
    if _display is not None:
        _display.apply(kind, value)
        return
    path = os.environ.get(ENV)
    if path and os.environ.get("RANK", "0") == "0":
        try:
            with open(path, "a") as f:
                f.write(f"{kind} {value}".rstrip() + "\n")
        except OSError:
            pass  # progress is never worth a failure


def _rich() -> bool:
    """A Rich display is drawn (a terminal): its bars would split a line printed beside them."""
    return _display is not None and hasattr(_display, "progress")


def _notice(text: str, *, end: str = "\n") -> None:
    if _rich():
        _display.progress.console.print(text, markup=False, highlight=False)
    else:
        print(text, file=sys.stderr, end=end, flush=True)


@contextmanager
def announced(text: str) -> Iterator[None]:
    """One line on stderr, on a terminal or not, for a long silent phase (a compile): `text ...` when it
    starts and its seconds when it ends (`compiling 48 blocks ... 31.2 s`; under a display, whose bars
    would split the line, the whole line at the end). Nothing with --quiet or on a rank other than 0."""
    import time

    say = not _quiet and os.environ.get("RANK") in (None, "0")
    if say and not _rich():
        _notice(f"{text} ...", end="")
    start = time.perf_counter()
    ok = False
    try:
        yield
        ok = True
    finally:
        if say:
            took = f"{time.perf_counter() - start:.1f} s" + ("" if ok else " (failed)")
            _notice(f" {took}" if not _rich() else f"{text}: {took}")


def plan_rows(total: int) -> None:
    _emit("rows", str(int(total)))


def start_row(label: str = "") -> None:
    _emit("row", " ".join(str(label).split()))


def plan_steps(total: int, label: str = "steps") -> None:
    """A loop of `total` steps starts (warm-up included)."""
    _emit("steps", f"{int(total)} {' '.join(label.split())}")


def step(count: int = 1) -> None:
    """`count` more steps of the running loop done (a tight loop says so every few thousand)."""
    _emit("step", str(int(count)) if count != 1 else "")


@contextmanager
def display(description: str, *, total_rows: Optional[int] = None) -> Iterator[Optional[Display]]:
    """The display for the block (None, and nothing drawn, when not `shown()`)."""
    global _display
    if _display is not None or not (shown() or logged()):
        yield None
        return
    if not shown():
        _display = Lines(description, total_rows)
        try:
            yield _display
            _display.close()
        finally:
            _display = None
        return
    _display = Display(description, total_rows)
    try:
        with _display.progress:
            yield _display
    finally:
        _display = None


def rows(items: Iterable[T], *, total: int, description: str) -> Iterator[T]:
    """Yield `items` (rows, or groups of rows) under a display: one more done per item."""
    with display(description, total_rows=total) as shown_:
        for item in items:
            yield item
            if shown_ is not None:
                shown_.finish_row()


@contextmanager
def relayed() -> Iterator[dict[str, str]]:
    """For a child process that is not a torchrun job (the step under nsys): yields the variables to add to
    its environment, and while the block runs a thread reads the child's progress lines into the display.
    Without a display: {} and nothing read. The file lives in a temporary folder, removed at the end."""
    if _display is None:
        yield {}
        return
    import tempfile
    import threading

    with tempfile.TemporaryDirectory(prefix="lmsys-progress-") as folder:
        relay = Relay(Path(folder))
        stop = threading.Event()

        def read() -> None:
            while not stop.wait(0.2):
                relay.poll()

        reader = threading.Thread(target=read, name="lmsys-progress", daemon=True)
        reader.start()
        try:
            yield relay.env()
        finally:
            stop.set()
            reader.join()
            relay.poll()


class Relay:
    """The launcher's side: a file for rank 0's progress lines, read into the display while the job runs."""

    def __init__(self, folder: Path):
        self.path = folder / "progress"
        self._offset = 0

    def env(self) -> dict[str, str]:
        return {ENV: str(self.path)} if _display is not None else {}

    def poll(self) -> None:
        tick = getattr(_display, "tick", None)
        if tick is not None:
            tick()  # a long row of a job says so in a log, between its own events
        if _display is None or not self.path.exists():
            return
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]  # a line being written is read next time
        self._offset += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            kind, _, value = line.partition(" ")
            try:
                _display.apply(kind, value)
            except (ValueError, KeyError, IndexError):
                pass
