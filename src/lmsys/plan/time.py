"""Step time of a training step on one GPU of a mesh: compute, recompute, exposed communication per mesh
dim, pipeline bubble, optimizer.

Rates come from a calibration profile (what this machine measured) or from the GPU table times stated
efficiencies (`Efficiency`; one set for every row, never per row). The assumptions, said once:
- Matmuls (forward 2·weights·tokens, backward twice that) run at the matmul rate, from the table on its
  curve: each GEMM adds `gemm_launch_us` (lmsys.core.hardware: 0.770 of peak + 3.15 µs, fit to plan
  calibrate's H200 GEMMs); attention's two
  matmuls at it too when the s×s scores are materialized, at the attention rate inside a fused (flash)
  kernel, which computes only the causal half (backward 2.5× forward); from the table, the attention
  rate is the part's own flash fraction of its peak (`GPU.flash`, with its source) where it has one. A profile that timed the model's
  own shapes (`plan calibrate`) gives each matmul, and the s×s products, the rate of the nearest shape it
  measured, forward and backward apart (small and skinny GEMMs run well below the large ones' rate).
- Elementwise ops (norms, activation, softmax, dropout, residual adds, RoPE) move the bytes `elementwise`
  counts at the elementwise rate (calibrated on a GPU: what a block's own elementwise kernels reach, far
  below a contiguous multiply's; else the stack's: `STACKS`, fused at the HBM rate, eager at
  `EAGER_ELEMENTWISE` of the datasheet bandwidth); their backward moves twice the forward's bytes. Autocast over fp32 weights adds
  its casts at that rate: per micro-batch each matmul weight read in fp32 and written in the compute dtype
  (forward, and the recompute), its gradient read back and written in fp32 (backward).
- Tensor parallelism is not overlapped (Megatron-LM): 4 all-reduces per block per micro-batch (2 forward,
  2 backward), as all-gather + reduce-scatter pairs with sequence parallelism (the same bytes). Pipeline
  sends (activations forward, gradients backward; 1/t of them with SP's scatter-gather) are exposed too.
- Data parallelism overlaps with the backward of the last micro-batch; what exceeds it is exposed, and so
  is the parameter all-gather after a ZeRO-1/2 step. ZeRO-3 (`zero3_exposed_ms`): per micro-batch, block
  by block, each gather hidden behind one block's forward, each gather + reduce-scatter behind one
  block's backward; the first gather, the last reduce-scatter and the root unit's exposed; while a
  collective runs beside compute it takes NCCL_SMS of the GPU's SMs from it.
- 1F1B and GPipe add (p-1) stage-times of bubble, interleaving (p-1)/v (Narayanan et al. 2021); the
  slowest stage (the last, with the LM head, or the first) sets the pace of the m micro-batches.
- A collective of B bytes over n GPUs takes latency + B·(n-1)/n / busbw (all-gather, reduce-scatter),
  twice that for an all-reduce (nccl-tests' busbw convention); from the table the latency is NCCL's ring
  model (`ring_latency_us`: a base and one hop per ring step, NVLink, PCIe or network). busbw is the link's one-way bandwidth
  (half the NVLink figure; across nodes the NIC's line rate × the group's GPUs in each node, capped by
  NVLink: one NCCL ring per NIC) times `Efficiency.link`. Measured (a
  profile's all-reduce busbw per size on n ranks): the all-reduce time at each measured size, linear
  between them, the smallest size's time below it (the latency floor) and the largest size's busbw above
  it; other collectives scale it by their bus factor (their busbw is the all-reduce's), and no latency
  is added (the measured times hold it).
- The optimizer (AdamW) streams its state once: bytes per parameter in `optimizer_bytes`, at the
  optimizer rate (calibrated: the AdamW this machine runs; else the HBM rate).
- Host: eager PyTorch dispatches a fixed number of ops per block per phase (`OpCounts`), each costing
  `launch_us` of host time; recomputation dispatches the recomputed ops again in the backward (full:
  the block's forward; selective: the attention core's), each costing `launch_us_recompute` (with the
  checkpoint's own Python around them; calibrated apart, else `launch_us`). On a GPU the host queues
  ahead of the device: with one pipeline stage across the whole step (nothing synchronises inside it, so
  a device-bound optimizer hides the next forward's launches), the step takes the longer of the host's
  total and the device's; with stages, which pace each other by micro-batch, each phase (a micro-batch's
  forward, its backward, the optimizer) takes max(device, host). What the host adds is the `host` term.
  On a CPU the host is the device: the host time adds in full.
Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lmsys.core.collectives import BUS_FACTORS, bus_factor  # noqa: F401  (busbw / algbw, nccl-tests)
from lmsys.plan.memory import Layout, Precision, stage_params
from lmsys.plan.shape import ModelShape, block_gemms, flops_per_token, head_gemm, layer_matmul_params


@dataclass(frozen=True)
class Efficiency:
    """Fractions of the table's peaks a training step reaches (used without a calibration profile)."""

    matmul: float = 0.75  # cuBLAS on a transformer's large GEMMs inside a training loop
    attention: float = 0.5  # a fused (flash) attention kernel, forward and backward together
    hbm: float = 0.8  # elementwise kernels and the optimizer's streaming
    link: float = 0.8  # NCCL busbw over the link's one-way bandwidth
    latency_us: float = 10.0  # per collective or send
    launch_us: float = 10.0  # host time per dispatched op of eager PyTorch (Python, dispatcher, launch)


@dataclass(frozen=True)
class OpCounts:
    """Ops eager PyTorch dispatches per training step, by phase: per block (forward, backward, and the
    backward's extra with recomputation: full repeats the block's forward and the checkpoint's own ops,
    selective the attention core's forward), outside the blocks (embedding, final norm, head, loss), and
    the optimizer (a fixed part and one per parameter tensor). The defaults are lmsys's block (naive
    attention, fp32, counted with a dispatch mode) and a fused AdamW; `plan calibrate` counts the run's own."""

    fwd_layer: float = 80
    bwd_layer: float = 132
    recompute_layer: float = 131  # full recomputation: the block's forward again, inside its backward
    recompute_core: float = 26  # selective: the attention core's forward again (naive: QKᵀ, scale, mask, softmax, ·V)
    fwd_other: float = 19
    bwd_other: float = 35
    opt_base: float = 12
    opt_per_tensor: float = 0


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
    elementwise_GBps: float | None = None  # elementwise kernels at activation sizes (None: hbm_GBps)
    optimizer_GBps: float | None = None  # AdamW's optimizer_bytes per parameter (None: hbm_GBps)
    launch_us: float = 10.0  # host time per dispatched op
    launch_us_recompute: float | None = None  # ... per op a recomputed block dispatches again (None: launch_us)
    overlap: bool = True  # the host queues ahead of the device (a GPU); False: one after the other (a CPU)
    ops: OpCounts = OpCounts()
    # measured rates by shape (a profile), else empty: the model's matmuls (M, K, N, forward TFLOP/s,
    # backward TFLOP/s: its two gradients together) and s×s attention's products (heads × batch, s, d,
    # forward: QKᵀ and ·V, backward: their four gradients)
    gemm: tuple = ()
    scores: tuple = ()
    # the table's matmul curve: µs each GEMM adds to its FLOPs at matmul_tflops (launch and tail; 0 with a
    # profile, whose measured rates hold it): small GEMMs run below the large ones' rate
    gemm_launch_us: float = 0.0
    # the table's collectives: NCCL's own latency model of a ring (`RING_LATENCY_US`) instead of latency_us,
    # and the share of the GPU's SMs a collective running beside compute takes from it (NCCL_SMS / GPU.sms;
    # 0: none modelled)
    ring_latency: bool = False
    comm_sm_share: float = 0.0

    def matmul_ms(self, M: int, K: int, N: int, *, backward: bool = False) -> float:
        """ms of one M×K·K×N matmul, or (backward) of its two gradients: at the rate measured at the nearest
        calibrated shape (the least sum of |log| ratios of M, K and N), else on the table's curve: at
        matmul_tflops plus gemm_launch_us a GEMM."""
        measured = _nearest(self.gemm, (M, K, N), 4 if backward else 3)
        gemms = 2 if backward else 1
        ms = 2.0 * M * K * N * gemms / ((measured or self.matmul_tflops) * 1e9)
        return ms if measured else ms + gemms * self.gemm_launch_us / 1e3

    def scores_ms(self, batch: int, s: int, d: int, *, backward: bool = False) -> float:
        """ms of materialized attention's two products over `batch` heads × sequences (QKᵀ and ·V, 2·s²·d
        FLOPs each; backward: their four gradients), at the nearest measured shape's rate, else on the
        table's curve (two batched GEMMs forward, four backward)."""
        measured = _nearest(self.scores, (batch, s, d), 4 if backward else 3)
        ms = 4.0 * batch * s * s * d * (2 if backward else 1) / ((measured or self.matmul_tflops) * 1e9)
        return ms if measured else ms + (4 if backward else 2) * self.gemm_launch_us / 1e3

    def link(self, group: int, *, inter: bool, per_node: int = 1) -> float:
        """busbw (GB/s) from the table of a collective over `group` GPUs, within a node or across nodes.
        Across nodes with `per_node` of the group's GPUs in each node, NCCL lays one ring per NIC: each
        GPU's own NIC carries 1/per_node of the ring traffic and NVLink the rest, so the busbw is the node's
        injection bandwidth, per_node × the NIC's, capped by the NVLink busbw (a dp group strided over
        nodes, one GPU in each: the NIC's)."""
        if inter:
            if self.inter_GBps is None:
                from lmsys.core.errors import LmsysError

                raise LmsysError("the mesh spans nodes but the network bandwidth is unknown; give network_GBps "
                                 "in --cluster FILE.yaml")
            return min(self.inter_GBps * max(1, per_node), max(self.intra_GBps or 0.0, self.inter_GBps))
        if not self.intra_GBps:
            from lmsys.core.errors import LmsysError

            raise LmsysError(f"no bandwidth between {group} ranks here: the profile has no all-reduce busbw on "
                             f"{group} and no table figure to fall back on; calibrate where {group} ranks run")
        return self.intra_GBps

    def collective_ms(self, kind: str, group: int, *, nbytes: float, inter: bool = False, per_node: int = 1) -> float:
        """ms of one collective (`lmsys.core.collectives.BUS_FACTORS`' kinds, or "send") of `nbytes` (the full buffer, as nccl-tests counts
        it) over `group` ranks: from the measured all-reduce times on `group` ranks when the profile has
        them (within a node), else latency + bytes · bus factor / the table's busbw (an all-reduce as a
        reduce-scatter and an all-gather: two latencies)."""
        factor = bus_factor(kind, group)
        measured = self.busbw.get(group) or self.busbw.get(str(group))
        if measured and not inter:
            return allreduce_ms(measured, group=group, nbytes=nbytes) * factor / bus_factor("all-reduce", group)
        bw = self.link(group, inter=inter, per_node=per_node) * 1e9 / 1e3  # bytes per ms
        if self.ring_latency:
            return nbytes * factor / bw + ring_latency_us(kind, group, nodes=group // per_node if inter else 1,
                                                          nvlink=self.intra_GBps is not None) / 1e3
        return nbytes * factor / bw + (2 if kind == "all-reduce" else 1) * self.latency_us / 1e3


# NCCL's latency model of a ring (src/graph/tuning.cc of NVIDIA/nccl at 5067397c2676d5aed50042fc39e5c8ee96eb0027,
# Simple protocol: the one large buffers take): a base latency per collective, then every step of the ring
# pays its hop's latency, NVLink or PCIe inside a node, the network's on the steps that cross nodes (n - 1
# steps for an all-gather or reduce-scatter, of which nodes - 1 cross; twice both for an all-reduce).
RING_LATENCY_US = {"base": 8.4, "nvlink": 3.4, "pcie": 5.7, "net": 14.0}
NCCL_TUNING = "NVIDIA/nccl src/graph/tuning.cc @5067397 (baseLatencies, hwLatencies: Ring, Simple)"


def ring_latency_us(kind: str, group: int, *, nodes: int = 1, nvlink: bool = True) -> float:
    """µs of latency of one ring collective over `group` ranks spread over `nodes` nodes (NCCL's model)."""
    if kind == "send":
        steps, inter = 1, 1 if nodes > 1 else 0
    else:
        twice = 2 if kind == "all-reduce" else 1
        steps, inter = twice * (group - 1), twice * (max(1, nodes) - 1)
    hop = RING_LATENCY_US["nvlink" if nvlink else "pcie"]
    return RING_LATENCY_US["base"] + (steps - inter) * hop + inter * RING_LATENCY_US["net"]


def _nearest(points: tuple, key: tuple, column: int) -> float | None:
    """points[i][column] of the point whose first len(key) entries are nearest `key` in log space."""
    import math

    if not points:
        return None
    best = min(points, key=lambda p: sum(abs(math.log(p[i] / k)) for i, k in enumerate(key)))
    return float(best[column])


def allreduce_ms(points: dict, *, group: int, nbytes: float) -> float:
    """An all-reduce's ms at `nbytes` on `group` ranks from measured (bytes -> busbw GB/s) points: each
    point's time is bytes · 2(n-1)/n / busbw; linear between points, the smallest point's time below
    them (latency-bound), the largest point's busbw above them."""
    factor = bus_factor("all-reduce", group)
    times = sorted((int(k), int(k) * factor / (float(v) * 1e9) * 1e3) for k, v in points.items())
    if nbytes <= times[0][0]:
        return times[0][1]
    for (b0, t0), (b1, t1) in zip(times, times[1:]):
        if nbytes <= b1:
            return t0 + (nbytes - b0) / (b1 - b0) * (t1 - t0)
    b_last, t_last = times[-1]
    return t_last * nbytes / b_last


# SMs an NCCL collective occupies, which compute kernels cannot use while it runs: "If you are on DGX with 8
# NICs and a top speed of 190 GB/s, then it would use 16 SMs" and "NCCL CTAs won't share an SM with compute
# kernels" (S. Jeaugey, NCCL maintainer, NVIDIA/nccl issue 689).
NCCL_SMS = 16

# The software stack's elementwise work (norms, activations, residual adds, RoPE, casts) as a fraction of
# the datasheet HBM bandwidth: "fused" (Megatron-LM's fused kernels, torch.compile): Efficiency.hbm, the
# rate a streaming kernel reaches; "eager" (one PyTorch kernel an op, lmsys's own block among them): what
# lmsys's eager bf16 block reached on an H200, block_elementwise_GBps 1756.6 GB/s of the 4800 datasheet
# (docs/benchmarks/plan-h200-profile.yaml, measured by plan calibrate; a strided, fp32-upcasting op mix).
EAGER_ELEMENTWISE = 1756.6 / 4800.0
STACKS = ("fused", "eager")


def table_rates(gpu, dtype: str, *, eff: Efficiency = Efficiency(), peak_tflops: float | None = None,
                stack: str = "fused") -> Rates:
    """Rates from the GPU table (lmsys.core.hardware.GPU) times `eff`; `stack` sets the elementwise rate."""
    if stack not in STACKS:
        from lmsys.core.errors import LmsysError

        raise LmsysError(f"stack {stack!r} is not one of {', '.join(STACKS)}")
    peak = peak_tflops if peak_tflops is not None else gpu.peak(dtype)
    intra = (gpu.nvlink_GBps if gpu.nvlink_gpus > 1 else gpu.pcie_GBps) / 2 * eff.link
    # a fused attention kernel: the part's own measured fraction where the table has one (the flash
    # kernels of its generation reach far less of a Hopper's peak than of an A100's), else the generic one
    attention = getattr(gpu, "flash", None) or eff.attention
    # the matmul curve: the part's own sustained fraction and per-GEMM time where the table has them
    # (lmsys.core.hardware: fit to plan calibrate's H200 GEMMs, scaled by MAMF per generation), else eff.matmul
    matmul = getattr(gpu, "matmul", None) or eff.matmul
    launch = getattr(gpu, "gemm_launch_us", 0.0) if getattr(gpu, "matmul", None) else 0.0
    sms = getattr(gpu, "sms", None)
    return Rates(matmul_tflops=peak * matmul, gemm_launch_us=launch, ring_latency=True,
                 comm_sm_share=NCCL_SMS / sms if sms else 0.0, attention_tflops=peak * attention, hbm_GBps=gpu.hbm_GBps * eff.hbm,
                 intra_GBps=intra, inter_GBps=None if gpu.network_GBps is None else gpu.network_GBps * eff.link,
                 latency_us=eff.latency_us, launch_us=eff.launch_us,
                 elementwise_GBps=gpu.hbm_GBps * (EAGER_ELEMENTWISE if stack == "eager" else eff.hbm),
                 source=(f"{gpu.name} table × efficiency (matmul {matmul}"
                         f"{f' + {launch:g} µs a GEMM' if launch else ''}, flash attention {attention}, "
                         f"{stack} elementwise {EAGER_ELEMENTWISE if stack == 'eager' else eff.hbm:.2f}, "
                         f"HBM {eff.hbm}, links {eff.link}, {eff.launch_us:g} µs an op)"))


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
    host: float  # host time the device does not hide (launch-bound phases; all of it on a CPU)
    flops: float  # model FLOPs of the whole step, all GPUs (MFU's numerator)
    parts: dict = field(default_factory=dict)

    @property
    def total(self) -> float:
        return (self.compute + self.recompute + self.tp_comm + self.pp_comm + self.dp_comm + self.bubble
                + self.optimizer + self.host)


def optimizer_bytes(prec: Precision) -> int:
    """A fused AdamW's traffic per parameter: read the gradient, read and write the fp32 parameter (the
    master copy if there is one, then also write the 16-bit weights) and both fp32 moments; gradients are
    set to None, not zeroed. fp32 and autocast 4 + 8 + 16 = 28 bytes, master weights 4 + 8 + 2 + 16 = 30."""
    master = prec.optimizer == 12
    return prec.grad + 8 + (prec.weight if master else 0) + 16


def host_ms(m: ModelShape, lay: Layout, rates: Rates, *, tensors: int) -> tuple[float, float, float]:
    """Host time (ms) of one micro-batch's forward and backward on a stage, and of the optimizer step
    over `tensors` parameter tensors: dispatched ops × launch_us. Recomputation dispatches its ops again
    in the backward of every block: the whole forward (full) or the attention core's (selective)."""
    ops, us = rates.ops, rates.launch_us / 1e3
    us_again = (rates.launch_us if rates.launch_us_recompute is None else rates.launch_us_recompute) / 1e3
    layers = m.layers / lay.pp
    again = {"none": 0.0, "selective": ops.recompute_core, "full": ops.recompute_layer,
             "op": ops.recompute_layer}[lay.checkpoint]
    fwd = (layers * ops.fwd_layer + ops.fwd_other) * us
    bwd = (layers * ops.bwd_layer + ops.bwd_other) * us + layers * again * us_again
    return fwd, bwd, (ops.opt_base + ops.opt_per_tensor * tensors) * us


def param_tensors(m: ModelShape, lay: Layout) -> int:
    """Parameter tensors on the fullest stage: per block the matmuls (fused QKV and the output, as lmsys
    and Megatron-LM keep them; 2 or 3 MLP), norms, biases; the embedding, final norm, head and positions
    counted once."""
    per_block = 2 + (3 if m.mlp == "swiglu" else 2)
    per_block += 2 * (2 if m.norm == "layer" else 1) + (per_block if m.bias else 0)
    return int(m.layers / lay.pp * per_block) + 3 + int(m.learned_positions)


@dataclass(frozen=True)
class BlockCost:
    """One block's forward and backward on one GPU for one micro-batch: the matmuls' ms (attention's
    products, or its fused kernel, included) and the bytes its elementwise ops move (autocast's casts
    included), which the step divides by the elementwise rate."""

    matmul_fwd: float
    matmul_bwd: float
    attn_fwd: float  # attention's part of matmul_fwd (selective recomputation runs it again)
    bytes_fwd: float
    bytes_bwd: float
    core_bytes: float  # the attention core's forward bytes (selective recomputation moves them again)
    cast_bytes: float  # autocast's casts of the weights (forward) and their gradients (backward), in bytes_*


def block_cost(m: ModelShape, *, b: int, t: int, sp: bool, prec: Precision, rates: Rates) -> BlockCost:
    """`BlockCost` of `m` at micro-batch `b`, tensor parallel degree `t` (sequence parallel `sp`)."""
    s, h = m.seq, m.d_model
    gemms = block_gemms(m, tokens=s * b, tp=t)
    gemm_fwd = sum(rates.matmul_ms(M, K, N) for _, M, K, N in gemms)
    gemm_bwd = sum(rates.matmul_ms(M, K, N, backward=True) for _, M, K, N in gemms)
    outside, core = elementwise_bytes(m, b=b, prec=prec, tp=t, sp=sp)
    if m.attention == "flash":
        attn_fwd = 4 * b * s * s * h / t / 2 / (rates.attention_tflops * 1e12 / 1e3)  # QKᵀ and ·V, the causal half
        attn_bwd = 2.5 * attn_fwd
    else:
        heads = b * -(-m.heads // t)
        attn_fwd = rates.scores_ms(heads, s, m.d_head)
        attn_bwd = rates.scores_ms(heads, s, m.d_head, backward=True)
    # autocast over fp32 weights: every micro-batch's forward casts each matmul weight (read fp32, write the
    # compute dtype; again in a full recompute) and its backward casts the weight's gradient back up
    cast_fwd = (prec.weight + prec.cast) * layer_matmul_params(m) / t if prec.cast else 0.0
    cast_bwd = (prec.cast + prec.grad) * layer_matmul_params(m) / t if prec.cast else 0.0
    return BlockCost(matmul_fwd=gemm_fwd + attn_fwd, matmul_bwd=gemm_bwd + attn_bwd, attn_fwd=attn_fwd,
                     bytes_fwd=outside + core + cast_fwd, bytes_bwd=2 * (outside + core) + cast_bwd, core_bytes=core,
                     cast_bytes=cast_fwd + cast_bwd)


def fsdp2_copy_bytes(m: ModelShape, lay: Layout, prec: Precision) -> tuple[float, float]:
    """Bytes torch's FSDP2 (fully_shard) copies on the compute stream per block and micro-batch, forward
    and backward: it all-gathers a block's parameters into one buffer and copies them out into each
    parameter (foreach_all_gather_copy_out: read and write, in the forward and again in the backward, which
    gathers anew), and copies the gradients into the reduce-scatter's buffer in the reduce dtype
    (foreach_reduce_scatter_copy_in: read in the gathered dtype, write in the gradient's), both on the
    current stream (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, 2.4 onwards). A flat FSDP
    (FSDP1, DeepSpeed, lmsys) gathers into the buffer its parameters are views of: none. A full recompute
    does not gather again (FSDP2's pre-forward returns early in the pre-backward state)."""
    from lmsys.plan.shape import layer_params

    if lay.zero < 3 or lay.dp == 1 or lay.fsdp != "fsdp2":
        return 0.0, 0.0
    block = layer_params(m) / lay.tp
    copy_out = 2 * prec.gathered * block
    # under a pipeline FSDP2 keeps the gathered blocks for the step and reduces once (torch's pipelining
    # turns resharding and gradient sync off but for the last micro-batch): once a step, not a micro-batch
    per = 1 / lay.microbatches if lay.pp > 1 else 1
    return per * copy_out, per * (copy_out + (prec.gathered + prec.grad) * block)


def op_recompute_ms(m: ModelShape, *, tokens: int, tp: int, rates: Rates) -> float:
    """ms of the matmuls selective op checkpointing runs again in a block's backward: the 2nd, 4th, ...
    of `op_matmuls` (column-parallel ones split N by tp, row-parallel ones K)."""
    from lmsys.plan.memory import op_matmuls

    total = 0.0
    for i, (name, k, n) in enumerate(op_matmuls(m)):
        if i % 2 == 1:
            row = name in ("attention out", "MLP out")
            total += rates.matmul_ms(tokens, -(-k // tp) if row else k, n if row else -(-n // tp))
    return total


def step_time(m: ModelShape, lay: Layout, prec: Precision, rates: Rates, *, gpus_per_node: int) -> StepTime:
    s, b, h, t, p = m.seq, lay.micro_batch, m.d_model, lay.tp, lay.pp
    tokens = s * b
    ew = (rates.elementwise_GBps or rates.hbm_GBps) * 1e9 / 1e3
    opt_rate = (rates.optimizer_GBps or rates.hbm_GBps) * 1e9 / 1e3

    # one block, one micro-batch, one GPU
    bc = block_cost(m, b=b, t=t, sp=lay.sp, prec=prec, rates=rates)
    # FSDP2's copies: large copy kernels, at the streaming rate (hbm_GBps: the table's 0.8 of HBM, a
    # profile's large copy), not the block's elementwise one
    copy_fwd, copy_bwd = (x / (rates.hbm_GBps * 1e6) for x in fsdp2_copy_bytes(m, lay, prec))
    fwd = bc.matmul_fwd + bc.bytes_fwd / ew + copy_fwd
    bwd = bc.matmul_bwd + bc.bytes_bwd / ew + copy_bwd
    # what the backward runs again, once per block per micro-batch (the head never): the attention core's
    # forward (selective), the whole block's forward, 1x its FLOPs and bytes (full), or every other
    # matmul's forward and the elementwise forward outside attention (op: torchtitan's selective op); FSDP2
    # does not gather again for a full recompute
    recompute = {"none": 0.0, "selective": bc.attn_fwd + bc.core_bytes / ew, "full": fwd - copy_fwd,
                 "op": 0.0}.get(lay.checkpoint, 0.0)
    if lay.checkpoint == "op":
        recompute = op_recompute_ms(m, tokens=tokens, tp=t, rates=rates) + (bc.bytes_fwd - bc.core_bytes) / ew

    # the mesh: tp innermost, then dp, then pp (Megatron-LM's order)
    tp_inter = t > gpus_per_node
    dp_inter = t * lay.dp > gpus_per_node
    dp_per_node = max(1, gpus_per_node // t) if dp_inter else lay.dp  # the dp group's GPUs in one node
    pp_inter = t * lay.dp * p > gpus_per_node and p > 1 and t * lay.dp >= gpus_per_node
    act_bytes = tokens * h * prec.act
    tp_block = tp_fwd = 0.0
    if t > 1:
        allreduce = rates.collective_ms("all-reduce", t, nbytes=act_bytes, inter=tp_inter)
        tp_fwd = 2 * allreduce  # the backward has 2, and the recomputed forward's 2 with full recomputation
        tp_block = 4 * allreduce + (2 * allreduce if lay.checkpoint == "full" else 0)
    tp_bwd = tp_block - tp_fwd

    layers = m.layers / p
    per_mb_layers = layers * (fwd + bwd)
    per_mb_recompute = layers * recompute
    per_mb_tp = layers * tp_block
    # the LM head and loss on the last stage, the embedding on the first
    _, M, K, N = head_gemm(m, tokens=tokens, tp=t)
    head = rates.matmul_ms(M, K, N) + rates.matmul_ms(M, K, N, backward=True) + 3 * 4 * tokens * m.vocab / t * 4 / ew \
        + ((prec.weight + 2 * prec.cast + prec.grad) * m.vocab * h / t / ew if prec.cast else 0.0)
    embed = 3 * tokens * h * prec.act / ew
    if p == 1:
        extra = head + embed
    else:
        extra = max(head, embed)
    pp_mb = 0.0
    if p > 1:
        sent = act_bytes / (t if lay.sp else 1)
        pp_mb = 2 * lay.chunks * rates.collective_ms("send", 2, nbytes=sent, inter=pp_inter)

    # the host: per phase max(device, host) on a GPU, device + host on a CPU; what it adds is `host`
    tensors = param_tensors(m, lay)
    host_fwd, host_bwd, host_opt = host_ms(m, lay, rates, tensors=tensors)
    dev_fwd = layers * (fwd + tp_fwd) + extra / 3
    dev_bwd = layers * (bwd + tp_bwd) + per_mb_recompute + 2 * extra / 3
    host_mb = (max(0.0, host_fwd - dev_fwd) + max(0.0, host_bwd - dev_bwd)) if rates.overlap else host_fwd + host_bwd

    mbs = lay.microbatches
    compute = mbs * (per_mb_layers + extra)
    recompute_ms = mbs * per_mb_recompute
    tp_comm = mbs * per_mb_tp
    pp_comm = mbs * pp_mb
    stage_mb = per_mb_layers + per_mb_recompute + per_mb_tp + pp_mb + host_mb
    bubble = 0.0 if p == 1 else (p - 1) / (lay.chunks if lay.schedule == "interleaved" else 1) * stage_mb

    # data parallelism and the optimizer, on the fuller stage
    n = max(stage_params(m, lay, first=True, last=p == 1), stage_params(m, lay, first=p == 1, last=True))
    dp_comm = 0.0
    if lay.dp > 1:
        d = lay.dp
        grads = rates.collective_ms("reduce-scatter", d, nbytes=n * prec.grad, inter=dp_inter, per_node=dp_per_node)
        params = rates.collective_ms("all-gather", d, nbytes=n * (prec.gathered if lay.zero >= 3 else prec.weight),
                                     inter=dp_inter, per_node=dp_per_node)
        allreduce = rates.collective_ms("all-reduce", d, nbytes=n * prec.grad, inter=dp_inter, per_node=dp_per_node)
        bwd_mb = layers * (bwd + recompute + tp_bwd)  # the recomputation runs inside the backward
        if lay.zero <= 1:
            dp_comm = max(0.0, allreduce - bwd_mb) + (params if lay.zero == 1 else 0.0)
        elif lay.zero == 2:
            dp_comm = max(0.0, grads - bwd_mb) + params
        else:
            dp_comm = mbs * zero3_exposed_ms(m, lay, prec, rates, n=n, fwd_layer=fwd + tp_fwd,
                                             bwd_layer=bwd + recompute + tp_bwd, inter=dp_inter, per_node=dp_per_node)
    shard = lay.dp if lay.zero >= 1 else 1
    optimizer = n / shard * optimizer_bytes(prec) / opt_rate
    if not rates.overlap:  # a CPU: the host is the device
        host = mbs * host_mb + host_opt
    elif p == 1:  # one stage: the host queues ahead across phases (a device-bound optimizer hides the next
        # forward's launches), so the step takes the longer of the two totals
        device = compute + recompute_ms + tp_comm + dp_comm + optimizer
        host = max(0.0, mbs * (host_fwd + host_bwd) + host_opt - device)
    else:  # stages pace each other by micro-batch: per phase
        host = mbs * host_mb + max(0.0, host_opt - optimizer)

    flops = flops_per_token(m) * s * lay.global_batch
    parts = {"fwd block ms": fwd, "bwd block ms": bwd, "tp per block ms": tp_block, "head ms": head,
             "stage ms per micro-batch": stage_mb, "host fwd ms": host_fwd, "host bwd ms": host_bwd,
             "host optimizer ms": host_opt, "elementwise fwd block ms": bc.bytes_fwd / ew,
             "elementwise bwd block ms": bc.bytes_bwd / ew, "autocast casts block ms": bc.cast_bytes / ew}
    return StepTime(compute, recompute_ms, tp_comm, pp_comm, dp_comm, bubble, optimizer, host, flops, parts)


def zero3_exposed_ms(m: ModelShape, lay: Layout, prec: Precision, rates: Rates, *, n: float, fwd_layer: float,
                     bwd_layer: float, inter: bool, per_node: int) -> float:
    """ms one micro-batch's ZeRO-3 (FSDP) communication adds to its forward and backward on one GPU.

    FSDP gathers one block at a time, prefetching the next while the current computes, and reduce-scatters
    a block's gradients while the block before it runs its backward (Zhao et al. 2023, PyTorch FSDP, section
    3.4). So each overlap is bounded by one block's compute: per block max(0, gather - forward) in the
    forward, max(0, gather + reduce-scatter - backward) in the backward (one NCCL stream: they queue), the
    first block's gather and the last reduce-scatter exposed, as is the gather and reduce-scatter of the
    rest (embedding, head: the root unit). While a collective runs beside compute it holds `comm_sm_share`
    of the SMs: the overlapped part of the compute runs that much slower."""
    from lmsys.plan.shape import layer_params

    d, layers = lay.dp, m.layers / lay.pp
    block = layer_params(m) / lay.tp
    root = max(0.0, n - layers * block)

    def gather(params):
        return rates.collective_ms("all-gather", d, nbytes=params * prec.gathered, inter=inter, per_node=per_node)

    def scatter(params):
        return rates.collective_ms("reduce-scatter", d, nbytes=params * prec.grad, inter=inter, per_node=per_node)

    g, r = gather(block), scatter(block)
    share = rates.comm_sm_share
    fwd = g + (layers - 1) * max(0.0, g - fwd_layer) + share * (layers - 1) * min(g, fwd_layer)
    bwd = r + layers * max(0.0, g + r - bwd_layer) + share * layers * min(g + r, bwd_layer)
    if root:
        fwd += gather(root)
        bwd += gather(root) + scatter(root)
    return fwd + bwd


def mfu(st: StepTime, *, gpus: int, peak_tflops: float) -> float:
    """Model FLOPs (6·N·tokens + attention, PaLM) over the step time and all GPUs' peak."""
    return st.flops / (st.total * 1e-3) / (gpus * peak_tflops * 1e12)
