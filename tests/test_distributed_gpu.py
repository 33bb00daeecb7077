"""NCCL paths on the lent 2-GPU machine (skipped without CUDA): the same checks as on the CPU, over NCCL."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


@pytest.fixture(autouse=True)
def not_under_torchrun(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def test_nccl_allreduce_sums_correctly(lmsys):
    r = lmsys("comm", "allreduce", "--backend", "nccl", "--world-size", "2", "--sizes", "1MB,3MiB",
              "--dtype", "bf16", "--warmup", "1", "--iters", "3", "--format", "json")
    assert r.code == 0, r.err
    rows = json.loads(r.out)["rows"]
    assert [row["sum correct"] for row in rows] == [True, True]


def test_nccl_ddp_train_parity_fp32(lmsys):
    r = lmsys("ddp", "train", "--backend", "nccl", "--world-size", "2", "--size", "tiny",
              "--context-length", "64", "--batch-size", "2", "--steps", "2", "--warmup", "2",
              "--bucket-mb", "0.5", "--comm-dtype", "fp32,bf16", "--format", "json")
    assert r.code == 0, r.err
    for row in json.loads(r.out)["rows"]:
        if row["strategy"].startswith("1 process"):
            continue
        tolerance = 1e-2 if "bf16" in row["strategy"] else 1e-4  # see test_ddp_train.py
        assert row["parity max|Δθ|"] < tolerance, row
        assert row["peak MiB/rank"] > 0


def _copy_engine_worker(rank, world, store_path, out_path):
    """Rank `rank` of a 2-GPU NCCL group: CopyEngineAllReduce against dist.all_reduce on the same data."""
    import os

    import torch.distributed as dist

    from lmsys.distributed.data_parallel.copy_engine import CopyEngineAllReduce

    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{store_path}", rank=rank, world_size=world,
                            device_id=device)
    sizes = [1, 1000, 4099, 2 * 128 + 3]  # odd sizes: every bucket padded, one smaller than the world
    ce = CopyEngineAllReduce(sizes, device, timeout_s=60)
    g = torch.Generator(device=device).manual_seed(1234 + rank)
    results = {"equal": [], "max_diff": [], "ranks_agree": []}
    for round_ in range(3):  # fresh data each round, no host synchronisation between rounds
        refs, works = [], []
        for b, n in enumerate(sizes):
            x = torch.randn(n, device=device, generator=g) * (rank + 1) + round_
            ref = x.clone()
            dist.all_reduce(ref)
            refs.append(ref)
            ce.bucket(b).copy_(x)
            works.append(ce.launch(b))
        for b, work in enumerate(works):
            work.wait()
            got = ce.bucket(b).clone()
            results["equal"].append(bool(torch.equal(got, refs[b])))
            results["max_diff"].append(float((got - refs[b]).abs().max()))
            gathered = [torch.empty_like(got) for _ in range(world)]
            dist.all_gather(gathered, got)
            results["ranks_agree"].append(all(torch.equal(t, gathered[0]) for t in gathered))
    pad_zero = all(bool((ce.flat[ce.offsets[b] + n:ce.offsets[b] + ce.padded[b]] == 0).all())
                   for b, n in enumerate(sizes))
    results["padding_zero"] = pad_zero
    import gloo_world

    gloo_world.finish(rank, results, out_path)


def test_copy_engine_all_reduce_equals_nccl_bitwise():
    """CopyEngineAllReduce (symmetric memory, copy engines, barriers) against NCCL's all-reduce on 2 GPUs:
    rank-dependent data, odd bucket sizes, three rounds of four buckets in flight at once; a sum of two
    values is the same bits in either order, so the two must agree exactly, on both ranks; the padding
    stays zero."""
    import gloo_world

    out = gloo_world.run_world(_copy_engine_worker, 2)
    assert all(out["equal"]), out["max_diff"]
    assert all(out["ranks_agree"]) and out["padding_zero"]


def test_copy_engine_lever_trains_like_one_process(lmsys):
    """BucketedDDP with the copy-engine all-reduce gives the same parameters as one process, as NCCL's
    all-reduce does."""
    r = lmsys("ddp", "train", "--backend", "nccl", "--world-size", "2", "--size", "tiny",
              "--context-length", "64", "--batch-size", "2", "--steps", "3", "--warmup", "2",
              "--strategy", "bucketed", "--bucket-mb", "0.3", "--lever", "copy-engine", "--format", "json")
    assert r.code == 0, r.err
    rows = {row["strategy"]: row for row in json.loads(r.out)["rows"]}
    assert set(rows) == {"1 process, batch 2", "bucketed 0.3 MiB", "bucketed 0.3 MiB +copy-engine"}
    for name, row in rows.items():
        if not name.startswith("1 process"):
            assert row["parity max|Δθ|"] < 1e-4, row


def test_carveout_lever_trains_like_one_process(lmsys):
    """The SM carveout (cuBLASLt with fewer SMs while buckets reduce) gives the same parameters too."""
    r = lmsys("ddp", "train", "--backend", "nccl", "--world-size", "2", "--size", "tiny",
              "--context-length", "64", "--batch-size", "2", "--steps", "3", "--warmup", "2",
              "--strategy", "bucketed", "--bucket-mb", "0.3", "--sm-carveout", "16", "--format", "json")
    assert r.code == 0, r.err
    rows = {row["strategy"]: row for row in json.loads(r.out)["rows"]}
    assert "bucketed 0.3 MiB +carveout 16" in rows
    for name, row in rows.items():
        if not name.startswith("1 process"):
            assert row["parity max|Δθ|"] < 1e-4, row
