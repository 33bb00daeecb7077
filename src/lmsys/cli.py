"""The root `lmsys` app: one sub-app per command group. No torch import here (`lmsys --help` is instant)."""

from __future__ import annotations

import os
import signal
import sys
from typing import Annotated, Optional

import typer

from lmsys import __version__
from lmsys.commands import bench, comm, ddp, flash, listing, precision, profile
from lmsys.core.errors import Interrupted, LmsysError

app = typer.Typer(
    name="lmsys",
    help="The systems side of training Transformer LMs: benchmark, profile, FlashAttention-2, collectives, DDP.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)
app.add_typer(bench.app, name="bench")
app.add_typer(profile.app, name="profile")
app.add_typer(comm.app, name="comm")
app.add_typer(ddp.app, name="ddp")
app.add_typer(flash.app, name="flash")
app.command("precision")(precision.precision)
app.command("list")(listing.list_names)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"lmsys {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[bool, typer.Option("--version", metavar="", callback=_version, is_eager=True,
                                                    help="Print the version and exit.")] = False,
):
    """lmsys: one CLI for the systems side of training Transformer language models."""


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point. User errors (LmsysError) become one line on stderr and exit code 2; any other
    exception one line and exit code 1 (the traceback with LMSYS_DEBUG=1); SIGINT / SIGTERM stop the
    work (child processes included), print `interrupted` and exit 130 / 143."""
    debug = os.environ.get("LMSYS_DEBUG") == "1"
    restore = _install_sigterm_handler()
    try:
        app(args=argv, prog_name="lmsys")
    except LmsysError as exc:
        if debug:
            raise
        print(f"error: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"hint: {exc.hint}", file=sys.stderr)
        sys.exit(2)
    except (KeyboardInterrupt, Interrupted) as exc:
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
        _quiet_exit(128 + int(signum))
    except Exception as exc:  # noqa: BLE001 - a crash is one line; LMSYS_DEBUG=1 keeps the traceback
        if debug:
            raise
        print(f"error: {_describe_crash(exc)}", file=sys.stderr)
        print("hint: LMSYS_DEBUG=1 shows the traceback", file=sys.stderr)
        sys.exit(1)
    finally:
        restore()


def _describe_crash(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if len(text) > 300:
        text = text[:297] + "..."
    name = type(exc).__name__
    if "OutOfMemory" in name or "out of memory" in text:
        return f"out of memory: {text}"
    if isinstance(exc, OSError) and exc.filename:
        return f"{exc.filename}: {exc.strerror or text}"
    return f"{name}: {text}" if text else name


def _quiet_exit(code: int) -> None:
    """`interrupted` on stderr and exit `code`; a second signal during the exit changes nothing."""
    signal.signal(signal.SIGINT, signal.SIG_IGN) if _main_thread() else None
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    print("interrupted", file=sys.stderr)
    sys.exit(code)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _install_sigterm_handler():
    """SIGTERM and SIGINT raise Interrupted (not KeyboardInterrupt, which Click turns into a silent
    exit 130 before main() sees it), so `finally` blocks run: torchrun's group is stopped and temporary
    folders removed. Returns a function restoring the old handlers (tests call main() in-process)."""
    if not _main_thread():
        return lambda: None

    def on_signal(signum, frame):
        raise Interrupted(signum)

    old_term = signal.signal(signal.SIGTERM, on_signal)
    old_int = signal.getsignal(signal.SIGINT)
    if old_int is signal.SIG_IGN or old_int is None:  # started in the background with SIGINT ignored
        old_int = None
    else:
        signal.signal(signal.SIGINT, on_signal)

    def restore():
        signal.signal(signal.SIGTERM, old_term if old_term is not None else signal.SIG_DFL)
        if old_int is not None:
            signal.signal(signal.SIGINT, old_int)

    return restore
