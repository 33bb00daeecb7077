"""`lmsys flash`: check the FlashAttention-2 implementations against a float64 reference."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from lmsys.commands._common import check_render_options, emit
from lmsys.commands.options import DeviceOpt, FormatOpt, OutputOpt, QuietOpt, opt

app = typer.Typer(help="FlashAttention-2: correctness checks of the PyTorch and Triton implementations.", no_args_is_help=True)


@app.command("check")
def check(
    impl: Annotated[Optional[str], opt("impl", "flash-torch | flash-triton | yours-torch | yours-triton (with --adapters) | pkg.module:Name or file.py:Name (your autograd.Function or callable (q, k, v, is_causal) on [batch, seq, d]); comma-separate several; `list` lists them. Default: flash-triton on a GPU (or under TRITON_INTERPRET=1), else flash-torch; with --adapters, yours-torch,yours-triton (yours-torch alone where flash-triton is not the default).")] = None,
    adapters: Annotated[Optional[str], opt("adapters", "Your CS336 adapters module (a .py file or a module name): --impl yours-torch, yours-triton.")] = None,
    device: DeviceOpt = "auto",
    cases: Annotated[int, typer.Option(help="Cases per tier (shapes, dtypes, causality drawn from the seed).")] = 12,
    seed: Annotated[int, typer.Option(help="Seed of the shapes and of the inputs.")] = 0,
    max_len: Annotated[Optional[int], typer.Option(help="Longest n_queries / n_keys. Default: 300 on a GPU, 80 on a CPU.")] = None,
    dtype: Annotated[Optional[str], opt("dtype", "Only these dtypes, comma-separated (fp32, bf16, fp16). Default: every one the device supports.")] = None,
    tier: Annotated[str, typer.Option("--tier", help="contract: the shapes CS336's handout promises (power-of-two lengths >= 16, n_queries = n_keys and not, d 16-128, fp32 and bf16, causal and not; your PyTorch version may ignore is_causal) | robust: awkward shapes (odd lengths, padded head dims, fp16, grouped-query) | all. With --adapters the exit code follows the contract tier.")] = "all",
    seq_len: Annotated[Optional[str], opt("seq_len", "Pin n_queries = n_keys to this length in every case (comma-separate several: cases take them in turn); --context-length is its other commands' name.")] = None,
    d_head: Annotated[Optional[str], opt("d_head", "Pin the head dim of every case (comma-separate several).")] = None,
    batch_size: Annotated[Optional[str], opt("batch_size", "Pin the batch (the first leading dim) of every case (comma-separate several).")] = None,
    causal: Annotated[Optional[bool], opt("causal", "Pin causality. Default: both.")] = None,
    quiet: QuietOpt = False,
    format: FormatOpt = None,
    output: OutputOpt = None,
):
    """Compare a FlashAttention-2 implementation with a float64 reference: the CS336 contract's shapes and awkward ones (exit 1 if a case fails; with --adapters, a contract case)."""
    from lmsys.bench import flash_runs
    from lmsys.commands.listing import list_if_asked

    list_if_asked(impl=impl)
    check_render_options(format, output, device=device, quiet=quiet)  # before torch is imported
    plan = flash_runs.resolve(impl=impl, adapters=adapters, device=device, cases=cases, seed=seed, max_len=max_len,
                              dtype=dtype, tier=tier, seq_len=seq_len, d_head=d_head, batch_size=batch_size,
                              causal=causal)
    for note in plan.notes:
        typer.echo(note, err=True)
    report, failed_impls = flash_runs.run(plan)
    emit(report, format, output)
    if failed_impls:
        raise typer.Exit(1)
