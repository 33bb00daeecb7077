"""The root `lmsys` app: one sub-app per command group. No torch import here (`lmsys --help` is instant)."""

from __future__ import annotations

import os
import signal
import sys
from typing import Annotated, Iterator, Optional

import typer

from lmsys import __version__
from lmsys.commands import bench, comm, ddp, flash, listing, parallel, plan, precision, profile
from lmsys.core.errors import Interrupted, LmsysError, RunFailed

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
app.add_typer(plan.app, name="plan")
app.add_typer(parallel.app, name="parallel")
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


def command():
    """The Click command of `app`, with every help text (commands' and options') shown as written: Typer reads
    help as Rich markup, where `[batch, seq, d]` is a tag and vanished ("your attention, )"). Help is
    escaped here, in one place, so that no help string has to know about markup."""
    from rich.markup import escape
    from typer.main import get_command

    root = get_command(app)
    todo = [root]
    while todo:
        cmd = todo.pop()
        for attr in ("help", "short_help"):
            if getattr(cmd, attr, None):
                setattr(cmd, attr, escape(getattr(cmd, attr)))
        for param in getattr(cmd, "params", []):
            if getattr(param, "help", None):
                param.help = escape(param.help)
        todo.extend(getattr(cmd, "commands", {}).values())
    return root


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point; the exit code means one thing. 2: the user's input is wrong (LmsysError, a Click usage
    error: one line plus a hint), decided before any work. 1: the run failed (a crash: one line; a failed
    row: said under the table). 0: otherwise. LMSYS_DEBUG=1 adds the traceback and keeps the code.
    SIGINT / SIGTERM stop the work (child processes included), print `interrupted` and exit 130 / 143;
    a closed stdout (`lmsys ... | head -1`) ends quietly by SIGPIPE, as the shell's own tools do. The user's
    code (--model, --impl, ...) that calls sys.exit, whatever its code, or crashes is a failed run: one line
    naming the option that supplied it, exit 1."""
    from lmsys.core.imports import describe_user_failure, forget_user_code

    debug = os.environ.get("LMSYS_DEBUG") == "1"
    forget_user_code()
    restore = _install_sigterm_handler()
    stdout = sys.stdout
    sys.stdout = _PipeGuard(stdout)
    code: int = 0
    spelled: dict = {}
    try:
        args = sys.argv[1:] if argv is None else list(argv)
        check_repeated_options(app, args)  # its message quotes the line as typed: not rewritten below
        spelled = given_spellings(app, args)
        rv = command().main(args=args, prog_name="lmsys", standalone_mode=False)
        code = rv if isinstance(rv, int) else 0
    except LmsysError as exc:
        _say_error(as_given(exc.message, spelled), as_given(exc.hint, spelled), debug=debug)
        code = 2
    except RunFailed as exc:
        _say_error(exc.message, None, debug=debug)
        code = 1
    except StdoutClosed:
        code = -1
    except SystemExit as exc:  # only the user's code calls sys.exit inside a command (Click returns its codes)
        line = describe_user_failure(exc)
        if line is None:
            raise
        _say_error(line, None, debug=debug)  # one line: the user's own call, nothing of lmsys's to trace
        code = 1
    except (KeyboardInterrupt, Interrupted) as exc:
        sys.stdout = stdout
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
        _quiet_exit(128 + int(signum))
    except Exception as exc:  # noqa: BLE001 - a crash is one line; LMSYS_DEBUG=1 keeps the traceback
        if _is_click_error(exc):
            code = _usage_error(exc, spelled, args, debug=debug)
        elif type(exc).__name__ == "Abort":  # typer.Abort: Click's answer to EOF at a prompt
            _say_error("aborted", None, debug=debug)
            code = 1
        else:
            _say_error(describe_user_failure(exc) or _describe_crash(exc), "LMSYS_DEBUG=1 shows the traceback" if not debug else None, debug=debug)
            code = 1
    finally:
        sys.stdout = stdout
        restore()
    if code == -1:
        _end_by_sigpipe(standalone=argv is None)
    sys.exit(code)


class StdoutClosed(BaseException):
    """stdout's reader went away (`| head -1`). A BaseException: Click turns an OSError(EPIPE) into exit 1."""


class _PipeGuard:
    """sys.stdout, with a closed pipe raised as StdoutClosed (past Click's own EPIPE handling)."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            raise StdoutClosed() from None

    def flush(self):
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise StdoutClosed() from None

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _end_by_sigpipe(*, standalone: bool) -> None:
    """No more output can reach the reader: point fd 1 at /dev/null (the interpreter's last flush must
    not complain), then die of SIGPIPE as `yes | head -1`'s writer does (the shell shows 141). Called
    in-process (tests), exit 141."""
    if not standalone:
        sys.exit(128 + 13)
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGPIPE)
    sys.exit(128 + 13)


def _say_error(message: str, hint: Optional[str], *, debug: bool) -> None:
    if debug:
        import traceback

        traceback.print_exc()
    print(f"error: {message}", file=sys.stderr)
    if hint:
        print(f"hint: {hint}", file=sys.stderr)


def _is_click_error(exc: BaseException) -> bool:
    """A Click exception (usage errors, bad parameters), from Typer's own Click or the `click` package:
    recognised by name, since STYLE.md keeps `click` imports out."""
    return any(cls.__name__ == "ClickException" for cls in type(exc).__mro__)


def _usage_error(exc, spelled: dict, args: list[str], *, debug: bool) -> int:
    """A usage error as lmsys's own: one line plus a hint naming the --help of the command (its options) or
    of the group (its commands) the user was typing; exit 2. A group called without a command shows its
    help, as before."""
    if type(exc).__name__ == "NoArgsIsHelpError":
        exc.show()
        return exc.exit_code
    ctx = getattr(exc, "ctx", None)
    message = as_given(" ".join(exc.format_message().split()).rstrip("."), spelled)
    if ctx is not None:  # the context Click was parsing when it failed
        path, group = ctx.command_path, hasattr(ctx.command, "commands")
    else:  # an error before any context (an option missing its value): the command named on the line
        path, group = _command_path(app, args)
    _say_error(message, f"{path} --help lists the {'commands' if group else 'options'}", debug=debug)
    return exc.exit_code


def _walk(root: typer.Typer, args: list[str]) -> tuple[object, list[str], int]:
    """(the Click command the arguments name, the names walked to it, the index of the first argument
    after them)."""
    from typer.main import get_command

    command, names, i = get_command(root), [], 0
    while i < len(args) and hasattr(command, "commands"):  # walk down the groups to the command
        if args[i] in getattr(command, "commands", {}):
            command = command.commands[args[i]]
            names.append(args[i])
        elif not args[i].startswith("-"):
            break
        i += 1
    return command, names, i


def _command_path(root: typer.Typer, args: list[str]) -> tuple[str, bool]:
    """('lmsys bench e2e', whether it is a group) for the command the arguments name."""
    command, names, _ = _walk(root, args)
    return " ".join(["lmsys", *names]), hasattr(command, "commands")


def _given_options(root: typer.Typer, args: list[str]) -> Iterator[tuple[object, str, str]]:
    """(Click parameter, the name typed, the option as given with its value) for each option on the command
    line, in order; nothing after `--` is looked at."""
    command, _, i = _walk(root, args)
    by_name = {}
    for param in getattr(command, "params", []):
        for name in (*getattr(param, "opts", ()), *getattr(param, "secondary_opts", ())):
            by_name[name] = param
    while i < len(args):
        token = args[i]
        i += 1
        if token == "--":
            break
        name = token.split("=", 1)[0] if token.startswith("--") else token
        param = by_name.get(name)
        if param is None:
            continue
        given = token
        if not getattr(param, "is_flag", False) and getattr(param, "count", False) is False and "=" not in token:
            given = f"{token} {args[i]}" if i < len(args) else token
            i += 1  # its value, which may look like an option itself
        yield param, name, given


def given_spellings(root: typer.Typer, args: list[str]) -> dict[str, tuple[tuple[str, ...], str]]:
    """For each option with several names that the user gave (`--seq-len` for --context-length, `--attn` for
    --impl): canonical name -> (all its names, the name typed). Messages then name what was typed."""
    spelled = {}
    for param, name, _ in _given_options(root, args):
        opts = tuple(getattr(param, "opts", ()))
        if len(opts) > 1 and name in opts:  # typed as the canonical name: Click's 'A' / 'B' still reads 'A'
            spelled[opts[0]] = (opts, name)
    return spelled


def as_given(text: Optional[str], spelled: dict[str, tuple[tuple[str, ...], str]]) -> Optional[str]:
    """`text` with each option named as the user typed it: lmsys's `--context-length must be >= 1` reads
    `--seq-len must be >= 1` after `--seq-len 0`, and Click's `'--context-length' / '--seq-len'` reads
    `'--seq-len'`."""
    import re

    if not text:
        return text
    for canonical, (opts, typed) in spelled.items():
        text = text.replace(" / ".join(f"'{o}'" for o in opts), f"'{typed}'")
        text = re.sub(rf"(?<![\w-]){re.escape(canonical)}(?![\w-])", typed, text)
    return text


def check_repeated_options(root: typer.Typer, args: list[str]) -> None:
    """A single-value option given twice (`--size a --size b`) is a usage error, not "the last one wins".
    Options that take a list (repeatable) are not counted; nothing after `--` is looked at."""
    seen: dict[str, str] = {}
    for param, name, given in _given_options(root, args):
        if getattr(param, "multiple", False):
            continue
        if param.name in seen:
            raise LmsysError(f"{name} was given twice ({seen[param.name]}, then {given})",
                             hint="give it once (options that sweep take a comma list)")
        seen[param.name] = given


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
