"""ZeRO stage 1: optimizer state sharded across ranks (Rajbhandari et al., 2020, "ZeRO").

Each parameter is owned by one rank, chosen greedily, largest first, to the rank with the fewest owned
elements so far (across all parameter groups), so ranks hold about 1/world of the optimizer state each.
Every rank builds `optimizer_cls` over its own parameters only (one local group per group, possibly
empty), steps it, and then each parameter is broadcast from its owner, so every rank ends the step with
all the updated parameters. Gradients must already be averaged (by a DDP wrapper); the result equals
the unsharded optimizer's, element for element (each parameter's update is computed by exactly the
same optimizer code, only on another rank).

Hyperparameters live in `self.param_groups` (what schedulers change) and are copied into the local
groups before every step.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist


class ShardedOptimizer(torch.optim.Optimizer):
    def __init__(self, params: Iterable, optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any):
        if not dist.is_initialized():
            raise RuntimeError("ShardedOptimizer needs an initialised torch.distributed process group")
        self.optimizer_cls = optimizer_cls
        self.optimizer_kwargs = kwargs
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.owner: dict[int, int] = {}  # id(param) -> owning rank
        self._load = [0] * self.world_size  # elements owned per rank
        self.local_optimizer: Optional[torch.optim.Optimizer] = None
        super().__init__(params, defaults=kwargs)  # calls add_param_group for each group

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)  # validates and fills in defaults
        group = self.param_groups[-1]
        by_size = sorted(range(len(group["params"])), key=lambda i: (-group["params"][i].numel(), i))
        for i in by_size:
            p = group["params"][i]
            owner = min(range(self.world_size), key=lambda r: (self._load[r], r))
            self.owner[id(p)] = owner
            self._load[owner] += p.numel()
        local = {k: v for k, v in group.items() if k != "params"}
        local["params"] = [p for p in group["params"] if self.owner[id(p)] == self.rank]
        if self.local_optimizer is None:
            self.local_optimizer = self.optimizer_cls([local], **self.optimizer_kwargs)
        else:
            self.local_optimizer.add_param_group(local)

    @property
    def owned_numel(self) -> list[int]:
        """Elements owned by each rank (the balance of the split)."""
        return list(self._load)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, local in zip(self.param_groups, self.local_optimizer.param_groups):
            for key, value in group.items():
                if key != "params":
                    local[key] = value
        self.local_optimizer.step()
        self.broadcast_parameters()
        return loss

    @torch.no_grad()
    def broadcast_parameters(self) -> None:
        """Every rank receives the parameters it does not own from their owners."""
        works = [dist.broadcast(p.data, src=self.owner[id(p)], async_op=True)
                 for group in self.param_groups for p in group["params"]]
        for work in works:
            work.wait()
