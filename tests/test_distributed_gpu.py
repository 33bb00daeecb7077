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


def test_copy_engine_and_carveout_levers_train_like_one_process(lmsys):
    """The copy-engine all-reduce (symmetric memory, copy engines, barriers) and the SM carveout give the
    same parameters as one process, as NCCL's all-reduce does."""
    r = lmsys("ddp", "train", "--backend", "nccl", "--world-size", "2", "--size", "tiny",
              "--context-length", "64", "--batch-size", "2", "--steps", "3", "--warmup", "2",
              "--strategy", "bucketed", "--bucket-mb", "0.3", "--lever", "copy-engine", "--sm-carveout", "16",
              "--format", "json")
    assert r.code == 0, r.err
    rows = {row["strategy"]: row for row in json.loads(r.out)["rows"]}
    assert set(rows) == {"1 process, batch 2", "bucketed 0.3 MiB", "bucketed 0.3 MiB +copy-engine",
                         "bucketed 0.3 MiB +carveout 16"}
    for name, row in rows.items():
        if not name.startswith("1 process"):
            assert row["parity max|Δθ|"] < 1e-4, row
