"""torch's own parallelisms on the same mesh, as the baseline rows of `lmsys parallel train --impl torch`.

The order is torchtitan's (`parallelize_llama`): pipeline split -> DTensor tensor parallelism on each stage
-> FSDP2 (`fully_shard`) or DDP over the dp dim.
- `torch_model(model)`: the TransformerLM rewritten in torch's module vocabulary, in place, sharing its
  weights: each lmsys `Linear` becomes an `nn.Linear`, the embedding an `nn.Embedding` (the styles accept
  only those), and the fused `qkv_proj` becomes three `nn.Linear`s q/k/v, its row blocks [q | k | v]
  (no permutation: each keeps its heads contiguous, so ColwiseParallel on each shards head by head).
- TP plan (torchtitan's): q/k/v, w1, w3 `ColwiseParallel`; output_proj, w2 `RowwiseParallel`; the
  embedding `RowwiseParallel` (vocabulary rows); the head `ColwiseParallel` with `loss_parallel` (pp = 1)
  or a replicated output (under pipelining, whose loss_fn sees plain tensors). With sequence parallelism:
  the norms `SequenceParallel`, `PrepareModuleInput` all-gathers before attention and the SwiGLU, the
  row-parallel outputs reduce-scatter to sequence shards.
- PP: `PipelineStage` per chunk (virtual stage s = chunk·pp + rank; lmsys's `PipelineModule` of that one
  chunk, the stage module lmsys's pipeline runs too) and `ScheduleGPipe`, `Schedule1F1B`,
  `ScheduleInterleaved1F1B` with the loss averaged over microbatches (scale_grads).
- DP: `fully_shard` per block then the root on the dp sub-mesh (torch-fsdp, or fsdp for these rows), or
  `DistributedDataParallel` on the dp group (torch-ddp, bucketed).
Limits: key/value heads must split over tp (no replicated k/v); no weight tying.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from lmsys.distributed.data_parallel.strategies import STRATEGIES
from lmsys.distributed.mesh import Mesh
from lmsys.distributed.model_parallel.pipeline import PipelineModule, StepResult, partition
from lmsys.model.transformer import CausalSelfAttention

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B"}
QKV = ("q_proj", "k_proj", "v_proj")


def not_composable(spec, dp_strategy: str) -> Optional[str]:
    """Why torch's row cannot run on this mesh with this dp strategy (None: it can)."""
    if spec.dp > 1 and not STRATEGIES[dp_strategy].shards_params and (spec.tp > 1 or spec.pp > 1):
        return ("not run: torch's DistributedDataParallel runs here only at tp=1, pp=1 (it takes no DTensor "
                "parameters; under torch.distributed.pipelining its reducer fails to rebuild buckets or, with "
                "static_graph, skips the sync); --dp-strategy torch-fsdp composes FSDP2 as torchtitan does")
    return None


class TorchAttention(CausalSelfAttention):
    """CausalSelfAttention with separate q/k/v `nn.Linear`s (what torch's ColwiseParallel shards); head counts
    follow the (possibly sharded) outputs; the attention and the output projection are CausalSelfAttention's."""

    def __init__(self, attn: nn.Module):
        nn.Module.__init__(self)  # the projections are `attn`'s weights, split, not built from a config
        H, Hkv, d = attn.num_heads, attn.kv_heads, attn.d_head
        self.d_head, self.attn_impl = d, attn.attn_impl
        q, k, v = attn.qkv_proj.weight.detach().split([H * d, Hkv * d, Hkv * d])
        self.q_proj, self.k_proj, self.v_proj = (_linear(w) for w in (q, k, v))
        self.output_proj = _linear(attn.output_proj.weight.detach())

    def project(self, x):
        return tuple(rearrange(proj(x), "b s (h d) -> b h s d", d=self.d_head)
                     for proj in (self.q_proj, self.k_proj, self.v_proj))


def _linear(weight: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    layer.weight = nn.Parameter(weight.clone())
    return layer


def torch_model(model):
    """Rewrite `model` in place with nn.Linear / nn.Embedding / split q,k,v (see the module docstring)."""
    for block in model.layers:
        block.attn = TorchAttention(block.attn)
        for name in ("w1", "w2", "w3"):
            setattr(block.ffn, name, _linear(getattr(block.ffn, name).weight.detach()))
    w = model.token_embeddings.weight.detach()
    model.token_embeddings = nn.Embedding(w.shape[0], w.shape[1], _weight=w.clone(), device=w.device, dtype=w.dtype)
    model.lm_head = _linear(model.lm_head.weight.detach())
    return model


def full_name(name: str) -> tuple[str, Optional[int]]:
    """A torch-model parameter's name in the lmsys model, and its place in the fused q/k/v (else None)."""
    for i, proj in enumerate(QKV):
        if f".attn.{proj}." in name:
            return name.replace(proj, "qkv_proj"), i
    return name, None


StageModule = PipelineModule  # one stage module for both pipelines (issue 40): a torch stage is one chunk


def apply_torch_tp(stage: PipelineModule, tp_mesh, *, sequence_parallel: bool, loss_parallel: bool) -> None:
    """torchtitan's TP plan on one stage (see the module docstring)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    sp = sequence_parallel
    seq_out = Shard(1) if sp else Replicate()
    plan = {}
    if stage.token_embeddings is not None:
        plan["token_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq_out)
    if stage.lm_head is not None:
        if sp:
            plan["ln_final"] = SequenceParallel()
        plan["lm_head"] = ColwiseParallel(input_layouts=seq_out,
                                          output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                          use_local_output=not loss_parallel)
    parallelize_module(stage, tp_mesh, plan)
    for block in stage.layers.values():
        layer_plan = {f"attn.{p}": ColwiseParallel() for p in QKV}
        layer_plan.update({"attn.output_proj": RowwiseParallel(output_layouts=seq_out), "ffn.w1": ColwiseParallel(),
                           "ffn.w3": ColwiseParallel(), "ffn.w2": RowwiseParallel(output_layouts=seq_out)})
        if sp:
            layer_plan.update({
                "ln1": SequenceParallel(), "ln2": SequenceParallel(),
                "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                           desired_input_layouts=(Replicate(), None, None)),
                "ffn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            })
        parallelize_module(block, tp_mesh, layer_plan)


class TorchParallelModel:
    """torch's TP / PP / FSDP2 on `mesh`; the same interface as parallelize.ParallelModel."""

    def __init__(self, model, mesh: Mesh, *, sequence_parallel: bool, pp_schedule: str, virtual_stages: int,
                 microbatches: int, dp_strategy: str, device):
        config = model.config
        tp, pp, dp = mesh.size("tp"), mesh.size("pp"), mesh.size("dp")
        self.mesh, self.device = mesh, device
        self.sp = sequence_parallel and tp > 1
        self.loss_parallel = tp > 1 and pp == 1
        torch_model(model)
        V = virtual_stages if pp_schedule == "interleaved-1f1b" else 1
        rank = mesh.coord("pp")
        chunks = partition(config, pp * V, tokens=config.context_length, equal=V > 1)
        self.stages = [PipelineModule(model, [chunks[c * pp + rank]], first=c * pp + rank == 0,
                                      last=c * pp + rank == pp * V - 1) for c in range(V)]
        for s in self.stages:
            if tp > 1:
                apply_torch_tp(s, mesh.sub("tp"), sequence_parallel=self.sp, loss_parallel=self.loss_parallel)
        self.modules = list(self.stages)  # what runs: the stages, or their DDP wrappers
        if dp > 1:
            if STRATEGIES[dp_strategy].shards_params:
                from torch.distributed.fsdp import fully_shard

                for s in self.stages:
                    for block in s.layers.values():
                        fully_shard(block, mesh=mesh.sub("dp"))
                    fully_shard(s, mesh=mesh.sub("dp"))
            else:  # bucketed, torch-ddp: torch's DDP on the dp group
                if (why := not_composable(mesh.spec, dp_strategy)) is not None:
                    raise ValueError(why)
                from torch.nn.parallel import DistributedDataParallel

                self.modules = [DistributedDataParallel(s, process_group=mesh.group("dp")) for s in self.stages]
        self.schedule = None
        if pp > 1:
            import torch.distributed.pipelining as pipelining

            pstages = [pipelining.PipelineStage(s, c * pp + rank, pp * V, device, group=mesh.group("pp"))
                       for c, s in enumerate(self.modules)]
            cls = getattr(pipelining, SCHEDULES[pp_schedule])
            loss = lambda logits, targets: F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())  # noqa: E731
            self.schedule = cls(pstages if V > 1 else pstages[0], microbatches, loss_fn=loss)

    def parameters(self):
        return [p for s in self.stages for p in s.parameters()]

    def train_step(self, inputs, targets, *, microbatches: int, autocast=None, device=None, timer=None,
                   measure_activations: bool = False) -> StepResult:
        """`timer` and `measure_activations` are ParallelModel's; torch's collectives and schedules run
        inside DTensor and torch.distributed.pipelining, out of their reach (no comm or bubble columns)."""
        with autocast() if autocast else nullcontext():
            if self.schedule is not None:
                loss = self._pipeline_step(inputs, targets)
            else:
                loss = self._accumulate(inputs, targets, microbatches)
        return StepResult(loss=loss, peak_activation_bytes=None)

    def _pipeline_step(self, inputs, targets):
        first = self.mesh.coord("pp") == 0
        last = self.mesh.coord("pp") == self.mesh.size("pp") - 1
        losses: list = []
        args = (inputs,) if first else ()
        self.schedule.step(*args, target=targets if last else None, losses=losses if last else None)
        return torch.stack([x.detach().float() for x in losses]).mean() if last else None

    def _accumulate(self, inputs, targets, microbatches):
        from torch.distributed.tensor.parallel import loss_parallel

        module = self.modules[0]
        total = 0.0
        for m, (x, t) in enumerate(zip(inputs.chunk(microbatches), targets.chunk(microbatches))):
            with loss_parallel() if self.loss_parallel else nullcontext():
                logits = module(x)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), t.flatten()) / microbatches
                loss.backward()
            total = total + loss.detach()
        return total.full_tensor() if hasattr(total, "full_tensor") else total

    def full_parameters(self, shapes: dict[str, torch.Size]) -> Optional[dict[str, torch.Tensor]]:
        """The full model's parameters on global rank 0 (None elsewhere). A collective."""
        gathered = gather_parameters(self.mesh, self.stages,
                                     rename=lambda n: n.replace("_fsdp_wrapped_module.", "").replace("module.", ""))
        if gathered is None:
            return None
        full = {name: torch.full(shape, float("nan")) for name, shape in shapes.items()}
        qkv: dict[str, list] = {}
        for rank_pieces in gathered:
            for name, t in rank_pieces.items():
                fused, part = full_name(name)
                if part is None:
                    full[fused].copy_(t)
                else:
                    qkv.setdefault(fused, [None] * 3)[part] = t
        for fused, parts in qkv.items():
            full[fused].copy_(torch.cat(parts))
        return full


def gather_parameters(mesh, modules, rename=lambda name: name) -> Optional[list[dict]]:
    """What `full_parameters` assembles from: on global rank 0, one {rename(name): fp32 CPU tensor} per rank,
    full for the ranks at dp 0 and tp 0 of their stage (a DTensor gathered over its sub-mesh), empty for the
    others; None on every other rank. A collective."""
    pieces = {}
    for module in modules:
        for name, p in module.named_parameters():
            t = p.detach()
            t = t.full_tensor() if hasattr(t, "full_tensor") else t  # every rank of its sub-mesh
            pieces[rename(name)] = t.float().cpu()
    keep = mesh.coord("dp") == 0 and mesh.coord("tp") == 0
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(pieces if keep else {}, gathered, dst=0)
    return gathered


def local_numel(p) -> int:
    return p.to_local().numel() if hasattr(p, "to_local") else p.numel()
