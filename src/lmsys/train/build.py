"""The one place a model is built, and the training step around it with the fast path applied.

`build_model` is the seam every tool builds through (bench, profiling, distributed, the parameter
count): `factory(config, device=)` makes the module: the one a caller passes, else the one `config.model`
names (lmsys's TransformerLM, or a user's / Hugging Face's through lmsys.model.user). `build_train_step` adds what a Workload asks for, from outside the model: bf16 master weights,
per-block or whole-loss torch.compile, activation checkpointing, the optimizer (in the backward or
after it). TF32 is a process-wide switch: `tf32_matmuls` scopes it around a run.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch

from lmsys.core.devices import MatmulCarveout, torch_dtype
from lmsys.model.config import ModelConfig
from lmsys.train.checkpointing import apply_activation_checkpointing
from lmsys.train.optim import OptimizerInBackward, make_optimizer, side_stream, update_groups
from lmsys.train.step import TrainStep, lm_loss
from lmsys.train.workload import Workload, checkpoint_segment

ModelFactory = Callable[..., torch.nn.Module]  # factory(config, device=device) -> a module on `device`


def transformer_lm(config: ModelConfig, *, device) -> torch.nn.Module:
    """lmsys's own model, the default factory."""
    from lmsys.model.transformer import TransformerLM

    return TransformerLM(config, device=device)


def default_factory(config: ModelConfig) -> ModelFactory:
    """The factory `config.model` names: TransformerLM for lmsys, else lmsys.model.user's (hf:NAME,
    pkg.module:Name, file.py:Name, wrapped so that ids [B, S] map to logits [B, S, V])."""
    from lmsys.model.user import build_user_model, is_user_model

    return build_user_model if is_user_model(config) else transformer_lm


def build_model(config: ModelConfig, *, device, seed: int = 0, factory: ModelFactory | None = None
                ) -> torch.nn.Module:
    """Random-weight model of `config` on `device`, seeded: every run of a comparison (workloads, ranks,
    the one-process reference) starts from the same weights. On `meta` nothing is allocated."""
    factory = factory or default_factory(config)
    if torch.device(device).type == "meta":  # no values: the global RNG is left alone
        with torch.device("meta"):  # tensors a factory makes without device= stay on meta too
            return factory(config, device=device)
    torch.manual_seed(seed)
    return factory(config, device=device)


def count_parameters(config: ModelConfig, *, factory: ModelFactory | None = None) -> int:
    """Parameter count of the real module, built on the meta device: no memory is allocated."""
    model = build_model(config, device="meta", factory=factory)
    return sum(p.numel() for p in model.parameters())


def build_train_step(workload: Workload, device, *, seed: int = 0, factory: ModelFactory | None = None
                     ) -> TrainStep:
    """The model (`build_model`), the optimizer, and the fast-path wrappers the workload asks for."""
    model = build_model(workload.config, device=device, seed=seed, factory=factory)
    if workload.master_weights:
        model = model.to(torch_dtype(workload.dtype))
    groups = update_groups(model) if workload.optimizer_in_backward else None  # before checkpointing regroups
    compile_mode = "reduce-overhead" if workload.cuda_graphs else None
    if workload.compile == "blocks":
        for layer in model.layers:
            layer.compile(mode=compile_mode)  # in place: the checkpointed segments below hold these
    segment = checkpoint_segment(workload.checkpoint, workload.config.num_layers)
    if segment is not None:
        apply_activation_checkpointing(model, segment)

    def loss_fn(inputs, targets):
        return lm_loss(model, inputs, targets, fused_ce=bool(workload.fused_ce))

    if workload.compile == "model":
        loss_fn = torch.compile(loss_fn, mode=compile_mode)

    def build_optimizer(params):
        return make_optimizer(params, lr=workload.lr, kind=workload.optimizer, master_weights=workload.master_weights)

    if workload.optimizer_in_backward:
        carveout = None if workload.sm_carveout is None else MatmulCarveout(workload.sm_carveout, device)
        optimizer = OptimizerInBackward(groups, build_optimizer, stream=side_stream(workload.optimizer_stream, device),
                                        carveout=carveout)
    else:
        optimizer = build_optimizer(model.parameters())
    return TrainStep(model, optimizer, device=device, dtype=workload.dtype, loss_fn=loss_fn,
                     autocast=not workload.master_weights)


@contextmanager
def tf32_matmuls(enabled: bool):
    """Allow (or forbid) TF32 tensor cores for fp32 matmuls and convolutions inside the block."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
