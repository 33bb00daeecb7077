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
CHECKPOINTS = ("none", "selective", "full")
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

    @property
    def state(self) -> int:
        return self.weight + self.grad + self.optimizer


PRECISIONS = {
    "fp32": Precision("fp32", act=4, residual=4, weight=4, grad=4, optimizer=8, cast=0),
    # fp32 weights, gradients and moments; matmuls in 16 bits (lmsys's default for bf16 / fp16)
    "autocast": Precision("autocast", act=2, residual=4, weight=4, grad=4, optimizer=8, cast=2),
    # 16-bit weights, fp32 gradient accumulation, fp32 master + moments (Megatron's mixed precision; 18 B/param)
    "master": Precision("master", act=2, residual=2, weight=2, grad=4, optimizer=12, cast=0),
}


def precision(dtype: str, *, master_weights: bool) -> Precision:
    if dtype == "fp32":
        return PRECISIONS["fp32"]
    return PRECISIONS["master" if master_weights else "autocast"]


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
    # pp = 1: 'none' runs each micro-batch's forward and backward in turn (gradient accumulation, 1F1B's
    # order on one stage); 'gpipe' runs every forward before the first backward (parallel train's gpipe)
    if lay.schedule not in SCHEDULES or (lay.pp > 1 and lay.schedule == "none") or \
            (lay.pp == 1 and lay.schedule not in ("none", "gpipe")):
        bad.append(f"schedule {lay.schedule!r} with pp={lay.pp} (one of {', '.join(SCHEDULES[1:])} with pp > 1, "
                   "none or gpipe with pp = 1)")
    if lay.checkpoint not in CHECKPOINTS:
        bad.append(f"checkpoint {lay.checkpoint!r} is not one of {', '.join(CHECKPOINTS)}")
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


def saved_tensors(m: ModelShape, *, b: int, prec: Precision) -> list[Saved]:
    """Every tensor one block keeps, for a micro-batch of b sequences, without parallelism."""
    s, h, f, a = m.seq, m.d_model, m.d_ff, m.heads
    sbh, sbk, sbf, ass = s * b * h, s * b * m.kv_dim, s * b * f, a * s * s * b
    act, res = prec.act, prec.residual
    out = [Saved("attention norm input", sbh, res, "seq"), Saved("QKV input", sbh, act, "seq"),
           Saved("Q", sbh, act, "tp"), Saved("K", sbk, act, "tp"), Saved("V", sbk, act, "tp")]
    if m.attention == "flash":
        out.append(Saved("log-sum-exp", a * s * b, 4, "tp", core=True))
    elif m.attention == "naive":  # softmax in fp32 under autocast, then cast for the ·V matmul
        out.append(Saved("softmax output", ass, 4, "tp", core=True))
        if act != 4:
            out.append(Saved("softmax output cast", ass, act, "tp", core=True))
    else:
        out.append(Saved("softmax output", ass, act, "tp", core=True))
        if m.dropout:
            out += [Saved("attention dropout mask", ass, 1, "tp", core=True),
                    Saved("attention dropout output", ass, act, "tp", core=True)]
    out.append(Saved("output projection input", sbh, act, "tp"))
    if m.dropout:
        out.append(Saved("attention block dropout mask", sbh, 1, "seq"))
    out += [Saved("MLP norm input", sbh, res, "seq"), Saved("MLP input", sbh, act, "seq")]
    if m.mlp == "gelu":
        out += [Saved("GeLU input", sbf, act, "tp"), Saved("MLP output projection input", sbf, act, "tp")]
    else:
        out += [Saved("gate", sbf, act, "tp"), Saved("up", sbf, act, "tp"), Saved("silu(gate)", sbf, act, "tp"),
                Saved("MLP output projection input", sbf, act, "tp")]
    if m.dropout:
        out.append(Saved("MLP dropout mask", sbh, 1, "seq"))
    return out


def _split(t: Saved, lay: Layout) -> float:
    return t.elements * t.nbytes / (lay.tp if (t.region == "tp" or lay.sp) else 1)


def layer_activation_bytes(m: ModelShape, lay: Layout, prec: Precision, *, checkpoint: str | None = None) -> float:
    """Bytes one block keeps for one micro-batch on one GPU, under `checkpoint` (default: the layout's)."""
    checkpoint = lay.checkpoint if checkpoint is None else checkpoint
    if checkpoint == "full":  # only the block's input
        return m.seq * lay.micro_batch * m.d_model * prec.residual / (lay.tp if lay.sp else 1)
    return sum(_split(t, lay) for t in saved_tensors(m, b=lay.micro_batch, prec=prec)
               if not (checkpoint == "selective" and t.core))


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
    """Bytes per GPU on its fullest pipeline stage."""

    stage: str
    weights: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    capacity: float
    parts: dict = field(default_factory=dict)  # the terms behind the sums, for tests and --format json

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
        return (f"needs {(self.total + self.reserve) / GiB:.1f} GiB per GPU on its {self.stage} stage, "
                f"{-self.headroom / GiB:.1f} GiB over the {self.capacity / GiB:.1f} GiB it has ({terms} GiB)")


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
    are alive at the stage's peak. Autocast caches a leaf weight's cast within one autocast region (a
    micro-batch's forward) and the matmul saves it for the backward: one copy of the stage's weights per
    micro-batch whose backward is pending, the `in_flight` count of the activations (1 with sequential
    accumulation, m with GPipe). Full recomputation saves no block's copy: the blocks' copies live in the
    cache until the forward ends (one copy, of the micro-batch being run), the head's are saved per
    micro-batch in flight. ZeRO-3: the shard's."""
    if not prec.cast:
        return 0.0
    blocks, head = cast_params(m, lay, last=stage in ("last", "only"))
    flight = in_flight(lay, stage="last" if stage == "last" else "first")
    held = (blocks + flight * head) if lay.checkpoint == "full" else flight * (blocks + head)
    return held * prec.cast / (lay.dp if lay.zero >= 3 else 1)


def memory(m: ModelShape, lay: Layout, prec: Precision, *, capacity: float) -> Memory:
    """The per-GPU breakdown of the fuller of the first and last pipeline stages."""
    check_layout(m, lay)
    stages = ("only",) if lay.pp == 1 else ("first", "last")
    return max((_stage_memory(m, lay, prec, capacity=capacity, stage=st) for st in stages), key=lambda x: x.total)


def _stage_memory(m: ModelShape, lay: Layout, prec: Precision, *, capacity: float, stage: str) -> Memory:
    first, last = stage in ("first", "only"), stage in ("last", "only")
    n = stage_params(m, lay, first=first, last=last)
    dp, z = lay.dp, lay.zero
    weights = n * prec.weight / (dp if z >= 3 else 1)
    grads = n * prec.grad / (dp if z >= 2 else 1)
    optimizer = n * prec.optimizer / (dp if z >= 1 else 1)
    cast = autocast_copies(m, lay, prec, stage=stage)
    s, b, h, t = m.seq, lay.micro_batch, m.d_model, lay.tp
    sp_split = t if lay.sp else 1
    layers = m.layers / lay.pp
    per_layer = layer_activation_bytes(m, lay, prec)
    flight = in_flight(lay, stage="last" if stage == "last" else "first")
    parts = {"params": n, "autocast weight copies": cast, "per layer": per_layer, "in flight": flight,
             "layers": layers * flight * per_layer}
    working = 0.0
    if lay.checkpoint == "full":  # the block being recomputed keeps everything until its backward is done
        working = layer_activation_bytes(m, lay, prec, checkpoint="none")
    elif lay.checkpoint == "selective":
        working = layer_activation_bytes(m, lay, prec, checkpoint="none") - per_layer
    parts["recompute working"] = working
    extra = 0.0
    if first and m.dropout:
        extra += flight * s * b * h / sp_split  # embedding dropout mask, 1 byte
    if last:  # per micro-batch in flight: 1 on a 1F1B last stage, m under GPipe (never recomputed)
        logit = m.logit_bytes or prec.act + 8  # logits, their fp32 copy for the loss, its gradient
        extra += flight * (s * b * h * (prec.residual + prec.act) / sp_split + s * b * m.vocab / t * logit)
    parts["embedding and head"] = extra
    activations = parts["layers"] + working + extra + cast
    buffers = 0.0
    if z >= 3 and dp > 1:  # two blocks gathered (this one and the prefetched one) and one block's gradients
        full_layer = layer_params(m) / t
        buffers += 2 * full_layer * prec.weight + full_layer * prec.grad
    elif dp > 1:
        buffers += 2 * DDP_BUCKET_BYTES
    if lay.sp:  # the all-gathered sequence a column-parallel matmul reads
        buffers += s * b * h * prec.act
    if lay.pp > 1:  # send and receive buffers for activations and their gradients
        buffers += 2 * s * b * h * prec.act / sp_split
    parts["buffers"] = buffers
    return Memory(stage, weights, grads, optimizer, activations, buffers, capacity, parts)
