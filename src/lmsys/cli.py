"""The root `lmsys` app: one sub-app per command group. No torch import here (`lmsys --help` is instant)."""

from __future__ import annotations

import os
import sys
from typing import Annotated, Optional

import typer

from lmsys import __version__
from lmsys.commands import bench, comm, ddp, flash, precision, profile
from lmsys.core.errors import LmsysError

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


def _version(value: bool) -> None:
    if value:
        typer.echo(f"lmsys {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                    help="Print the version and exit.")] = False,
):
    """lmsys: one CLI for the systems side of training Transformer language models."""


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point: user errors (LmsysError) become one line on stderr and exit code 2."""
    try:
        app(args=argv, prog_name="lmsys")
    except LmsysError as exc:
        if os.environ.get("LMSYS_DEBUG") == "1":
            raise
        print(f"error: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"hint: {exc.hint}", file=sys.stderr)
        sys.exit(2)
