"""`lmsys flash`: check the FlashAttention-2 implementations against a float64 reference."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from lmsys.commands._common import (DeviceOpt, FormatOpt, OutputOpt, QuietOpt, check_attention_impl,
                                    check_render_options, emit,
                                    track)

app = typer.Typer(help="FlashAttention-2: correctness checks of the PyTorch and Triton implementations.", no_args_is_help=True)


@app.command("check")
def check(
    impl: Annotated[Optional[str], typer.Option(help="flash-torch | flash-triton | yours-torch | yours-triton (with --adapters) | pkg.module:Name or file.py:Name (your autograd.Function or callable (q, k, v, is_causal) on [batch, seq, d]); comma-separate several; `list` lists them. Default: flash-triton on a GPU (or under TRITON_INTERPRET=1), else flash-torch; with --adapters, yours-torch,yours-triton (yours-torch alone where flash-triton is not the default).")] = None,
    adapters: Annotated[Optional[str], typer.Option("--adapters", help="Your CS336 adapters module (a .py file or a module name): --impl yours-torch, yours-triton.")] = None,
    device: DeviceOpt = "auto",
    cases: Annotated[int, typer.Option(help="Cases per tier (shapes, dtypes, causality drawn from the seed).")] = 12,
    seed: Annotated[int, typer.Option(help="Seed of the shapes and of the inputs.")] = 0,
    max_len: Annotated[Optional[int], typer.Option(help="Longest n_queries / n_keys. Default: 300 on a GPU, 80 on a CPU.")] = None,
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="Only these dtypes, comma-separated (fp32, bf16, fp16). Default: every one the device supports.")] = None,
    tier: Annotated[str, typer.Option("--tier", help="contract: the shapes CS336's handout promises (power-of-two lengths >= 16, n_queries = n_keys and not, d 16-128, fp32 and bf16, causal and not; your PyTorch version may ignore is_causal) | robust: awkward shapes (odd lengths, padded head dims, fp16, grouped-query) | all. With --adapters the exit code follows the contract tier.")] = "all",
    seq_len: Annotated[Optional[str], typer.Option("--seq-len", help="Pin n_queries = n_keys to this length in every case (comma-separate several: cases take them in turn).")] = None,
    d_head: Annotated[Optional[str], typer.Option("--d-head", help="Pin the head dim of every case (comma-separate several).")] = None,
    batch_size: Annotated[Optional[str], typer.Option("--batch-size", "--batch", help="Pin the batch (the first leading dim) of every case (comma-separate several).")] = None,
    causal: Annotated[Optional[bool], typer.Option("--causal/--no-causal", metavar="", help="Pin causality. Default: both.")] = None,
    quiet: QuietOpt = False,
    format: FormatOpt = None,
    output: OutputOpt = None,
):
    """Compare a FlashAttention-2 implementation with a float64 reference: the CS336 contract's shapes and awkward ones (exit 1 if a case fails; with --adapters, a contract case)."""
    from lmsys.commands.listing import list_if_asked
    from lmsys.core.errors import LmsysError

    list_if_asked(impl=impl)
    check_render_options(format, output, device=device, quiet=quiet)  # before torch is imported
    if not 0 <= seed < 2**63:  # torch.manual_seed takes a 64-bit seed
        raise LmsysError(f"--seed must be in 0 .. 2**63-1, got {seed}")
    from lmsys.core.parsing import choose, parse_int_list

    choose(tier, ("contract", "robust", "all"), what="--tier")
    pinned = dict(seq_len=tuple(parse_int_list(seq_len, what="--seq-len")),
                  d_head=tuple(parse_int_list(d_head, what="--d-head")),
                  batch=tuple(parse_int_list(batch_size, what="--batch-size")), causal=causal)

    from lmsys.core.devices import environment, resolve_device
    from lmsys.core.parsing import parse_list
    from lmsys.core.results import Report
    from lmsys.bench import flash_check
    from lmsys.kernels.registry import ADAPTER_NAMES

    dev = resolve_device(device)
    builtin = flash_check.default_impl(dev)  # flash-triton where Triton runs (a GPU or its interpreter)
    default = ("yours-torch,yours-triton" if builtin == "flash-triton" else "yours-torch") if adapters else builtin
    names = [flash_check.check_impl(n, adapters=adapters)
             for n in dict.fromkeys(parse_list(impl or default, str, what="--impl"))]
    for one in names:
        check_attention_impl(one, dev)
    name = ", ".join(names)
    dtypes = parse_list(dtype, flash_check.check_dtype, what="--dtype") if dtype else flash_check.device_dtypes(dev)
    length = flash_check.default_max_len(dev) if max_len is None else max_len
    pins = flash_check.Pins(**pinned)
    for one in names:
        flash_check.check_pins(one, pins)
    tiers, tier_notes = flash_check.plan_tiers(tier, pins, dtypes)
    for note in tier_notes:
        typer.echo(note, err=True)
    rows, verdicts, failed_impls = [], [], []
    for one in names:
        user = flash_check.is_user(one)
        drawn = (flash_check.contract_cases(cases, seed=seed, dtypes=dtypes, max_len=length, impl=one, pins=pins)
                 if "contract" in tiers else [])
        if "robust" in tiers:
            drawn += flash_check.random_cases(cases, seed=seed, dtypes=dtypes, max_len=length, impl=one,
                                              three_d=user, pins=pins)
        run = (flash_check.run_user_check(one, drawn, device=dev, seed=seed, adapters=adapters) if user
               else flash_check.run_check(one, drawn, device=dev, seed=seed))
        named = len(names) > 1  # several: every row says whose it is (a user's rows always do)
        mine = [{"impl": one, **row} if named else row
                for row in track(run, total=len(drawn), description=f"flash check {one}")]
        lines, failed = flash_check.summarize(mine, one, contract_gates=one in ADAPTER_NAMES)
        rows += mine
        verdicts += lines
        if failed:
            failed_impls.append(one)
    meta = environment(dev)
    pinned_text = f", pinned: {pins.describe()}" if pins.describe() else ""
    meta["run"] = (f"impl {name}, tier {' + '.join(tiers)}, {cases} cases per tier, seed {seed}{pinned_text}, "
                   "reference float64 on the CPU")
    skipped = sum(r["result"].startswith("not implemented") for r in rows)
    failed = sum(flash_check.counts_as_failed(r["result"]) for r in rows)
    notes = [
        "err = max |x - ref| / max(max |ref|, 1) for O, the saved logsumexp L, and dQ, dK, dV (dO random); "
        "tolerance fp32 1e-4 (your code's fp32: 1e-2, the handout's tests' tolerance, which TF32 dots meet), "
        "bf16/fp16 2e-2.",
        f"{len(rows) - failed - skipped} of {len(rows) - skipped} cases pass." if not failed
        else f"{failed} of {len(rows) - skipped} cases FAIL.",
        *verdicts,
    ]
    if any(one in ADAPTER_NAMES for one in names) and "contract" in tiers:
        notes.append("The exit code follows the CS336 contract tier for your adapters' rows (the handout's "
                     "promises); the robust tier says what lies beyond them.")
    if any(flash_check.is_user(n) for n in names):
        notes.append("Your attention gets CS336's [batch, seq, d]. off: the tensors beyond the tolerance, their shape "
                     "and max abs / max rel error against float64 (and the factor where one is a constant multiple "
                     "of the reference). CS336 saved L: whether the saved tensors are exactly one fp32 L of shape "
                     "q.shape[:-1] beside q, k, v, o (not part of pass/FAIL).")
    emit(Report(f"flash check: {name}", rows, meta, notes), format, output)
    if failed_impls:
        raise typer.Exit(1)
