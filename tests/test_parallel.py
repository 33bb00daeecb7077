"""`lmsys parallel train`: the mesh and its checks, tensor / sequence / pipeline parallelism against one
process (gloo, tiny model, a few steps), the vocab-parallel cross-entropy against F.cross_entropy."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import gloo_world
from lmsys.core.errors import LmsysError
from lmsys.core.results import NOT_MEASURED
from lmsys.distributed.mesh import MeshSpec, check_plan, parse_mesh
from lmsys.distributed.model_parallel.pipeline import ideal_bubble, partition, schedule
from lmsys.model.config import get_config

TINY = dict(num_heads=4, kv_heads=4, d_ff=512, vocab_size=10_000, num_layers=2)
FP32_PARITY = 5e-5  # AdamW turns rounding-level gradient differences into up to ~2 % of one lr=1e-3 step
GRAD_TOL = 1e-6  # one step's gradients: rounding only
# bf16 autocast: one step's gradients within 2e-2 relative per parameter (measured ~7e-3 for tp=2, as far
# as the bf16 reference itself is from fp32: ~2 bf16 ulps); the loss within 2e-3; the parameters within
# AdamW's own bound (a near-zero gradient's sign may flip under rounding: up to 2·lr per step apart)
BF16_GRAD_REL, BF16_LOSS = 2e-2, 2e-3


# ------------------------------------------------------------------------------------ torch-free checks


def test_parse_mesh_orders_tp_fastest():
    spec = parse_mesh("tp=2, dp=2")
    assert spec == MeshSpec(pp=1, dp=2, tp=2) and spec.world_size == 4
    assert [spec.coords(r) for r in range(4)] == [{"pp": 0, "dp": 0, "tp": 0}, {"pp": 0, "dp": 0, "tp": 1},
                                                   {"pp": 0, "dp": 1, "tp": 0}, {"pp": 0, "dp": 1, "tp": 1}]
    spec = MeshSpec(pp=2, dp=2, tp=2)
    assert all(spec.rank_of(**spec.coords(r)) == r for r in range(8))
    for bad in ("dp=2,dp=2", "xp=2", "tp=0", "tp=two", "tp"):
        with pytest.raises(LmsysError):
            parse_mesh(bad)


@pytest.mark.parametrize("kwargs, words", [
    (dict(spec="dp=2,tp=2", world_size=2), "multiply to 4, not the world size 2"),
    (dict(spec="tp=3", world_size=3), "heads (4)"),
    (dict(spec="tp=8", world_size=8, d_ff=512), "heads (4)"),
    (dict(spec="tp=2", world_size=2, kv_heads=3, num_heads=6), "kv heads (3"),
    (dict(spec="tp=2", world_size=2, d_ff=511), "d_ff (511)"),
    (dict(spec="tp=2", world_size=2, vocab_size=10_001), "vocab (10001)"),
    (dict(spec="pp=4", world_size=4), "2 layers cannot fill pp=4"),
    (dict(spec="pp=2", world_size=2, microbatches=1), "fewer than the pp=2 stages"),
    (dict(spec="pp=2", world_size=2, schedule="interleaved-1f1b", virtual_stages=2, microbatches=2),
     "do not split into pp×V = 2×2 = 4"),
    (dict(spec="pp=2", world_size=2, schedule="interleaved-1f1b", virtual_stages=1, microbatches=3,
          num_layers=4), "multiple of pp=2"),
    (dict(spec="pp=2", world_size=2, schedule="gpipe", virtual_stages=2, microbatches=2), "needs --pp-schedule"),
])
def test_every_plan_error(kwargs, words):
    kw = {**TINY, "microbatches": 4, **kwargs}
    spec = parse_mesh(kw.pop("spec"))
    with pytest.raises(LmsysError) as err:
        check_plan(spec, **kw)
    assert words in err.value.message


def test_tp_error_names_the_nearest_degrees():
    with pytest.raises(LmsysError) as err:
        check_plan(parse_mesh("tp=3"), world_size=3, **TINY)
    assert err.value.hint == "nearest degrees that work: tp=2 or tp=4"
    check_plan(parse_mesh("tp=4"), world_size=4, **{**TINY, "kv_heads": 2})  # kv heads replicated: fine
    check_plan(parse_mesh("pp=2"), world_size=2, microbatches=1, schedule="gpipe", **TINY)  # gpipe: M < p is fine


def test_cli_error_before_any_process(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-m", "lmsys", "parallel", "train", "--mesh", "tp=3", "--world-size", "3"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 2 and "tp=3 does not divide" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("kind, V, M", [("gpipe", 1, 3), ("1f1b", 1, 2), ("1f1b", 1, 5), ("interleaved-1f1b", 2, 4),
                                         ("interleaved-1f1b", 3, 6)])
def test_schedules_run_each_unit_once_and_forward_first(kind, V, M):
    pp = 2 if kind != "1f1b" else 3
    M = max(M, pp)
    for rank in range(pp):
        acts = schedule(kind, pp=pp, rank=rank, microbatches=M, virtual_stages=V)
        units = {(c, m) for c in range(V) for m in range(M)}
        assert sorted(a[1:] for a in acts if a[0] == "F") == sorted(units)
        assert sorted(a[1:] for a in acts if a[0] == "B") == sorted(units)
        for i, (op, c, m) in enumerate(acts):
            if op == "B":
                assert ("F", c, m) in acts[:i]
        if kind != "gpipe":  # 1F1B holds at most (pp - rank) microbatches in flight per chunk (warm-up + 1)
            held = peak = 0
            for op, _, _ in acts:
                held += 1 if op == "F" else -1
                peak = max(peak, held)
            assert peak <= (pp - rank - 1) * (2 if V > 1 else 1) + (V - 1) * pp + 1
    assert ideal_bubble("1f1b", pp=4, microbatches=8) == pytest.approx(3 / 11)
    assert ideal_bubble("interleaved-1f1b", pp=4, microbatches=8, virtual_stages=2) == pytest.approx(3 / 22)


def test_partition_counts_embedding_and_head():
    config = get_config("tiny").with_overrides(num_layers=6, vocab_size=50_000)
    # the head (parameters and FLOPs) outweighs the embedding (parameters only): the last stage takes fewest blocks
    assert partition(config, 2, tokens=512) == [[0, 1, 2, 3, 4], [5]]
    assert partition(config, 3, tokens=512) == [[0], [1, 2, 3, 4], [5]]
    assert partition(config, 3, tokens=512, equal=True) == [[0, 1], [2, 3], [4, 5]]


# -------------------------------------------------------------------------------------- gloo workers


def _init(rank, world, store_path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world,
                           timeout=timedelta(seconds=120))


def _ctx(rank, world):
    from lmsys.distributed.launch import RankContext

    return RankContext(rank=rank, world_size=world, local_rank=rank, backend="gloo", device=torch.device("cpu"))


def _job(ctx, meshes, **kw):
    from lmsys.bench.parallel import parallel_job

    base = dict(impls=["lmsys"], dp_strategy="bucketed", sequence_parallel=False, pp_schedule="1f1b",
                virtual_stages=1, microbatches=2, size="tiny", context_length=16, batch_size=4, dtype="fp32",
                steps=1, warmup=1)
    return parallel_job(ctx, meshes=meshes, **{**base, **kw})["rows"]


def _tp_gradients(rank, world):
    """One step's loss and gradients of the tensor-parallel model against the full one (no optimizer)."""
    from lmsys.distributed.model_parallel.tensor_parallel import (apply_tensor_parallel, tp_loss,
                                                                  vocab_parallel_cross_entropy)
    from lmsys.model.transformer import TransformerLM

    out = {}
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(37, 1000, generator=gen, dtype=torch.float64)  # odd token count, float64
    targets = torch.randint(0, 1000, (37,), generator=gen)
    ref = F.cross_entropy(logits.requires_grad_(), targets)
    ref.backward()
    n = 1000 // world
    local = logits.detach()[:, rank * n:(rank + 1) * n].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, targets, vocab_start=rank * n, group=dist.group.WORLD)
    loss.backward()
    out["ce"] = [abs(loss.item() - ref.item()), (local.grad - logits.grad[:, rank * n:(rank + 1) * n]).abs().max().item()]
    for sp in (False, True):
        out[f"bf16,sp={sp}"] = _tp_bf16_gradients(gen, sp)
        for kv in (None, 1):  # kv heads split, and replicated (1 kv head, tp=2)
            config = get_config("tiny").with_overrides(context_length=16, num_kv_heads=kv, vocab_size=1000)
            torch.manual_seed(0)
            full = TransformerLM(config)
            torch.manual_seed(0)
            model = TransformerLM(config)
            ids = torch.randint(0, 1000, (2, 16), generator=gen)
            tgt = torch.randint(0, 1000, (2, 16), generator=gen)
            loss_ref = F.cross_entropy(full(ids).flatten(0, 1), tgt.flatten())
            loss_ref.backward()
            apply_tensor_parallel(model, dist.group.WORLD, sequence_parallel=sp)
            loss = tp_loss(model, model.hidden_states(ids), tgt)
            loss.backward()
            grads = dict(full.named_parameters())
            worst = 0.0
            for name, p in model.named_parameters():
                src, dim, index = model.tp_layout.get(name, (name, None, None))
                g = grads[src].grad if index is None else grads[src].grad.index_select(dim, index)
                worst = max(worst, (p.grad - g).abs().max().item())
            sharded = sum(p.numel() for p in model.parameters()) < sum(p.numel() for p in full.parameters())
            out[f"sp={sp},kv={kv}"] = [abs(loss.item() - loss_ref.item()), worst, sharded]
    return out


def _tp_bf16_gradients(gen, sp):
    """(max relative gradient error of the tp=2 model against the full one, both under bf16 autocast;
    the same of the full bf16 model against fp32: what bf16 itself costs)."""
    from lmsys.distributed.model_parallel.tensor_parallel import apply_tensor_parallel, tp_loss
    from lmsys.model.transformer import TransformerLM

    config = get_config("tiny").with_overrides(context_length=16, vocab_size=1000)
    models = []
    for _ in range(3):  # bf16 full, fp32 full, bf16 tensor-parallel
        torch.manual_seed(0)
        models.append(TransformerLM(config))
    full, f32, model = models
    ids, tgt = (torch.randint(0, 1000, (2, 16), generator=gen) for _ in range(2))
    apply_tensor_parallel(model, dist.group.WORLD, sequence_parallel=sp)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        F.cross_entropy(full(ids).flatten(0, 1).float(), tgt.flatten()).backward()
        tp_loss(model, model.hidden_states(ids), tgt).backward()
    F.cross_entropy(f32(ids).flatten(0, 1), tgt.flatten()).backward()
    g16, g32 = dict(full.named_parameters()), dict(f32.named_parameters())
    worst = worst_bf16 = 0.0
    for name, p in model.named_parameters():
        src, dim, index = model.tp_layout.get(name, (name, None, None))
        ref, ref32 = ((g[src].grad if index is None else g[src].grad.index_select(dim, index)) for g in (g16, g32))
        worst = max(worst, ((p.grad - ref).norm() / ref.norm()).item())
        worst_bf16 = max(worst_bf16, ((ref - ref32).norm() / ref32.norm()).item())
    return [worst, worst_bf16]


def worker_1(rank, world, store_path, out_path):
    """The degenerate mesh dp=tp=pp=1 is the plain step: no wrapper, no collective, the same numbers."""
    from lmsys.core.timing import RegionTimer
    from lmsys.distributed.mesh import build_mesh
    from lmsys.distributed.parallelize import parallelize
    from lmsys.train import TrainStep, build_model, run_step
    from lmsys.train.optim import make_optimizer

    _init(rank, world, store_path)
    config = get_config("tiny").with_overrides(context_length=16, vocab_size=1000)
    gen = torch.Generator().manual_seed(3)
    ids, tgt = (torch.randint(0, 1000, (3, 16), generator=gen) for _ in range(2))
    plain = build_model(config, device="cpu")
    step = TrainStep(plain, make_optimizer(plain.parameters(), lr=1e-3), device=torch.device("cpu"), dtype="fp32")
    step.optimizer_step = lambda: None  # keep the gradients
    loss = run_step(step, ids, tgt)
    pm = parallelize(build_model(config, device="cpu"), build_mesh(parse_mesh("dp=1")), microbatches=1,
                     tokens_per_microbatch=48)
    timer = RegionTimer("cpu")
    res = pm.train_step(ids, tgt, microbatches=1, timer=timer, measure_activations=False)
    grads = dict(plain.named_parameters())
    out = {"dloss": abs(res.loss.item() - loss.item()),
           "dgrad": max((p.grad - grads[n].grad).abs().max().item() for n, p in pm.stage.named_parameters()),
           "wrapper": pm.dp is not None, "regions": sorted(timer.stats()), "act": res.peak_activation_bytes,
           "names": sorted(n for n, _ in pm.stage.named_parameters()) == sorted(grads)}
    gloo_world.finish(rank, out, out_path)


# ops a step of parallel train may run that bench e2e's does not, and why: none today (at M = 1 the
# microbatch split is skipped, the batch is on the device before the loop, the activation hook is Python)
EXTRA_OPS_ALLOWED: dict[str, str] = {}


def _aten_ops(fn) -> dict[str, int]:
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return dict(Counter(e.name for e in prof.events() if e.name.startswith("aten::")))


def worker_ops(rank, world, store_path, out_path):
    """The aten ops of two steps (one warm-up, one timed) of each path, as each command builds and loops
    them: bench e2e without --fast (bench.e2e.step_options, resolve_workloads, timed_steps) and parallel
    train's degenerate mesh (parallelize, the same AdamW kind, bench.parallel.timed_steps)."""
    from lmsys.bench import e2e
    from lmsys.bench.parallel import timed_steps
    from lmsys.distributed.mesh import build_mesh
    from lmsys.distributed.parallelize import parallelize
    from lmsys.train import build_model
    from lmsys.train.data import BatchSource, to_device
    from lmsys.train.build import build_train_step
    from lmsys.train.optim import DDP_TRAIN_LR, default_kind, make_optimizer
    from lmsys.train.step import random_batch

    _init(rank, world, store_path)
    device, out = torch.device("cpu"), {}
    for dtype in ("fp32", "bf16"):
        options = e2e.step_options(device, dtype, fast=False, attn=None, compile_scope=None, optimizer="auto",
                                   master_weights=False, fused_ce="auto", tf32=False)
        options.pop("attn_impl")  # None: the preset's own, as `bench e2e` without --impl
        config = get_config("tiny").with_overrides(context_length=32)
        (_, workload), = e2e.resolve_workloads([("tiny", config)], checkpoints=["none"], batch_size=2,
                                              dtype=dtype, **options)
        step = build_train_step(workload, device)
        inputs, targets = random_batch(workload, device)
        bench = _aten_ops(lambda: e2e.timed_steps(step, inputs, targets, mode="train", warmup=1, steps=1,
                                                  device=device))
        pm = parallelize(build_model(config, device=device), build_mesh(parse_mesh("dp=1,tp=1,pp=1")),
                         microbatches=1, tokens_per_microbatch=64)
        optimizer = make_optimizer(pm.parameters(), lr=DDP_TRAIN_LR, kind=default_kind(device))
        source = BatchSource(vocab_size=config.vocab_size, seq_len=32, global_batch=2, seed=0)
        batches = [to_device(source.local_batch_at(i, 0, 1), device) for i in range(2)]
        autocast = None if dtype == "fp32" else (lambda: torch.autocast("cpu", dtype=torch.bfloat16))
        par = _aten_ops(lambda: timed_steps(pm, optimizer, batches, warmup=1, microbatches=1, autocast=autocast,
                                            device=device))
        flags, train_step = [], pm.train_step  # the activation hook: on the warm-up step only

        def spy(*args, **kw):
            flags.append(kw["measure_activations"])
            return train_step(*args, **kw)

        pm.train_step = spy
        timed_steps(pm, optimizer, batches, warmup=1, microbatches=1, autocast=autocast, device=device)
        out[dtype] = {"bench": bench, "parallel": par, "hooked": flags}
    gloo_world.finish(rank, out, out_path)


def worker_2(rank, world, store_path, out_path):
    _init(rank, world, store_path)
    ctx = _ctx(rank, world)
    results = {"grads": _tp_gradients(rank, world)}
    both = ["lmsys", "torch"]  # torch's DTensor TP / pipelining rows beside lmsys's, on the same reference
    results["tp"] = _job(ctx, ["tp=2"], impls=both)
    results["tp_sp"] = _job(ctx, ["tp=2"], sequence_parallel=True, impls=both)
    results["gpipe"] = _job(ctx, ["pp=2"], pp_schedule="gpipe", impls=both)
    results["1f1b"] = _job(ctx, ["pp=2"], pp_schedule="1f1b", microbatches=4, impls=both)
    four = os.path.join(os.path.dirname(out_path), "tiny4.yaml")
    if rank == 0:
        with open(four, "w") as f:
            f.write("preset: tiny\nnum_layers: 4\n")
    dist.barrier()
    results["interleaved"] = _job(ctx, ["pp=2"], pp_schedule="interleaved-1f1b", virtual_stages=2, size=four)
    # activation checkpointing of each block, after TP (with SP: the all-gathers run again in the recompute) and PP
    results["checkpoint"] = _job(ctx, ["tp=2", "pp=2"], sequence_parallel=True, checkpoint="block",
                                 impls=["lmsys", "torch"])
    results["bf16"] = _job(ctx, ["tp=2", "pp=2"], dtype="bf16")
    gloo_world.finish(rank, results, out_path)


def worker_4(rank, world, store_path, out_path):
    _init(rank, world, store_path)
    ctx = _ctx(rank, world)
    results = {"rows": _job(ctx, ["dp=2,tp=2", "pp=2,dp=2", "pp=2,tp=2"], sequence_parallel=True),
               # lmsys's FSDP and torch's FSDP2 on the mesh's dp dim, beside TP and PP
               "fsdp": _job(ctx, ["pp=2,dp=2", "dp=2,tp=2"], dp_strategy="fsdp", impls=["lmsys", "torch"]),
               # FSDP's unit hooks around a checkpointed block: they fire once, the recompute runs the block alone
               "fsdp_checkpoint": _job(ctx, ["pp=2,dp=2"], dp_strategy="fsdp", checkpoint="block")}
    gloo_world.finish(rank, results, out_path)


def _assert_parity(rows):
    for row in rows:
        assert row["status"] == "ok", row
        assert row["|Δloss|"] < 1e-5, row
        assert row["parity max|Δθ|"] < FP32_PARITY, row


def test_degenerate_mesh_is_the_plain_step():
    res = gloo_world.run_world(worker_1, 1)
    assert res["dloss"] == 0 and res["dgrad"] == 0 and res["names"]  # bit for bit: the same ops in the same order
    assert not res["wrapper"] and res["regions"] == ["compute"]  # no DDP at dp=1, no tp / pp / dp collective
    assert res["act"] is None  # not counted unless asked (the hook costs a call per saved tensor)


def test_degenerate_mesh_runs_bench_e2e_ops():
    """parallel train's degenerate mesh runs no aten op that bench e2e's step lacks, each as often (two
    steps each on the CPU, fp32 and bf16 autocast): what is left between them on a GPU is not in the ops."""
    res = gloo_world.run_world(worker_ops, 1)
    for dtype, r in res.items():
        bench, par = r["bench"], r["parallel"]
        extra = {op: n - bench.get(op, 0) for op, n in par.items() if n > bench.get(op, 0)}
        assert set(extra) <= set(EXTRA_OPS_ALLOWED), (dtype, extra)
        missing = {op: n - par.get(op, 0) for op, n in bench.items() if n > par.get(op, 0)}
        assert not missing, (dtype, missing)  # the same work, not less of it either
        assert bench["aten::mm"] > 0 and (dtype == "fp32" or bench.get("aten::_to_copy", 0) > 0), dtype
        assert r["hooked"] == [True, False]  # saved-tensor hooks (Python, no aten op) off in the timed step


def test_tensor_parallel_gradients_and_vocab_parallel_ce():
    res = gloo_world.run_world(worker_2, 2)["grads"]
    assert res["ce"][0] < 1e-12 and res["ce"][1] < 1e-15
    for sp in (False, True):
        worst, bf16_itself = res[f"bf16,sp={sp}"]
        assert worst < BF16_GRAD_REL and bf16_itself > 1e-3, (sp, worst, bf16_itself)  # bf16 really ran
    for key in ("sp=False,kv=None", "sp=True,kv=None", "sp=False,kv=1", "sp=True,kv=1"):
        dloss, dgrad, sharded = res[key]
        assert dloss < 1e-5 and dgrad < GRAD_TOL and sharded, (key, res[key])


@pytest.mark.parametrize("run", ["tp", "tp_sp", "gpipe", "1f1b", "interleaved"])
def test_world_2_against_one_process(run):
    rows = gloo_world.run_world(worker_2, 2)[run]
    _assert_parity(rows)
    assert [r["impl"] for r in rows] == (["lmsys"] if run == "interleaved" else ["lmsys", "torch"])
    for row in rows:
        if run.startswith("tp"):
            assert row["params/rank"] < 1_600_000  # tiny has 2.9 M; the vocab and the blocks are split
        elif row["impl"] == "lmsys":
            assert 0 < row["bubble %"] < 100 and row["ideal bubble %"] > 0 and row["act MiB held"] > 0
        else:  # torch's schedules do not expose their compute time: no measured bubble
            assert row["bubble %"] == NOT_MEASURED and row["ideal bubble %"] > 0
        if row["impl"] == "torch":
            assert row["act MiB held"] == NOT_MEASURED and row["comm ms (dp)"] is None  # dp=1: nothing to measure


def test_world_4_meshes_against_one_process():
    res = gloo_world.run_world(worker_4, 4)
    _assert_parity(res["rows"])
    assert [r["mesh"] for r in res["rows"]] == ["dp=2,tp=2,pp=1", "dp=2,tp=1,pp=2", "dp=1,tp=2,pp=2"]
    fsdp = res["fsdp"]
    _assert_parity(fsdp)
    assert [(r["impl"], r["mesh"]) for r in fsdp] == [("lmsys", "dp=2,tp=1,pp=2"), ("torch", "dp=2,tp=1,pp=2"),
                                                     ("lmsys", "dp=2,tp=2,pp=1"), ("torch", "dp=2,tp=2,pp=1")]
    # parameters (so gradients and optimizer state) sharded over dp: half of bucketed DDP's per rank
    assert fsdp[0]["params/rank"] < 0.51 * res["rows"][1]["params/rank"]


def test_checkpointing_keeps_parity_and_holds_less():
    res = gloo_world.run_world(worker_2, 2)
    rows = res["checkpoint"]
    assert [(r["impl"], r["mesh"]) for r in rows] == [("lmsys", "dp=1,tp=2,pp=1"), ("torch", "dp=1,tp=2,pp=1"),
                                                     ("lmsys", "dp=1,tp=1,pp=2"), ("torch", "dp=1,tp=1,pp=2")]
    lmsys_rows = [r for r in rows if r["impl"] == "lmsys"]
    _assert_parity(lmsys_rows)
    assert all(r["status"].startswith("not run") for r in rows if r["impl"] == "torch")
    without = next(r for r in res["tp_sp"] if r["impl"] == "lmsys")  # the same mesh, SP, M=2, no checkpointing
    assert 0 < lmsys_rows[0]["act MiB held"] < 0.7 * without["act MiB held"]
    assert "checkpoint block" in lmsys_rows[0]["schedule"]


def test_comm_columns_per_mesh_dim():
    res = gloo_world.run_world(worker_2, 2)
    tp = next(r for r in res["tp"] if r["impl"] == "lmsys")
    pp = next(r for r in res["1f1b"] if r["impl"] == "lmsys")
    assert tp["comm ms (tp)"] > 0 and tp["comm ms (pp)"] is None and tp["comm ms (dp)"] is None
    assert pp["comm ms (pp)"] > 0 and pp["comm ms (tp)"] is None
    assert pp["comm ms (pp)"] < pp["ms/step"] and tp["comm ms (tp)"] < tp["ms/step"]
    for r in res["tp"] + res["1f1b"]:
        if r["impl"] == "torch":  # inside DTensor / pipelining: not measured; a dim of 1: nothing to measure
            assert r["comm ms (tp)" if r in res["tp"] else "comm ms (pp)"] == NOT_MEASURED, r
            assert r["comm ms (pp)" if r in res["tp"] else "comm ms (tp)"] is None, r
    four = gloo_world.run_world(worker_4, 4)
    dp = four["rows"][0]  # dp=2,tp=2, bucketed
    assert dp["comm ms (dp)"] > 0 and dp["comm ms (tp)"] > 0
    for r in four["fsdp"]:  # lmsys's FSDP: its all-gathers and reduce-scatters (inline on gloo) are timed
        if r["impl"] == "lmsys":
            assert 0 < r["comm ms (dp)"] < r["ms/step"], r
        else:
            assert r["comm ms (dp)"] == NOT_MEASURED and r["bubble %"] in (None, NOT_MEASURED), r


def test_bf16_against_one_process_in_bf16():
    for row in gloo_world.run_world(worker_2, 2)["bf16"]:
        assert row["status"] == "ok", row
        assert row["|Δloss|"] < BF16_LOSS, row
        assert row["parity max|Δθ|"] < 2 * 1e-3 * 2, row  # AdamW's bound: 2·lr per step, 2 steps


def worker_one_process(rank, world, store_path, out_path):
    """parallel train's job on the degenerate mesh, whole: the one-process row, then the mesh's; and again
    with the one-process run out of memory (its first build_model raises CUDA's OOM)."""
    from lmsys.bench import parallel as parallel_train
    from lmsys.train import loop  # the one-process run builds its model there

    _init(rank, world, store_path)
    ctx = _ctx(rank, world)
    base = dict(impls=["lmsys"], dp_strategy="bucketed", sequence_parallel=False, pp_schedule="1f1b",
                virtual_stages=1, microbatches=1, size="tiny", context_length=16, batch_size=4, dtype="fp32",
                steps=2, warmup=1)
    results = {"ok": parallel_train.parallel_job(ctx, meshes=["dp=1,tp=1,pp=1"], **base)}
    real, calls = parallel_train.build_model, []

    def oom_first(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(*args, **kwargs)

    parallel_train.build_model = loop.build_model = oom_first
    try:
        results["oom"] = parallel_train.parallel_job(ctx, meshes=["dp=1,tp=1,pp=1"], **base)
    finally:
        parallel_train.build_model = loop.build_model = real
    gloo_world.finish(rank, results, out_path)


def test_one_process_row_comes_first_and_each_mesh_says_its_speedup():
    res = gloo_world.run_world(worker_one_process, 1)
    (one,), (mesh,) = res["ok"]["baselines"], res["ok"]["rows"]
    assert (one["impl"], one["status"]) == ("1 process", "ok") and one["ms/step"] > 0 and one["tokens/s"] > 0
    assert one["params/rank"] == mesh["params/rank"]  # the whole model in both
    assert one["loss"] == pytest.approx(mesh["loss"], abs=1e-6) and mesh["|Δloss|"] < 1e-6  # the same batches
    assert mesh["× 1 process"] == pytest.approx(one["ms/step"] / mesh["ms/step"])
    (one,), (mesh,) = res["oom"]["baselines"], res["oom"]["rows"]
    assert one["status"].startswith("OOM") and one["ms/step"] is None
    assert mesh["status"] == "ok" and mesh["× 1 process"] is None and mesh["parity max|Δθ|"] is None
    assert any("1 process, batch 4: OOM" in note for note in res["oom"]["notes"])
