"""The one AdamW every tool trains with, its learning rates, AdamW run inside the backward, and the bytes
of state an optimizer holds on a rank (`optimizer_state_bytes`).

Torch-free at import (torch loads inside the functions), so that the torch-free run descriptions
(`lmsys.bench.ddp_runs`) can name the learning rate they print.
"""

from __future__ import annotations

from contextlib import contextmanager

from lmsys.core.errors import LmsysError
from lmsys.core.parsing import choose

OPTIMIZER_CHOICES = ("adamw", "adamw-fused")
ADAMW_DEFAULTS = dict(weight_decay=0.01)  # every tool's AdamW (ZeRO-1's too: lmsys.bench.ddp)
STEP_LR = 1e-4      # a Workload's (bench e2e, profile): a few steps of a benchmark, the loss barely moves
DDP_TRAIN_LR = 1e-3  # ddp train's: parity max|Δθ| compares parameters that moved visibly in a few steps


def default_kind(device) -> str:
    """The AdamW a step uses unless told: fused on a GPU (one kernel over every tensor), foreach elsewhere.
    `bench e2e` and `parallel train` both pick it, so their steps compare like for like."""
    return "adamw-fused" if getattr(device, "type", str(device)) == "cuda" else "adamw"


def make_optimizer(params, *, lr: float, kind: str = "adamw", master_weights: bool = False):
    """The one AdamW (weight decay 0.01) every tool trains with: foreach or fused (`kind`), or the Triton
    master-weight AdamW for bf16 weights."""
    import torch

    kw = dict(lr=lr, **ADAMW_DEFAULTS)
    choose(kind, OPTIMIZER_CHOICES, what="--optimizer")
    if master_weights:
        from lmsys.kernels.adamw import MasterWeightAdamW

        return MasterWeightAdamW(params, **kw)
    if kind == "adamw-fused":
        return torch.optim.AdamW(params, fused=True, **kw)
    return torch.optim.AdamW(params, **kw)


# ----------------------------------------------------------------------------- optimizer in backward


def update_groups(model) -> list[list]:
    """The units the in-backward optimizer updates: each block (`model.layers`) with its parameters
    together, every other parameter (embedding, final norm, LM head) alone."""
    in_blocks = {id(p) for layer in model.layers for p in layer.parameters()}
    return ([list(layer.parameters()) for layer in model.layers]
            + [[p] for p in model.parameters() if id(p) not in in_blocks])


def side_stream(enabled: bool, device):
    """The CUDA stream the in-backward updates run on (None when not `enabled`: the backward's own)."""
    if not enabled:
        return None
    if device.type != "cuda":
        raise LmsysError("--optimizer-stream needs a CUDA GPU (it overlaps the updates with the backward)")
    import torch

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
    With `carveout` (a lmsys.core.devices.MatmulCarveout), the backward's matmuls leave its SMs to the
    updates from the first update until `step()`: a GEMM sized for every SM otherwise holds them all.

    Per-tensor AdamW is elementwise, so the result equals one optimizer stepped after the backward.
    Looks like a torch.optim.Optimizer to TrainStep (`step`, `zero_grad`, `param_groups`, `state`)."""

    def __init__(self, groups: list[list], make_optimizer, *, stream=None, carveout=None):
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
        def hook(param) -> None:
            if not self._active:
                return
            self._arrived[index] += 1
            if self._arrived[index] == len(self.groups[index]):
                self._update(index)
        return hook

    def _update(self, index: int) -> None:
        import torch

        self._arrived[index] = 0
        grads = [p.grad for p in self.groups[index] if p.grad is not None]
        if self.carveout is not None:
            self.carveout.on()  # the rest of the backward runs beside the updates
        with torch.no_grad():
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
            import torch

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


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of optimizer state held on this rank: every tensor in `optimizer.state` (for a
    ShardedOptimizer, its local optimizer's state: this rank's shard only; for an optimizer that lists
    its own, `state_tensors()`, as BucketedDDP's per-bucket optimizers do; for FSDP2's DTensors, the
    local shard), each storage once. Parameters and gradients are not state and are not counted."""
    import torch

    if hasattr(optimizer, "state_tensors"):
        tensors = optimizer.state_tensors()
    else:
        inner = getattr(optimizer, "local_optimizer", None) or optimizer
        # a user's sharded optimizer may keep its local optimizer under any attribute name
        inners = [inner] + [v for v in vars(inner).values() if isinstance(v, torch.optim.Optimizer) and v is not inner]
        tensors = [value for opt in inners for state in opt.state.values() for value in state.values()
                   if torch.is_tensor(value)]
    seen: set[int] = set()
    total = 0
    for value in tensors:
        value = value.to_local() if hasattr(value, "to_local") else value
        if value.numel() and value.data_ptr() in seen:
            continue
        if value.numel():
            seen.add(value.data_ptr())
        total += value.numel() * value.element_size()
    return total
