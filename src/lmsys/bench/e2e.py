"""`bench e2e`: time forward, backward and optimizer of the LM training step over sizes and modes.

Each (configuration, path) yields one row per mode; an out-of-memory configuration yields rows marked
OOM and the sweep goes on. With `compare`, every configuration also runs the plain references in the
same process — the same model with naive attention and torch.optim.AdamW, eager, and under
torch.compile with fused AdamW — and rows carry the speed-ups over both. Rows are plain dicts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterator

from lmsys.core import progress
from lmsys.core.devices import check_carveout
from lmsys.core.errors import LmsysError
from lmsys.core.flops import MFU_NOTE, mfu
from lmsys.core.parsing import MiB, choose
from lmsys.core.results import NON_FINITE_LOSS, MeanStd
from lmsys.core.timing import synchronize
from lmsys.model import describe
from lmsys.model.config import ModelConfig
from lmsys.train import MODES
from lmsys.train.optim import default_kind
from lmsys.train.workload import Workload

MODE_CHOICES = (*MODES, "all")
PLAIN_EAGER, PLAIN_COMPILED = "plain eager", "plain compiled"
LMSYS_EAGER, LMSYS_FAST = "lmsys eager", "lmsys --fast"  # --compare on a --model: lmsys's own at its sizes


def check_user_fast_path(config: ModelConfig, options: dict, checkpoints: list[str], *,
                         compile_from_fast: bool = False) -> dict:
    """The fast-path switches on a --model: per-block compile and the in-backward optimizer need its list
    of blocks (found: lmsys.model.user.find_blocks); chunked cross-entropy and checkpointing need lmsys's
    structure (hidden states and an LM head; blocks called as block(x, cos, sin)), so they are refused.
    `--fast`'s compile (`compile_from_fast`) is per block on a model whose blocks are found: a whole user
    model compiled at once took 140-150 s at xl before its first step on an H100, its blocks 31 s."""
    from lmsys.model.user import find_blocks, is_user_model

    if not is_user_model(config):
        return options
    if compile_from_fast and options.get("compile") == "model":
        from lmsys.train.build import build_model

        if find_blocks(build_model(config, device="meta")) is not None:
            options = {**options, "compile": "blocks"}
    if options.get("fused_ce") is True:
        raise LmsysError(f"--fused-ce on needs lmsys's hidden states and LM head; --model {config.model} has "
                         "neither (use --fused-ce off)")
    if any(c != "none" for c in checkpoints):
        raise LmsysError(f"--checkpoint calls lmsys's blocks as block(x, cos, sin); --model {config.model}'s "
                         "blocks take their own arguments (use --checkpoint none)")
    if options.get("compile") == "blocks" or options.get("optimizer_in_backward"):
        from lmsys.train.build import build_model

        blocks = find_blocks(build_model(config, device="meta"))
        if blocks is None:
            what = "--compile-blocks" if options.get("compile") == "blocks" else "--optimizer-in-backward"
            raise LmsysError(f"{what} needs a list of blocks; --model {config.model} has no ModuleList of "
                             "modules of one type")
    return {**options, "fused_ce": False}  # "auto" would pick the chunked loss for a large vocabulary


def check_memory(configs: list[tuple[str, ModelConfig]], device, *, batch_size: int, dtype: str) -> None:
    """On a CPU, each configuration's training step against the RAM available now: a 10b model is one
    line before it is built, not an OOM kill (on a GPU an OOM row marks it and the sweep goes on)."""
    if device.type != "cpu":
        return
    from lmsys.model.memory import check_fits_in_ram

    for name, cfg in configs:
        check_fits_in_ram(cfg, batch_size=batch_size, dtype=dtype, what=f"--size {name}")


def fast_path(device, dtype: str) -> dict:
    """What `--fast` switches on. Measured on an H200 (docs/benchmarks/e2e.md): whole-model compile
    with SDPA inside the graph (small fp32 with TF32: 20.85 ms against plain compiled's 43.23 ms), and
    bf16 master weights (2.7b bf16 ablation: 173.0 -> 140.4 ms on top of fused AdamW). Not the optimizer
    in backward: the same ablation ("Issue 15") measured 96.31 ms without it, 97.54 with it and 96.46 on
    a side stream (the AdamW kernels queue behind the backward's matmuls), so it stays a switch for the
    memory it saves."""
    cuda = device.type == "cuda"
    options = {
        "attn_impl": "sdpa",
        "compile": "model" if cuda else "none",  # torch.compile on a CPU costs more than it saves here
        "optimizer": "adamw-fused",
        "master_weights": dtype == "bf16",
        "fused_ce": "auto",
        "tf32": cuda and dtype == "fp32",
    }
    return options


def step_options(device, dtype: str, *, fast: bool, attn: str | None, compile_scope: str | None,
                 optimizer: str, master_weights: bool, fused_ce: str, tf32: bool,
                 optimizer_in_backward: bool | None = None, optimizer_stream: bool | None = None,
                 sm_carveout: int | None = None) -> dict:
    """The command line's switches -> Workload fields (plus `attn_impl`): `--fast` first, then each
    explicit switch on top. optimizer 'auto' = fused AdamW on a GPU; fused_ce 'auto' | 'on' | 'off';
    optimizer_in_backward / optimizer_stream: None keeps what `--fast` chose (off without it);
    sm_carveout: SMs the backward's matmuls leave to the in-backward updates (None: all SMs to both)."""
    choose(fused_ce, ("auto", "on", "off"), what="--fused-ce")
    choose(optimizer, ("auto", "adamw", "adamw-fused"), what="--optimizer")
    # attn_impl None: each config's own (a preset's naive, or what its YAML says)
    options = fast_path(device, dtype) if fast else {"attn_impl": None, "compile": "none"}
    options["compile_from_fast"] = fast and compile_scope is None and options["compile"] != "none"
    if attn is not None:
        options["attn_impl"] = attn
    if compile_scope is not None:
        options["compile"] = compile_scope
    if optimizer != "auto":
        options["optimizer"] = optimizer
    options.setdefault("optimizer", default_kind(device))
    options["master_weights"] = master_weights or options.get("master_weights", False)
    options["fused_ce"] = {"on": True, "off": False}.get(fused_ce, options.get("fused_ce", "auto"))
    options["tf32"] = tf32 or options.get("tf32", False)
    for key, value in (("optimizer_in_backward", optimizer_in_backward), ("optimizer_stream", optimizer_stream)):
        options[key] = options.get(key, False) if value is None else value
    if optimizer_in_backward is False and optimizer_stream is None:
        options["optimizer_stream"] = False  # the side stream only exists for the in-backward updates
    if options["optimizer_stream"] and options["optimizer_in_backward"] and device.type != "cuda":
        raise LmsysError("--optimizer-stream needs a CUDA GPU (it overlaps the updates with the backward)")
    check_carveout(sm_carveout, device)
    options["sm_carveout"] = sm_carveout
    return options


def sweep_configs(sizes: list[str], *, context_lengths: list[int], heads: list[int | None], **overrides
                  ) -> list[tuple[str, ModelConfig]]:
    """(name, config) for every size x head count x context length (sizes outermost), each validated by
    `resolve_configs` with `overrides` (d_model, layers, attn_impl, model, ...) applied."""
    from lmsys.model.config import resolve_configs

    return [pair for name in sizes for h in heads for c in context_lengths
            for pair in resolve_configs([name], context_length=c, heads=h, **overrides)]


def resolve_workloads(configs: list[tuple[str, ModelConfig]], *, checkpoints: list[str],
                      batch_sizes: list[int] | None = None, variants: list[dict] | None = None, **options
                      ) -> list[tuple[str, Workload]]:
    """One Workload per (configuration, batch size, variant, checkpoint policy); `options` are Workload
    fields, `variants` Workload fields that differ between rows (dtype, sm_carveout) on top of them."""
    per_batch = [{"batch_size": b} for b in batch_sizes] if batch_sizes else [{}]
    out = []
    for name, cfg in configs:
        for batch in per_batch:
            for variant in variants or [{}]:
                fields = {**options, **batch, **variant}
                from_fast = fields.pop("compile_from_fast", False)
                fields = check_user_fast_path(cfg, fields, checkpoints, compile_from_fast=from_fast)
                for policy in checkpoints:  # Workload validates the policy
                    out.append((name, Workload(cfg, checkpoint=policy, **fields)))
    return out


# What a sweep can vary within one --size, as (column, value of a Workload): a column is shown when it does.
SWEPT = (
    ("heads", lambda w: w.config.num_heads),
    ("context", lambda w: w.config.context_length),
    ("batch", lambda w: w.batch_size),
    ("dtype", lambda w: w.dtype),
    ("sm carveout", lambda w: w.sm_carveout),
)


def swept_columns(workloads: list[tuple[str, Workload]]) -> list[str]:
    """The SWEPT columns that take more than one value for some --size (a different size's own head count
    is not a sweep)."""
    seen: dict[tuple[str, str], set] = {}
    for name, workload in workloads:
        for column, value in SWEPT:
            seen.setdefault((name, column), set()).add(value(workload))
    return [column for column, _ in SWEPT if any(len(seen.get((name, column), ())) > 1 for name, _ in workloads)]


def reference_workloads(workload: Workload) -> list[tuple[str, Workload]]:
    """The user's alternative: the plain model (naive attention, AdamW), eager and torch.compile'd."""
    plain = replace(workload, config=workload.config.with_overrides(attn_impl="naive"), compile="none",
                    cuda_graphs=False, optimizer="adamw", master_weights=False, fused_ce=False,
                    checkpoint="none", tf32=False,
                    optimizer_in_backward=False, optimizer_stream=False, sm_carveout=None)
    return [(PLAIN_EAGER, plain), (PLAIN_COMPILED, replace(plain, compile="model", optimizer="adamw-fused"))]


def lmsys_workloads(workload: Workload, device) -> list[tuple[str, Workload]]:
    """For a --model: lmsys's own TransformerLM at the same sizes, batch and dtype, eager (naive attention,
    AdamW) and on `--fast` (fast_path: sdpa, compile, fused AdamW, ...), so the user sees the gap."""
    from lmsys.model.user import is_user_model

    if not is_user_model(workload.config):
        return []
    mine = workload.config.with_overrides(model="lmsys", model_kwargs="")
    eager = replace(workload, config=mine.with_overrides(attn_impl="naive"), compile="none", cuda_graphs=False,
                    optimizer="adamw", master_weights=False, fused_ce=False, checkpoint="none", tf32=False,
                    optimizer_in_backward=False, optimizer_stream=False, sm_carveout=None)
    fast = fast_path(device, workload.dtype)
    fast = replace(eager, config=mine.with_overrides(attn_impl=fast.pop("attn_impl")), **fast)
    return [(LMSYS_EAGER, eager), (LMSYS_FAST, fast)]


def expand_modes(mode: str) -> list[str]:
    choose(mode, MODE_CHOICES, what="--mode")
    return list(MODES) if mode == "all" else [mode]


def numerics(workload: Workload) -> str:
    """How the step computes: fp32, autocast over fp32 weights (grad-scaled for fp16), or bf16 weights."""
    dtype = workload.dtype
    if dtype == "fp32":
        return "fp32"
    if workload.master_weights:
        return f"{dtype} weights + fp32 master"
    return f"{dtype} autocast, fp32 weights" + (", grad scaler" if dtype == "fp16" else "")


def describe_run(meta: dict, configs: list[tuple[str, ModelConfig]], workloads: list[tuple[str, Workload]], *,
                 warmup: int, steps: int, compare: bool, device=None) -> tuple[dict, list[str]]:
    """The meta lines and notes of a `bench e2e` report (added to `meta`, the environment). Swept values
    are listed where they vary: `context 128,256`, `batch 2,4`."""
    workload = workloads[0][1]
    by_name: dict[str, list[str]] = {}
    for name, cfg in configs:
        by_name.setdefault(name, []).append(describe(cfg))
    meta.update({name: _merge(lines) for name, lines in by_name.items()})
    batches = ",".join(map(str, dict.fromkeys(w.batch_size for _, w in workloads)))
    how = " | ".join(dict.fromkeys(numerics(w) for _, w in workloads))
    meta["run"] = f"batch {batches}, {how}, warmup {warmup}, steps {steps}"
    meta["lmsys path"] = " | ".join(dict.fromkeys(w.describe() for _, w in workloads))
    notes = [MFU_NOTE + (" (TF32 peak where TF32 is on)." if workload.tf32 else ".")]
    if compare:
        from lmsys.model.user import is_user_model

        user = any(is_user_model(w.config) for _, w in workloads)
        attention = "the model's own attention" if user else "naive attention"
        meta["plain eager"] = f"{attention}, torch.optim.AdamW (foreach), autocast as above"
        meta["plain compiled"] = f"torch.compile(model + loss), {attention}, torch.optim.AdamW(fused=True)"
        notes.append("× vs eager / × vs compiled: the reference's step time over this row's (same process, same data).")
        if user and device is not None:
            lm = [(p, w) for _, w0 in workloads[:1] for p, w in lmsys_workloads(w0, device)]
            for path, w in lm:
                meta[path] = f"lmsys's TransformerLM at the same sizes: {w.describe()}"
            notes.append("× vs lmsys --fast: lmsys's own model on --fast at the same sizes, its step time over this "
                         "row's (below 1: this row is that many times lmsys's speed).")
    return meta, notes


def _merge(lines: list[str]) -> str:
    """Descriptions of one size's swept configs as one: the words that differ listed with commas
    ("4 heads" and "8 heads" -> "4,8 heads"); descriptions of another shape are joined whole."""
    lines = list(dict.fromkeys(lines))
    words = [line.split(" ") for line in lines]
    if len({len(w) for w in words}) != 1:
        return " | ".join(lines)
    merged = []
    for column in zip(*words):
        comma = "," if all(w.endswith(",") for w in column) else ""
        merged.append(",".join(dict.fromkeys(w.removesuffix(comma) for w in column)) + comma)
    return " ".join(merged)


def run_e2e(workloads: list[tuple[str, Workload]], *, modes: list[str], warmup: int, steps: int, device,
            compare: bool = False, peak_tflops: float | None = None) -> Iterator[dict]:
    """Yield rows per (workload, path, mode). With `compare`, the plain references run first, once per
    model configuration (checkpoint policies share them), and lmsys rows carry the speed-ups.
    `peak_tflops`: the peak MFU divides by (default: the GPU table's; a GPU it lacks: no MFU)."""
    from lmsys.model.user import is_user_model
    from lmsys.train.build import count_parameters

    show_checkpoint = any(w.checkpoint != "none" for _, w in workloads)
    swept = swept_columns(workloads)
    references: dict = {}  # (name, config, batch, dtype) -> reference rows
    for name, workload in workloads:
        params = count_parameters(workload.config)
        measure = dict(modes=modes, warmup=warmup, steps=steps, device=device, peak_tflops=peak_tflops)
        group: list[dict] = []
        ref_key = (name, workload.config, workload.batch_size, workload.dtype)
        if compare and ref_key not in references:
            references[ref_key] = [
                _ident(name, path, ref if show_checkpoint else None, swept=swept, of=workload) | row
                for path, ref in reference_workloads(workload) + lmsys_workloads(workload, device)
                for row in _measure_or_oom(ref, params if path.startswith("plain") else
                                           count_parameters(ref.config), **measure)
            ]
            group += references[ref_key]
        for row in _measure_or_oom(workload, params, **measure):
            mine = "your model" if is_user_model(workload.config) else "lmsys"  # beside lmsys's own rows
            group.append(_ident(name, mine if compare else None, workload if show_checkpoint else None,
                                swept=swept, of=workload) | row)
        if compare:
            _add_speedups(group, references[ref_key])
        yield from group


def _ident(name: str, path: str | None, workload: Workload | None, *, swept: list[str] = (),
           of: Workload | None = None) -> dict:
    """The columns naming a row: size, the swept values of `of` (the lmsys workload: a reference row
    carries its batch and shape), the path, the checkpoint policy of `workload`."""
    ident = {"size": name}
    for column, value in SWEPT:
        if column in swept:
            ident[column] = value(of)
    if path is not None:
        ident["path"] = path
    if workload is not None:
        ident["checkpoint"] = workload.checkpoint
    return ident


def _measure_or_oom(workload, params, **kw) -> list[dict]:
    from lmsys.core.devices import free_memory, is_oom, oom_row

    rows: list[dict] = []
    try:
        for row in _measure_config(workload, params, **kw):
            rows.append(row)
    except Exception as exc:  # noqa: BLE001 - OOM and user-level errors mark the row; bugs propagate
        if is_oom(exc):
            status = "OOM"
        elif isinstance(exc, LmsysError):
            status = f"error: {exc.message}"
        else:
            raise
        done = {r["mode"] for r in rows}
        rows += [oom_row(status, mode=m, params=params) for m in kw["modes"] if m not in done]
    free_memory(kw["device"])
    return rows


def _measure_config(workload: Workload, params: int, *, modes, warmup, steps, device, peak_tflops=None):
    from lmsys.core.devices import peak_tflops as _peak
    from lmsys.train.build import build_train_step, tf32_matmuls

    given_peak, peak_tflops = peak_tflops, _peak
    from lmsys.train.step import random_batch

    cfg = workload.config
    with tf32_matmuls(workload.tf32):
        step = build_train_step(workload, device)
        inputs, targets = random_batch(workload, device)
        peak = peak_tflops(device, workload.dtype, tf32=workload.tf32, given=given_peak)
        if workload.compile != "none":  # one untimed step compiles, said on stderr with its seconds
            with progress.announced(f"compiling {_compile_scope(workload)} (torch.compile, first step)"):
                from lmsys.train.step import run_step

                run_step(step, inputs, targets, mode=modes[0])
                synchronize(device)
        for mode in modes:
            timer, peaks, last_loss = timed_steps(step, inputs, targets, mode=mode, warmup=warmup, steps=steps,
                                                  device=device)
            peak_fwd, peak_step = peaks["fwd"], peaks["step"]
            stats = timer.stats()
            step_ms = stats["step"].mean
            from lmsys.model.user import model_flops

            flops = model_flops(cfg, batch_size=workload.batch_size, seq_len=cfg.context_length,
                                backward=mode != "fwd")
            util = mfu(flops, step_ms, peak)
            yield {
                "mode": mode,
                "params": params,
                "forward ms": _cell(stats.get("forward")),
                "backward ms": _cell(stats.get("backward")),
                "optimizer ms": _cell(stats.get("optimizer")),
                "ms/step": _cell(stats["step"]),
                "tokens/s": workload.tokens / (step_ms * 1e-3),
                "MFU %": None if util is None else 100 * util,
                "peak fwd MiB": None if peak_fwd is None else peak_fwd / MiB,
                "peak step MiB": None if peak_step is None else peak_step / MiB,
                "loss": float(last_loss),
                "status": "ok" if math.isfinite(float(last_loss)) else NON_FINITE_LOSS,
            }


def _compile_scope(workload: Workload) -> str:
    """What torch.compile compiles in `workload`, for the stderr line: 'each of 48 blocks (transformer.h: ...)'."""
    from lmsys.model.user import blocks_of, is_user_model

    name = workload.config.model if is_user_model(workload.config) else "lmsys's model"
    if workload.compile == "blocks":
        where = blocks_of(workload.config) if is_user_model(workload.config) else \
            f"layers: {workload.config.num_layers} × Block"
        return f"each block of {name} ({where})"
    return f"{name} and its loss whole"


def timed_steps(step, inputs, targets, *, mode: str, warmup: int, steps: int, device):
    """`warmup` untimed then `steps` timed steps of `mode` on one batch (lmsys.train.loop's timed_loop):
    (the RegionTimer, the peak memory after the forward and over the step, the last loss). Nothing
    synchronises inside or between steps; the peaks are the timed steps' (each resets it first)."""
    from lmsys.core.devices import peak_memory, reset_peak_memory
    from lmsys.train.loop import timed_loop

    peaks = {"fwd": None, "step": None}

    def record(key):
        peaks[key] = _max(peaks[key], peak_memory(device))

    timed = dict(before=lambda: reset_peak_memory(device), after_forward=lambda: record("fwd"))
    losses: list = []
    timer = timed_loop(step, [(inputs, targets)] * (warmup + steps), warmup=warmup, device=device, mode=mode,
                       hooks=lambda i: timed if i >= warmup else {},
                       after_step=lambda i: record("step") if i >= warmup else None, losses=losses,
                       label=f"{mode} steps")
    return timer, peaks, losses[-1] if steps else None


def _add_speedups(group: list[dict], references: list[dict]) -> None:
    """× over the plain references: their step time divided by this row's, mode by mode."""
    ref_ms = {(r["path"], r["mode"]): r["ms/step"].mean for r in references if r["status"] == "ok"}
    for r in group:
        mine = r["ms/step"].mean if r["status"] == "ok" else None
        columns = [(PLAIN_EAGER, "× vs eager"), (PLAIN_COMPILED, "× vs compiled")]
        if any(ref["path"] == LMSYS_FAST for ref in references):
            columns.append((LMSYS_FAST, "× vs lmsys --fast"))
        for ref, col in columns:
            base = ref_ms.get((ref, r["mode"]))
            r[col] = base / mine if (base and mine) else None
        r["status"] = r.pop("status")  # keep status the last column


def _cell(stats) -> MeanStd | None:
    return None if stats is None else MeanStd(stats.mean, stats.std, stats.median)


def _max(a, b):
    if b is None:
        return a
    return b if a is None else max(a, b)


# ------------------------------------------------------------------------------------- the command's


@dataclass
class E2ERun:
    """What `bench e2e` runs, its options checked (`resolve`)."""

    configs: list
    workloads: list
    modes: list[str]
    warmup: int
    steps: int
    device: object
    compare: bool
    peak_tflops: float | None


def resolve(*, size, d_model, d_ff, layers, heads, context_length: str, batch_size: str, vocab_size, mode: str,
            warmup: int, steps: int, dtype: str, peak_tflops, attn, compile: bool, compile_blocks: bool,
            cuda_graphs: bool, optimizer: str, master_weights: bool, fused_ce: str, tf32: bool,
            optimizer_in_backward, optimizer_stream, sm_carveout, checkpoint: str, fast: bool, model, model_kwargs,
            compare: bool, device: str) -> E2ERun:
    """Every option of `bench e2e` checked: the torch-free ones first (a typo answers before torch loads),
    then the device, each dtype and attention on it (lmsys.kernels.requirements: what this device and install
    run), the workloads and their memory."""
    from lmsys.core.hardware import check_peak
    from lmsys.core.parsing import check_counts, check_dtypes, parse_int_list, parse_list
    from lmsys.kernels.registry import check_name
    from lmsys.kernels.requirements import check_attention_impl, require_triton
    from lmsys.model.user import check_model, is_lmsys_model, parse_model_kwargs

    check_peak(peak_tflops)
    check_counts(warmup=(warmup, 0), steps=(steps, 1))
    dtypes = check_dtypes(dtype)
    batch_sizes = parse_int_list(batch_size, what="--batch-size")
    context_lengths = parse_int_list(context_length, what="--context-length")
    head_counts = parse_int_list(heads, what="--heads") if heads is not None else [None]
    carveouts = parse_int_list(sm_carveout, what="--sm-carveout", minimum=0) if sm_carveout is not None else [None]
    if compile and compile_blocks:
        raise LmsysError("--compile and --compile-blocks are exclusive: pick one scope")
    if attn is not None:
        check_name(attn, what="--impl")
    model = check_model(model) if model else None
    if attn is not None and not is_lmsys_model(model):
        raise LmsysError(f"--impl picks the attention inside lmsys's model; --model {model} runs its own "
                         "(leave --impl out)")
    kwargs_json = parse_model_kwargs(model_kwargs)

    from lmsys.core.devices import check_dtype_for_device, resolve_device
    from lmsys.model.config import default_size
    modes = expand_modes(mode)
    dev = resolve_device(device)
    for one in dtypes:
        check_dtype_for_device(one, dev)
    variants = [{"dtype": one, **step_options(
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
    configs = sweep_configs(sizes, context_lengths=context_lengths, heads=head_counts, vocab_size=vocab_size,
                            d_model=d_model, d_ff=d_ff, layers=layers, attn_impl=attn_impl, model=model,
                            model_kwargs=kwargs_json)
    for _, cfg in configs:  # a YAML's own attn_impl, checked as --impl is
        check_attention_impl(cfg.attn_impl, dev)
    workloads = resolve_workloads(configs, checkpoints=parse_list(checkpoint, str, what="--checkpoint"),
                                  batch_sizes=batch_sizes, variants=variants, cuda_graphs=cuda_graphs)
    for one in dtypes:
        check_memory(configs, dev, batch_size=max(batch_sizes), dtype=one)
    return E2ERun(configs=configs, workloads=workloads, modes=modes, warmup=warmup, steps=steps, device=dev,
                  compare=compare, peak_tflops=peak_tflops)


def e2e_report(run: E2ERun):
    """`bench e2e`: every workload in every mode (under the progress display), one Report."""
    from lmsys.core.devices import environment
    from lmsys.core.results import Report

    per_workload = len(run.modes) * (3 if run.compare else 1)
    rows = list(progress.rows(
        run_e2e(run.workloads, modes=run.modes, warmup=run.warmup, steps=run.steps, device=run.device,
                compare=run.compare, peak_tflops=run.peak_tflops),
        total=len(run.workloads) * per_workload, description="bench e2e"))
    meta, notes = describe_run(environment(run.device, peak_tflops=run.peak_tflops), run.configs, run.workloads,
                               warmup=run.warmup, steps=run.steps, compare=run.compare, device=run.device)
    return Report("bench e2e", rows, meta, notes)
