"""`lmsys profile`: where time (nsys or torch.profiler) and memory go in a training step."""

from __future__ import annotations

import typer

app = typer.Typer(help="Profiling: nsys / torch.profiler time breakdowns, memory timelines.", no_args_is_help=True)
