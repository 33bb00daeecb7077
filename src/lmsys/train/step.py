"""The training step every single-device tool runs: build a model, random data, and the three phases.

`bench e2e` wraps the phases in timer regions, `profile nsys` in NVTX ranges, `profile memory` in
memory-history phases: the step itself knows nothing of who watches it.

A `Workload` also carries the fast-path switches (each measured in docs/benchmarks/e2e.md); they are
applied here, from outside the model: compile (whole loss function or each block), CUDA graphs, fused
or master-weight AdamW, chunked cross-entropy, activation checkpointing, TF32, and the optimizer run
inside the backward (`OptimizerInBackward`: each block updated as soon as its gradients are final).
"""

from __future__ import annotations

import re
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, ContextManager, Mapping

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lmsys.core.devices import MatmulCarveout, torch_dtype
from lmsys.core.errors import LmsysError
from lmsys.core.parsing import choose
from lmsys.model.config import ModelConfig
from lmsys.model.transformer import TransformerLM

COMPILE_CHOICES = ("none", "model", "blocks")
OPTIMIZER_CHOICES = ("adamw", "adamw-fused")
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
    lr: float = 1e-4

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
        parts = [f"attention {self.config.attn_impl}"]
        if self.compile != "none":
            parts.append(f"compile {self.compile}" + (" + CUDA graphs" if self.cuda_graphs else ""))
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

    def run(self, inputs, targets, mode: str = "train") -> torch.Tensor:
        """One whole step of `mode` outside any range (warm-up; tools that do not split phases)."""
        return run_step(self, inputs, targets, mode=mode)


# ----------------------------------------------------------------------------- the one step runner

RangeFn = Callable[[str], ContextManager]

# The timer regions of `bench e2e` and `ddp train` (their row columns); the profilers pass their own
# names (lmsys.profiling.phases.PROFILER_NAMES). A part without a name runs outside any range.
TIMER_NAMES = {"step": "step", "forward": "forward", "backward": "backward", "optimizer": "optimizer"}


def no_range(_name: str) -> ContextManager:
    return nullcontext()


def run_step(step, inputs, targets, *, mode: str = "train", range_fn: RangeFn = no_range,
             names: Mapping[str, str] = TIMER_NAMES, before: Callable[[], None] | None = None,
             after_forward: Callable[[], None] | None = None,
             after_backward: Callable[[], None] | None = None) -> torch.Tensor:
    """One training step of `mode` (fwd | fwd-bwd | train), each part inside `range_fn(names[part])`.

    Outside any range: gradients are cleared, then `before()` runs (a DDP wrapper's batch-start hook,
    a peak-memory reset). Inside `names["step"]`: forward, `after_forward()`, backward, `after_backward()`
    in `names["after_backward"]` (the DDP comm wait) and the optimizer, each in its own range. Returns
    the detached loss; the graph is dropped before the function returns."""

    def part(name):
        key = names.get(name)
        return nullcontext() if key is None else range_fn(key)

    step.zero_grad()
    if before is not None:
        before()
    with part("step"):
        with part("forward"):
            loss = step.forward(inputs, targets)
        if after_forward is not None:
            after_forward()
        if mode != "fwd":
            with part("backward"):
                step.backward(loss, update=mode == "train")  # fwd-bwd: no in-backward updates
            if after_backward is not None:
                with part("after_backward"):
                    after_backward()
        if mode == "train":
            with part("optimizer"):
                step.optimizer_step()
    return loss.detach()


def lm_loss(model: TransformerLM, inputs, targets, *, fused_ce: bool) -> torch.Tensor:
    """Mean next-token cross-entropy; chunked so the [tokens, vocab] logits never exist when fused_ce."""
    if fused_ce:
        from lmsys.kernels.cross_entropy import chunked_cross_entropy

        return chunked_cross_entropy(model.hidden_states(inputs), model.lm_head.weight, targets)
    logits = model(inputs)  # [B, S, V]
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def random_batch(workload: Workload, device, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform random token ids and targets, [B, S] each."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    shape = (workload.batch_size, workload.seq_len)
    inputs = torch.randint(0, workload.config.vocab_size, shape, generator=gen)
    targets = torch.randint(0, workload.config.vocab_size, shape, generator=gen)
    return inputs.to(device), targets.to(device)


def build_train_step(workload: Workload, device, *, seed: int = 0) -> TrainStep:
    """Random-weight model on `device` (seeded: every workload of a comparison starts from the same
    weights), the optimizer, and the fast-path wrappers the workload asks for."""
    from lmsys.model.user import build_model  # hook: lmsys's TransformerLM, or the --model a config names

    torch.manual_seed(seed)
    model = build_model(workload.config, device=device)
    if workload.master_weights:
        model = model.to(torch_dtype(workload.dtype))
    groups = update_groups(model)  # before checkpointing regroups the blocks
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
        optimizer = OptimizerInBackward(groups, build_optimizer, stream=side_stream(workload, device),
                                        carveout=carveout)
    else:
        optimizer = build_optimizer(model.parameters())
    return TrainStep(model, optimizer, device=device, dtype=workload.dtype, loss_fn=loss_fn,
                     autocast=not workload.master_weights)


ADAMW_DEFAULTS = dict(weight_decay=0.01)  # every tool's AdamW (ZeRO-1's too: lmsys.distributed.train)


def make_optimizer(params, *, lr: float, kind: str = "adamw", master_weights: bool = False) -> torch.optim.Optimizer:
    """The one AdamW (weight decay 0.01) every tool trains with: foreach or fused (`kind`), or the Triton
    master-weight AdamW for bf16 weights."""
    kw = dict(lr=lr, **ADAMW_DEFAULTS)
    choose(kind, OPTIMIZER_CHOICES, what="--optimizer")
    if master_weights:
        from lmsys.kernels.adamw import MasterWeightAdamW

        return MasterWeightAdamW(params, **kw)
    if kind == "adamw-fused":
        return torch.optim.AdamW(params, fused=True, **kw)
    return torch.optim.AdamW(params, **kw)


# ----------------------------------------------------------------------------- optimizer in backward


def update_groups(model: TransformerLM) -> list[list[torch.nn.Parameter]]:
    """The units the in-backward optimizer updates: each block's parameters together, every other
    parameter (embedding, final norm, LM head) alone."""
    in_blocks = {id(p) for layer in model.layers for p in layer.parameters()}
    return ([list(layer.parameters()) for layer in model.layers]
            + [[p] for p in model.parameters() if id(p) not in in_blocks])


def side_stream(workload: Workload, device):
    """The CUDA stream the in-backward updates run on (None: the backward's own stream)."""
    if not workload.optimizer_stream:
        return None
    if device.type != "cuda":
        raise LmsysError("--optimizer-stream needs a CUDA GPU (it overlaps the updates with the backward)")
    return torch.cuda.Stream(device)


class OptimizerInBackward:
    """AdamW run inside the backward: one optimizer per group (a block, or a lone parameter), stepped
    from a post-accumulate-grad hook as soon as the group's last gradient is final; the gradients are
    freed right after, so at most a block's gradients (plus those not yet consumed) are alive.

    With `stream`, the update runs on that side stream: it waits on an event recorded on the backward's
    stream after the gradients, the gradients are `record_stream`'d so that the allocator does not
    reuse their memory under the update, and `step()` makes the current stream wait for the side
    stream before the next forward reads the weights. `step()` is all that is left after backward:
    it updates any group whose gradients came only in part (a parameter unused by the loss) and waits.
    With `carveout` (a MatmulCarveout), the backward's matmuls leave its SMs to the updates from the
    first update until `step()`: a GEMM sized for every SM otherwise holds them all while it runs.

    Per-tensor AdamW is elementwise, so the result equals one optimizer stepped after the backward.
    Looks like a torch.optim.Optimizer to TrainStep (`step`, `zero_grad`, `param_groups`, `state`)."""

    def __init__(self, groups: list[list[torch.nn.Parameter]], make_optimizer, *, stream=None,
                 carveout: MatmulCarveout | None = None):
        self.groups = [g for g in groups if g]
        self.optimizers = [make_optimizer(g) for g in self.groups]
        self.stream = stream
        self.carveout = carveout
        self._arrived = [0] * len(self.groups)
        self._active = True
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(i))
                         for i, group in enumerate(self.groups) for p in group]

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    def _hook(self, index: int):
        def hook(param: torch.Tensor) -> None:
            if not self._active:
                return
            self._arrived[index] += 1
            if self._arrived[index] == len(self.groups[index]):
                self._update(index)
        return hook

    @torch.no_grad()
    def _update(self, index: int) -> None:
        self._arrived[index] = 0
        grads = [p.grad for p in self.groups[index] if p.grad is not None]
        if self.carveout is not None:
            self.carveout.on()  # the rest of the backward runs beside the updates
        if self.stream is None:
            self.optimizers[index].step()
        else:
            ready = torch.cuda.current_stream(self.stream.device).record_event()
            self.stream.wait_event(ready)
            with torch.cuda.stream(self.stream):
                self.optimizers[index].step()
            for g in grads:
                g.record_stream(self.stream)
        for p in self.groups[index]:
            p.grad = None

    def step(self) -> None:
        """The optimizer phase: finish groups that got some gradients but not all, then wait."""
        for index, arrived in enumerate(self._arrived):
            if arrived:
                self._update(index)
        self.end_carveout()
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)

    def end_carveout(self) -> None:
        """The matmuls get every SM back (after the updates, or when a backward failed half-way)."""
        if self.carveout is not None:
            self.carveout.off()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.end_carveout()
        self._arrived = [0] * len(self.groups)
        for group in self.groups:
            for p in group:
                p.grad = None

    @contextmanager
    def paused(self):
        """Gradients accumulate as usual and nothing is updated (the fwd-bwd mode)."""
        self._active = False
        try:
            yield
        finally:
            self._active = True

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


@contextmanager
def tf32_matmuls(enabled: bool):
    """Allow (or forbid) TF32 tensor cores for fp32 matmuls and convolutions inside the block."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


# ----------------------------------------------------------------------------- activation checkpointing


class CheckpointedSegment(torch.nn.Module):
    """Consecutive blocks whose activations are recomputed in backward instead of stored."""

    def __init__(self, blocks: list[torch.nn.Module]):
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)

    def _run(self, x, cos, sin):
        for block in self.blocks:
            x = block(x, cos, sin)
        return x

    def forward(self, x, cos, sin):
        return checkpoint(self._run, x, cos, sin, use_reentrant=False)


def apply_activation_checkpointing(model: TransformerLM, segment: int) -> None:
    """Group model.layers into checkpointed segments of `segment` blocks (1 = every block)."""
    blocks = list(model.layers)
    model.layers = torch.nn.ModuleList(
        CheckpointedSegment(blocks[i:i + segment]) for i in range(0, len(blocks), segment)
    )
