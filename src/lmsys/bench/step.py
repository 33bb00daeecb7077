"""The training step every single-device tool runs: build a model, random data, and the three phases.

`bench e2e` wraps the phases in timer regions, `profile nsys` in NVTX ranges, `profile memory` in
memory-history phases: the step itself knows nothing of who watches it.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lmsys.core.devices import torch_dtype
from lmsys.model.config import ModelConfig
from lmsys.model.transformer import TransformerLM

MODES = ("fwd", "fwd-bwd", "train")


@dataclass(frozen=True)
class Workload:
    """What one benchmarked training step is: the model, the batch and the numerics."""

    config: ModelConfig
    batch_size: int = 4
    dtype: str = "fp32"  # autocast dtype; weights stay fp32
    compile: bool = False

    @property
    def seq_len(self) -> int:
        return self.config.context_length

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len


class TrainStep:
    """forward (loss under autocast) -> backward (grad-scaled for fp16) -> optimizer (step + zero_grad)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, device, dtype: str):
        self.model = model
        self.optimizer = optimizer
        self.device = device
        self.autocast_dtype = None if dtype == "fp32" else torch_dtype(dtype)
        self.scaler = torch.amp.GradScaler(device.type) if dtype == "fp16" else None

    def _autocast(self):
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            logits = self.model(inputs)  # [B, S, V]
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def optimizer_step(self) -> None:
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def run(self, inputs, targets, mode: str = "train") -> torch.Tensor:
        """One whole step of `mode` (used for warm-up and by tools that do not split phases)."""
        if mode == "fwd":
            return self.forward(inputs, targets)
        self.zero_grad()
        loss = self.forward(inputs, targets)
        self.backward(loss)
        if mode == "train":
            self.optimizer_step()
        return loss


def random_batch(workload: Workload, device, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform random token ids and targets, [B, S] each."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    shape = (workload.batch_size, workload.seq_len)
    inputs = torch.randint(0, workload.config.vocab_size, shape, generator=gen)
    targets = torch.randint(0, workload.config.vocab_size, shape, generator=gen)
    return inputs.to(device), targets.to(device)


def build_train_step(workload: Workload, device, *, seed: int = 0) -> TrainStep:
    """Random-weight model on `device` with AdamW, wrapped as a TrainStep."""
    torch.manual_seed(seed)
    model = TransformerLM(workload.config, device=device)
    if workload.compile:
        model = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    return TrainStep(model, optimizer, device=device, dtype=workload.dtype)
