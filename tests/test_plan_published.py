"""lmsys.plan.published and `plan validate --published`: the shipped runs, the loader, the CLI rows, and
the terms the published runs brought into the time model."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from lmsys.core import hardware
from lmsys.core.errors import LmsysError
from lmsys.plan import memory as mem
from lmsys.plan import published as pub
from lmsys.plan import time as ptime


# --------------------------------------------------------------------------------------------- loader

def test_shipped_set_every_run_sourced_and_complete():
    data = pub.load_published()
    runs = data["runs"]
    assert len(runs) >= 20
    assert len({data["sources"][r["source"]]["repo"] for r in runs}) >= 4  # independent repositories (issue 42)
    for run in runs:
        for field in pub.RUN_FIELDS:
            assert run.get(field) is not None, (run["id"], field)
        src = data["sources"][run["source"]]
        assert re.fullmatch(r"[0-9a-f]{40}", src["commit"]) and src["repo"] and src["path"] and src["definition"]
        assert run["published"]["tokens_per_s_per_gpu"] > 0
        system = data["systems"][run["system"]]
        assert hardware.find_gpu(system["gpu"]) is not None and system["stated"]
    gpus = {data["systems"][r["system"]]["gpu"] for r in runs}
    assert any("A100" in g for g in gpus) and any("H100" in g for g in gpus)
    assert min(r["seq"] for r in runs) <= 2048 and max(r["seq"] for r in runs) >= 8192
    assert any(r["mesh"].get("tp", 1) > 1 and r["mesh"].get("pp", 1) > 1 for r in runs)
    assert any(r["mesh"].get("zero") == 3 for r in runs)


def test_every_shipped_run_that_trained_fits():
    # issue 42: every published run trained on its hardware, so each is predicted to fit; a figure the source
    # does not state is marked assumed (OLMo-core's GPU count among them)
    rows, summary = pub.validate_published()
    assert summary["not fitting"] == [] and all(r["fits"] for r in rows)
    data = pub.load_published()
    assert "8" in data["systems"]["olmo-h100"]["assumed"]


def test_shipped_file_is_package_data():
    # plan validate --published reads it from the installed package, not from the repository
    assert pub.SHIPPED.parent.name == "plan" and pub.SHIPPED.is_file()
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert "*.yaml" in pyproject["tool"]["setuptools"]["package-data"]["lmsys.plan"]


def _two_runs(tmp_path, *, second_gpus=8, drop=None):
    data = pub.load_published()
    keep = [r for r in data["runs"] if r["id"] in ("mosaic-a100-80gb-1b-s2k", "titan-a100-llama3-70b")]
    small = dict(keep[1], id="llama3-70b-on-one-node", gpus=second_gpus, mesh={"dp": second_gpus, "zero": 3},
                 global_batch=second_gpus)
    runs = [keep[0], small]
    if drop:
        runs[0] = {k: v for k, v in runs[0].items() if k != drop}
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump({**{k: data[k] for k in ("sources", "models", "systems")}, "runs": runs}))
    return path


def test_loader_names_a_missing_field(tmp_path):
    with pytest.raises(LmsysError, match=r"run mosaic-a100-80gb-1b-s2k lacks micro_batch"):
        pub.load_published(_two_runs(tmp_path, drop="micro_batch"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("runs: []\n")
    with pytest.raises(LmsysError, match="a list of runs"):
        pub.load_published(bad)


# ----------------------------------------------------------------------------------------------- CLI

def test_validate_published_two_runs_one_does_not_fit(lmsys, tmp_path):
    path = _two_runs(tmp_path)
    r = lmsys("plan", "validate", "--published", str(path), "--format", "json")
    assert r.code == 0, r.err
    out = json.loads(r.out)
    rows = out["rows"]
    assert [row["run"] for row in rows] == ["mosaic-a100-80gb-1b-s2k", "llama3-70b-on-one-node"]
    for row in rows:
        assert {"published tok/s/GPU", "predicted tok/s/GPU", "error %", "predicted GiB", "fits"} <= set(row)
        assert row["error %"] == pytest.approx(100 * (row["predicted tok/s/GPU"] / row["published tok/s/GPU"] - 1))
    assert rows[0]["fits"] is True
    assert rows[1]["fits"] is False  # 70B with AdamW state on 8 × 80 GB: a row, not a crash
    assert any("llama3-70b-on-one-node" in n and "not to fit" in n for n in out["notes"])
    assert any(re.search(r"mean \|error\| [\d.]+ %, max [\d.]+ %", n) for n in out["notes"])


def test_validate_needs_profile_or_published(lmsys, tmp_path):
    r = lmsys("plan", "validate")
    assert r.code == 2 and "--profile FILE" in r.err and "--published" in r.err and "Traceback" not in r.err
    r = lmsys("plan", "validate", str(tmp_path / "runs.yaml"))
    assert r.code == 2 and "only with --published" in r.err


def test_validate_published_missing_file(lmsys, tmp_path):
    r = lmsys("plan", "validate", "--published", str(tmp_path / "nope.yaml"))
    assert r.code == 2 and "cannot read it" in r.err


# ------------------------------------------------------------------------------------ the new terms

def test_inter_node_busbw_is_the_nodes_injection_bandwidth():
    # A100 80GB SXM table: NVLink 600 GB/s both ways -> 300 one way × 0.8 = 240 GB/s busbw in a node;
    # 25 GB/s NIC per GPU × 0.8 = 20 GB/s. A group with 8 GPUs in each node: 8 rings, one per NIC: 160 GB/s.
    rates = ptime.table_rates(hardware.GPUS["A100 80GB SXM"], "bf16")
    assert rates.link(64, inter=True, per_node=8) == pytest.approx(160.0)
    assert rates.link(64, inter=True, per_node=1) == pytest.approx(20.0)  # strided: one GPU a node
    assert rates.link(64, inter=True, per_node=32) == pytest.approx(240.0)  # capped by NVLink
    # all-gather of 1 GB over 64 GPUs, 8 a node: 1e9 · 63/64 / 160e9 s + NCCL's ring latency: 8.4 µs base,
    # 56 NVLink steps at 3.4 µs and the 7 steps that cross nodes at 14 µs = 296.8 µs
    ms = rates.collective_ms("all-gather", 64, nbytes=1e9, inter=True, per_node=8)
    assert ms == pytest.approx(1e9 * 63 / 64 / 160e9 * 1e3 + 0.2968)


def test_ring_latency_by_hand():
    # NCCL's model (tuning.cc, Ring, Simple): base 8.4 µs, 3.4 µs a NVLink step, 5.7 a PCIe one, 14 a network one
    assert ptime.ring_latency_us("all-gather", 8) == pytest.approx(8.4 + 7 * 3.4)
    assert ptime.ring_latency_us("all-reduce", 8) == pytest.approx(8.4 + 14 * 3.4)
    assert ptime.ring_latency_us("reduce-scatter", 32, nodes=4) == pytest.approx(8.4 + 28 * 3.4 + 3 * 14.0)
    assert ptime.ring_latency_us("all-reduce", 16, nodes=2) == pytest.approx(8.4 + 28 * 3.4 + 2 * 14.0)
    assert ptime.ring_latency_us("all-gather", 2, nvlink=False) == pytest.approx(8.4 + 5.7)
    assert ptime.ring_latency_us("send", 2, nodes=2) == pytest.approx(8.4 + 14.0)


def test_fsdp_across_nodes_uses_every_nic():
    # 8 nodes × 8 GPUs of FSDP: the dp group has 8 GPUs in each node, so its gathers run at 8 NICs' rate;
    # each block's gather hides behind the block before it, its reduce-scatter behind the next backward
    from lmsys.plan.shape import gpt, layer_params

    m = gpt("g", d_model=4096, layers=8, heads=32)
    rates = ptime.table_rates(hardware.GPUS["A100 80GB SXM"], "bf16")
    prec = mem.PRECISIONS["master"]
    wide = ptime.step_time(m, mem.Layout(dp=64, zero=3, microbatches=1), prec, rates, gpus_per_node=8)
    n = mem.stage_params(m, mem.Layout(dp=64, zero=3), first=True, last=True)
    block, root = layer_params(m), n - 8 * layer_params(m)
    lat = (8.4 + 56 * 3.4 + 7 * 14.0) / 1e3  # NCCL's ring latency over 8 nodes of 8, ms
    g = block * 2 * 63 / 64 / 160e9 * 1e3 + lat  # one block's gather in 16 bits
    r = block * 4 * 63 / 64 / 160e9 * 1e3 + lat  # its gradients' reduce-scatter in fp32
    assert rates.collective_ms("all-gather", 64, nbytes=block * 2, inter=True, per_node=8) == pytest.approx(g)
    f, b = wide.parts["fwd block ms"], wide.parts["bwd block ms"]
    share = 16 / 108  # NCCL's 16 SMs of an A100's 108, while a collective runs beside compute
    fwd = g + 7 * max(0.0, g - f) + share * 7 * min(g, f)
    bwd = r + 8 * max(0.0, g + r - b) + share * 8 * min(g + r, b)
    root_ms = (root * 2 * 63 / 64 / 160e9 * 1e3 + lat) * 2 + root * 4 * 63 / 64 / 160e9 * 1e3 + lat
    assert wide.dp_comm == pytest.approx(fwd + bwd + root_ms)
    # the same mesh in one node of 8 pays NVLink steps only: less
    one = ptime.step_time(m, mem.Layout(dp=8, zero=3, microbatches=1), prec, rates, gpus_per_node=8)
    assert one.dp_comm < wide.dp_comm


# ------------------------------------------------------------------------------------------- memory

def _memory(run_id):
    data = pub.load_published()
    run = next(r for r in data["runs"] if r["id"] == run_id)
    m, lay, cluster = pub.run_shape(data, run), pub.run_layout(run), pub.run_cluster(data, run)
    return mem.memory(m, lay, pub.run_precision(run), capacity=cluster.capacity), cluster, run


def test_published_run_at_its_limit_fits():
    # MPT-1B, micro-batch 20 at 2048 on 64 H100 80GB without recomputation, and MPT-3B, micro-batch 3 at 8192
    # on 8 (refused before the capacity was nvidia-smi's): each fits, as the run did, the 3B within 6 % of
    # what the GPU holds, 81559 MiB (nvidia-smi on an H100 80GB HBM3), not the datasheet's 80 GB
    memory, cluster, _ = _memory("mosaic-h100-1b-s2k-64")
    assert cluster.capacity == 81559 * 2**20
    assert memory.headroom > 0 and memory.total + memory.reserve > 0.90 * cluster.capacity
    memory, cluster, _ = _memory("mosaic-h100-3b-s8k")
    assert memory.headroom > 0 and memory.total + memory.reserve > 0.94 * cluster.capacity
    # the same 3B on the datasheet's 80 GB (74.5 GiB) would not fit: the capacity decides it
    over = mem.memory(*(_shape_layout_prec("mosaic-h100-3b-s8k")), capacity=80e9)
    assert over.headroom < 0


def _shape_layout_prec(run_id):
    data = pub.load_published()
    run = next(r for r in data["runs"] if r["id"] == run_id)
    return pub.run_shape(data, run), pub.run_layout(run), pub.run_precision(run)


def test_capacity_is_nvidia_smi_where_read_else_the_datasheet():
    from lmsys.plan.search import Cluster

    assert Cluster(hardware.GPUS["H100 SXM"], 8, 8).capacity == 81559 * 2**20
    assert Cluster(hardware.GPUS["H200 SXM"], 8, 8).capacity == 143771 * 2**20
    assert Cluster(hardware.GPUS["A100 80GB SXM"], 8, 8).capacity == 80e9
    # a published system that states another memory (torchtitan's H100 96GB) uses it, not the table's reading
    _, cluster, _ = _memory("titan-h100-llama31-8b-8")
    assert cluster.capacity == 96e9


def test_matmul_curve_by_hand():
    # a GEMM of F FLOPs on an H100 SXM: F / (0.698 × peak) + 3.15 µs (the rate kept at 700 W); the backward's
    # two GEMMs twice both; an A100 keeps the burst fit's 0.770
    rates = ptime.table_rates(hardware.GPUS["H100 SXM"], "bf16")
    f = 2 * 4096 * 4096 * 4096
    assert rates.matmul_ms(4096, 4096, 4096) == pytest.approx(f / (0.698 * 989.5e12) * 1e3 + 3.15e-3)
    assert rates.matmul_ms(4096, 4096, 4096, backward=True) == pytest.approx(2 * f / (0.698 * 989.5e12) * 1e3 + 6.3e-3)
    a100 = ptime.table_rates(hardware.GPUS["A100 80GB SXM"], "bf16")
    assert a100.matmul_ms(4096, 4096, 4096) == pytest.approx(f / (0.770 * 312e12) * 1e3 + 3.15e-3)
    assert hardware.GPUS["H200 SXM"].matmul == 0.679 and hardware.GPUS["H100 NVL"].matmul == 0.698
    # small GEMMs fall below the large ones' rate: 2048×768·768×768 (2.42 GFLOP) reaches 0.36 of peak
    small = 2 * 2048 * 768 * 768
    achieved = small / (rates.matmul_ms(2048, 768, 768) * 1e-3) / 989.5e12
    assert achieved == pytest.approx(small / (small / (0.698 * 989.5e12) + 3.15e-6) / 989.5e12)
    assert 0.35 < achieved < 0.38
    # a profile's measured shapes hold their own launch time: none added
    prof = ptime.Rates(matmul_tflops=1.0, attention_tflops=1.0, hbm_GBps=1.0, intra_GBps=1.0, inter_GBps=None,
                       latency_us=0.0, source="t", gemm=((4, 8, 16, 2.0, 2.0),), gemm_launch_us=3.15)
    assert prof.matmul_ms(4, 8, 16) == pytest.approx(2 * 4 * 8 * 16 / 2e9)


def test_matmul_curve_fit_recovers_its_terms_and_the_tables_constants():
    """plan calibrate's fit (lmsys.plan.calibrate.matmul_curve) on GEMMs made from a known curve gives that
    curve back, and on the committed H200 profile the constants the GPU table holds (their stated source)."""
    from pathlib import Path

    from lmsys.plan.calibrate import curve_notes, matmul_curve

    peak, fraction, launch = 989.5, 0.7, 5e-6
    def tflops(flops, gemms):
        return flops / (flops / (peak * 1e12 * fraction) + gemms * launch) / 1e12
    gemms = [[m, k, n, tflops(2 * m * k * n, 1), tflops(4 * m * k * n, 2)]
             for m, k, n in ((512, 768, 768), (2048, 1600, 6400), (8192, 4096, 4096))]
    fit = matmul_curve(gemms, peak)
    assert fit["fraction"] == pytest.approx(0.7) and fit["launch_us"] == pytest.approx(5.0)
    assert fit["max_error"] < 1e-9 and matmul_curve(gemms[:1], peak) is None
    assert matmul_curve([gemms[1], gemms[1]], peak) is None  # one size twice: the two terms cannot be told apart
    profile = yaml.safe_load(Path(__file__).parent.parent.joinpath("docs/benchmarks/plan-h200-profile.yaml").read_text())
    fit = matmul_curve(profile["gemm_tflops"]["bf16"], hardware.GPUS["H200 SXM"].bf16)
    assert round(fit["fraction"], 3) == hardware.MATMUL_FIT and round(fit["launch_us"], 2) == hardware.GEMM_LAUNCH_US
    assert any(line.startswith("bf16 GEMM curve (H200 SXM") and "0.770 of the 989.5 TFLOP/s peak + 3.15 µs" in line
               for line in curve_notes(profile))


def test_fused_stack_saves_less_by_hand():
    # SwiGLU + RMSNorm block, s 4, b 3, h 8, f 24, kv 4, flash, bf16 FSDP: eager keeps each norm's fp32 input
    # and x·rsqrt (8 B), QKV input, Q (2 B), K, V (kv 4), lse (4 B × heads), out-proj input, MLP input and
    # four 24-wide tensors; fused keeps each norm's input in bf16 (2 B) and gate and up only
    from lmsys.plan.shape import ModelShape

    m = ModelShape(name="t", vocab=64, d_model=8, d_ff=24, layers=2, heads=2, kv_heads=1, seq=4, attention="flash")
    prec = mem.PRECISIONS["fsdp"]
    sbh, sbk, sbf = 12 * 8, 12 * 4, 12 * 24
    lay = mem.Layout(micro_batch=3)
    eager = 2 * 8 * sbh + 2 * sbh + 2 * sbh + 2 * 2 * sbk + 4 * 2 * 12 + 2 * sbh + 2 * sbh + 4 * 2 * sbf
    fused = 2 * 2 * sbh + 2 * sbh + 2 * sbh + 2 * 2 * sbk + 4 * 2 * 12 + 2 * sbh + 2 * sbh + 2 * 2 * sbf
    assert mem.layer_activation_bytes(m, lay, prec) == eager
    assert mem.layer_activation_bytes(m, lay, prec, fused=True) == fused


def test_torchtitan_h100_memory_beside_published():
    # Llama 3.1 8B, FSDP over 8 H100 96GB, local batch 2 at 8192, selective op checkpointing: 82.4 GiB published
    memory, _, run = _memory("titan-h100-llama31-8b-8")
    assert memory.headroom > 0
    need = (memory.total + memory.reserve) / mem.GiB
    assert abs(need - run["published"]["memory_GiB"]) / run["published"]["memory_GiB"] < 0.15


# ------------------------------------------------------------------------------- the terms by hand

def test_op_checkpoint_saves_every_other_matmul_output():
    from lmsys.plan.shape import ModelShape

    m = ModelShape(name="t", vocab=64, d_model=8, d_ff=24, layers=2, heads=2, kv_heads=1, seq=4)
    prec = mem.PRECISIONS["fsdp"]
    # wq(8) wk(4) wv(4) wo(8) w1(24) w3(24) w2(8): kept wq, wv, w1, w2 outputs; input (2 B), output, lse
    sbh = 4 * 3 * 8
    saved = mem.layer_activation_bytes(m, mem.Layout(micro_batch=3, checkpoint="op"), prec)
    assert saved == 2 * sbh + 2 * 4 * 3 * (8 + 4 + 24 + 8) + 2 * sbh + 4 * 2 * 4 * 3
    rates = ptime.table_rates(hardware.GPUS["A100 80GB SXM"], "bf16")
    # recomputed: wk, wo, w3 on the table's curve: at 0.770 × 312 TFLOP/s plus 3.15 µs each
    ms = ptime.op_recompute_ms(m, tokens=12, tp=1, rates=rates)
    assert ms == pytest.approx(2 * 12 * (8 * 4 + 8 * 8 + 8 * 24) / (0.770 * 312e12) * 1e3 + 3 * 3.15e-3)


def test_fsdp_precision_gathers_16_bits():
    prec = mem.PRECISIONS["fsdp"]
    assert (prec.weight, prec.grad, prec.optimizer, prec.cast, prec.gathered) == (4, 4, 8, 0, 2)
    assert mem.PRECISIONS["autocast"].gathered == 4 and mem.PRECISIONS["master"].gathered == 2


def test_stack_sets_the_elementwise_rate():
    h100 = hardware.GPUS["H100 SXM"]
    fused = ptime.table_rates(h100, "bf16")
    eager = ptime.table_rates(h100, "bf16", stack="eager")
    assert fused.elementwise_GBps == pytest.approx(3350 * 0.8)
    assert eager.elementwise_GBps == pytest.approx(3350 * 1756.6 / 4800)
    with pytest.raises(LmsysError, match="stack 'compiled'"):
        ptime.table_rates(h100, "bf16", stack="compiled")


def test_flash_efficiency_per_gpu():
    # FlashAttention-2 on Hopper: 35 % of the peak (FlashAttention-3's abstract); on the A100 the generic 0.5
    assert ptime.table_rates(hardware.GPUS["H100 SXM"], "bf16").attention_tflops == pytest.approx(0.35 * 989.5)
    assert ptime.table_rates(hardware.GPUS["A100 80GB SXM"], "bf16").attention_tflops == pytest.approx(0.5 * 312)
    assert ptime.table_rates(hardware.GPUS["B200"], "bf16").attention_tflops == pytest.approx(0.5 * 2250)
    for gpu in hardware.GPUS.values():
        assert gpu.flash is None or gpu.flash_source


def test_low_precision_norm_keeps_its_input_in_the_compute_dtype():
    from dataclasses import replace

    from lmsys.plan.shape import gpt

    m = replace(gpt("g", d_model=64, layers=2, heads=4), dropout=False)
    prec = mem.PRECISIONS["autocast"]
    full = {t.name: t.nbytes for t in mem.saved_tensors(m, b=1, prec=prec)}
    low = {t.name: t.nbytes for t in mem.saved_tensors(replace(m, low_precision_norm=True), b=1, prec=prec)}
    assert full["attention norm input"] == 4 and low["attention norm input"] == 2


def test_plan_train_mesh_takes_op_checkpointing(lmsys):
    r = lmsys("plan", "train", "--size", "small", "--gpus", "8", "--gpu", "H100", "--global-batch", "8",
              "--mesh", "dp=8,zero=3,checkpoint=op", "--format", "json")
    assert r.code == 0, r.err
    rows = json.loads(r.out)["rows"]
    assert rows and {row["checkpoint"] for row in rows} == {"op"} and rows[0]["recompute ms"] > 0
    r = lmsys("plan", "train", "--size", "small", "--gpus", "8", "--gpu", "H100", "--global-batch", "8",
              "--format", "json", "--top", "50")
    assert "op" not in {row["checkpoint"] for row in json.loads(r.out)["rows"]}  # not searched unasked


def test_plan_train_stack_production_is_the_default(lmsys):
    def best(*extra):
        r = lmsys("plan", "train", "--size", "10b", "--gpus", "8", "--gpu", "H100", "--global-batch", "64",
                  "--mesh", "dp=8,zero=3,mb=1,checkpoint=full", "--top", "1", "--format", "json", *extra)
        assert r.code == 0, r.err
        out = json.loads(r.out)
        return out["meta"]["stack"], out["rows"][0]

    (stack, default), (_, production), (eager_stack, eager) = best(), best("--stack", "production"), \
        best("--stack", "eager")
    assert stack.startswith("production") and eager_stack.startswith("eager")
    assert default == production
    # the preset's naive attention and one kernel an op: slower and no less memory than a flash kernel, fused
    assert eager["step ms"] > production["step ms"] and eager["activations GiB"] >= production["activations GiB"]
    r = lmsys("plan", "train", "--size", "small", "--stack", "compiled")
    assert r.code == 2 and "--stack must be one of production, eager" in r.err


def test_hopper_sustained_fractions_are_the_committed_measurements():
    """The GPU table's H100 and H200 matmul fractions are what the committed runs measured: plan calibrate
    --sustain's fraction on the H100, the mean of the H200 probe's sustained column."""
    import re
    from pathlib import Path

    import yaml

    bench = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"
    h100 = yaml.safe_load((bench / "plan-h100-sustain-profile.yaml").read_text())["gemm_sustained"]["bf16"]
    assert round(h100["fraction"], 3) == hardware.H100_SUSTAINED
    assert h100["power_limit_W"] == 700 and len(h100["rows"]) == 15
    rates = [float(x) for x in re.findall(r"sustained (\d+)", (bench / "plan-h200-sustained-matmul.txt").read_text())]
    assert len(rates) == 15
    assert round(sum(rates) / len(rates) / 989.5, 3) == hardware.H200_SUSTAINED


def test_fsdp2_copies_by_hand():
    """torch's FSDP2 copies on the compute stream, per block and micro-batch: the gathered parameters out of
    the all-gather's buffer (read and write, forward and again in the backward) and the gradients into the
    reduce-scatter's (read bf16, write fp32); a flat FSDP, dp 1 or ZeRO below 3 copies nothing."""
    from lmsys.plan.memory import PRECISIONS, Layout
    from lmsys.plan.shape import layer_params

    data = pub.load_published()
    m = pub.run_shape(data, next(r for r in data["runs"] if r["id"] == "olmo-core-olmo2-13b"))
    block = layer_params(m)  # 4·5120² + 3·5120·13824 + 2·5120 (no biases, two RMSNorms)
    assert block == 4 * 5120**2 + 3 * 5120 * 13824 + 2 * 5120
    prec = PRECISIONS["fsdp"]
    fwd, bwd = ptime.fsdp2_copy_bytes(m, Layout(dp=8, zero=3, fsdp="fsdp2"), prec)
    assert fwd == 4 * block and bwd == 4 * block + (2 + 4) * block  # 2 B read + 2 B written; + bf16 in, fp32 out
    assert ptime.fsdp2_copy_bytes(m, Layout(dp=8, zero=3, fsdp="fsdp2", tp=2), prec) == (2 * block, 5 * block)
    for lay in (Layout(dp=8, zero=3), Layout(dp=1, zero=3, fsdp="fsdp2"), Layout(dp=8, zero=2, fsdp="fsdp2")):
        assert ptime.fsdp2_copy_bytes(m, lay, prec) == (0.0, 0.0)
    # under a pipeline: gathered and reduced once a step, so per micro-batch 1/microbatches of it
    assert ptime.fsdp2_copy_bytes(m, Layout(dp=2, pp=4, zero=3, fsdp="fsdp2", microbatches=8), prec) == \
        (fwd / 8, bwd / 8)
    # in the step: the block's forward and backward grow by those bytes at the streaming (HBM) rate, on the
    # eager stack too; a full recompute runs the forward again without gathering again
    rates = ptime.table_rates(hardware.GPUS["H100 SXM"], "bf16", stack="eager")
    hbm = rates.hbm_GBps * 1e6
    assert hbm == pytest.approx(0.8 * 3350e6) and rates.elementwise_GBps < rates.hbm_GBps
    for ckpt in ("none", "full"):
        flat = ptime.step_time(m, Layout(dp=8, zero=3, checkpoint=ckpt), prec, rates, gpus_per_node=8)
        fsdp2 = ptime.step_time(m, Layout(dp=8, zero=3, checkpoint=ckpt, fsdp="fsdp2"), prec, rates, gpus_per_node=8)
        assert fsdp2.parts["fwd block ms"] - flat.parts["fwd block ms"] == pytest.approx(fwd / hbm)
        assert fsdp2.parts["bwd block ms"] - flat.parts["bwd block ms"] == pytest.approx(bwd / hbm)
        assert fsdp2.recompute == pytest.approx(flat.recompute)


def test_published_fsdp_implementation_is_recorded_and_checked(tmp_path):
    """torchtitan and OLMo-core shard with torch's fully_shard (FSDP2): their runs say so; MosaicML's Composer
    wraps FSDP1 (flat). Any other value is a one-line error naming it."""
    from lmsys.plan.memory import check_layout

    data = pub.load_published()
    impl = {r["id"]: pub.run_layout(r).fsdp for r in data["runs"] if r["mesh"].get("zero") == 3}
    assert all(v == ("fsdp2" if k.startswith(("titan", "olmo")) else "flat-param") for k, v in impl.items())
    m = pub.run_shape(data, data["runs"][0])
    with pytest.raises(LmsysError, match="FSDP implementation 'fsdp3' is not one of flat-param, fsdp2"):
        check_layout(m, pub.run_layout({**data["runs"][0], "mesh": {"dp": 8, "zero": 3, "fsdp": "fsdp3"}}))
    with pytest.raises(LmsysError, match="fsdp=fsdp2 shards the weights: it needs zero=3, not 2"):
        check_layout(m, pub.run_layout({**data["runs"][0], "mesh": {"dp": 8, "zero": 2, "fsdp": "fsdp2"}}))


def test_mesh_takes_the_fsdp_implementation(lmsys):
    """plan train --mesh ...,fsdp=fsdp2 plans torch's fully_shard (its copies in the step); flat is the
    default; another value is a one-line error, exit 2."""
    from lmsys.plan.search import parse_mesh

    assert parse_mesh("dp=8,zero=3,fsdp=fsdp2") == {"dp": 8, "zero": 3, "fsdp": "fsdp2"}
    args = ("plan", "train", "--size", "2.7b", "--gpu", "h100-sxm", "--gpus", "8", "--global-batch", "64",
            "--format", "json")
    flat, fsdp2 = (json.loads(lmsys(*args, "--mesh", f"dp=8,zero=3,mb=4,checkpoint=none{extra}").out)["rows"][0]
                   for extra in ("", ",fsdp=fsdp2"))
    assert fsdp2["step ms"] > flat["step ms"]
    r = lmsys(*args, "--mesh", "dp=8,zero=3,fsdp=fsdp3")
    assert r.code == 2 and r.err.strip() == "error: --mesh: fsdp=fsdp3 is not one of flat-param, fsdp2"
