"""`lmsys flash`: check the FlashAttention-2 implementations against a float64 reference."""

from __future__ import annotations

import typer

app = typer.Typer(help="FlashAttention-2: correctness checks of the PyTorch and Triton implementations.", no_args_is_help=True)
