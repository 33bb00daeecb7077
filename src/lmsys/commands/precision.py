"""`lmsys precision`: the autocast walk-through and the accumulation experiment."""

from __future__ import annotations

from typing import Annotated

import typer

from lmsys.commands._common import check_counts, check_render_options, emit
from lmsys.commands.options import DeviceOpt, FormatOpt, OutputOpt, QuietOpt, opt


MAX_STEPS = 1_000_000


def precision(
    device: DeviceOpt = "auto",
    steps: Annotated[int, opt("steps", "Additions in the accumulation experiment (at most 1,000,000: about a minute on a CPU).")] = 1000,
    quiet: QuietOpt = False,
    format: FormatOpt = None,
    output: OutputOpt = None,
):
    """Show the dtype of every tensor under autocast, and what fp16/bf16 accumulation loses."""
    from lmsys.core.errors import LmsysError

    check_render_options(format, output, device=device, quiet=quiet)  # before torch is imported
    check_counts(steps=(steps, 1))
    if steps > MAX_STEPS:  # each addition is a Python-level op: 10^6 take about a minute on a CPU
        raise LmsysError(f"--steps {steps:,} is over the limit of {MAX_STEPS:,} additions")

    from lmsys.bench.precision import precision_reports

    emit(precision_reports(device, steps), format, output)
