"""What one training step is (`Workload`): the model config, the batch, the numerics and the fast path.

The fast-path switches (each measured in docs/benchmarks/e2e.md) are checked here, once, and applied
from outside the model by `lmsys.train.build`: compile (whole loss function or each block), CUDA graphs,
fused or master-weight AdamW, chunked cross-entropy, activation checkpointing, TF32, and the optimizer
run inside the backward.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lmsys.core.devices import torch_dtype
from lmsys.core.errors import LmsysError
from lmsys.core.parsing import choose
from lmsys.model.config import ModelConfig
from lmsys.train.optim import OPTIMIZER_CHOICES, STEP_LR

COMPILE_CHOICES = ("none", "model", "blocks")
FUSED_CE_BYTES = 2**30  # "auto" chunks the cross-entropy once fp32 logits would exceed 1 GiB


@dataclass(frozen=True)
class Workload:
    """What one benchmarked training step is: the model, the batch, the numerics and the fast path."""

    config: ModelConfig
    batch_size: int = 4
    dtype: str = "fp32"            # autocast dtype (weights fp32), or the weights' dtype with master_weights
    compile: str = "none"          # none | model (the whole loss function) | blocks (each block)
    cuda_graphs: bool = False      # torch.compile mode="reduce-overhead"
    optimizer: str = "adamw"       # adamw (foreach) | adamw-fused; ignored with master_weights
    master_weights: bool = False   # bf16 weights and grads, fp32 master + moments (lmsys.kernels.adamw)
    fused_ce: bool | str = False   # chunked cross-entropy: True | False | "auto" (when logits are large)
    checkpoint: str = "none"       # none | block | every:N (segments of N blocks)
    tf32: bool = False             # TF32 tensor cores for fp32 matmuls
    optimizer_in_backward: bool = False  # each block's AdamW runs from a post-accumulate-grad hook
    optimizer_stream: bool = False  # ... on a side CUDA stream, under the rest of the backward
    sm_carveout: int | None = None  # ... while the backward's matmuls leave this many SMs to it
    lr: float = STEP_LR

    def __post_init__(self):
        choose(self.compile, COMPILE_CHOICES, what="compile")
        choose(self.optimizer, OPTIMIZER_CHOICES, what="--optimizer")
        torch_dtype(self.dtype)
        if self.master_weights and self.dtype != "bf16":
            raise LmsysError("--master-weights keeps bf16 weights with fp32 master copies: use it with --dtype bf16")
        if self.cuda_graphs and self.compile == "none":
            raise LmsysError("--cuda-graphs works through torch.compile: add --compile or --compile-blocks")
        if self.fused_ce == "auto":
            logits_bytes = 4 * self.tokens * self.config.vocab_size
            object.__setattr__(self, "fused_ce", logits_bytes > FUSED_CE_BYTES)
        checkpoint_segment(self.checkpoint, self.config.num_layers)
        check_optimizer_in_backward(self)

    @property
    def seq_len(self) -> int:
        return self.config.context_length

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len

    def describe(self) -> str:
        from lmsys.model.user import is_user_model

        user = is_user_model(self.config)
        parts = [] if user else [f"attention {self.config.attn_impl}"]  # a --model's own
        if self.compile != "none":
            scope = self.compile
            if user:
                from lmsys.model.user import blocks_of

                scope = (f"each block ({blocks_of(self.config)})" if self.compile == "blocks"
                         else "the whole model and loss")
            parts.append(f"compile {scope}" + (" + CUDA graphs" if self.cuda_graphs else ""))
        parts.append("bf16 weights + fp32 master AdamW" if self.master_weights else
                     ("fused AdamW" if self.optimizer == "adamw-fused" else "AdamW"))
        if self.fused_ce:
            parts.append("chunked CE")
        if self.checkpoint != "none":
            parts.append(f"checkpoint {self.checkpoint}")
        if self.tf32:
            parts.append("TF32")
        if self.optimizer_in_backward:
            where = " (side stream" + (f", matmuls leave it {self.sm_carveout} SMs" if self.sm_carveout is not None
                                       else "") + ")"
            parts.append("optimizer in backward" + (where if self.optimizer_stream else ""))
        return ", ".join(parts)


def check_optimizer_in_backward(workload: Workload) -> None:
    """The combinations the in-backward optimizer refuses, each with why (one line)."""
    if workload.optimizer_stream and not workload.optimizer_in_backward:
        raise LmsysError("--optimizer-stream runs the in-backward updates on a side stream: "
                         "add --optimizer-in-backward")
    if workload.sm_carveout is not None and not (workload.optimizer_in_backward and workload.optimizer_stream):
        raise LmsysError("--sm-carveout leaves SMs to the in-backward updates on their side stream: "
                         "add --optimizer-in-backward --optimizer-stream")
    if workload.sm_carveout is not None and workload.sm_carveout < 0:
        raise LmsysError(f"--sm-carveout must be >= 0 SMs, not {workload.sm_carveout}")
    if not workload.optimizer_in_backward:
        return
    if workload.dtype == "fp16":
        raise LmsysError("--optimizer-in-backward cannot use fp16's GradScaler: it updates blocks before the "
                         "scaler has seen every gradient for inf/NaN; use --dtype bf16 or fp32")
    if workload.cuda_graphs:
        raise LmsysError("--optimizer-in-backward with --cuda-graphs is not supported: graph replays reuse the "
                         "gradient buffers the hooks update from")


def checkpoint_segment(policy: str, num_layers: int) -> int | None:
    """'none' -> None; 'block' -> 1; 'every:N' -> N (blocks per recomputed segment)."""
    if policy == "none":
        return None
    if policy == "block":
        return 1
    m = re.fullmatch(r"every:(\d+)", policy)
    if not m or int(m.group(1)) < 1:
        raise LmsysError(f"--checkpoint must be none, block or every:N (N >= 1), not {policy!r}")
    return min(int(m.group(1)), num_layers)
