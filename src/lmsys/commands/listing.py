"""`lmsys list`: every model, attention implementation and distributed strategy a command accepts
(lmsys's own, torch's, an adapters module's, import paths). Torch-free: each kind is one
lmsys.core.registry.Registry, and its module's `listing()` gives the rows."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from lmsys.commands._common import FormatOpt, OutputOpt, check_render_options, emit

# kind -> the module whose `listing()` gives that registry's rows (imported when asked: torch-free all the same)
REGISTRIES = {"models": "lmsys.model.user", "attention": "lmsys.kernels.registry",
              "strategies": "lmsys.distributed.data_parallel.strategies"}
KINDS = tuple(REGISTRIES)


def _rows(kind: str) -> list[dict]:
    import importlib

    listing = importlib.import_module(REGISTRIES[kind]).listing
    return [{"kind": kind, "name": name, "what": what} for name, what in listing()]


def list_names(
    kind: Annotated[Optional[str], typer.Argument(help="models | attention | strategies (default: all three).",
                                                  show_default=False)] = None,
    format: FormatOpt = None,
    output: OutputOpt = None,
):
    """List the models, attention implementations and distributed strategies lmsys accepts by name."""
    from lmsys.core.parsing import choose
    from lmsys.core.results import Report

    check_render_options(format, output)
    kinds = [choose(kind, KINDS, what="kind")] if kind else list(KINDS)
    rows = [row for k in kinds for row in _rows(k)]
    emit(Report("lmsys list", rows, {}, ["pkg.module:Name also takes path/to/file.py:Name."]), format, output)


def list_if_asked(*, impl=None, strategy=None, model=None) -> None:
    """`--impl list`, `--strategy list`, `--model list`: print that registry's names and exit 0."""
    for kind, value in (("attention", impl), ("strategies", strategy), ("models", model)):
        values = [value] if isinstance(value, str) else list(value or [])
        if "list" in values:
            list_names(kind, format="table", output=None)
            raise typer.Exit(0)
