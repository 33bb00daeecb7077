"""`plan train`: the one library call behind the command (inputs resolved, rows and meta out). Torch-free."""

from __future__ import annotations

from lmsys.core.errors import LmsysError
from lmsys.plan import memory as mem
from lmsys.plan import search as srch
from lmsys.plan.shape import load_shape
from lmsys.plan.time import Efficiency, table_rates

# plan train's terminal view: memory and time in one column each (md, csv and json keep every column)
GROUPS = [
    ("micro-batches/size", ("micro-batches", "micro-batch")),
    ("memory GiB (w/g/o/a/b/free)",
     ("weights GiB", "grads GiB", "optimizer GiB", "activations GiB", "buffers GiB", "headroom GiB")),
    ("ms (comp/recomp/tp/pp/dp/bubble/opt/host)",
     ("compute ms", "recompute ms", "tp comm ms", "pp comm ms", "dp comm ms", "bubble ms", "optimizer ms", "host ms")),
]

NOTES = [
    "Memory per GPU on its fullest pipeline stage at the phase of the step where it peaks (memory peak: forward, "
    "backward start, backward end or optimizer), each term what is alive then (no gradient yet at a first "
    "forward's end); headroom = the GPU's memory (nvidia-smi's MiB where the GPU table has them, else the "
    "datasheet's GB) - (1 GiB + 5 %) reserve (CUDA context, NCCL, fragmentation) "
    "- the rest. Activations per Korthikanti et al. 2022, counted tensor by tensor (docs/plan.md).",
    "Step time on the slowest GPU; comm = what is not hidden under compute (tensor and pipeline "
    "communication never are); bubble (p-1)/(m+p-1) of a pipeline step (÷ chunks interleaved).",
    "MFU: 6·N·tokens + attention (PaLM convention, causal counted in full) over the peak for the dtype.",
    "host: launch time the device does not hide (docs/plan.md). On the terminal, memory GiB (w/g/o/a/b/free) = "
    "weights/gradients/optimizer/activations/buffers/headroom and ms (comp/recomp/tp/pp/dp/bubble/opt/host) = "
    "compute/recompute/exposed tp, pp, dp communication/bubble/optimizer/host; md, csv and json keep a column each.",
]


STACKS = {
    "production": "a production stack: a fused flash kernel where the model says naive attention, fused "
                  "elementwise kernels (0.8 of HBM)",
    "eager": "lmsys's eager block: the model's own attention, one kernel an op (0.37 of HBM, as lmsys's "
             "block reached on an H200)",
}


def resolve(*, size: str, context_length: int | None, gpus: int | None, gpus_per_node: int | None, gpu: str | None,
            cluster: str | None, profile: str | None, dtype: str, master_weights: bool,
            peak_tflops: float | None, stack: str = "production"):
    """(shape, precision, cluster, rates, peak TFLOP/s, peak label) from the command line's options.
    `stack` (STACKS): production runs naive attention as a flash kernel and the elementwise work fused;
    eager keeps the model's attention and lmsys's eager elementwise rate. A profile's measured rates
    replace the stack's elementwise rate either way."""
    from dataclasses import replace

    from lmsys.core.hardware import find_gpu, get_gpu, peak_label
    from lmsys.core.parsing import choose
    from lmsys.plan.profile import device_part, load_profile, rates as profile_rates

    choose(stack, tuple(STACKS), what="--stack")
    shape = load_shape(size, seq=context_length)
    if stack == "production" and shape.attention == "naive":
        shape = replace(shape, attention="flash")
    prof = load_profile(profile) if profile else None
    measured_peak = False  # the part is the profile's device: MFU divides by its measured matmul rate
    if cluster:
        clu = srch.load_cluster(cluster, gpus=gpus, gpus_per_node=gpus_per_node)
    else:
        name = gpu or (prof["device"] if prof else None)
        if name is None:
            raise LmsysError("give the GPU: --gpu NAME or --cluster FILE.yaml (or a --profile from plan calibrate)")
        if gpu or find_gpu(name):
            part = get_gpu(name, option="--cluster FILE.yaml")
        else:  # a CPU or a GPU the table lacks: what the profile measured
            profile_rates(prof, dtype)  # one line if the profile has no rates for this dtype
            part, measured_peak = device_part(prof, path=profile), True
        clu = srch.Cluster(part, gpus or 1, gpus_per_node or 8)
    if clu.gpus < 1:
        raise LmsysError(f"--gpus must be >= 1, got {clu.gpus}")
    if clu.gpus > clu.gpus_per_node and clu.gpus % clu.gpus_per_node:
        near = sorted({clu.gpus // clu.gpus_per_node * clu.gpus_per_node, -(-clu.gpus // clu.gpus_per_node)
                       * clu.gpus_per_node})
        raise LmsysError(f"--gpus {clu.gpus} is not a whole number of nodes of --gpus-per-node {clu.gpus_per_node}",
                         hint=f"--gpus {' or '.join(map(str, near))}, or a --gpus-per-node that divides {clu.gpus}")
    peak = peak_tflops if peak_tflops is not None else clu.gpu.peak(dtype)
    if peak is None:
        raise LmsysError(f"{clu.gpu.name} has no {dtype} rate in the table; give --peak-tflops")
    rates = table_rates(clu.gpu, dtype, eff=Efficiency(), peak_tflops=peak,
                        stack="fused" if stack == "production" else "eager")
    if prof is not None:
        rates = profile_rates(prof, dtype, fallback=rates)
    label = peak_label(clu.gpu.name, dtype, peak) + (
        " (--peak-tflops)" if peak_tflops is not None else
        " (measured matmul rate from the profile: the device is not in the GPU table; --peak-tflops gives a peak)"
        if measured_peak else "")
    return shape, mem.precision(dtype, master_weights=master_weights), clu, rates, peak, label


def global_batch_sequences(*, tokens: int | None, sequences: int | None, seq: int, gpus: int) -> int:
    if tokens is not None and sequences is not None:
        raise LmsysError("--global-batch-tokens and --global-batch are exclusive: give one")
    if tokens is not None:
        if tokens % seq:
            raise LmsysError(f"--global-batch-tokens {tokens} is not a whole number of {seq}-token sequences")
        return tokens // seq
    return sequences if sequences is not None else gpus


def plan_train(*, size: str, gpus: int | None = None, gpus_per_node: int | None = None, gpu: str | None = None,
               cluster: str | None = None, profile: str | None = None, dtype: str = "bf16",
               master_weights: bool = True, global_batch_tokens: int | None = None, global_batch: int | None = None,
               context_length: int | None = None, mesh: str | None = None, top: int = 10,
               peak_tflops: float | None = None, stack: str = "production") -> tuple[list[dict], dict, list, list[str]]:
    """(rows, meta, plans, notes): the `top` fitting layouts, fastest first."""
    shape, prec, clu, rates, peak, label = resolve(
        size=size, context_length=context_length, gpus=gpus, gpus_per_node=gpus_per_node, gpu=gpu, cluster=cluster,
        profile=profile, dtype=dtype, master_weights=master_weights, peak_tflops=peak_tflops, stack=stack)
    batch = global_batch_sequences(tokens=global_batch_tokens, sequences=global_batch, seq=shape.seq, gpus=clu.gpus)
    fixed = srch.parse_mesh(mesh) if mesh else {}
    plans = srch.search(shape, prec=prec, rates=rates, cluster=clu, global_batch=batch, peak_tflops=peak,
                        fixed=fixed)[:top]
    meta = {
        "model": shape.describe(),
        "cluster": f"{clu.gpus} × {clu.gpu.name}, {clu.gpus_per_node} per node, {clu.gpu.hbm_GB:g} GB each",
        "batch": f"{batch} sequences × {shape.seq} tokens per step, {dtype}, {prec.name} precision "
                 f"({prec.state} bytes/parameter of weights, gradients and optimizer)",
        "MFU peak": label,
        "rates": rates.source,
        "stack": f"{stack}: {STACKS[stack]}",
    }
    return [srch.row(p) for p in plans], meta, plans, list(NOTES)


def train_report(*, size: str, gpus: int | None, gpus_per_node: int | None, gpu: str | None, cluster, profile,
                 dtype: str, master_weights: bool, global_batch_tokens: int | None, global_batch: int | None,
                 context_length: int | None, mesh: str | None, top: int, plot, peak_tflops: float | None,
                 stack: str):
    """`plan train`: its options checked (torch-free), the plan, the plot when asked; one Report."""
    from lmsys.core.files import check_output_path
    from lmsys.core.hardware import check_peak
    from lmsys.core.parsing import check_counts, choose
    from lmsys.core.results import Report

    check_output_path(plot, what="--plot")
    choose(dtype, ("fp32", "bf16", "fp16"), what="--dtype")
    choose(stack, ("production", "eager"), what="--stack")
    check_counts(top=(top, 1))
    check_peak(peak_tflops)
    given = dict(gpus=gpus, gpus_per_node=gpus_per_node, context_length=context_length, global_batch=global_batch,
                 global_batch_tokens=global_batch_tokens)
    check_counts(**{name: (value, 1) for name, value in given.items() if value is not None})
    rows, meta, plans, notes = plan_train(
        size=size, gpus=gpus, gpus_per_node=gpus_per_node, gpu=gpu, cluster=str(cluster) if cluster else None,
        profile=str(profile) if profile else None, dtype=dtype, master_weights=master_weights,
        global_batch_tokens=global_batch_tokens, global_batch=global_batch, context_length=context_length,
        mesh=mesh, top=top, peak_tflops=peak_tflops, stack=stack)
    if plot is not None:
        srch.plot_plans(plans, plot, title=f"{meta['model'].split(':')[0]} on {meta['cluster'].split(',')[0]}")
        notes.append(f"Plot written to {plot}.")
    return Report("plan train", rows, meta, notes, groups=GROUPS)
