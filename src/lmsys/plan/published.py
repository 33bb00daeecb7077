"""`plan validate --published`: the planner against published training runs, with one set of assumptions.

The runs live in `published_runs.yaml` (shipped in the package; another file of the same form can be
given). Each run records its source (a repository path at a commit), the hardware, the mesh, micro and
global batch, recomputation, attention kernel, precision and the published tokens/s per GPU (and MFU,
memory where the source gives them). Every run is predicted with the GPU table, the run's hardware
figures and the time model's one `Efficiency` and one stack (`lmsys.plan.time.STACKS`): nothing is
fitted per run. A run the planner predicts not to fit is a row saying so, not an error. Torch-free.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from lmsys.core.errors import LmsysError

SHIPPED = Path(__file__).with_name("published_runs.yaml")
RUN_FIELDS = ("id", "source", "table", "model", "seq", "system", "gpus", "mesh", "micro_batch", "global_batch",
              "recompute", "attention", "stack", "precision", "state", "published")
SOURCE_FIELDS = ("title", "repo", "path", "commit", "definition")
SYSTEM_FIELDS = ("gpu", "gpus_per_node", "network_GBps", "stated")
GPU_OVERRIDES = ("hbm_GB", "hbm_GBps", "bf16", "nvlink_GBps", "network_GBps")


def load_published(path: str | Path | None = None) -> dict:
    """The runs file as a mapping (sources, models, systems, runs), every field checked: a missing or
    unknown reference is a one-line error naming the run and the field."""
    import yaml

    path = Path(path) if path is not None else SHIPPED
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise LmsysError(f"--published {path}: cannot read it ({exc.__class__.__name__})") from None
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list) or not data["runs"]:
        raise LmsysError(f"--published {path}: expected a mapping with sources, models, systems and a list of runs")
    for key in ("sources", "models", "systems"):
        if not isinstance(data.get(key), dict):
            raise LmsysError(f"--published {path}: `{key}` must be a mapping")
    for name, src in data["sources"].items():
        missing = [f for f in SOURCE_FIELDS if not (isinstance(src, dict) and src.get(f))]
        if missing:
            raise LmsysError(f"--published {path}: source {name} lacks {', '.join(missing)}")
        if not isinstance(src["commit"], str) or len(src["commit"]) != 40:
            raise LmsysError(f"--published {path}: source {name}: commit must be a 40-hex commit hash")
    for name, system in data["systems"].items():
        missing = [f for f in SYSTEM_FIELDS if not (isinstance(system, dict) and f in system)]
        if missing:
            raise LmsysError(f"--published {path}: system {name} lacks {', '.join(missing)}")
    seen = set()
    for i, run in enumerate(data["runs"]):
        rid = run.get("id", f"#{i + 1}") if isinstance(run, dict) else f"#{i + 1}"
        missing = [f for f in RUN_FIELDS if not isinstance(run, dict) or run.get(f) is None]
        if missing:
            raise LmsysError(f"--published {path}: run {rid} lacks {', '.join(missing)}")
        if rid in seen:
            raise LmsysError(f"--published {path}: run id {rid} twice")
        seen.add(rid)
        for key, table in (("source", "sources"), ("model", "models"), ("system", "systems")):
            if run[key] not in data[table]:
                raise LmsysError(f"--published {path}: run {rid}: {key} {run[key]!r} is not in `{table}`")
        if not (run["published"].get("tokens_per_s_per_gpu") or 0) > 0:
            raise LmsysError(f"--published {path}: run {rid}: published.tokens_per_s_per_gpu must be positive")
    return data


def run_shape(data: dict, run: dict):
    """The run's ModelShape: its model's sizes at its sequence. Layers that the pipeline does not divide
    evenly (BLOOM's 70 over 12 stages, placed with the embeddings counted as blocks) are rounded up to a
    multiple of pp: the fullest stage's blocks, which set the pace."""
    from lmsys.plan.shape import ModelShape

    spec = dict(data["models"][run["model"]])
    fields = {"vocab": spec.pop("vocab"), "d_model": spec.pop("d_model"), "d_ff": spec.pop("d_ff"),
              "layers": spec.pop("num_layers"), "heads": spec.pop("num_heads"),
              "kv_heads": spec.pop("num_kv_heads", None), "seq": run["seq"]}
    fields["kv_heads"] = fields["kv_heads"] or fields["heads"]
    known = {f.name for f in dataclasses.fields(ModelShape)}
    unknown = set(spec) - known
    if unknown:
        raise LmsysError(f"published model {run['model']}: unknown keys {sorted(unknown)}")
    pp = run["mesh"].get("pp", 1)
    fields["layers"] = math.ceil(fields["layers"] / pp) * pp
    return ModelShape(name=run["model"], **fields, **spec)


def run_cluster(data: dict, run: dict):
    from lmsys.core.hardware import get_gpu
    from lmsys.plan.search import Cluster

    system = data["systems"][run["system"]]
    gpu = get_gpu(system["gpu"], option="a published system's gpu")
    gpu = dataclasses.replace(gpu, **{k: system[k] for k in GPU_OVERRIDES if k in system})
    if "hbm_GB" in system:  # another part's memory: the table's nvidia-smi reading is not this one's
        gpu = dataclasses.replace(gpu, memory_MiB=None)
    return Cluster(gpu, run["gpus"], system["gpus_per_node"])


def run_layout(run: dict):
    from lmsys.plan.memory import Layout

    mesh = run["mesh"]
    tp, pp = mesh.get("tp", 1), mesh.get("pp", 1)
    dp = mesh.get("dp", run["gpus"] // (tp * pp))
    if dp * tp * pp != run["gpus"]:
        raise LmsysError(f"published run {run['id']}: dp {dp} × tp {tp} × pp {pp} is not its {run['gpus']} GPUs")
    per_replica = run["global_batch"] / dp / run["micro_batch"]
    if per_replica != int(per_replica):
        raise LmsysError(f"published run {run['id']}: global batch {run['global_batch']} is not dp {dp} × "
                         f"micro-batch {run['micro_batch']} × a whole number of micro-batches")
    return Layout(dp=dp, tp=tp, pp=pp, zero=mesh.get("zero", 0), sp=mesh.get("sp", False),
                  schedule=mesh.get("schedule", "none" if pp == 1 else "1f1b"), chunks=mesh.get("chunks", 1),
                  micro_batch=run["micro_batch"], microbatches=int(per_replica), checkpoint=run["recompute"],
                  fsdp=mesh.get("fsdp", Layout.fsdp))


def run_precision(run: dict):
    """The run's `state`: how weights, gradients and optimizer state are kept (lmsys.plan.memory.PRECISIONS:
    autocast, master or fsdp)."""
    from lmsys.plan.memory import PRECISIONS

    if run["state"] not in PRECISIONS or run["state"] == "fp32":
        raise LmsysError(f"published run {run['id']}: state {run['state']!r} is not autocast, master or fsdp")
    return PRECISIONS[run["state"]]


def predict(data: dict, run: dict) -> dict:
    """One row: the run, its published figures and the planner's, with the error of tokens/s/GPU."""
    from lmsys.plan.memory import GiB
    from lmsys.plan.search import evaluate
    from lmsys.plan.time import Efficiency, table_rates

    shape = run_shape(data, run)
    cluster = run_cluster(data, run)
    lay = run_layout(run)
    prec = run_precision(run)
    rates = table_rates(cluster.gpu, "bf16", eff=Efficiency(), stack=run["stack"])
    plan = evaluate(shape, lay, prec, rates, cluster, peak_tflops=cluster.gpu.bf16, fused=run["stack"] == "fused")
    pub = run["published"]
    tps = plan.tokens_per_s_per_gpu
    need = (plan.memory.total + plan.memory.reserve) / GiB
    row = {
        "run": run["id"],
        "source": run["source"],
        "GPU": f"{run['gpus']} × {cluster.gpu.name}" + (" (as stated)" if cluster.gpu != _table_gpu(cluster) else ""),
        "model": f"{run['model']} s={run['seq']}",
        "mesh": lay.describe() + (f" ZeRO-{lay.zero}" if lay.zero else ""),
        "batch": f"{lay.micro_batch}×{lay.microbatches}×{lay.dp}",
        "recompute": run.get("recompute_as_published", run["recompute"]),
        "stack": run["stack"],
        "published tok/s/GPU": float(pub["tokens_per_s_per_gpu"]),
        "predicted tok/s/GPU": tps,
        "error %": 100 * (tps - pub["tokens_per_s_per_gpu"]) / pub["tokens_per_s_per_gpu"],
        "published MFU %": pub.get("mfu_percent"),
        "predicted MFU %": 100 * plan.mfu,
        "published GiB": pub.get("memory_GiB"),
        "predicted GiB": need,
        "fits": plan.fits,
        "step ms": plan.time.total,
    }
    row["overflow"] = None if plan.fits else plan.memory.overflow()
    return row


def _table_gpu(cluster):
    from lmsys.core.hardware import GPUS

    return GPUS.get(cluster.gpu.name)


def validate_published(path: str | Path | None = None) -> tuple[list[dict], dict]:
    """(rows, summary) over every run of the file (the shipped set by default). The summary: mean and max
    |error| of tokens/s/GPU, rows within 10 and 20 %, runs predicted not to fit."""
    data = load_published(path)
    rows = [predict(data, run) for run in data["runs"]]
    errs = [abs(r["error %"]) for r in rows]
    repos = {data["sources"][run["source"]]["repo"] for run in data["runs"]}
    summary = {"runs": len(rows), "sources": len(repos),  # independent: one per repository
               "mean |error| %": sum(errs) / len(errs), "max |error| %": max(errs),
               "within 10 %": sum(e <= 10 for e in errs), "within 20 %": sum(e <= 20 for e in errs),
               "not fitting": [r["run"] for r in rows if not r["fits"]]}
    return rows, summary


def published_report(path: str | Path | None = None) -> tuple[list[dict], dict, list[str]]:
    """`plan validate --published`: (rows, meta, notes) for the renderer. A run predicted not to fit is a
    row (fits: False) and a note saying what overflows."""
    from lmsys.core.hardware import GEMM_LAUNCH_US, H100_SUSTAINED, H200_SUSTAINED, MATMUL_FIT
    from lmsys.plan.time import EAGER_ELEMENTWISE, NCCL_SMS, Efficiency

    rows, summary = validate_published(path)
    eff = Efficiency()

    meta = {"runs": f"{summary['runs']} runs from {summary['sources']} sources ({path or 'the shipped set, lmsys/plan/published_runs.yaml'})",
            "assumptions": (f"one set for every run: the GPU table's bf16 peaks, links, flash-attention fraction "
                            f"(H100/H200 0.35, A100 0.5) and memory as nvidia-smi reads it (a run's stated hardware "
                            f"figures replace the table's); every GEMM at the rate its GPU keeps at its power limit "
                            f"(H100 {H100_SUSTAINED}, H200 {H200_SUSTAINED} of the peak: plan calibrate --sustain; "
                            f"A100 and B200 {MATMUL_FIT}: calibrate's H200 bursts) plus {GEMM_LAUNCH_US:g} µs, "
                            f"FSDP2's copies on the compute stream (torch fully_shard runs), elementwise work at "
                            f"{eff.hbm} of HBM (fused stack) or {EAGER_ELEMENTWISE:.2f} (eager, measured on an H200), "
                            f"links {eff.link} with NCCL's ring latency per step; FSDP gathers and reduce-scatters "
                            f"overlap block by block, the first and last exposed, taking {NCCL_SMS} SMs from compute "
                            "while they run; across nodes the node's NICs together; "
                            "docs/plan.md lists every one with its source")}
    notes = [f"tokens/s per GPU: mean |error| {summary['mean |error| %']:.1f} %, max {summary['max |error| %']:.1f} %; "
             f"{summary['within 10 %']} of {summary['runs']} runs within 10 %, {summary['within 20 %']} within 20 %.",
             "error % = (predicted - published) / published tokens/s per GPU; MFU: 6·N·tokens + attention (PaLM) "
             "over the bf16 peak the run's GPU is given; GiB: the planner's per-GPU need including its reserve "
             "(1 GiB + 5 %), beside the peak the source reports where it reports one."]
    for row in rows:
        if row.pop("overflow"):
            notes.append(f"{row['run']} trained on its hardware but is predicted not to fit.")
    return rows, meta, notes
