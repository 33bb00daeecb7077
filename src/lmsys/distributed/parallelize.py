"""`parallelize(model, mesh, ...)`: tensor parallelism -> pipeline stages -> data parallelism over the
mesh's dp dim, applied to a TransformerLM from outside, in that fixed order (picotron's and torchtitan's).

The result, a `ParallelModel`, trains with `train_step(inputs, targets)`: this dp rank's batch is split
into microbatches, run through the pipeline schedule (pp = 1 is one stage: plain gradient accumulation),
and the gradients are averaged over the dp group before the optimizer. Data parallelism is lmsys's
BucketedDDP on the dp group, its buckets launched during the last microbatch's backward (the earlier
ones accumulate locally, `require_grad_sync = False`), or lmsys's FSDP on the dp group (`reshard=False`:
each unit stays gathered through the step's microbatches, its gradient reduce-scattered per backward). `full_parameters()` gathers every rank's shards
into the full model's parameters on global rank 0.
`checkpoint="block"`: each block of the stage (tensor-parallel already) recomputes its activations in
backward (its TP collectives run again there); applied between PP and DP, so DDP's and FSDP's hooks see
the block as before. Compile is not applied.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Optional

import torch
import torch.distributed as dist

from lmsys.distributed.data_parallel.fsdp import FSDP
from lmsys.distributed.data_parallel.strategies import HAND_WRITTEN_DP, MESH_DP, STRATEGIES
from lmsys.distributed.mesh import CHECKPOINTS, Mesh
from lmsys.distributed.model_parallel.pipeline import PipelineModule, StepResult, p2p_plan, partition, run_schedule
from lmsys.distributed.model_parallel.tensor_parallel import apply_tensor_parallel, timed_collectives, tp_loss
from lmsys.train.checkpointing import checkpoint_forward

DP_STRATEGIES = MESH_DP  # --dp-strategy (data_parallel.strategies: torch-free, for the option checks)


class ParallelModel:
    def __init__(self, stage: PipelineModule, mesh: Mesh, *, steps, dp_wrapper, act_dim: tuple[int, int]):
        self.stage, self.mesh, self.steps, self.dp = stage, mesh, steps, dp_wrapper  # steps: p2p_plan's row
        self.act_dim = act_dim  # (sequence length per rank, d_model) of what stages send
        self.last_backward = max(i for i, (action, _) in enumerate(steps) if action is not None and action[0] == "B")

    def parameters(self):
        return (self.dp if isinstance(self.dp, FSDP) else self.stage).parameters()

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor, *, microbatches: int, autocast=None,
                   device=None, timer, measure_activations: bool = True) -> StepResult:
        """One step's forward and backward; the gradients averaged over dp. `timer` (a RegionTimer) gets
        the regions "compute", "pp" (run_schedule), "tp" (every TP collective) and "dp" (bucketed: the
        wait for the gradient sync after the last backward; fsdp: every wait for its all-gathers and
        reduce-scatters, `FSDP.timed`)."""
        if microbatches == 1:  # the plain step's ops: no split (views, but ops all the same)
            mb_in, mb_tg = [inputs], [targets]
        else:
            mb_in, mb_tg = list(inputs.chunk(microbatches)), list(targets.chunk(microbatches))
        fsdp, hook = isinstance(self.dp, FSDP), None
        if self.dp is not None and not fsdp:
            self.dp.on_train_batch_start()
            self.dp.require_grad_sync = False
            # the last backward of this rank fires the buckets: sync on just before it
            hook = _SyncBefore(self.dp, self.last_backward)
        with timed_collectives(timer), (self.dp.timed(timer, "dp") if fsdp else nullcontext()):
            result = run_schedule(self.stage, _watch(self.steps, hook), inputs=mb_in, targets=mb_tg,
                                  pp_ranks=self.mesh.ranks("pp"), pp_rank=self.mesh.coord("pp"),
                                  group=self.mesh.group("pp"), act_shape=(mb_in[0].shape[0], *self.act_dim),
                                  autocast=autocast, device=device, timer=timer,
                                  measure_activations=measure_activations)
            if fsdp:
                self.dp.finish_gradient_synchronization()  # its waits timed inside
        if self.dp is not None and not fsdp:
            with timer.region("dp"):
                self.dp.finish_gradient_synchronization()
        return result

    def local_pieces(self) -> dict[str, tuple[Optional[int], Optional[list[int]], torch.Tensor]]:
        """{full name: (dim, index or None, tensor)} of the parameters this rank holds (dp rank 0 only)."""
        if isinstance(self.dp, FSDP):
            named = self.dp.gather_full_params().items()  # a collective on the dp group
        else:
            named = self.stage.named_parameters()
        if self.mesh.coord("dp") != 0:
            return {}
        out = {}
        for name, p in named:
            full, dim, index = self.stage.tp_layout.get(name, (name, None, None))
            if index is None and self.mesh.coord("tp") != 0:
                continue  # a replicated copy: tp rank 0's stands for all
            key = name if full == name else f"{full}@{name}"
            out[key] = (dim, None if index is None else index.tolist(), p.detach().cpu().clone())
        return out

    def full_parameters(self, shapes: dict[str, torch.Size]) -> Optional[dict[str, torch.Tensor]]:
        """The full model's parameters, assembled on global rank 0 (None elsewhere). A collective."""
        if dist.get_world_size() == 1:  # nothing to gather: no pickling of the whole model
            pieces = [self.local_pieces()]
        else:
            pieces = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
            dist.gather_object(self.local_pieces(), pieces, dst=0)  # NCCL: the launcher set the device
        if pieces is None:
            return None
        full = {name: torch.full(shape, float("nan")) for name, shape in shapes.items()}
        for rank_pieces in pieces:
            for key, (dim, index, t) in rank_pieces.items():
                name = key.partition("@")[0]
                if index is None:
                    full[name].copy_(t)
                else:
                    full[name].index_copy_(dim, torch.tensor(index), t.float())
        return full


class _SyncBefore:
    def __init__(self, dp, index: int):
        self.dp, self.index = dp, index

    def __call__(self, i: int) -> None:
        if i == self.index:
            self.dp.require_grad_sync = True


def _watch(steps, hook):
    for i, step in enumerate(steps):
        if hook is not None:
            hook(i)
        yield step


def parallelize(model, mesh: Mesh, *, sequence_parallel: bool = False, pp_schedule: str = "1f1b",
                virtual_stages: int = 1, microbatches: int = 1, tokens_per_microbatch: int,
                dp_strategy: str = "bucketed", bucket_mb: float = 25.0, checkpoint: str = "none") -> ParallelModel:
    """TP -> PP -> activation checkpointing -> DP, see the module docstring. `model`: the full
    TransformerLM, the same on every rank. A dim of size 1 adds nothing: no collective, no wrapper."""
    if checkpoint not in CHECKPOINTS:
        raise ValueError(f"checkpoint {checkpoint!r}: one of {', '.join(CHECKPOINTS)}")
    config = model.config
    tp, pp, dp = mesh.size("tp"), mesh.size("pp"), mesh.size("dp")
    if tp > 1 or sequence_parallel:
        apply_tensor_parallel(model, mesh.group("tp"), sequence_parallel=sequence_parallel and tp > 1)
    V = virtual_stages if pp_schedule == "interleaved-1f1b" else 1
    chunks = partition(config, pp * V, tokens=tokens_per_microbatch, equal=V > 1)
    rank = mesh.coord("pp")
    mine = [chunks[c * pp + rank] for c in range(V)]
    stage = PipelineModule(model, mine, first=rank == 0, last=rank == pp - 1, loss_fn=tp_loss)
    steps = p2p_plan(pp_schedule, pp=pp, microbatches=microbatches, virtual_stages=V)[rank]
    if pp > 1:  # NCCL: a group's first batch_isend_irecv must involve all its ranks; a barrier comes first
        dist.barrier(group=mesh.group("pp"))
    if checkpoint == "block":  # the stage's blocks (sharded already); before DP, whose hooks stay outside
        for block in stage.layers.values():
            checkpoint_forward(block)
    wrapper = None
    if dp > 1:
        if dp_strategy not in HAND_WRITTEN_DP:
            raise ValueError(f"dp strategy {dp_strategy!r} is torch's: model_parallel.torch_parallel runs it")
        if STRATEGIES[dp_strategy].shards_params:
            wrapper = FSDP(stage, units=list(stage.layers.values()), group=mesh.group("dp"), reshard=False)
            stage.before_forward = wrapper.gather_root
        else:
            from lmsys.distributed.data_parallel.ddp import BucketedDDP

            wrapper = BucketedDDP(stage, bucket_mb, group=mesh.group("dp"))
    seq = config.context_length // tp if (sequence_parallel and tp > 1) else config.context_length
    return ParallelModel(stage, mesh, steps=steps, dp_wrapper=wrapper, act_dim=(seq, config.d_model))
