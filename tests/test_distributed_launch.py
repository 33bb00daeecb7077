"""The launcher: torchrun re-exec, rank 0's result back in the parent, failures end the job quickly."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from lmsys.core.errors import LmsysError
from lmsys.distributed import launch

TESTS = str(Path(__file__).resolve().parent)


# Jobs (run inside torchrun workers, imported from this file through PYTHONPATH)


def echo_job(ctx, *, value):
    import torch
    import torch.distributed as dist

    t = torch.tensor([ctx.rank + 1.0])
    dist.all_reduce(t)
    return {"rank": ctx.rank, "world": ctx.world_size, "value": value, "sum": t.item(),
            "device": str(ctx.device)}


def crash_job(ctx, *, mode):
    import torch
    import torch.distributed as dist

    if ctx.rank == 1:
        if mode == "raise":
            raise RuntimeError("boom from rank 1")
        if mode == "user":
            raise LmsysError("bad input seen on rank 1")
        if mode == "exit":
            os._exit(3)
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 0 waits here for a rank that is gone
    time.sleep(60)
    return {"unreachable": True}


@pytest.fixture
def job_env(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv(launch.ENV_TIMEOUT, "60")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.slow
def test_rank0_result_comes_back_to_the_parent(job_env):
    result = launch.run("test_distributed_launch:echo_job", {"value": "x"}, world_size=2, backend="gloo")
    assert result == {"rank": 0, "world": 2, "value": "x", "sum": 3.0, "device": "cpu"}


@pytest.mark.slow
def test_a_crashing_rank_ends_the_job_quickly_with_its_error(job_env):
    start = time.monotonic()
    with pytest.raises(launch.RankFailedError) as info:
        launch.run("test_distributed_launch:crash_job", {"mode": "raise"}, world_size=2, backend="gloo")
    assert time.monotonic() - start < 30  # not the 60 s timeout, not the 60 s sleep
    assert info.value.rank == 1
    assert "rank 1 failed: RuntimeError: boom from rank 1" in str(info.value)


@pytest.mark.slow
def test_a_rank_that_dies_without_a_word_still_fails_the_job(job_env):
    start = time.monotonic()
    with pytest.raises(launch.RankFailedError) as info:
        launch.run("test_distributed_launch:crash_job", {"mode": "exit"}, world_size=2, backend="gloo")
    assert time.monotonic() - start < 30
    # rank 0 may report the broken connection before torchrun stops it; either way rank 1 is named
    message = str(info.value)
    assert "died without reporting" in message or "no report from rank 1:" in message


@pytest.mark.slow
def test_a_user_error_on_a_rank_comes_back_as_lmsys_error(job_env):
    with pytest.raises(LmsysError, match="bad input seen on rank 1"):
        launch.run("test_distributed_launch:crash_job", {"mode": "user"}, world_size=2, backend="gloo")


def test_backend_and_world_size_validation(monkeypatch):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(LmsysError, match="--backend must be one of"):
        launch.resolve_backend("mpi")
    assert launch.resolve_world_sizes(None) == [2]
    assert launch.resolve_world_sizes([4, 6]) == [4, 6]
    with pytest.raises(LmsysError, match="must be >= 1"):
        launch.check_launch("gloo", [0])
    launch.check_launch("gloo", [8])  # gloo: any number of CPU processes


def test_under_torchrun_the_group_size_wins(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert launch.resolve_world_sizes(None) == [4]
    assert launch.resolve_world_sizes([4]) == [4]
    with pytest.raises(LmsysError, match="does not match torchrun's WORLD_SIZE=4"):
        launch.resolve_world_sizes([2])


def test_nccl_needs_cuda_and_a_gpu_per_rank(monkeypatch):
    import torch

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(LmsysError, match="needs CUDA GPUs"):
        launch.check_launch("nccl", [2])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    launch.check_launch("nccl", [1, 2])
    with pytest.raises(LmsysError, match="needs 4 GPUs; 2 visible"):
        launch.check_launch("nccl", [2, 4])


def test_child_environment_keeps_nvls_off_and_lmsys_importable():
    env = launch.child_environment("nccl", 2)
    assert env["NCCL_NVLS_ENABLE"] == os.environ.get("NCCL_NVLS_ENABLE", "0")
    import lmsys

    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(Path(lmsys.__file__).resolve().parent.parent)
    assert int(env["OMP_NUM_THREADS"]) >= 1
