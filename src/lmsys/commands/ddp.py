"""`lmsys ddp`: data-parallel training with hand-written DDP variants, ZeRO-1 and FSDP."""

from __future__ import annotations

import typer

app = typer.Typer(help="Data parallelism: naive/flat/overlap/bucketed DDP, ZeRO-1, FSDP vs torch DDP.", no_args_is_help=True)
