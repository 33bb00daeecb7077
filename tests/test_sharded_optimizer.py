"""ShardedOptimizer (ZeRO-1, flat buckets) against unsharded torch optimizers (gloo, CPU).

One spawn per world size (2, and 3 where buckets need padding) runs every scenario in the same
processes. The reference is the plain torch optimizer on a copy of the same parameters, fed the same
gradients (what a DDP wrapper would leave on every rank), with awkward sizes, two param groups with
their own lr and weight decay, a scheduler changing lr, a parameter whose gradient is None on some
steps and one that never gets a gradient.
"""

from __future__ import annotations

from datetime import timedelta

import gloo_world
import pytest
import torch
import torch.distributed as dist

SHAPES = {"a": (7, 5), "b": (13,), "c": (3, 3, 3), "d": (1,), "e": (40,), "f": (6, 11), "g": (5,)}
GROUP_1 = ("e", "f", "g")  # second param group: other lr and weight decay
SOMETIMES = "c"  # gradient None on even steps
NEVER = "g"  # never a gradient
STEPS = 6
SCENARIOS = {  # name -> (optimizer, bucket_mb)
    "adamw-one-bucket": ("adamw", 1000.0),
    "adamw-small-buckets": ("adamw", 50 * 4 / 2**20),  # 50 fp32 elements: several buckets, split params
    "adamw-bucket-per-param": ("adamw", 1e-9),
    "sgd-small-buckets": ("sgd", 50 * 4 / 2**20),
}


def make_params(seed: int) -> dict[str, torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.nn.Parameter(torch.randn(s, generator=gen)) for n, s in SHAPES.items()}


def make_optimizer(kind: str, params: dict, *, bucket_mb=None):
    groups = [{"params": [p for n, p in params.items() if n not in GROUP_1]},
              {"params": [params[n] for n in GROUP_1], "lr": 0.05, "weight_decay": 0.3}]
    cls, kw = {"adamw": (torch.optim.AdamW, dict(lr=0.02, weight_decay=0.1, betas=(0.8, 0.95))),
               "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01))}[kind]
    if bucket_mb is None:
        return cls(groups, **kw)
    from lmsys.distributed.data_parallel.zero1 import ShardedOptimizer

    return ShardedOptimizer(groups, cls, bucket_mb=bucket_mb, **kw)


def train(kind: str, params: dict, bucket_mb=None):
    opt = make_optimizer(kind, params, bucket_mb=bucket_mb)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    gen = torch.Generator().manual_seed(7)  # the same gradients on every rank, as after DDP's average
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        for n, p in params.items():
            g = torch.randn(p.shape, generator=gen)
            if n == NEVER or (n == SOMETIMES and step % 2 == 0):
                continue
            p.grad = g
        opt.step()
        sched.step()
    return opt


def worker(rank: int, world: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    from lmsys.distributed.data_parallel.zero1 import optimizer_state_bytes

    calls = {"all_gather_single": 0, "all_gather_into_tensor": 0, "all_gather": 0, "broadcast": 0}
    for name in calls:
        real = getattr(dist, name, None)
        if real is None:  # all_gather_single is new in torch 2.13
            continue

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        setattr(dist, name, counted)
    results = {}
    for scenario, (kind, mb) in SCENARIOS.items():
        for name in calls:
            calls[name] = 0
        ref_params = make_params(1)
        ref = train(kind, ref_params)
        params = make_params(1)
        opt = train(kind, params, bucket_mb=mb)
        diff = max((params[n] - ref_params[n]).abs().max().item() for n in SHAPES)
        storages = {b.flat.untyped_storage().data_ptr() for b in opt.buckets}
        info = {
            "diff": diff,
            "never_moved": bool(torch.equal(params[NEVER], make_params(1)[NEVER])),
            "buckets": len(opt.buckets),
            "padded": [b.flat.numel() for b in opt.buckets],
            "owned": opt.owned_numel,
            "local_numel": sum(p.numel() for g in opt.local_optimizer.param_groups for p in g["params"]),
            "views": all(p.untyped_storage().data_ptr() in storages for p in params.values()),
            "calls": dict(calls),
            "state_bytes": optimizer_state_bytes(opt),
            "ref_state_bytes": optimizer_state_bytes(ref),
            "stateful": len(opt.local_optimizer.state),
            "ref_stateful": len(ref.state),
            "lr": [g["lr"] for g in opt.param_groups],
            "ref_lr": [g["lr"] for g in ref.param_groups],
        }
        gathered = [None] * world
        dist.all_gather_object(gathered, info)
        results[scenario] = gathered
    gloo_world.finish(rank, results, out)


def run_world(world: int) -> dict:
    return gloo_world.run_world(worker, world)


TOTAL = sum(torch.Size(s).numel() for s in SHAPES.values())


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_equals_unsharded_optimizer(world):
    for scenario, infos in run_world(world).items():
        for info in infos:
            # same elementwise arithmetic on each element: equal to fp32 rounding (measured: 0.0)
            assert info["diff"] <= 1e-6, (scenario, info["diff"])
            assert info["never_moved"], scenario  # no gradient ever: no decay, no step
            assert info["views"], scenario  # parameters live in the flat buckets
            assert info["lr"] == info["ref_lr"], scenario  # the scheduler sees the optimizer's groups


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_one_all_gather_per_bucket_per_step_and_no_broadcast(world):
    for scenario, infos in run_world(world).items():
        for info in infos:
            assert info["calls"]["broadcast"] == 0, scenario
            gathers = info["calls"]["all_gather_single"] + info["calls"]["all_gather_into_tensor"]
            assert gathers == info["buckets"] * STEPS and info["calls"]["all_gather"] == 0, (scenario, info)
        n = infos[0]["buckets"]
        expected = {"adamw-one-bucket": n == 2,  # one per group
                    "adamw-bucket-per-param": n == len(SHAPES)}.get(scenario, 2 < n < len(SHAPES))
        assert expected, (scenario, n)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_shards_split_the_state_evenly_with_padding(world):
    for scenario, infos in run_world(world).items():
        owned = infos[0]["owned"]
        assert sum(owned) == TOTAL
        assert [i["local_numel"] for i in infos] == owned, scenario
        for padded in infos[0]["padded"]:
            assert padded % world == 0
        # each bucket is split evenly: a rank holds at most one element more per bucket than its share
        assert max(owned) - TOTAL / world <= infos[0]["buckets"], (scenario, owned)
        if world == 3:
            assert any(p % 3 == 0 and p > 0 for p in infos[0]["padded"])


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_optimizer_state_bytes_is_this_ranks_share(world):
    for scenario, infos in run_world(world).items():
        ref, ref_tensors = infos[0]["ref_state_bytes"], infos[0]["ref_stateful"]
        per_elem, per_tensor = (8, 4) if scenario.startswith("adamw") else (4, 0)  # moments | momentum; step
        # all ranks together hold the reference's elementwise state; AdamW adds a 4-byte step per piece
        total = sum(i["state_bytes"] for i in infos)
        assert total - ref == per_tensor * (sum(i["stateful"] for i in infos) - ref_tensors), scenario
        for info in infos:  # this rank: its share, give or take a bucket's rounding
            share = ref / world + per_elem * infos[0]["buckets"] + per_tensor * info["stateful"]
            assert 0 < info["state_bytes"] <= share, (scenario, info["state_bytes"], share)
