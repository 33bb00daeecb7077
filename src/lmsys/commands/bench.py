"""`lmsys bench`: end-to-end training-step timing and attention kernel sweeps."""

from __future__ import annotations

from typing import Annotated, List, Optional

import typer

from lmsys.kernels.registry import NAMES as ATTENTION_NAMES
from lmsys.commands._common import (QuietOpt, DeviceOpt, FormatOpt, OutputOpt, check_attention_impl, check_counts,
                                    check_render_options, emit, require_triton, track)

app = typer.Typer(help="Benchmarks: end-to-end training step, attention kernels.", no_args_is_help=True)


@app.command("e2e")
def e2e(
    size: Annotated[Optional[str], typer.Option(help="Preset(s), comma-separated (tiny, small, medium, large, xl, 2.7b, 10b) or a .yaml config. Default: small on a GPU, tiny on a CPU.")] = None,
    d_model: Annotated[Optional[int], typer.Option(help="Override d_model.")] = None,
    d_ff: Annotated[Optional[int], typer.Option(help="Override d_ff.")] = None,
    layers: Annotated[Optional[int], typer.Option(help="Override the number of layers.")] = None,
    heads: Annotated[Optional[str], typer.Option(help="Override the number of heads; a comma list sweeps it (one row each).")] = None,
    context_length: Annotated[str, typer.Option("--context-length", "--seq-len", help="Sequence length of the batch; a comma list sweeps it (one row each).")] = "512",
    batch_size: Annotated[str, typer.Option("--batch-size", "--batch", help="Sequences per step; a comma list sweeps it (one row each).")] = "4",
    vocab_size: Annotated[Optional[int], typer.Option(help="Override the vocabulary size (10,000).")] = None,
    mode: Annotated[str, typer.Option(help="fwd | fwd-bwd | train | all.")] = "train",
    warmup: Annotated[int, typer.Option(help="Untimed warm-up steps (0 allowed).")] = 5,
    steps: Annotated[int, typer.Option("--steps", "--iters", help="Timed steps.")] = 10,
    dtype: Annotated[str, typer.Option("--dtype", help="fp32 | bf16 | fp16; a comma list sweeps it (one row each).")] = "fp32",
    peak_tflops: Annotated[Optional[float], typer.Option("--peak-tflops", help="Dense peak TFLOP/s per GPU that MFU divides by, for a GPU lmsys.core.hardware's table does not know (default: the table's for --dtype; unknown GPU: no MFU).")] = None,
    attn: Annotated[Optional[str], typer.Option("--impl", "--attn", help="Attention implementation (--attn: the former name): " + " | ".join(ATTENTION_NAMES) + " | pkg.module:Name | file.py:Name (your attention, [batch, seq, d]). Default naive (sdpa with --fast).")] = None,
    compile: Annotated[bool, typer.Option("--compile", metavar="", help="torch.compile the whole loss function (model + cross-entropy).")] = False,
    compile_blocks: Annotated[bool, typer.Option("--compile-blocks", metavar="", help="torch.compile each Transformer block (compiles once, fast to start).")] = False,
    cuda_graphs: Annotated[bool, typer.Option("--cuda-graphs", metavar="", help="CUDA graphs through torch.compile's reduce-overhead mode.")] = False,
    optimizer: Annotated[str, typer.Option(help="auto | adamw | adamw-fused (auto: fused on a GPU).")] = "auto",
    master_weights: Annotated[bool, typer.Option("--master-weights", metavar="", help="bf16 weights and grads with fp32 master weights in a fused Triton AdamW (needs --dtype bf16).")] = False,
    fused_ce: Annotated[str, typer.Option(help="Chunked cross-entropy that never holds full logits: auto (when fp32 logits > 1 GiB) | on | off.")] = "auto",
    tf32: Annotated[bool, typer.Option("--tf32", metavar="", help="TF32 tensor cores for fp32 matmuls (said so in the output).")] = False,
    optimizer_in_backward: Annotated[Optional[bool], typer.Option("--optimizer-in-backward/--no-optimizer-in-backward", metavar="", help="Run each block's AdamW inside the backward, from a post-accumulate-grad hook, and free its gradients (off by default, also with --fast: measured no faster on an H200).")] = None,
    optimizer_stream: Annotated[Optional[bool], typer.Option("--optimizer-stream/--no-optimizer-stream", metavar="", help="Run the in-backward updates on a side CUDA stream, under the rest of the backward (needs --optimizer-in-backward).")] = None,
    sm_carveout: Annotated[Optional[str], typer.Option("--sm-carveout", help="SMs the backward's matmuls leave to the in-backward updates on their side stream, from the first update to the end of backward (needs --optimizer-in-backward --optimizer-stream; GPU only); a comma list sweeps it (one row each).")] = None,
    checkpoint: Annotated[str, typer.Option(help="Activation checkpointing: none | block | every:N, or a comma list to compare.")] = "none",
    fast: Annotated[bool, typer.Option("--fast", metavar="", help="The lmsys fast path: sdpa, torch.compile of model + loss (GPU), fused AdamW, bf16 master weights (bf16), chunked CE when logits are large, TF32 (fp32).")] = False,
    model: Annotated[Optional[str], typer.Option("--model", help="lmsys | hf:llama | hf:gpt2 | hf:qwen2 | hf:mistral | pkg.module:Name or file.py:Name (your model class or factory, built with --size's sizes by keyword or in its config object's fields, ids [B, S] -> logits [B, S, V]); `list` lists them. Default: lmsys.")] = None,
    model_kwargs: Annotated[Optional[str], typer.Option("--model-kwargs", help="Extra keyword arguments for --model: YAML or JSON text, or a .yaml/.json file.")] = None,
    compare: Annotated[bool, typer.Option("--compare", metavar="", help="Also run the plain model (naive attention, AdamW) eager and torch.compile'd in the same process, with speed-ups; with --model, also lmsys's own model at the same sizes, eager and on --fast (× vs lmsys --fast).")] = False,
    device: DeviceOpt = "auto",
    quiet: QuietOpt = False,
    format: FormatOpt = None,
    output: OutputOpt = None,
):
    """Time forward, backward and optimizer of a Transformer LM training step (mean ± std, MFU, memory)."""
    from lmsys.core.errors import LmsysError
    from lmsys.commands.listing import list_if_asked
    from lmsys.kernels.registry import check_name
    from lmsys.model.user import check_model, parse_model_kwargs

    list_if_asked(model=model)
    check_render_options(format, output, device=device, quiet=quiet)  # before torch is imported
    from lmsys.core.devices import DTYPE_CHOICES
    from lmsys.core.hardware import check_peak
    from lmsys.core.parsing import choose, parse_int_list, parse_list

    check_peak(peak_tflops)
    check_counts(warmup=(warmup, 0), steps=(steps, 1))
    dtypes = [choose(d, DTYPE_CHOICES, what="--dtype") for d in parse_list(dtype, str, what="--dtype")]
    batch_sizes = parse_int_list(batch_size, what="--batch-size")
    context_lengths = parse_int_list(context_length, what="--context-length")
    head_counts = parse_int_list(heads, what="--heads") if heads is not None else [None]
    carveouts = parse_int_list(sm_carveout, what="--sm-carveout", minimum=0) if sm_carveout is not None else [None]
    if compile and compile_blocks:
        raise LmsysError("--compile and --compile-blocks are exclusive: pick one scope")
    if attn is not None:
        check_name(attn, what="--impl")
    model = check_model(model) if model else None
    if attn is not None and model not in (None, "lmsys"):
        raise LmsysError(f"--impl picks the attention inside lmsys's model; --model {model} runs its own "
                         "(leave --impl out)")
    kwargs_json = parse_model_kwargs(model_kwargs)

    from lmsys.bench import e2e
    from lmsys.core.devices import check_dtype_for_device, environment, resolve_device
    from lmsys.core.results import Report
    from lmsys.model.config import default_size
    modes = e2e.expand_modes(mode)
    dev = resolve_device(device)
    for one in dtypes:
        check_dtype_for_device(one, dev)
    variants = [{"dtype": one, **e2e.step_options(
        dev, one, fast=fast, attn=attn, compile_scope="model" if compile else ("blocks" if compile_blocks else None),
        optimizer=optimizer, master_weights=master_weights, fused_ce=fused_ce, tf32=tf32,
        optimizer_in_backward=optimizer_in_backward, optimizer_stream=optimizer_stream, sm_carveout=carveout)}
        for one in dtypes for carveout in carveouts]
    attn_impl = [v.pop("attn_impl") for v in variants][0]  # --impl or --fast's: the same for every dtype
    if attn_impl is not None:
        check_attention_impl(attn_impl, dev)
    if any(v.get("master_weights") for v in variants):
        require_triton("--master-weights (a fused Triton AdamW)")
    sizes = parse_list(default_size(dev.type) if size is None else size, str, what="--size")
    configs = e2e.sweep_configs(sizes, context_lengths=context_lengths, heads=head_counts, vocab_size=vocab_size,
                                d_model=d_model, d_ff=d_ff, layers=layers, attn_impl=attn_impl, model=model,
                                model_kwargs=kwargs_json)
    for _, cfg in configs:  # a YAML's own attn_impl, checked as --impl is
        check_attention_impl(cfg.attn_impl, dev)
    workloads = e2e.resolve_workloads(configs, checkpoints=parse_list(checkpoint, str, what="--checkpoint"),
                                      batch_sizes=batch_sizes, variants=variants, cuda_graphs=cuda_graphs)
    for one in dtypes:
        e2e.check_memory(configs, dev, batch_size=max(batch_sizes), dtype=one)
    per_workload = len(modes) * (3 if compare else 1)
    rows = list(track(e2e.run_e2e(workloads, modes=modes, warmup=warmup, steps=steps, device=dev, compare=compare,
                                  peak_tflops=peak_tflops),
                      total=len(workloads) * per_workload, description="bench e2e"))
    meta, notes = e2e.describe_run(environment(dev, peak_tflops=peak_tflops), configs, workloads, warmup=warmup, steps=steps, compare=compare,
                                    device=dev)
    emit(Report("bench e2e", rows, meta, notes), format, output)

@app.command("attention")
def attention(
    impl: Annotated[Optional[List[str]], typer.Option("--impl", help="Repeatable (or comma-separated): naive, compiled, sdpa, sdpa-flash, sdpa-cudnn, sdpa-efficient, sdpa-math, flash-torch, flash-triton, yours-torch, yours-triton (with --adapters), pkg.module:Name or file.py:Name (your attention on [batch, seq, d]: heads are folded into the batch); `list` lists them. Default: naive, compiled, flash-triton (naive, flash-torch on a CPU); --adapters adds yours-torch, yours-triton (yours-torch on a CPU).")] = None,
    adapters: Annotated[Optional[str], typer.Option("--adapters", help="Your CS336 adapters module (a .py file or a module name): --impl yours-torch, yours-triton.")] = None,
    batch: Annotated[Optional[str], typer.Option("--batch-size", "--batch", help="Batch sizes, comma-separated. Defaults (here and below): the seed's sweep (batch 8, 1 head, d 16,32,64,128, seq 256..16384, fp32, no mask, warmup 10, steps 100) on a GPU or whenever a size option is given; on a CPU without sizes a small one (batch 1, d 16,64, seq 128,256, warmup 1, steps 5).")] = None,
    heads: Annotated[Optional[str], typer.Option(help="Head counts, comma-separated (seed: 1).")] = None,
    kv_heads: Annotated[Optional[int], typer.Option("--kv-heads", help="Key/value heads (grouped-query attention; must divide every --heads). Default: as many as --heads.")] = None,
    d_head: Annotated[Optional[str], typer.Option(help="Head dims, comma-separated (seed: 16,32,64,128; CPU: 16,64).")] = None,
    seq_len: Annotated[Optional[str], typer.Option("--context-length", "--seq-len", help="Sequence lengths, comma-separated (seed: 256,1024,4096,8192,16384; CPU: 128,256).")] = None,
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="fp32 | bf16 | fp16, comma-separated: the whole sweep once per dtype (seed: fp32).")] = None,
    causal: Annotated[Optional[bool], typer.Option("--causal/--no-causal", metavar="", help="Causal mask (seed: no).")] = None,
    preset: Annotated[Optional[str], typer.Option(help="leaderboard: bf16, causal, batch 1, 16 heads, seq 16384, d 64, sdpa-flash vs sdpa-cudnn vs flash-triton (other options override it; on a CPU the CPU implementations run instead, said on stderr).")] = None,
    warmup: Annotated[Optional[int], typer.Option(help="Untimed forward+backward steps first (seed: 10; CPU: 1).")] = None,
    steps: Annotated[Optional[int], typer.Option("--steps", "--iters", help="Timed forward+backward steps (seed: 100; CPU: 5).")] = None,
    policy: Annotated[Optional[List[str]], typer.Option("--policy", metavar="FIELD=VALUE[,...]", help="Repeatable: flash-triton runs once more per option, under lmsys.kernels.flash_triton.Policy with these fields changed (e.g. tma=true, persistent=true, deterministic=false,tma_backward=false, pick=0; booleans true/false, none where the field allows it); rows then carry a policy column, the default policy first.")] = None,
    plot: Annotated[Optional[str], typer.Option("--plot", help="Also draw fwd+bwd ms against seq into this PNG (matplotlib).")] = None,
    device: DeviceOpt = "auto",
    quiet: QuietOpt = False,
    format: FormatOpt = None,
    output: OutputOpt = None,
):
    """Time attention implementations forward and backward over head dims × sequence lengths (ms, TFLOP/s, memory)."""
    from lmsys.commands.listing import list_if_asked
    from lmsys.core.files import check_output_path

    list_if_asked(impl=impl)

    check_render_options(format, output, device=device, quiet=quiet)  # before torch is imported
    check_output_path(plot, what="--plot")
    from lmsys.core.devices import DTYPE_CHOICES
    from lmsys.core.parsing import choose, parse_int_list, parse_list

    dtypes = [choose(d, DTYPE_CHOICES, what="--dtype") for d in parse_list(dtype, str, what="--dtype")] \
        if dtype is not None else [None]
    from lmsys.bench import attention  # torch-free until it runs

    for text in policy or ():
        attention.split_policy(text)  # the syntax; the fields and values once the kernels' Policy is imported

    from lmsys.core.flops import ATTENTION_RATE_NOTE
    from lmsys.core.devices import environment, resolve_device
    from lmsys.core.results import Report
    dev = resolve_device(device)
    if impl and "flash-triton" in parse_list(impl, str, what="--impl"):
        require_triton("flash-triton")
    sizes = dict(impls=parse_list(impl, str, what="--impl") if impl else None,
                 batch=parse_int_list(batch, what="--batch-size") or None,
                 heads=parse_int_list(heads, what="--heads") or None,
                 d_head=parse_int_list(d_head, what="--d-head") or None,
                 seq_len=parse_int_list(seq_len, what="--context-length") or None)
    resolved = [attention.resolve_sweep(device=dev, preset=preset, dtype=one, causal=causal, warmup=warmup,
                                        steps=steps, kv_heads=kv_heads, policies=policy, adapters=adapters, **sizes)
                for one in dtypes]
    sweeps = [sweep for sweep, _ in resolved]
    sweep, notes = resolved[0]  # the notes say what was chosen, the same for every dtype
    for note in notes:  # what was chosen for the user (a CPU fallback, the small CPU sweep): said before it runs
        typer.echo(note, err=True)
    rows = list(track(attention.run_sweeps(sweeps, device=dev), total=sum(s.size for s in sweeps),
                      description="bench attention"))
    meta = environment(dev)
    meta["run"] = attention.describe_sweeps(sweeps)
    notes.append("ms: mean ± std over the timed steps (CUDA events on a GPU). " + ATTENTION_RATE_NOTE)
    notes.append("Memory (GPU only): peak allocated during one forward, allocated just before its backward "
                 "(inputs, saved tensors, output), peak during the backward.")
    notes.append("status: each row's first step is checked: O, dQ, dK, dV of batch element 0 (the query heads "
                 "of key/value head 0) against float64, err = max |x - ref| / max(max |ref|, 1), tolerance "
                 "fp32 1e-4 (your attention's: 1e-2, the handout's), bf16/fp16 2e-2; `wrong (...)` names the tensors beyond it, and the command exits 1.")
    notes.append("host µs: median host time to issue one forward+backward on an idle device, after the timed "
                 "steps; near fwd+bwd ms × 1000 the row is host-bound (on a CPU: the whole step).")
    report = Report("bench attention", rows, meta, notes)
    if plot is not None:
        title = f"attention fwd+bwd, {attention.describe_sweeps(sweeps).split(', warmup')[0]}"
        attention.plot_attention(rows, plot, title=title)
        notes.append(f"Plot written to {plot}.")
    emit(report, format, output)
