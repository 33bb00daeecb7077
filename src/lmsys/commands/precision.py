"""`lmsys precision`: the autocast walk-through and the accumulation experiment."""

from __future__ import annotations

from typing import Annotated

import typer

from lmsys.commands._common import DeviceOpt, FormatOpt, OutputOpt, check_counts, check_render_options, emit


def precision(
    device: DeviceOpt = "auto",
    steps: Annotated[int, typer.Option(help="Additions in the accumulation experiment.")] = 1000,
    format: FormatOpt = "table",
    output: OutputOpt = None,
):
    """Show the dtype of every tensor under autocast, and what fp16/bf16 accumulation loses."""
    from lmsys.bench.precision import accumulation_experiment, autocast_walkthrough
    from lmsys.core.devices import environment, resolve_device
    from lmsys.core.results import Report

    check_render_options(format, output)
    check_counts(steps=(steps, 1))
    dev = resolve_device(device)
    walk = Report("autocast: dtype of each tensor (toy model fc1 → ReLU → LayerNorm → fc2)",
                  autocast_walkthrough(dev, ["fp16", "bf16"]), environment(dev))
    acc = Report(f"accumulating 0.01 {steps} times (exact: {0.01 * steps:g})", accumulation_experiment(steps))
    emit([walk, acc], format, output)
