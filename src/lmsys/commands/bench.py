"""`lmsys bench`: end-to-end training-step timing and attention kernel sweeps."""

from __future__ import annotations

from typing import Annotated, List, Optional

import typer

from lmsys.kernels.registry import NAMES as ATTENTION_NAMES
from lmsys.commands._common import check_render_options, emit
from lmsys.commands.options import (DeviceOpt, FormatOpt, ModelKwargsOpt, OutputOpt, PeakTflopsOpt, QuietOpt,
                                    opt)

app = typer.Typer(help="Benchmarks: end-to-end training step, attention kernels.", no_args_is_help=True)


@app.command("e2e")
def e2e(
    size: Annotated[Optional[str], opt("size", "Preset(s), comma-separated (tiny, small, medium, large, xl, 2.7b, 10b) or a .yaml config. Default: small on a GPU, tiny on a CPU.")] = None,
    d_model: Annotated[Optional[int], typer.Option(help="Override d_model.")] = None,
    d_ff: Annotated[Optional[int], typer.Option(help="Override d_ff.")] = None,
    layers: Annotated[Optional[int], typer.Option(help="Override the number of layers.")] = None,
    heads: Annotated[Optional[str], opt("heads", "Override the number of heads; a comma list sweeps it (one row each).")] = None,
    context_length: Annotated[str, opt("context_length", "Sequence length of the batch; a comma list sweeps it (one row each).")] = "512",
    batch_size: Annotated[str, opt("batch_size", "Sequences per step; a comma list sweeps it (one row each).")] = "4",
    vocab_size: Annotated[Optional[int], typer.Option(help="Override the vocabulary size (10,000).")] = None,
    mode: Annotated[str, opt("mode", "fwd | fwd-bwd | train | all.")] = "train",
    warmup: Annotated[int, opt("warmup", "Untimed warm-up steps (0 allowed).")] = 5,
    steps: Annotated[int, opt("steps", "Timed steps.")] = 10,
    dtype: Annotated[str, opt("dtype", "fp32 | bf16 | fp16; a comma list sweeps it (one row each).")] = "fp32",
    peak_tflops: PeakTflopsOpt = None,
    attn: Annotated[Optional[str], opt("impl", aliases=("--attn",), help="Attention implementation (--attn: the former name): " + " | ".join(ATTENTION_NAMES) + " | pkg.module:Name | file.py:Name (your attention, [batch, seq, d]). Default naive (sdpa with --fast).")] = None,
    compile: Annotated[bool, typer.Option("--compile", metavar="", help="torch.compile the whole loss function (model + cross-entropy).")] = False,
    compile_blocks: Annotated[bool, typer.Option("--compile-blocks", metavar="", help="torch.compile each Transformer block (compiles once, fast to start).")] = False,
    cuda_graphs: Annotated[bool, typer.Option("--cuda-graphs", metavar="", help="CUDA graphs through torch.compile's reduce-overhead mode.")] = False,
    optimizer: Annotated[str, typer.Option(help="auto | adamw | adamw-fused (auto: fused on a GPU).")] = "auto",
    master_weights: Annotated[bool, opt("master_weights", "bf16 weights and grads with fp32 master weights in a fused Triton AdamW (needs --dtype bf16).")] = False,
    fused_ce: Annotated[str, typer.Option(help="Chunked cross-entropy that never holds full logits: auto (when fp32 logits > 1 GiB) | on | off.")] = "auto",
    tf32: Annotated[bool, typer.Option("--tf32", metavar="", help="TF32 tensor cores for fp32 matmuls (flash-triton's fp32 dots then bf16x3; said so in the output).")] = False,
    optimizer_in_backward: Annotated[Optional[bool], typer.Option("--optimizer-in-backward/--no-optimizer-in-backward", metavar="", help="Run each block's AdamW inside the backward, from a post-accumulate-grad hook, and free its gradients (off by default, also with --fast: measured no faster on an H200).")] = None,
    optimizer_stream: Annotated[Optional[bool], typer.Option("--optimizer-stream/--no-optimizer-stream", metavar="", help="Run the in-backward updates on a side CUDA stream, under the rest of the backward (needs --optimizer-in-backward).")] = None,
    sm_carveout: Annotated[Optional[str], opt("sm_carveout", "SMs the backward's matmuls leave to the in-backward updates on their side stream, from the first update to the end of backward (needs --optimizer-in-backward --optimizer-stream; GPU only); a comma list sweeps it (one row each).")] = None,
    checkpoint: Annotated[str, opt("checkpoint", "Activation checkpointing: none | block | every:N, or a comma list to compare.")] = "none",
    fast: Annotated[bool, typer.Option("--fast", metavar="", help="The lmsys fast path: sdpa, torch.compile of model + loss (GPU), fused AdamW, bf16 master weights (bf16), chunked CE when logits are large, TF32 (fp32).")] = False,
    model: Annotated[Optional[str], opt("model", "lmsys | hf:llama | hf:gpt2 | hf:qwen2 | hf:mistral | pkg.module:Name or file.py:Name (your model class or factory, built with --size's sizes by keyword or in its config object's fields, ids [B, S] -> logits [B, S, V]); `list` lists them. Default: lmsys.")] = None,
    model_kwargs: ModelKwargsOpt = None,
    compare: Annotated[bool, typer.Option("--compare", metavar="", help="Also run the plain model (naive attention, AdamW) eager and torch.compile'd in the same process, with speed-ups; with --model, also lmsys's own model at the same sizes, eager and on --fast (× vs lmsys --fast).")] = False,
    device: DeviceOpt = "auto",
    quiet: QuietOpt = False,
    format: FormatOpt = None,
    output: OutputOpt = None,
):
    """Time forward, backward and optimizer of a Transformer LM training step (mean ± std, MFU, memory)."""
    from lmsys.bench import e2e
    from lmsys.commands.listing import list_if_asked

    list_if_asked(model=model)
    check_render_options(format, output, device=device, quiet=quiet)  # before torch is imported
    run = e2e.resolve(
        size=size, d_model=d_model, d_ff=d_ff, layers=layers, heads=heads, context_length=context_length,
        batch_size=batch_size, vocab_size=vocab_size, mode=mode, warmup=warmup, steps=steps, dtype=dtype,
        peak_tflops=peak_tflops, attn=attn, compile=compile, compile_blocks=compile_blocks, cuda_graphs=cuda_graphs,
        optimizer=optimizer, master_weights=master_weights, fused_ce=fused_ce, tf32=tf32,
        optimizer_in_backward=optimizer_in_backward, optimizer_stream=optimizer_stream, sm_carveout=sm_carveout,
        checkpoint=checkpoint, fast=fast, model=model, model_kwargs=model_kwargs, compare=compare, device=device)
    emit(e2e.e2e_report(run), format, output)


@app.command("attention")
def attention(
    impl: Annotated[Optional[List[str]], opt("impl", "Repeatable (or comma-separated): naive, compiled, sdpa, sdpa-flash, sdpa-cudnn, sdpa-efficient, sdpa-math, flash-torch, flash-triton, yours-torch, yours-triton (with --adapters), pkg.module:Name or file.py:Name (your attention on [batch, seq, d]: heads are folded into the batch); `list` lists them. Default: naive, compiled, flash-triton (naive, flash-torch on a CPU); --adapters adds yours-torch, yours-triton (yours-torch on a CPU).")] = None,
    adapters: Annotated[Optional[str], opt("adapters", "Your CS336 adapters module (a .py file or a module name): --impl yours-torch, yours-triton.")] = None,
    batch: Annotated[Optional[str], opt("batch_size", "Batch sizes, comma-separated. Defaults (here and below): the seed's sweep (batch 8, 1 head, d 16,32,64,128, seq 256..16384, fp32, no mask, warmup 10, steps 100) on a GPU or whenever a size option is given; on a CPU without sizes a small one (batch 1, d 16,64, seq 128,256, warmup 1, steps 5).")] = None,
    heads: Annotated[Optional[str], opt("heads", "Head counts, comma-separated (seed: 1).")] = None,
    kv_heads: Annotated[Optional[int], typer.Option("--kv-heads", help="Key/value heads (grouped-query attention; must divide every --heads). Default: as many as --heads.")] = None,
    d_head: Annotated[Optional[str], opt("d_head", "Head dims, comma-separated (seed: 16,32,64,128; CPU: 16,64).")] = None,
    seq_len: Annotated[Optional[str], opt("context_length", "Sequence lengths, comma-separated (seed: 256,1024,4096,8192,16384; CPU: 128,256).")] = None,
    dtype: Annotated[Optional[str], opt("dtype", "fp32 | bf16 | fp16, comma-separated: the whole sweep once per dtype (seed: fp32).")] = None,
    causal: Annotated[Optional[bool], opt("causal", "Causal mask (seed: no).")] = None,
    preset: Annotated[Optional[str], typer.Option(help="leaderboard: bf16, causal, batch 1, 16 heads, seq 16384, d 64, sdpa-flash vs sdpa-cudnn vs flash-triton (other options override it; on a CPU the CPU implementations run instead, said on stderr).")] = None,
    warmup: Annotated[Optional[int], opt("warmup", "Untimed forward+backward steps first (seed: 10; CPU: 1).")] = None,
    steps: Annotated[Optional[int], opt("steps", "Timed forward+backward steps (seed: 100; CPU: 5).")] = None,
    policy: Annotated[Optional[List[str]], typer.Option("--policy", metavar="FIELD=VALUE[,...]", help="Repeatable: flash-triton runs once more per option, under lmsys.kernels.flash_triton.Policy with these fields changed (e.g. tma=true, persistent=true, deterministic=false,tma_backward=false, pick=0; booleans true/false, none where the field allows it); rows then carry a policy column, the default policy first.")] = None,
    plot: Annotated[Optional[str], opt("plot", "Also draw fwd+bwd ms against seq into this PNG (matplotlib).")] = None,
    device: DeviceOpt = "auto",
    quiet: QuietOpt = False,
    format: FormatOpt = None,
    output: OutputOpt = None,
):
    """Time attention implementations forward and backward over head dims × sequence lengths (ms, TFLOP/s, memory)."""
    from lmsys.bench import attention  # torch-free until it runs
    from lmsys.commands.listing import list_if_asked

    list_if_asked(impl=impl)
    check_render_options(format, output, device=device, quiet=quiet)  # before torch is imported
    run = attention.resolve(impl=impl, adapters=adapters, batch=batch, heads=heads, kv_heads=kv_heads, d_head=d_head,
                            seq_len=seq_len, dtype=dtype, causal=causal, preset=preset, warmup=warmup, steps=steps,
                            policy=policy, plot=plot, device=device)
    for note in run.notes:  # what was chosen for the user (a CPU fallback, the small CPU sweep): said before it runs
        typer.echo(note, err=True)
    emit(attention.attention_report(run), format, output)
