"""One training step: forward and backward, then the optimizer, each in a range.

`TrainStep` holds the model, the optimizer and the numerics (autocast, fp16's grad scaler);
`ParallelStep` is a step whose forward and backward are one call (a model split over a mesh runs its
microbatches through its pipeline schedule), as torchtitan's trainer has one `forward_backward_step`
with a pipelined branch. `run_step` runs one step of either, each part inside the caller's range:
`bench e2e`, `ddp train`, `parallel train` and `plan calibrate` pass timer regions (through
lmsys.train.loop's one timed loop), `profile nsys` NVTX ranges, `profile memory` allocator phases. The
step knows nothing of who watches it. `lm_loss` and `random_batch` are the loss and the data.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, ContextManager, Mapping

import torch
import torch.nn.functional as F

from lmsys.core.devices import torch_dtype
from lmsys.train.optim import OptimizerInBackward


class TrainStep:
    """forward (loss under autocast) -> backward (grad-scaled for fp16) -> optimizer (step + zero_grad)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, device, dtype: str,
                 loss_fn=None, autocast: bool = True):
        self.model = model
        self.optimizer = optimizer
        self.device = device
        self.autocast_dtype = None if (dtype == "fp32" or not autocast) else torch_dtype(dtype)
        self.scaler = torch.amp.GradScaler(device.type) if dtype == "fp16" else None
        self.loss_fn = loss_fn or (lambda inputs, targets: lm_loss(model, inputs, targets, fused_ce=False))

    def _autocast(self):
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            return self.loss_fn(inputs, targets)

    def forward_backward(self, inputs, targets, ranges: Ranges, *, mode: str = "train",
                         after_forward: Callable[[], None] | None = None,
                         after_backward: Callable[[], None] | None = None) -> torch.Tensor:
        """forward, `after_forward()`, then (fwd-bwd, train) backward and `after_backward()`, each in
        `ranges(part)`; the detached loss."""
        with ranges("forward"):
            loss = self.forward(inputs, targets)
        if after_forward is not None:
            after_forward()
        if mode != "fwd":
            with ranges("backward"):
                self.backward(loss, update=mode == "train")  # fwd-bwd: no in-backward updates
            if after_backward is not None:
                with ranges("after_backward"):
                    after_backward()
        return loss.detach()

    def backward(self, loss: torch.Tensor, *, update: bool = True) -> None:
        """Gradients of `loss`; with an `OptimizerInBackward`, also the updates (unless update=False:
        then the gradients stay, as in the fwd-bwd mode)."""
        paused = (self.optimizer.paused() if isinstance(self.optimizer, OptimizerInBackward) and not update
                  else nullcontext())
        with paused:
            try:
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            except BaseException:  # an OOM mid-backward: the next rows must not run with SMs carved out
                if isinstance(self.optimizer, OptimizerInBackward):
                    self.optimizer.end_carveout()
                raise

    def optimizer_step(self) -> None:
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


class ParallelStep:
    """A step whose forward and backward are one call: `model.train_step(inputs, targets, ...)` of a model
    split over a mesh (lmsys.distributed.parallelize's ParallelModel, model_parallel.torch_parallel's
    TorchParallelModel) runs the microbatches through its pipeline schedule (pp = 1: accumulates them) and
    leaves the gradients averaged over dp; then the optimizer steps. The model's own regions (compute,
    pp, tp, dp) go to the caller's ranges (`ranges.region`); its first step counts the bytes autograd
    saves (`activation_bytes`: a hook per saved tensor, one step only)."""

    def __init__(self, model, optimizer, *, microbatches: int, autocast=None, device=None):
        self.model, self.optimizer = model, optimizer
        self.microbatches, self.autocast, self.device = microbatches, autocast, device
        self.activation_bytes = None
        self._count_activations = True

    def forward_backward(self, inputs, targets, ranges: Ranges, *, mode: str = "train",
                         after_forward=None, after_backward=None) -> torch.Tensor | None:
        """The loss on the last pipeline stage (None elsewhere)."""
        if mode != "train" or after_forward is not None or after_backward is not None:
            raise ValueError("a ParallelStep trains (mode train) and takes no hooks: its forward and backward are one")
        result = self.model.train_step(inputs, targets, microbatches=self.microbatches, autocast=self.autocast,
                                       device=self.device, timer=ranges, measure_activations=self._count_activations)
        if self._count_activations:
            self.activation_bytes, self._count_activations = result.peak_activation_bytes, False
        return result.loss

    def optimizer_step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


# ----------------------------------------------------------------------------- the one step runner

RangeFn = Callable[[str], ContextManager]

# The timer regions of `bench e2e` and `ddp train` (their row columns); the profilers pass their own
# names (lmsys.profiling.phases.PROFILER_NAMES). A part without a name runs outside any range.
TIMER_NAMES = {"step": "step", "forward": "forward", "backward": "backward", "optimizer": "optimizer"}


def no_range(_name: str) -> ContextManager:
    return nullcontext()


class Ranges:
    """The caller's range function under a step's part names: `ranges(part)` opens `range_fn(names[part])`
    (nothing for a part without a name); `ranges.region(name)` opens `range_fn(name)` itself, for a step's
    own regions (a RegionTimer's interface: ParallelStep's model times its compute and collectives there)."""

    def __init__(self, range_fn: RangeFn, names: Mapping[str, str]):
        self.range_fn, self.names = range_fn, names

    def __call__(self, part: str) -> ContextManager:
        key = self.names.get(part)
        return nullcontext() if key is None else self.range_fn(key)

    def region(self, name: str) -> ContextManager:
        return self.range_fn(name)


def run_step(step, inputs, targets, *, mode: str = "train", range_fn: RangeFn = no_range,
             names: Mapping[str, str] = TIMER_NAMES, before: Callable[[], None] | None = None,
             after_forward: Callable[[], None] | None = None,
             after_backward: Callable[[], None] | None = None) -> torch.Tensor:
    """One training step of `mode` (fwd | fwd-bwd | train) of `step` (a TrainStep or a ParallelStep), each
    part inside `range_fn(names[part])`.

    Outside any range: gradients are cleared, then `before()` runs (a DDP wrapper's batch-start hook,
    a peak-memory reset). Inside `names["step"]`: the step's forward_backward (forward, `after_forward()`,
    backward, `after_backward()` in `names["after_backward"]`: the DDP comm wait), then the optimizer,
    each in its own range. Returns the detached loss (None on a pipeline stage without it); the graph is
    dropped before the function returns."""
    ranges = Ranges(range_fn, names)
    step.zero_grad()
    if before is not None:
        before()
    with ranges("step"):
        loss = step.forward_backward(inputs, targets, ranges, mode=mode, after_forward=after_forward,
                                     after_backward=after_backward)
        if mode == "train":
            with ranges("optimizer"):
                step.optimizer_step()
    return loss


def lm_loss(model, inputs, targets, *, fused_ce: bool) -> torch.Tensor:
    """Mean next-token cross-entropy; chunked so the [tokens, vocab] logits never exist when fused_ce. A
    user's model that gives every position's logits only when called with its targets (nanoGPT's) gives its
    own loss, as its training loop uses it (lmsys.model.user.UserLM.own_loss)."""
    if getattr(model, "targets", None) is not None and hasattr(model, "own_loss"):
        return model.own_loss(inputs, targets)
    if fused_ce:
        from lmsys.kernels.cross_entropy import chunked_cross_entropy

        return chunked_cross_entropy(model.hidden_states(inputs), model.lm_head.weight, targets)
    logits = model(inputs)  # [B, S, V]
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def random_batch(workload, device, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform random token ids and targets for a Workload's batch, [B, S] each."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    shape = (workload.batch_size, workload.seq_len)
    inputs = torch.randint(0, workload.config.vocab_size, shape, generator=gen)
    targets = torch.randint(0, workload.config.vocab_size, shape, generator=gen)
    return inputs.to(device), targets.to(device)
