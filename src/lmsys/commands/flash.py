"""`lmsys flash`: check the FlashAttention-2 implementations against a float64 reference."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from lmsys.commands._common import (DeviceOpt, FormatOpt, OutputOpt, check_attention_impl, check_render_options, emit,
                                    track)

app = typer.Typer(help="FlashAttention-2: correctness checks of the PyTorch and Triton implementations.", no_args_is_help=True)


@app.command("check")
def check(
    impl: Annotated[Optional[str], typer.Option(help="flash-torch | flash-triton. Default: flash-triton on a GPU (or under TRITON_INTERPRET=1), else flash-torch.")] = None,
    device: DeviceOpt = "auto",
    cases: Annotated[int, typer.Option(help="Random cases (shapes, dtypes, causality) to run.")] = 12,
    seed: Annotated[int, typer.Option(help="Seed of the shapes and of the inputs.")] = 0,
    max_len: Annotated[Optional[int], typer.Option(help="Longest n_queries / n_keys. Default: 300 on a GPU, 80 on a CPU.")] = None,
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="Only these dtypes, comma-separated (fp32, bf16, fp16). Default: every one the device supports.")] = None,
    format: FormatOpt = "table",
    output: OutputOpt = None,
):
    """Compare a FlashAttention-2 implementation with a float64 reference on random awkward shapes (exit 1 if any case fails)."""
    from lmsys.core.errors import LmsysError

    check_render_options(format, output, device=device)  # before torch is imported
    if not 0 <= seed < 2**63:  # torch.manual_seed takes a 64-bit seed
        raise LmsysError(f"--seed must be in 0 .. 2**63-1, got {seed}")

    from lmsys.core.devices import environment, resolve_device
    from lmsys.core.parsing import parse_list
    from lmsys.core.results import Report
    from lmsys.bench import flash_check

    dev = resolve_device(device)
    name = flash_check.check_impl(impl or flash_check.default_impl(dev))
    check_attention_impl(name, dev)
    dtypes = parse_list(dtype, flash_check.check_dtype, what="--dtype") if dtype else flash_check.device_dtypes(dev)
    drawn = flash_check.random_cases(
        cases, seed=seed, dtypes=dtypes, max_len=flash_check.default_max_len(dev) if max_len is None else max_len,
        impl=name)
    rows = list(track(flash_check.run_check(name, drawn, device=dev, seed=seed), total=len(drawn),
                      description="flash check"))
    meta = environment(dev)
    meta["run"] = f"impl {name}, {len(drawn)} cases, seed {seed}, reference float64 on the CPU"
    failed = sum(r["result"] != "pass" for r in rows)
    notes = [
        "err = max |x - ref| / max(max |ref|, 1) for O, the saved logsumexp L, and dQ, dK, dV (dO random); "
        "tolerance fp32 1e-4, bf16/fp16 2e-2.",
        f"{len(rows) - failed} of {len(rows)} cases pass." if not failed else f"{failed} of {len(rows)} cases FAIL.",
    ]
    emit(Report(f"flash check: {name}", rows, meta, notes), format, output)
    if failed:
        raise typer.Exit(1)
