"""Per-GPU memory of a training step: weights, gradients, optimizer state, activations, buffers.

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", section 4): the tensors each block keeps for its backward, counted one by one (`saved_tensors`),
so the paper's standard GPT block gives exactly sbh(34 + 5as/h) bytes (16-bit activations, 1-byte dropout
masks), sbh(10 + 24/t + 5as/(ht)) with tensor parallelism, sbh(34/t + 5as/(ht)) with sequence
parallelism, 34sbh/t with selective recomputation and 2sbh (/t with SP) with full recomputation.
lmsys's block (SwiGLU, RMSNorm, RoPE, no dropout or biases) is the same count over its own tensors: the
MLP keeps gate, up, silu(gate) and their product (4·sbf instead of GeLU's 2·sbf), K and V are kv_dim
wide, no masks; flash attention keeps the log-sum-exp (fp32, a·s·b) instead of the s×s probabilities.
Under autocast the residual stream and the norms' inputs are fp32.

Pipeline schedules set the microbatches in flight on the first stage (Narayanan et al. 2021; Korthikanti
section 4.2.3): GPipe m, 1F1B min(p, m), interleaved with v chunks L·(1 + (p-1)/(p·v)) layers' worth.
ZeRO (Rajbhandari et al. 2020) shards optimizer state (stage 1), gradients (2) and weights (3, = FSDP)
over the data-parallel group. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lmsys.core.errors import LmsysError
from lmsys.plan.shape import ModelShape, layer_matmul_params, layer_params, norm_params

GiB = 2**30
SCHEDULES = ("none", "1f1b", "interleaved", "gpipe")
CHECKPOINTS = ("none", "selective", "full")  # what plan train's search tries
# every recomputation the model knows: also "op", torchtitan's selective op checkpointing (the block's
# matmul outputs saved every other one, its flash attention's output saved, everything else recomputed);
# given with --mesh checkpoint=op or by a published run
CHECKPOINT_KINDS = (*CHECKPOINTS, "op")
DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket; two in flight (one reducing, one filling)
RESERVE_BYTES = 1 * GiB  # CUDA context, NCCL communicators ...
RESERVE_FRACTION = 0.05  # ... and the caching allocator's fragmentation, of the GPU's memory


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of state."""

    name: str
    act: int  # activations in the compute dtype
    residual: int  # the residual stream and the norms' inputs
    weight: int
    grad: int
    optimizer: int  # fp32 master copy (if any) + AdamW's two moments
    cast: int  # bytes per element of the low-precision weight copies autocast keeps from forward to backward
    gather: int = 0  # bytes per element a ZeRO-3 all-gather moves and holds (0: `weight`)

    @property
    def gathered(self) -> int:
        return self.gather or self.weight

    @property
    def state(self) -> int:
        return self.weight + self.grad + self.optimizer


PRECISIONS = {
    "fp32": Precision("fp32", act=4, residual=4, weight=4, grad=4, optimizer=8, cast=0),
    # fp32 weights, gradients and moments; matmuls in 16 bits (lmsys's default for bf16 / fp16)
    "autocast": Precision("autocast", act=2, residual=4, weight=4, grad=4, optimizer=8, cast=2),
    # 16-bit weights, fp32 gradient accumulation, fp32 master + moments (Megatron's mixed precision; 18 B/param)
    "master": Precision("master", act=2, residual=2, weight=2, grad=4, optimizer=12, cast=0),
    # FSDP's mixed precision (torch FSDP / FSDP2 with a bf16 param dtype, fp32 reduce): fp32 sharded weights
    # (the master copy), fp32 gradients and moments, gathered in 16 bits for compute; no autocast cache
    "fsdp": Precision("fsdp", act=2, residual=2, weight=4, grad=4, optimizer=8, cast=0, gather=2),
}


def precision(dtype: str, *, master_weights: bool) -> Precision:
    if dtype == "fp32":
        return PRECISIONS["fp32"]
    return PRECISIONS["master" if master_weights else "autocast"]


FSDP_KINDS = ("flat-param", "fsdp2")  # ZeRO-3 gathered into a flat buffer (FSDP1, DeepSpeed, lmsys) or per parameter


@dataclass(frozen=True)
class Layout:
    """How the step is spread: the mesh, ZeRO stage, sequence parallelism, pipeline schedule and
    microbatches (per pipeline, per step), micro-batch size (sequences) and recomputation."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0  # 0..3; 3 = FSDP
    sp: bool = False
    schedule: str = "none"
    chunks: int = 1  # model chunks per GPU (interleaved schedule)
    micro_batch: int = 1
    microbatches: int = 1
    checkpoint: str = "none"
    # ZeRO-3's implementation (FSDP_KINDS): "flat-param" gathers into one buffer the parameters are views of
    # (torch FSDP1's FlatParameter, DeepSpeed, lmsys); "fsdp2" (torch fully_shard) gathers per parameter and
    # copies on the compute stream
    fsdp: str = "flat-param"

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def global_batch(self) -> int:
        return self.dp * self.micro_batch * self.microbatches

    def describe(self) -> str:
        return f"dp{self.dp} tp{self.tp} pp{self.pp}"


def check_layout(m: ModelShape, lay: Layout) -> None:
    """The degrees must divide the model: one line naming each that does not."""
    bad = []
    for what, size, deg in (("heads", m.heads, lay.tp), ("kv heads", m.kv_heads, lay.tp),
                            ("d_ff", m.d_ff, lay.tp), ("vocabulary", m.vocab, lay.tp),
                            ("layers", m.layers, lay.pp * lay.chunks)):
        if size % deg:
            dim = "tp" if what != "layers" else ("pp" if lay.chunks == 1 else "pp × chunks")
            bad.append(f"{dim}={deg} does not divide {what} ({size})")
    if lay.sp and m.seq % lay.tp:
        bad.append(f"sequence parallelism: tp={lay.tp} does not divide the sequence ({m.seq})")
    if lay.sp and lay.tp == 1:
        bad.append("sequence parallelism needs tp > 1")
    if lay.zero not in (0, 1, 2, 3):
        bad.append(f"ZeRO stage {lay.zero} is not 0, 1, 2 or 3")
    if lay.fsdp not in FSDP_KINDS:
        bad.append(f"FSDP implementation {lay.fsdp!r} is not one of {', '.join(FSDP_KINDS)}")
    elif lay.fsdp != FSDP_KINDS[0] and lay.zero < 3:
        bad.append(f"fsdp={lay.fsdp} shards the weights: it needs zero=3, not {lay.zero}")
    # pp = 1: 'none' runs each micro-batch's forward and backward in turn (gradient accumulation, 1F1B's
    # order on one stage); 'gpipe' runs every forward before the first backward (parallel train's gpipe)
    if lay.schedule not in SCHEDULES or (lay.pp > 1 and lay.schedule == "none") or \
            (lay.pp == 1 and lay.schedule not in ("none", "gpipe")):
        bad.append(f"schedule {lay.schedule!r} with pp={lay.pp} (one of {', '.join(SCHEDULES[1:])} with pp > 1, "
                   "none or gpipe with pp = 1)")
    if lay.checkpoint not in CHECKPOINT_KINDS:
        bad.append(f"checkpoint {lay.checkpoint!r} is not one of {', '.join(CHECKPOINT_KINDS)}")
    if lay.schedule == "interleaved" and lay.microbatches % lay.pp:
        bad.append(f"interleaved schedule: pp={lay.pp} does not divide the microbatches ({lay.microbatches})")
    if bad:
        raise LmsysError(f"{m.name} on {lay.describe()}: " + "; ".join(bad))


# ---------------------------------------------------------------------------------------- activations

@dataclass(frozen=True)
class Saved:
    """One tensor a block keeps for its backward."""

    name: str
    elements: int
    nbytes: int  # per element
    region: str  # 'tp': split by tensor parallelism; 'seq': split only with sequence parallelism
    core: bool = False  # attention's core (QKᵀ, softmax, dropout, ·V): what selective recomputation drops


def saved_tensors(m: ModelShape, *, b: int, prec: Precision, device: str = "cuda", fused: bool = False) -> list[Saved]:
    """Every tensor one block keeps, for a micro-batch of b sequences, without parallelism.

    lmsys's own choices, each found by counting what autograd saves (saved_tensors_hooks, one count per
    storage; tests/test_plan_phases.py): its RMSNorm computes in fp32 and keeps its fp32 input and
    x·rsqrt(mean x²) besides the output the next matmul keeps (`norm == "rms"`; a fused LayerNorm keeps its
    input only); under autocast each of SwiGLU's two input matmuls casts the fp32 normed input itself (two
    copies kept); naive attention keeps the s×s causal mask (bytes, once per block), K and V repeated to
    every head with grouped-query attention and, at b = 1 without it, V as a view of the whole QKV output
    (its reshape for the batched matmul needs no copy then). CUDA's autocast
    runs softmax in fp32 (its output kept, then a cast for ·V); the CPU's keeps the compute dtype
    (`device`).

    `fused`: a compiled or fused stack (torch.compile's min-cut partitioner, Megatron's fused kernels) keeps
    what its fused kernels need and recomputes cheap elementwise results in the backward: a norm keeps its
    input in the compute dtype (and per-row statistics, negligible), SwiGLU keeps gate and up only (silu and
    the product are recomputed from them)."""
    s, h, f, a = m.seq, m.d_model, m.d_ff, m.heads
    sbh, sbk, sbf, ass = s * b * h, s * b * m.kv_dim, s * b * f, a * s * s * b
    act = prec.act
    out = _norm_saved(m, sbh, prec, "attention", fused=fused) + [Saved("QKV input", sbh, act, "seq"),
                                                                 Saved("Q", sbh, act, "tp")]
    if m.attention == "naive" and m.kv_heads != m.heads:  # K and V repeated to every head before the matmuls
        out += [Saved("K, repeated", sbh, act, "tp"), Saved("V, repeated", sbh, act, "tp")]
    elif m.attention == "naive" and b == 1:  # the view keeps Q, K and V before RoPE
        out += [Saved("K", sbk, act, "tp"), Saved("V (a view of the QKV output)", s * b * (h + 2 * m.kv_dim), act, "tp")]
    else:
        out += [Saved("K", sbk, act, "tp"), Saved("V", sbk, act, "tp")]
    if m.attention == "flash":
        out.append(Saved("log-sum-exp", a * s * b, 4, "tp", core=True))
    elif m.attention == "naive":  # softmax in fp32 under CUDA's autocast, then cast for the ·V matmul
        out.append(Saved("causal mask", s * s, 1, "rep", core=True))
        if act != 4 and device == "cuda":
            out += [Saved("softmax output", ass, 4, "tp", core=True),
                    Saved("softmax output cast", ass, act, "tp", core=True)]
        else:
            out.append(Saved("softmax output", ass, act, "tp", core=True))
    else:
        out.append(Saved("softmax output", ass, act, "tp", core=True))
        if m.dropout:
            out += [Saved("attention dropout mask", ass, 1, "tp", core=True),
                    Saved("attention dropout output", ass, act, "tp", core=True)]
    out.append(Saved("output projection input", sbh, act, "tp"))
    if m.dropout:
        out.append(Saved("attention block dropout mask", sbh, 1, "seq"))
    out += _norm_saved(m, sbh, prec, "MLP", fused=fused) + [Saved("MLP input", sbh, act, "seq")]
    if m.mlp == "gelu":
        out += [Saved("GeLU input", sbf, act, "tp"), Saved("MLP output projection input", sbf, act, "tp")]
    else:
        if prec.cast:
            out.append(Saved("MLP input, second cast", sbh, act, "seq"))
        out += [Saved("gate", sbf, act, "tp"), Saved("up", sbf, act, "tp")]
        if not fused:
            out += [Saved("silu(gate)", sbf, act, "tp"), Saved("MLP output projection input", sbf, act, "tp")]
    if m.dropout:
        out.append(Saved("MLP dropout mask", sbh, 1, "seq"))
    return out


def _norm_saved(m: ModelShape, sbh: int, prec: Precision, where: str, *, fused: bool = False) -> list[Saved]:
    """What a norm keeps besides its output: a fused LayerNorm its input; lmsys's RMSNorm (fp32 math) its
    input in fp32 and the normalized x·rsqrt(mean x²) in fp32; a low-precision norm (MPT's
    low_precision_layernorm: cast to the compute dtype first) its input in the compute dtype."""
    if fused or m.fused_norm:  # a fused kernel keeps its input (and per-row statistics, negligible)
        return [Saved(f"{where} norm input", sbh, prec.act, "seq")]
    if m.norm == "rms" and not m.low_precision_norm:
        return [Saved(f"{where} norm input (fp32)", sbh, 4, "seq"), Saved(f"{where} norm x·rsqrt", sbh, 4, "seq")]
    return [Saved(f"{where} norm input", sbh, prec.act if m.low_precision_norm else prec.residual, "seq")]


def _split(t: Saved, lay: Layout) -> float:
    if t.region == "rep":  # the same on every tensor-parallel rank
        return t.elements * t.nbytes
    return t.elements * t.nbytes / (lay.tp if (t.region == "tp" or lay.sp) else 1)


def layer_activation_bytes(m: ModelShape, lay: Layout, prec: Precision, *, checkpoint: str | None = None,
                           device: str = "cuda", fused: bool = False) -> float:
    """Bytes one block keeps for one micro-batch on one GPU, under `checkpoint` (default: the layout's)."""
    checkpoint = lay.checkpoint if checkpoint is None else checkpoint
    if checkpoint == "full":  # only the block's input
        return m.seq * lay.micro_batch * m.d_model * prec.residual / (lay.tp if lay.sp else 1)
    if checkpoint == "op":
        return sum(_split(t, lay) for t in op_saved(m, b=lay.micro_batch, prec=prec))
    return sum(_split(t, lay) for t in saved_tensors(m, b=lay.micro_batch, prec=prec, device=device, fused=fused)
               if not (checkpoint == "selective" and t.core))


def op_matmuls(m: ModelShape) -> list[tuple[str, int, int]]:
    """(name, K, N) of a block's matmuls in the order torchtitan's Llama runs them (wq, wk, wv apart, the
    output, then the MLP's); selective op checkpointing saves the outputs of the 1st, 3rd, 5th ... and
    recomputes the others."""
    h, kv, f = m.d_model, m.kv_dim, m.d_ff
    mlp = [("MLP gate", h, f), ("MLP up", h, f), ("MLP out", f, h)] if m.mlp == "swiglu" else \
        [("MLP in", h, f), ("MLP out", f, h)]
    return [("Q", h, h), ("K", h, kv), ("V", h, kv), ("attention out", h, h), *mlp]


def op_saved(m: ModelShape, *, b: int, prec: Precision) -> list[Saved]:
    """What one block keeps under selective op checkpointing: its input (the checkpoint's), every other
    matmul's output, and the flash kernel's output and log-sum-exp (attention is never recomputed)."""
    s, h = m.seq, m.d_model
    out = [Saved("block input", s * b * h, prec.residual, "seq")]
    for i, (name, _, n) in enumerate(op_matmuls(m)):
        if i % 2 == 0:
            out.append(Saved(f"{name} output", s * b * n, prec.act, "tp" if n != h or name == "Q" else "seq"))
    out += [Saved("attention output", s * b * h, prec.act, "tp"), Saved("log-sum-exp", m.heads * s * b, 4, "tp")]
    return out


def block_backward_transient(m: ModelShape, lay: Layout, prec: Precision, *, device: str = "cuda",
                             fused: bool = False) -> float:
    """Bytes a block's backward holds beyond its saved tensors and its gradients: the incoming gradient of
    the residual stream and, at the largest saved tensor, its gradient and its input's (the attention
    scores' at this context: the gradients of the probabilities and of the scores)."""
    largest = max(_split(t, lay) for t in saved_tensors(m, b=lay.micro_batch, prec=prec, device=device, fused=fused))
    return m.seq * lay.micro_batch * m.d_model * prec.residual / (lay.tp if lay.sp else 1) + 2 * largest


def korthikanti(*, s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False, recompute: str = "none") -> float:
    """The paper's per-layer activation bytes (Table 2) for the standard GPT block, 16-bit activations."""
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    core = 0 if recompute == "selective" else 5 * a * s / h
    if sp:
        return s * b * h * (34 / t + core / t)
    return s * b * h * (10 + 24 / t + core / t)


def in_flight(lay: Layout, *, stage: str) -> float:
    """Microbatches whose activations a stage holds at its peak ('first' or 'last' stage), as a multiple of
    its own layers' activations (the interleaved schedule's first stage holds extra chunks)."""
    m, p, v = lay.microbatches, lay.pp, lay.chunks
    if lay.schedule == "none":
        return 1
    if lay.schedule == "gpipe":
        return m
    if stage == "last":
        return 1
    if lay.schedule == "interleaved":
        return p * (1 + (p - 1) / (p * v)) if m >= p else min(m, p)
    return min(p, m)


# ------------------------------------------------------------------------------------------ breakdown

@dataclass
class Memory:
    """Bytes per GPU on its fullest pipeline stage, at the phase of the step where they peak (`phase`):
    weights and optimizer state always; the gradients that exist then (none at the end of a step's first
    forward, all of them at its optimizer step); the activations alive then (saved tensors, autocast's
    weight copies, the phase's transient buffers); communication buffers and library workspaces.
    `parts` holds the terms behind the sums, every phase's total among them."""

    stage: str
    weights: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    capacity: float
    parts: dict = field(default_factory=dict)  # the terms behind the sums, for tests and --format json
    phase: str = "backward start"

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.buffers

    @property
    def reserve(self) -> float:
        return RESERVE_BYTES + RESERVE_FRACTION * self.capacity

    @property
    def headroom(self) -> float:
        return self.capacity - self.reserve - self.total

    def overflow(self) -> str:
        """What fills the GPU, for the error of a layout that does not fit."""
        terms = ", ".join(f"{k} {v / GiB:.1f}" for k, v in (("weights", self.weights), ("gradients", self.grads),
                          ("optimizer", self.optimizer), ("activations", self.activations),
                          ("buffers", self.buffers), ("reserve", self.reserve)))
        return (f"needs {(self.total + self.reserve) / GiB:.1f} GiB per GPU on its {self.stage} stage at its "
                f"{self.phase}, {-self.headroom / GiB:.1f} GiB over the {self.capacity / GiB:.1f} GiB it has "
                f"({terms} GiB)")


def stage_params(m: ModelShape, lay: Layout, *, first: bool, last: bool) -> float:
    """Parameters one GPU of a pipeline stage holds before ZeRO-3 sharding. Matmul weights, embedding and
    LM head (vocabulary-parallel) and column-parallel biases are split by tp; norms, row-parallel biases
    and learned positions are replicated. A tied head is the embedding when one stage holds both;
    across stages the last keeps a copy (as Megatron-LM does)."""
    t, h = lay.tp, m.d_model
    row_bias = 2 * h if m.bias else 0  # attention output and MLP output biases
    per_layer = (layer_params(m) - 2 * norm_params(m) - row_bias) / t + 2 * norm_params(m) + row_bias
    total = m.layers / lay.pp * per_layer
    if first:
        total += m.vocab * h / t + (m.seq * h if m.learned_positions else 0)
    if last:
        total += norm_params(m) + (0 if (m.tied and first) else m.vocab * h / t)
    return total


def cast_params(m: ModelShape, lay: Layout, *, last: bool) -> tuple[float, float]:
    """(block, head) parameters one GPU of a stage hands autocast to cast to the compute dtype: the
    matmul weights (split by tp); the embedding is looked up and the norms run in fp32, uncast."""
    return m.layers / lay.pp * layer_matmul_params(m) / lay.tp, (m.vocab * m.d_model / lay.tp if last else 0.0)


def autocast_copies(m: ModelShape, lay: Layout, prec: Precision, *, stage: str) -> float:
    """Bytes of the compute-dtype weight copies autocast makes of fp32 weights (`prec.cast` bytes each) that
    are alive at the end of the stage's forward. Autocast caches a leaf weight's cast within one autocast
    region (a micro-batch's forward) and the matmul saves it for the backward: one copy of the stage's
    weights per micro-batch whose backward is pending, the `in_flight` count of the activations (1 with
    sequential accumulation, m with GPipe). Full recomputation saves no block's copy: the blocks' copies
    live in the cache until the forward ends (one copy, of the micro-batch being run), the head's are saved
    per micro-batch in flight. ZeRO-3: the shard's."""
    per_mb, cached = _casts(m, lay, prec, stage=stage)
    return in_flight(lay, stage="last" if stage == "last" else "first") * per_mb + cached


def _casts(m: ModelShape, lay: Layout, prec: Precision, *, stage: str) -> tuple[float, float]:
    """(copies saved per micro-batch, copies only autocast's cache holds until a forward ends), bytes."""
    if not prec.cast:
        return 0.0, 0.0
    blocks, head = cast_params(m, lay, last=stage in ("last", "only"))
    shard = prec.cast / (lay.dp if lay.zero >= 3 else 1)
    if lay.checkpoint == "full":
        return head * shard, blocks * shard
    return (blocks + head) * shard, 0.0


CUBLAS_WORKSPACE_BYTES = 2 * (32 + 1) * 2**20
"""cuBLAS's workspaces, allocated by PyTorch through its caching allocator once per (handle, stream): on
Hopper 32 MiB for cuBLAS and 1 MiB for cuBLASLt (torch's defaults), one handle for the forward's thread and
one for the autograd engine's (the backward's); other GPUs default to 8.1 MiB, a 50 MiB difference."""


def memory(m: ModelShape, lay: Layout, prec: Precision, *, capacity: float, device: str = "cuda",
           fused: bool = False) -> Memory:
    """The per-GPU breakdown of the fuller of the first and last pipeline stages, at its peak phase.
    `device`: "cuda" (the default: CUDA autocast's fp32 softmax, cuBLAS's workspaces) or "cpu"; `fused`: a
    compiled or fused stack's saved tensors (`saved_tensors`), default lmsys's eager block."""
    check_layout(m, lay)
    stages = ("only",) if lay.pp == 1 else ("first", "last")
    return max((_stage_memory(m, lay, prec, capacity=capacity, stage=st, device=device, fused=fused)
                for st in stages),
               key=lambda x: x.total)


def _stage_memory(m: ModelShape, lay: Layout, prec: Precision, *, capacity: float, stage: str,
                  device: str = "cuda", fused: bool = False) -> Memory:
    """The stage's bytes at each phase of a step; the largest is its peak.

    - forward: at the end of the forward that brings the stage to its most micro-batches in flight:
      weights, optimizer state, the gradients of the micro-batches already done (all of them once a
      backward has run before it: sequential accumulation's later micro-batches, 1F1B's steady state;
      none at a step's first forward, GPipe's), the saved activations of the micro-batches in flight,
      autocast's copies (the cached ones included) and, on the last stage, the loss's logits and their
      fp32 copy;
    - backward start: the same with autocast's cache gone, plus the larger of the loss's backward (two fp32
      gradients of the logits) and the last block's (the head's gradients, that block's transient
      buffers, its recomputed activations under recomputation) less what the head kept;
    - backward end: every gradient, the other micro-batches in flight, and the first block's backward (its
      activations, recomputed or kept, its weight copies and its transient) less its own gradients and the
      embedding's, which do not exist yet;
    - optimizer: weights, gradients and state (fused AdamW: no temporaries).
    Communication buffers (and on CUDA, cuBLAS's workspaces) are added to every phase."""
    first, last = stage in ("first", "only"), stage in ("last", "only")
    n = stage_params(m, lay, first=first, last=last)
    dp, z = lay.dp, lay.zero
    weights = n * prec.weight / (dp if z >= 3 else 1)
    grads = n * prec.grad / (dp if z >= 2 else 1)
    optimizer = n * prec.optimizer / (dp if z >= 1 else 1)
    grad_of = prec.grad / (dp if z >= 2 else 1)  # gradient bytes per parameter on this GPU
    s, b, h, t = m.seq, lay.micro_batch, m.d_model, lay.tp
    sp_split = t if lay.sp else 1
    layers = m.layers / lay.pp
    per_layer = layer_activation_bytes(m, lay, prec, device=device, fused=fused)
    full_layer = layer_activation_bytes(m, lay, prec, checkpoint="none", device=device, fused=fused)
    transient = block_backward_transient(m, lay, prec, device=device, fused=fused)
    flight = in_flight(lay, stage="last" if stage == "last" else "first")
    held = lay.microbatches > flight  # a backward ran before the stage held its most micro-batches
    cast_mb, cast_cached = _casts(m, lay, prec, stage=stage)
    cast_layer = (cast_params(m, lay, last=False)[0] / layers * prec.cast / (dp if z >= 3 else 1)
                  if prec.cast else 0.0)
    working = 0.0  # what the block being recomputed adds in its backward
    if lay.checkpoint == "full":
        working = full_layer + cast_layer
    elif lay.checkpoint in ("selective", "op"):
        working = full_layer - per_layer

    head_saved = logits_fwd = logits_bwd = head_grads = 0.0
    if first and m.dropout:
        head_saved += s * b * h / sp_split  # embedding dropout mask, 1 byte
    if last:  # never recomputed: kept per micro-batch in flight
        norm = sum(x.nbytes for x in _norm_saved(m, 1, prec, "final", fused=fused))
        sbv = s * b * m.vocab / t
        head_saved += s * b * h * (norm + prec.act) / sp_split + sbv * (m.logit_bytes or 4)
        # lmsys's loss: logits in the compute dtype, their fp32 copy and log-softmax (kept) in the forward;
        # the gradients of the log-probabilities and of the logits (fp32) in the backward
        logits_fwd = 0.0 if m.logit_bytes else sbv * (prec.act + (4 if prec.act != 4 else 0))
        logits_bwd = sbv * (m.logit_bytes or 8)
        head_grads = (norm_params(m) + (0 if (m.tied and first) else m.vocab * h / t)) * grad_of
    per_mb = layers * per_layer + head_saved + cast_mb
    first_grads = layer_params(m) / t * grad_of + (m.vocab * h / t * grad_of if first else 0.0)

    buffers = 0.0
    if z >= 3 and dp > 1:  # two blocks gathered (this one and the prefetched one) and one block's gradients
        block = layer_params(m) / t
        buffers += 2 * block * prec.gathered + block * prec.grad
    elif dp > 1:
        buffers += 2 * DDP_BUCKET_BYTES
    if lay.sp:  # the all-gathered sequence a column-parallel matmul reads
        buffers += s * b * h * prec.act
    if lay.pp > 1:  # send and receive buffers for activations and their gradients
        buffers += 2 * s * b * h * prec.act / sp_split
    workspace = CUBLAS_WORKSPACE_BYTES if device == "cuda" else 0.0
    buffers += workspace

    # (gradients, activations) alive at each phase. Once a backward has run (`held`), a gradient arrives
    # as a new buffer added into the existing one: the head's and the first block's count as transients.
    g_held = grads if held else 0.0
    last_block = head_grads + transient + working - head_saved  # the backward reaching the last block
    if logits_bwd >= last_block:
        start = (g_held, logits_bwd)
    else:
        start = (g_held + (0.0 if held else head_grads), last_block - (0.0 if held else head_grads))
    first_block = (working if lay.checkpoint == "full" else full_layer + cast_layer) + transient \
        - (0.0 if held else first_grads)
    phases = {
        "forward": (g_held, flight * per_mb + cast_cached + logits_fwd),
        "backward start": (start[0], flight * per_mb + start[1]),
        "backward end": (grads, (flight - 1) * per_mb + max(0.0, first_block)),
        "optimizer": (grads, 0.0),
    }
    phase = max(phases, key=lambda k: sum(phases[k]))
    g, act = phases[phase]
    parts = {"params": n, "gradients (all)": grads, "autocast weight copies": flight * cast_mb + cast_cached,
             "per layer": per_layer, "in flight": flight, "layers": layers * flight * per_layer,
             "recompute working": working, "block backward transient": transient,
             "embedding and head": flight * head_saved, "logits forward": logits_fwd, "loss backward": logits_bwd,
             "buffers": buffers - workspace, "cuBLAS workspaces": workspace,
             "phases": {k: weights + optimizer + gv + av + buffers for k, (gv, av) in phases.items()}}
    return Memory(stage, weights, g, optimizer, act, buffers, capacity, parts, phase)
