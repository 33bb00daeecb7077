"""`lmsys bench`: end-to-end training-step timing and attention kernel sweeps."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from lmsys.commands._common import DeviceOpt, DtypeOpt, FormatOpt, OutputOpt, check_render_options, emit, track

app = typer.Typer(help="Benchmarks: end-to-end training step, attention kernels.", no_args_is_help=True)


@app.command("e2e")
def e2e(
    size: Annotated[Optional[str], typer.Option(help="Preset(s), comma-separated (tiny, small, medium, large, xl, 2.7b, 10b) or a .yaml config. Default: small on a GPU, tiny on a CPU.")] = None,
    d_model: Annotated[Optional[int], typer.Option(help="Override d_model.")] = None,
    d_ff: Annotated[Optional[int], typer.Option(help="Override d_ff.")] = None,
    layers: Annotated[Optional[int], typer.Option(help="Override the number of layers.")] = None,
    heads: Annotated[Optional[int], typer.Option(help="Override the number of heads.")] = None,
    context_length: Annotated[int, typer.Option(help="Sequence length of the batch.")] = 512,
    batch_size: Annotated[int, typer.Option(help="Sequences per step.")] = 4,
    vocab_size: Annotated[Optional[int], typer.Option(help="Override the vocabulary size (10,000).")] = None,
    mode: Annotated[str, typer.Option(help="fwd | fwd-bwd | train | all.")] = "train",
    warmup: Annotated[int, typer.Option(help="Untimed warm-up steps (0 allowed).")] = 5,
    steps: Annotated[int, typer.Option(help="Timed steps.")] = 10,
    dtype: DtypeOpt = "fp32",
    compile: Annotated[bool, typer.Option("--compile", help="torch.compile the model.")] = False,
    attn: Annotated[str, typer.Option(help="Attention: naive | compiled | sdpa | flash-torch | flash-triton.")] = "naive",
    device: DeviceOpt = "auto",
    format: FormatOpt = "table",
    output: OutputOpt = None,
):
    """Time forward, backward and optimizer of a Transformer LM training step (mean ± std, MFU, memory)."""
    from lmsys.bench import e2e as lib
    from lmsys.core.devices import check_dtype_for_device, environment, resolve_device
    from lmsys.core.errors import LmsysError
    from lmsys.core.parsing import parse_list
    from lmsys.core.results import Report

    check_render_options(format, output)
    if warmup < 0 or steps < 1 or batch_size < 1:
        raise LmsysError("--warmup must be >= 0, --steps and --batch-size >= 1")
    modes = lib.expand_modes(mode)
    dev = resolve_device(device)
    check_dtype_for_device(dtype, dev)
    sizes = parse_list(size or lib.default_size(dev), str, what="--size")
    configs = lib.resolve_configs(sizes, context_length=context_length, vocab_size=vocab_size, d_model=d_model,
                                  d_ff=d_ff, layers=layers, heads=heads, attn_impl=attn)
    rows = list(track(
        lib.run_e2e(configs, modes=modes, batch_size=batch_size, dtype=dtype, compile=compile,
                    warmup=warmup, steps=steps, device=dev),
        total=len(configs) * len(modes), description="bench e2e",
    ))
    meta = environment(dev)
    meta.update({name: lib.describe(cfg) for name, cfg in configs})
    numerics = "fp32" if dtype == "fp32" else f"{dtype} autocast, fp32 weights" + (", grad scaler" if dtype == "fp16" else "")
    meta["run"] = (f"batch {batch_size}, {numerics}, attention {attn}, compile {compile}, "
                   f"warmup {warmup}, steps {steps}, AdamW")
    notes = ["MFU: 6·N·tokens + attention (PaLM convention, causal counted in full) over the peak for the dtype."]
    emit(Report("bench e2e", rows, meta, notes), format, output)
