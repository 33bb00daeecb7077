"""`lmsys comm`: collective-communication benchmarks under torchrun."""

from __future__ import annotations

import typer

app = typer.Typer(help="Collectives: all-reduce bandwidth over gloo or NCCL.", no_args_is_help=True)
