"""A user's model (`--model`, lmsys.model.user.UserLM) on a mesh, with torch's parallelisms applied from
outside, in torchtitan's order: pipeline split -> DTensor tensor parallelism -> FSDP2 or DDP over dp.

- TP: the model's plan (lmsys.model.user.tp_plan: Hugging Face's `base_model_tp_plan`, a `tp_plan` class
  attribute or `--tp-plan FILE.yaml`), each pattern `ColwiseParallel` or `RowwiseParallel` through
  `parallelize_module` (wildcards allowed); everything else is replicated. The model's attention must
  take its head count from the (sharded) projections' width, as Hugging Face's do (`view(..., -1, d_head)`).
- PP: `torch.distributed.pipelining.pipeline` traces the model and splits it at its blocks (the list
  `find_blocks` finds), as evenly as the block count allows; `ScheduleGPipe` or `Schedule1F1B` with the mean
  next-token cross-entropy of the last stage's logits.
- DP: fsdp / torch-fsdp: `fully_shard` on each block then the root (pp = 1; a stage's root under pp) on
  the dp sub-mesh; bucketed: lmsys's BucketedDDP on the dp group; torch-ddp: DistributedDataParallel (both
  at tp = pp = 1: they take no DTensor parameters and no traced stages).
Checked before any rank starts: lmsys.model.user.check_parallel.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Optional

import torch
import torch.nn.functional as F

from lmsys.distributed.data_parallel.strategies import STRATEGIES
from lmsys.distributed.mesh import Mesh
from lmsys.distributed.model_parallel.pipeline import StepResult
from lmsys.distributed.model_parallel.torch_parallel import SCHEDULES, gather_parameters


def not_composable(spec, dp_strategy: str) -> Optional[str]:
    """Why a --model cannot run on this mesh with this dp strategy (None: it can)."""
    if spec.dp > 1 and not STRATEGIES[dp_strategy].shards_params and (spec.tp > 1 or spec.pp > 1):
        return (f"not run: {dp_strategy} on a --model runs at tp=1, pp=1 only (DDP takes no DTensor parameters "
                "and no traced pipeline stages); --dp-strategy fsdp or torch-fsdp composes FSDP2")
    return None


def _split_points(model, pp: int) -> dict:
    from torch.distributed.pipelining import SplitPoint

    from lmsys.model.user import find_blocks

    blocks = find_blocks(model)
    names = {id(m): n for n, m in model.named_modules()}
    n = len(blocks)
    starts = [round(s * n / pp) for s in range(1, pp)]
    return {names[id(blocks[i])]: SplitPoint.BEGINNING for i in starts}


class UserParallelModel:
    """A --model on `mesh`; the interface of lmsys.distributed.parallelize.ParallelModel."""

    def __init__(self, model, mesh: Mesh, *, plan: Optional[dict], pp_schedule: str, microbatches: int,
                 dp_strategy: str, device, example):
        tp, pp, dp = mesh.size("tp"), mesh.size("pp"), mesh.size("dp")
        self.mesh, self.device, self.model = mesh, device, model
        if (why := not_composable(mesh.spec, dp_strategy)) is not None:
            raise ValueError(why)
        self.schedule = None
        if tp > 1:
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
            parallelize_module(model, mesh.sub("tp"), {k: styles[v]() for k, v in plan.items()})
        if pp > 1:
            from torch.distributed.pipelining import pipeline

            mb = example[: example.shape[0] // microbatches]
            pipe = pipeline(model, mb_args=(mb,), split_spec=_split_points(model, pp))
            rank = mesh.coord("pp")
            self.stage_module = pipe.get_stage_module(rank)
            self.modules = [self.stage_module]
        else:
            self.modules = [model]
        self.runner = self.modules[0]
        if dp > 1:
            if STRATEGIES[dp_strategy].shards_params:
                from torch.distributed.fsdp import fully_shard

                from lmsys.model.user import find_blocks

                if pp == 1:
                    for block in find_blocks(model) or []:
                        fully_shard(block, mesh=mesh.sub("dp"))
                fully_shard(self.runner, mesh=mesh.sub("dp"))
            elif STRATEGIES[dp_strategy].hand_written:  # lmsys's BucketedDDP
                from lmsys.distributed.data_parallel.ddp import BucketedDDP

                self.runner = BucketedDDP(model, 25.0, group=mesh.group("dp"))
            else:
                from torch.nn.parallel import DistributedDataParallel

                self.runner = DistributedDataParallel(model, process_group=mesh.group("dp"))
        if pp > 1:
            import torch.distributed.pipelining as pipelining

            stage = pipe.build_stage(mesh.coord("pp"), device, group=mesh.group("pp"))
            loss = lambda logits, targets: F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())  # noqa: E731
            self.schedule = getattr(pipelining, SCHEDULES[pp_schedule])(stage, microbatches, loss_fn=loss)

    def parameters(self):
        return [p for m in self.modules for p in m.parameters()]

    def train_step(self, inputs, targets, *, microbatches: int, autocast=None, device=None, timer=None,
                   measure_activations: bool = False) -> StepResult:
        """One step's forward and backward over `microbatches`; torch's collectives run inside DTensor,
        FSDP2, DDP and pipelining, out of lmsys's timer (no comm or bubble columns)."""
        with autocast() if autocast else nullcontext():
            if self.schedule is not None:
                first = self.mesh.coord("pp") == 0
                last = self.mesh.coord("pp") == self.mesh.size("pp") - 1
                losses: list = []
                self.schedule.step(*((inputs,) if first else ()), target=targets if last else None,
                                   losses=losses if last else None)
                loss = torch.stack([x.detach().float() for x in losses]).mean() if last else None
            else:
                loss = self._accumulate(inputs, targets, microbatches)
        return StepResult(loss=loss, peak_activation_bytes=None)

    def _accumulate(self, inputs, targets, microbatches):
        from lmsys.distributed.data_parallel.ddp import BucketedDDP
        from lmsys.train.step import lm_loss

        bucketed = isinstance(self.runner, BucketedDDP)
        if bucketed:
            self.runner.on_train_batch_start()
        total = 0.0
        chunks = list(zip(inputs.chunk(microbatches), targets.chunk(microbatches)))
        for m, (x, t) in enumerate(chunks):
            if bucketed:
                self.runner.require_grad_sync = m == len(chunks) - 1  # the buckets fire in the last backward
            sync = nullcontext() if bucketed or not hasattr(self.runner, "no_sync") or m == len(chunks) - 1 \
                else self.runner.no_sync()
            with sync:
                loss = lm_loss(self.runner, x, t, fused_ce=False) / microbatches
                loss.backward()
            total = total + loss.detach()
        if bucketed:
            self.runner.finish_gradient_synchronization()
        return total.full_tensor() if hasattr(total, "full_tensor") else total

    def full_parameters(self, shapes: dict[str, torch.Size]) -> Optional[dict[str, torch.Tensor]]:
        """The full model's parameters (UserLM's names) on global rank 0 (None elsewhere). A collective."""
        gathered = gather_parameters(self.mesh, self.modules)
        if gathered is None:
            return None
        full = {name: torch.full(shape, float("nan")) for name, shape in shapes.items()}
        for rank_pieces in gathered:
            for name, t in rank_pieces.items():
                if name in full:
                    full[name].copy_(t)
        return full
