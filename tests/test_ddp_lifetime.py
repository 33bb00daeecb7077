"""A dropped DDP wrapper releases its model: `ddp train` builds one model per strategy in the same
process, and on 2×H200 (xl, bf16) the hooks' strong references kept every earlier model, its gradients
and buckets alive until the third strategy ran out of 140 GiB. World size 1 over gloo is enough to see it."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lmsys.distributed.data_parallel.ddp import BucketedDDP, FlatDDP, NaiveDDP, OverlapDDP


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("make", [NaiveDDP, FlatDDP, OverlapDDP, lambda m: BucketedDDP(m, 0.001)],
                         ids=["naive", "flat", "overlap", "bucketed"])
def test_wrapper_and_model_are_freed_after_training(group, make):
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    wrapped = make(model)
    optimizer = torch.optim.AdamW(wrapped.parameters())
    for _ in range(2):
        wrapped.on_train_batch_start()
        wrapped(torch.randn(4, 8)).sum().backward()
        wrapped.finish_gradient_synchronization()
        optimizer.step()
        optimizer.zero_grad()
    alive = weakref.ref(model), weakref.ref(wrapped), weakref.ref(model[0].weight)
    del model, wrapped, optimizer
    gc.collect()
    assert [ref() is None for ref in alive] == [True, True, True]


def test_a_parameter_outliving_its_wrapper_has_no_hook_left(group):
    model = nn.Linear(4, 2)
    wrapped = OverlapDDP(model)
    del wrapped
    gc.collect()
    assert not getattr(model.weight, "_post_accumulate_grad_hooks", None)  # removed, not left as no-ops
    model(torch.randn(3, 4)).sum().backward()
    assert model.weight.grad is not None
