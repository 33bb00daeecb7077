"""Step time of a training step on one GPU of a mesh: compute, recompute, exposed communication per mesh
dim, pipeline bubble, optimizer.

Rates come from a calibration profile (what this machine measured) or from the GPU table times stated
efficiencies (`Efficiency`; one set for every row, never per row). The assumptions, said once:
- Matmuls (forward 2·weights·tokens, backward twice that) run at the matmul rate; attention's two
  matmuls at it too when the s×s scores are materialized, at the attention rate inside a fused (flash)
  kernel, which computes only the causal half (backward 2.5× forward).
- Elementwise ops (norms, activation, softmax, dropout, residual adds, RoPE) move the bytes `elementwise`
  counts at the HBM rate; their backward moves twice the forward's bytes.
- Tensor parallelism is not overlapped (Megatron-LM): 4 all-reduces per block per micro-batch (2 forward,
  2 backward), as all-gather + reduce-scatter pairs with sequence parallelism (the same bytes). Pipeline
  sends (activations forward, gradients backward; 1/t of them with SP's scatter-gather) are exposed too.
- Data parallelism overlaps with the backward of the last micro-batch; what exceeds it is exposed, and so
  is the parameter all-gather after a ZeRO-1/2 step. ZeRO-3 all-gathers overlap with each micro-batch's
  forward and backward (gradients reduce-scattered every micro-batch).
- 1F1B and GPipe add (p-1) stage-times of bubble, interleaving (p-1)/v (Narayanan et al. 2021); the
  slowest stage (the last, with the LM head, or the first) sets the pace of the m micro-batches.
- A collective of B bytes over n GPUs takes latency + B·(n-1)/n / busbw (all-gather, reduce-scatter),
  twice that for an all-reduce (nccl-tests' busbw convention). busbw is the link's one-way bandwidth
  (half the NVLink figure, the NIC's line rate across nodes) times `Efficiency.link`.
- The optimizer (AdamW) streams its state once at the HBM rate: bytes per parameter in `optimizer_bytes`.
Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lmsys.plan.memory import Layout, Precision, stage_params
from lmsys.plan.shape import ModelShape, flops_per_token, layer_matmul_params


@dataclass(frozen=True)
class Efficiency:
    """Fractions of the table's peaks a training step reaches (used without a calibration profile)."""

    matmul: float = 0.75  # cuBLAS on a transformer's large GEMMs inside a training loop
    attention: float = 0.5  # a fused (flash) attention kernel, forward and backward together
    hbm: float = 0.8  # elementwise kernels and the optimizer's streaming
    link: float = 0.8  # NCCL busbw over the link's one-way bandwidth
    latency_us: float = 10.0  # per collective or send


@dataclass(frozen=True)
class Rates:
    """What the time model divides by: achieved rates, and where they came from."""

    matmul_tflops: float
    attention_tflops: float
    hbm_GBps: float
    intra_GBps: float  # busbw inside a node (NVLink, or PCIe)
    inter_GBps: float | None  # busbw across nodes
    latency_us: float
    source: str
    busbw: dict = field(default_factory=dict)  # measured {world size: {bytes: GB/s}} (a profile), else empty

    def link(self, group: int, *, inter: bool, nbytes: float) -> float:
        """busbw (GB/s) of a collective over `group` GPUs, within a node or across nodes."""
        measured = self.busbw.get(group) or self.busbw.get(str(group))
        if measured and not inter:
            return _interpolate(measured, nbytes)
        if inter:
            if self.inter_GBps is None:
                from lmsys.core.errors import LmsysError

                raise LmsysError("the mesh spans nodes but the network bandwidth is unknown; give network_GBps "
                                 "in --cluster FILE.yaml")
            return self.inter_GBps
        return self.intra_GBps


def _interpolate(points: dict, nbytes: float) -> float:
    """busbw at `nbytes` from measured (bytes -> GB/s) points: the nearest measured size at or below it."""
    sizes = sorted((int(k), float(v)) for k, v in points.items())
    below = [bw for size, bw in sizes if size <= nbytes]
    return below[-1] if below else sizes[0][1]


def table_rates(gpu, dtype: str, *, eff: Efficiency = Efficiency(), peak_tflops: float | None = None) -> Rates:
    """Rates from the GPU table (lmsys.core.hardware.GPU) times `eff`."""
    peak = peak_tflops if peak_tflops is not None else gpu.peak(dtype)
    intra = (gpu.nvlink_GBps if gpu.nvlink_gpus > 1 else gpu.pcie_GBps) / 2 * eff.link
    return Rates(matmul_tflops=peak * eff.matmul, attention_tflops=peak * eff.attention, hbm_GBps=gpu.hbm_GBps * eff.hbm,
                 intra_GBps=intra, inter_GBps=None if gpu.network_GBps is None else gpu.network_GBps * eff.link,
                 latency_us=eff.latency_us,
                 source=(f"{gpu.name} table × efficiency (matmul {eff.matmul}, attention {eff.attention}, "
                         f"HBM {eff.hbm}, links {eff.link})"))


# ------------------------------------------------------------------------------------ per-block costs

def elementwise_bytes(m: ModelShape, *, b: int, prec: Precision, tp: int, sp: bool) -> tuple[float, float]:
    """Bytes the forward's elementwise ops of one block move on one GPU: (outside the core, the core).
    Megatron-style blocks (dropout): LayerNorm r/w 4sbh ×2, bias-dropout-add 7sbh ×2, bias-GeLU 4sbf,
    fused softmax 4as²b, dropout 5as²b. lmsys blocks: RMSNorm r/w ×2, residual adds r2 w1 ×2, RoPE on Q
    and K, SiLU r/w and the gate product r2 w1 on sbf; s×s scores: a fused softmax r/w, or lmsys's naive
    chain (scale, mask, fp32 softmax, cast)."""
    s, h, f, a = m.seq, m.d_model, m.d_ff, m.heads
    sbh, sbf, ass = s * b * h, s * b * f, a * s * s * b
    seq_split = tp if sp else 1
    act, res = prec.act, prec.residual
    if m.dropout:
        outside = 22 * sbh / seq_split + 2 * act * sbf / tp
        core = (2 * act + 2 * act + 1) * ass / tp
    else:
        outside = (2 * 2 * res + 2 * 3 * res) * sbh / seq_split + 2 * act * (sbh + s * b * m.kv_dim) / tp \
            + (2 + 3) * act * sbf / tp
        core = 0.0
    if m.attention == "materialized" and not m.dropout:
        core = 2 * act * ass / tp
    elif m.attention == "naive":
        core = (6 * act + 8) * ass / tp
    return outside, core


@dataclass
class StepTime:
    """Milliseconds of one step on the slowest GPU, split by cause."""

    compute: float
    recompute: float
    tp_comm: float
    pp_comm: float
    dp_comm: float
    bubble: float
    optimizer: float
    flops: float  # model FLOPs of the whole step, all GPUs (MFU's numerator)
    parts: dict = field(default_factory=dict)

    @property
    def total(self) -> float:
        return (self.compute + self.recompute + self.tp_comm + self.pp_comm + self.dp_comm + self.bubble
                + self.optimizer)


def optimizer_bytes(prec: Precision) -> int:
    """AdamW's traffic per parameter: read the gradient, read and write weights, master copy (if any) and
    both moments, zero the gradient."""
    master = 8 if prec.optimizer == 12 else 0
    return prec.grad + 2 * prec.weight + master + 16 + prec.grad


def step_time(m: ModelShape, lay: Layout, prec: Precision, rates: Rates, *, gpus_per_node: int) -> StepTime:
    s, b, h, t, p = m.seq, lay.micro_batch, m.d_model, lay.tp, lay.pp
    tokens = s * b
    mm = rates.matmul_tflops * 1e12 / 1e3  # FLOPs per ms
    hbm = rates.hbm_GBps * 1e9 / 1e3  # bytes per ms
    lat = rates.latency_us / 1e3

    # one block, one micro-batch, one GPU
    gemm = 2 * tokens * layer_matmul_params(m) / t
    attn = 4 * b * s * s * h / t  # QKᵀ and ·V, forward
    outside, core = elementwise_bytes(m, b=b, prec=prec, tp=t, sp=lay.sp)
    if m.attention == "flash":
        attn_fwd = attn / 2 / (rates.attention_tflops * 1e12 / 1e3)
        attn_bwd = 2.5 * attn_fwd
    else:
        attn_fwd = attn / mm
        attn_bwd = 2 * attn_fwd
    fwd = gemm / mm + attn_fwd + (outside + core) / hbm
    bwd = 2 * gemm / mm + attn_bwd + 2 * (outside + core) / hbm
    recompute = {"none": 0.0, "selective": attn_fwd + core / hbm, "full": fwd}[lay.checkpoint]

    # the mesh: tp innermost, then dp, then pp (Megatron-LM's order)
    tp_inter = t > gpus_per_node
    dp_inter = t * lay.dp > gpus_per_node
    pp_inter = t * lay.dp * p > gpus_per_node and p > 1 and t * lay.dp >= gpus_per_node
    act_bytes = tokens * h * prec.act
    tp_block = 0.0
    if t > 1:
        bw = rates.link(t, inter=tp_inter, nbytes=act_bytes) * 1e9 / 1e3
        allreduce = 2 * act_bytes * (t - 1) / t / bw + 2 * lat
        tp_block = 4 * allreduce + (2 * allreduce if lay.checkpoint == "full" else 0)

    layers = m.layers / p
    per_mb_layers = layers * (fwd + bwd)
    per_mb_recompute = layers * recompute
    per_mb_tp = layers * tp_block
    # the LM head and loss on the last stage, the embedding on the first
    head = 3 * 2 * tokens * h * m.vocab / t / mm + 3 * 4 * tokens * m.vocab / t * 4 / hbm
    embed = 3 * tokens * h * prec.act / hbm
    if p == 1:
        extra = head + embed
    else:
        extra = max(head, embed)
    pp_mb = 0.0
    if p > 1:
        sent = act_bytes / (t if lay.sp else 1)
        bw = rates.link(2, inter=pp_inter, nbytes=sent) * 1e9 / 1e3
        pp_mb = 2 * lay.chunks * (sent / bw + lat)

    mbs = lay.microbatches
    compute = mbs * (per_mb_layers + extra)
    recompute_ms = mbs * per_mb_recompute
    tp_comm = mbs * per_mb_tp
    pp_comm = mbs * pp_mb
    stage_mb = per_mb_layers + per_mb_recompute + per_mb_tp + pp_mb
    bubble = 0.0 if p == 1 else (p - 1) / (lay.chunks if lay.schedule == "interleaved" else 1) * stage_mb

    # data parallelism and the optimizer, on the fuller stage
    n = max(stage_params(m, lay, first=True, last=p == 1), stage_params(m, lay, first=p == 1, last=True))
    dp_comm = 0.0
    if lay.dp > 1:
        d = lay.dp
        bw = rates.link(d, inter=dp_inter, nbytes=n * prec.grad) * 1e9 / 1e3
        grads = n * prec.grad * (d - 1) / d / bw + lat
        params = n * prec.weight * (d - 1) / d / bw + lat
        bwd_mb = layers * (bwd + tp_block / 2)
        fwd_mb = layers * (fwd + tp_block / 2)
        if lay.zero <= 1:
            dp_comm = max(0.0, 2 * grads - bwd_mb) + (params if lay.zero == 1 else 0.0)
        elif lay.zero == 2:
            dp_comm = max(0.0, grads - bwd_mb) + params
        else:
            dp_comm = mbs * (max(0.0, params - fwd_mb) + max(0.0, params + grads - bwd_mb))
    shard = lay.dp if lay.zero >= 1 else 1
    optimizer = n / shard * optimizer_bytes(prec) / hbm

    flops = flops_per_token(m) * s * lay.global_batch
    parts = {"fwd block ms": fwd, "bwd block ms": bwd, "tp per block ms": tp_block, "head ms": head,
             "stage ms per micro-batch": stage_mb}
    return StepTime(compute, recompute_ms, tp_comm, pp_comm, dp_comm, bubble, optimizer, flops, parts)


def mfu(st: StepTime, *, gpus: int, peak_tflops: float) -> float:
    """Model FLOPs (6·N·tokens + attention, PaLM) over the step time and all GPUs' peak."""
    return st.flops / (st.total * 1e-3) / (gpus * peak_tflops * 1e12)
