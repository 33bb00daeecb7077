"""What every command does around its one library call: check the render options, launch ranks, track
progress, emit the rows. The shared options live in `lmsys.commands.options` (re-exported here)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator, Optional, TypeVar

import typer

from lmsys.commands.options import DeviceOpt, DtypeOpt, FormatOpt, OutputOpt, QuietOpt  # noqa: F401 (re-exported)
from lmsys.core.parsing import check_counts, check_one_size  # noqa: F401 (re-exported)
from lmsys.kernels import requirements as _requirements

T = TypeVar("T")

# what an attention implementation needs, asked of its spec (lmsys.kernels.requirements); kept here by name
check_attention_impl = _requirements.check_attention_impl
require_triton = _requirements.require_triton


def check_render_options(fmt: Optional[str], output: Optional[Path], *, device: Optional[str] = None,
                         dtype: Optional[str] = None, quiet: bool = False) -> None:
    """Validate --format/--output (and --device/--dtype when given) before any work starts and before
    torch is imported: a typo answers in a fraction of a second. Call it first in a command. `quiet`:
    --quiet, no progress display for this command."""
    from lmsys.core import progress
    from lmsys.core.devices import DEVICE_CHOICES, DTYPE_CHOICES

    progress.set_quiet(quiet)
    from lmsys.core.parsing import choose
    from lmsys.core.files import check_output_path
    from lmsys.core.results import check_format, check_format_for_output

    check_format(fmt)
    check_format_for_output(fmt, output)
    if device is not None and not device.startswith("cuda:"):
        choose(device, DEVICE_CHOICES, what="--device")
    if dtype is not None:
        choose(dtype, DTYPE_CHOICES, what="--dtype")
    check_output_path(output)


def run_on_ranks(target: str, kwargs: dict, *, world_size: int, backend: str, description: str = "run"):
    """`lmsys.distributed.launch.run`, under a progress display that shows rank 0's rows and steps; a
    failed rank ends the command with its error on one line and exit code 1 (a crash, not a user error).
    None on torchrun workers other than rank 0."""
    from lmsys.core import progress
    from lmsys.distributed import launch

    try:
        with progress.display(f"{description}, world size {world_size}"):
            return launch.run(target, kwargs, world_size=world_size, backend=backend)
    except launch.RankFailedError as exc:
        typer.echo(f"error: {exc.message}", err=True)
        raise typer.Exit(1) from None


def emit(reports, fmt: Optional[str], output: Optional[Path]) -> None:
    """Render one Report or a list of them; with --output, say where the file went. Then the rows decide
    the exit code (`lmsys.core.results.outcome`): a row whose status is an error, `wrong (...)` (a checked
    result that is not right) or a non-finite loss makes the run a failure, and so does a run where every row ran out of memory (an OOM row beside rows
    that ran is a result, as the seed's tables have OOM cells): one line after the table, exit 1."""
    from lmsys.core.results import outcome, render

    render(reports, fmt, output)
    if output is not None:
        typer.echo(f"wrote {output}", err=True)
    failure = outcome(reports)
    if failure:
        typer.echo(f"error: {failure}", err=True)
        raise typer.Exit(1)


def track(items: Iterable[T], *, total: int, description: str) -> Iterator[T]:
    """A progress display on stderr while a sweep runs: rows done of `total`, the steps of the row that
    runs (silent when stderr is not a terminal, or with --quiet)."""
    from lmsys.core import progress

    yield from progress.rows(items, total=total, description=description)
