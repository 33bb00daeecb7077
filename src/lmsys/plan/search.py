"""Enumerate the layouts of a training run over a cluster, keep those that fit, rank them by tokens/s.

A layout is a mesh dp × tp × pp of the GPUs (tp within a node, dividing heads, kv heads, d_ff and the
vocabulary; pp dividing the layers), a ZeRO stage, sequence parallelism on or off, a pipeline schedule
(1F1B, or interleaved with 2 or 4 chunks), a micro-batch size dividing the per-replica batch, and
recomputation none / selective / full. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from lmsys.core.errors import LmsysError
from lmsys.plan.memory import CHECKPOINT_KINDS, CHECKPOINTS, GiB, Layout, Memory, Precision, check_layout, memory
from lmsys.plan.shape import ModelShape
from lmsys.plan.time import Rates, StepTime, mfu, step_time

MESH_KEYS = ("dp", "tp", "pp", "zero", "sp", "schedule", "chunks", "micro_batch", "checkpoint", "fsdp")
CHOICE_KEYS = ("schedule", "checkpoint", "fsdp")  # --mesh keys whose value is one of a list
MICRO_BATCHES = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class Cluster:
    gpu: object  # lmsys.core.hardware.GPU
    gpus: int
    gpus_per_node: int

    @property
    def capacity(self) -> float:
        # nvidia-smi's MiB where the table has them (lmsys.core.hardware.GPU.capacity_bytes), else the datasheet's GB
        cap = getattr(self.gpu, "capacity_bytes", None)
        return cap if cap is not None else self.gpu.hbm_GB * 1e9


@dataclass
class Plan:
    layout: Layout
    memory: Memory
    time: StepTime
    mfu: float
    tokens_per_s_per_gpu: float

    @property
    def fits(self) -> bool:
        return self.memory.headroom >= 0


def load_cluster(path: str | Path, *, gpus: int | None, gpus_per_node: int | None) -> Cluster:
    """A YAML file: `gpu:` a table name or torch's device name, `gpus:`, `gpus_per_node:`, and any GPU
    field to override (bf16, hbm_GB, hbm_GBps, nvlink_GBps, network_GBps, ...), e.g. a part not in the
    table: `gpu: {name: MyGPU, bf16: 500, ...}` with every field."""
    import dataclasses

    import yaml

    from lmsys.core.hardware import GPU, get_gpu

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise LmsysError(f"--cluster {path}: cannot read it ({exc.__class__.__name__})") from None
    if not isinstance(data, dict) or "gpu" not in data:
        raise LmsysError(f"--cluster {path}: expected a mapping with `gpu:` (a name, or a mapping of its figures)")
    known = {f.name for f in dataclasses.fields(GPU)} - {"patterns", "sources", "exclude"}
    gpu_spec = data.pop("gpu")
    n = data.pop("gpus", None)
    per_node = data.pop("gpus_per_node", None)
    overrides = {k: v for k, v in data.items() if k in known}
    unknown = set(data) - known
    if unknown:
        raise LmsysError(f"--cluster {path}: unknown keys {sorted(unknown)}; known: gpu, gpus, gpus_per_node, "
                         f"{', '.join(sorted(known))}")
    if isinstance(gpu_spec, dict):
        missing = known - {"name"} - set(gpu_spec) - {"fp8", "network_GBps"}
        if missing:
            raise LmsysError(f"--cluster {path}: gpu is missing {sorted(missing)}")
        gpu = GPU(patterns=(), sources={k: str(path) for k in ("compute", "memory", "links", "network")},
                  **{"fp8": None, "network_GBps": None, **gpu_spec})
    else:
        gpu = get_gpu(str(gpu_spec), option="a `gpu:` mapping of its figures in --cluster")
    gpu = dataclasses.replace(gpu, **overrides)
    return Cluster(gpu, gpus or n or 1, gpus_per_node or per_node or 8)


def parse_mesh(text: str) -> dict:
    """'dp=8,tp=1,pp=1' (also zero=, sp=on|off, schedule=, chunks=, micro_batch= or mb=, checkpoint=,
    fsdp=flat-param|fsdp2: ZeRO-3's implementation, lmsys.plan.time.fsdp2_copy_bytes)."""
    out: dict = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = item.partition("=")
        key = {"mb": "micro_batch", "ckpt": "checkpoint"}.get(key.strip(), key.strip())
        value = value.strip()
        if key not in MESH_KEYS or not value:
            raise LmsysError(f"--mesh: cannot read {item!r}; use key=value with keys {', '.join(MESH_KEYS)}")
        if key in CHOICE_KEYS:
            from lmsys.plan.memory import CHECKPOINT_KINDS, FSDP_KINDS, SCHEDULES

            allowed = {"schedule": SCHEDULES, "checkpoint": CHECKPOINT_KINDS, "fsdp": FSDP_KINDS}[key]
            if value not in allowed:
                raise LmsysError(f"--mesh: {key}={value} is not one of {', '.join(allowed)}")
            out[key] = value
        elif key == "sp":
            if value not in ("on", "off", "1", "0", "true", "false"):
                raise LmsysError(f"--mesh: sp must be on or off, not {value!r}")
            out[key] = value in ("on", "1", "true")
        else:
            try:
                out[key] = int(value)
            except ValueError:
                raise LmsysError(f"--mesh: {key} must be an integer, not {value!r}") from None
            if key == "zero" and out[key] not in (0, 1, 2, 3):
                raise LmsysError(f"--mesh: zero={value} is not a ZeRO stage; one of 0 (none), 1 (optimizer state "
                                 "sharded), 2 (and gradients), 3 (and weights)")
            if out[key] < (0 if key == "zero" else 1):
                raise LmsysError(f"--mesh: {key} must be {'>= 0' if key == 'zero' else 'positive'}, got {value}")
    return out


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(m: ModelShape, *, gpus: int, gpus_per_node: int) -> Iterator[tuple[int, int, int]]:
    """(dp, tp, pp) with dp·tp·pp = gpus, tp within a node dividing the model's widths, pp its layers."""
    for tp in divisors(gpus):
        if tp > gpus_per_node or any(x % tp for x in (m.heads, m.kv_heads, m.d_ff, m.vocab)):
            continue
        for pp in divisors(gpus // tp):
            if m.layers % pp == 0:
                yield gpus // tp // pp, tp, pp


def candidates(m: ModelShape, *, gpus: int, gpus_per_node: int, global_batch: int, fixed: dict) -> Iterator[Layout]:
    """Every layout of `gpus` for `global_batch` sequences, restricted to what `fixed` (--mesh) sets."""
    for dp, tp, pp in meshes(m, gpus=gpus, gpus_per_node=gpus_per_node):
        if any(k in fixed and fixed[k] != v for k, v in (("dp", dp), ("tp", tp), ("pp", pp))):
            continue
        if global_batch % dp:
            continue
        per_replica = global_batch // dp
        for b in MICRO_BATCHES:
            if per_replica % b or fixed.get("micro_batch", b) != b:
                continue
            mbs = per_replica // b
            schedules = [("none", 1)] if pp == 1 else [("1f1b", 1)] + [
                ("interleaved", v) for v in (2, 4) if m.layers % (pp * v) == 0 and mbs % pp == 0]
            for schedule, chunks in schedules:
                if fixed.get("schedule", schedule) != schedule or fixed.get("chunks", chunks) != chunks:
                    continue
                for zero in ((0,) if dp == 1 else (0, 1, 2, 3)):
                    if fixed.get("zero", zero) != zero:
                        continue
                    for sp in ((False, True) if tp > 1 and m.seq % tp == 0 else (False,)):
                        if fixed.get("sp", sp) != sp:
                            continue
                        for ckpt in (CHECKPOINT_KINDS if fixed.get("checkpoint") == "op" else CHECKPOINTS):
                            if fixed.get("checkpoint", ckpt) != ckpt:
                                continue
                            yield Layout(dp=dp, tp=tp, pp=pp, zero=zero, sp=sp, schedule=schedule, chunks=chunks,
                                         micro_batch=b, microbatches=mbs, checkpoint=ckpt,
                                         fsdp=fixed.get("fsdp", Layout.fsdp))


def evaluate(m: ModelShape, lay: Layout, prec: Precision, rates: Rates, cluster: Cluster, *, peak_tflops: float,
             fused: bool = False) -> Plan:
    """One layout's memory and step time; `fused`: the stack's compiled memory (lmsys.plan.memory.memory)."""
    mem = memory(m, lay, prec, capacity=cluster.capacity, fused=fused)
    st = step_time(m, lay, prec, rates, gpus_per_node=cluster.gpus_per_node)
    tokens = lay.global_batch * m.seq
    return Plan(lay, mem, st, mfu(st, gpus=lay.gpus, peak_tflops=peak_tflops),
                tokens / (st.total * 1e-3) / lay.gpus)


def search(m: ModelShape, *, prec: Precision, rates: Rates, cluster: Cluster, global_batch: int, peak_tflops: float,
           fixed: dict | None = None) -> list[Plan]:
    """Every layout that fits, fastest first (ties: less memory). None fits: the error names the closest
    one and what overflows; a --mesh that the model or the batch rule out: the error says which."""
    fixed = dict(fixed or {})
    if "dp" in fixed or "tp" in fixed or "pp" in fixed:
        _check_fixed(m, fixed, cluster=cluster, global_batch=global_batch)
    plans = [evaluate(m, lay, prec, rates, cluster, peak_tflops=peak_tflops)
             for lay in candidates(m, gpus=cluster.gpus, gpus_per_node=cluster.gpus_per_node,
                                   global_batch=global_batch, fixed=fixed)]
    if not plans:
        raise LmsysError(f"no layout of {cluster.gpus} GPUs runs {m.name} with a global batch of {global_batch} "
                         f"sequences{' and --mesh ' + _fixed_text(fixed) if fixed else ''}: the data-parallel "
                         "degree must divide the batch, tp the heads, kv heads, d_ff and vocabulary, pp the layers")
    fitting = [p for p in plans if p.fits]
    if not fitting:
        closest = max(plans, key=lambda p: p.memory.headroom)
        raise LmsysError(f"nothing fits on {cluster.gpus} × {cluster.gpu.name}: the closest layout "
                         f"({describe(closest.layout)}) {closest.memory.overflow()}",
                         hint="more GPUs, a smaller global batch, or a GPU with more memory")
    return sorted(fitting, key=lambda p: (-p.tokens_per_s_per_gpu, p.memory.total))


def _check_fixed(m: ModelShape, fixed: dict, *, cluster: Cluster, global_batch: int) -> None:
    dims = {k: fixed.get(k) for k in ("dp", "tp", "pp")}
    given = [v for v in dims.values() if v]
    if dims["dp"] == 1 and fixed.get("zero", 0) > 0:
        raise LmsysError(f"--mesh {_fixed_text(fixed)}: zero={fixed['zero']} shards over the data-parallel ranks, "
                         "and dp=1 has one", hint="zero=0 with dp=1, or dp >= 2")
    if all(dims.values()) and dims["dp"] * dims["tp"] * dims["pp"] != cluster.gpus:
        raise LmsysError(f"--mesh dp={dims['dp']},tp={dims['tp']},pp={dims['pp']} is "
                         f"{dims['dp'] * dims['tp'] * dims['pp']} GPUs, not the {cluster.gpus} of --gpus")
    product = 1
    for v in given:
        product *= v
    if cluster.gpus % product:
        raise LmsysError(f"--mesh {_fixed_text(fixed)}: its degrees do not divide the {cluster.gpus} GPUs")
    tp, pp = dims["tp"] or 1, dims["pp"] or 1
    probe = Layout(tp=tp, pp=pp, chunks=fixed.get("chunks", 1), sp=fixed.get("sp", False) and tp > 1,
                   schedule=fixed.get("schedule", "none" if pp == 1 else "1f1b"))
    check_layout(m, probe)  # tp against heads / kv heads / d_ff / vocabulary, pp against layers
    if dims["dp"] and global_batch % dims["dp"]:
        raise LmsysError(f"--mesh dp={dims['dp']} does not divide the global batch of {global_batch} sequences")
    if dims["tp"] and dims["tp"] > cluster.gpus_per_node:
        raise LmsysError(f"--mesh tp={dims['tp']} spans nodes of {cluster.gpus_per_node} GPUs; tensor parallelism "
                         "stays within a node here")


def _fixed_text(fixed: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in fixed.items())


def describe(lay: Layout) -> str:
    sched = "" if lay.pp == 1 else f", {lay.schedule}" + (f"×{lay.chunks}" if lay.chunks > 1 else "")
    return (f"{lay.describe()}, ZeRO-{lay.zero}, SP {'on' if lay.sp else 'off'}{sched}, micro-batch "
            f"{lay.micro_batch} × {lay.microbatches}, checkpoint {lay.checkpoint}")


def row(plan: Plan) -> dict:
    """One output row: the layout, memory per GPU (GiB), step time split (ms), MFU, tokens/s/GPU."""
    lay, mem, st = plan.layout, plan.memory, plan.time
    return {
        "mesh": lay.describe(),
        "ZeRO": "FSDP (3)" if lay.zero == 3 else str(lay.zero),
        "SP": lay.sp,
        "schedule": "—" if lay.pp == 1 else (lay.schedule + (f"×{lay.chunks}" if lay.chunks > 1 else "")),
        "micro-batches": lay.microbatches,
        "micro-batch": lay.micro_batch,
        "checkpoint": lay.checkpoint,
        "weights GiB": mem.weights / GiB,
        "grads GiB": mem.grads / GiB,
        "optimizer GiB": mem.optimizer / GiB,
        "activations GiB": mem.activations / GiB,
        "buffers GiB": mem.buffers / GiB,
        "headroom GiB": mem.headroom / GiB,
        "memory peak": mem.phase,
        "compute ms": st.compute,
        "recompute ms": st.recompute,
        "tp comm ms": st.tp_comm,
        "pp comm ms": st.pp_comm,
        "dp comm ms": st.dp_comm,
        "bubble ms": st.bubble,
        "optimizer ms": st.optimizer,
        "host ms": st.host,
        "step ms": st.total,
        "MFU %": 100 * plan.mfu,
        "tokens/s/GPU": plan.tokens_per_s_per_gpu,
    }


def plot_plans(plans: list[Plan], path, *, title: str) -> None:
    """Two stacked bars per plan: memory per GPU (GiB) and step time (ms), split by term, to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row(p) for p in plans]
    labels = [f"{r['mesh']}\nZ{plans[i].layout.zero} {r['checkpoint']}" for i, r in enumerate(rows)]
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(rows) * 2), 5))
    for ax, keys, unit in ((ax_mem, ("weights", "grads", "optimizer", "activations", "buffers"), "GiB"),
                           (ax_time, ("compute", "recompute", "tp comm", "pp comm", "dp comm", "bubble", "optimizer", "host"),
                            "ms")):
        bottom = [0.0] * len(rows)
        for key in keys:
            values = [max(r[f"{key} {unit}"], 0.0) for r in rows]
            ax.bar(range(len(rows)), values, bottom=bottom, label=key)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_xticks(range(len(rows)), labels, fontsize="small")
        ax.set_ylabel(("memory per GPU (" if unit == "GiB" else "step time (") + unit + ")")
        ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    from lmsys.core.files import save_figure

    save_figure(fig, path, what="--plot", dpi=120)  # whole or not at all; a link or a device written through
    plt.close(fig)
