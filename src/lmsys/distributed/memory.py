"""Will a training run fit, and what to say when a rank runs out of memory.

- `fits(config, batch_size=, dtype=, device=)`: the planner's memory model through lmsys.model.memory
  (weights, gradients, AdamW state, activations) against the budget below, with why (the status of an `OOM` row).
- `memory_budget(device)`: free device memory (`torch.cuda.mem_get_info`), available RAM on the CPU;
  `LMSYS_MEMORY_BUDGET_MB`, when set, replaces it (tests use it to take the does-not-fit path).
- `PhaseTracker`: which phase a rank is in (build, forward, backward, comm, optimizer), from hooks on
  the wrapped model and optimizer and the gradient sync the runner calls (`in_phase`); `LMSYS_INJECT_OOM=RANK:PHASE` makes that rank raise torch's
  OutOfMemoryError on entering PHASE (a fault-injection hook for tests).
- `RankOutOfMemory`: the one-line error a rank reports (which rank, phase, how much was asked).
"""

from __future__ import annotations

import os
import re
from typing import Optional

from lmsys.distributed.launch import RankError
from lmsys.model.memory import available_ram, train_memory_estimate

ENV_BUDGET = "LMSYS_MEMORY_BUDGET_MB"
ENV_INJECT_OOM = "LMSYS_INJECT_OOM"
GiB = 1024**3


def memory_budget(device) -> tuple[int, str]:
    """(bytes this process may use, where the number comes from)."""
    text = os.environ.get(ENV_BUDGET)
    if text:
        from lmsys.core.errors import LmsysError

        try:
            mb = float(text)
        except ValueError:
            raise LmsysError(f"{ENV_BUDGET}={text!r} is not a number of MiB") from None
        return int(mb * 2**20), ENV_BUDGET
    import torch

    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, "free GPU memory"
    ram = available_ram()
    return (ram, "available RAM") if ram is not None else (2**62, "RAM (amount unknown: not checked)")


def fits(config, *, batch_size: int, dtype: str, device) -> tuple[bool, str]:
    """(fits, why): the estimate against the budget; why is the row's status when it does not fit."""
    need = train_memory_estimate(config, batch_size=batch_size, dtype=dtype,
                                 device="cuda" if getattr(device, "type", device) == "cuda" else "cpu")
    budget, source = memory_budget(device)
    why = f"needs ~{need / GiB:.1f} GiB (estimate), {budget / GiB:.1f} GiB {source}"
    return need <= budget, why


def requested_bytes(exc: BaseException) -> Optional[str]:
    """'2.00 GiB' from torch's "Tried to allocate 2.00 GiB", or None."""
    m = re.search(r"[Tt]ried to allocate ([\d.]+ ?[KMGT]?i?B)", str(exc))
    return m.group(1) if m else None


class RankOutOfMemory(RankError):
    """A rank ran out of memory: one line, no traceback."""

    def __init__(self, *, rank: int, phase: str, what: str, exc: BaseException):
        asked = requested_bytes(exc)
        message = f"rank {rank} ran out of memory in {phase} ({what})"
        message += f": tried to allocate {asked}" if asked else f": {str(exc).splitlines()[0] if str(exc) else 'OOM'}"
        super().__init__(message)
        self.rank, self.phase, self.asked = rank, phase, asked


class PhaseTracker:
    """The phase a rank is in, set by hooks on the model (forward, backward) and the optimizer, and by
    the gradient sync wrapped with `in_phase` for the runner; entering the phase LMSYS_INJECT_OOM names
    raises a synthetic OOM."""

    def __init__(self, rank: int):
        self.rank = rank
        self.phase = "build"
        spec = os.environ.get(ENV_INJECT_OOM, "")
        target_rank, _, target_phase = spec.partition(":")
        self._inject = target_phase if spec and target_rank.strip() == str(rank) else None
        self._handles = []

    def enter(self, phase: str) -> None:
        self.phase = phase
        if self._inject == phase:
            import torch

            self._inject = None
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate 2.00 GiB. (injected by {ENV_INJECT_OOM})")

    def in_phase(self, phase: str, fn):
        """`fn` that enters `phase` first (the runner's hook for the gradient sync: `comm`)."""
        def entered(*args, **kwargs):
            self.enter(phase)
            return fn(*args, **kwargs)
        return entered

    def watch(self, model, optimizer) -> None:
        """Hooks: forward pre-hook, a gradient hook on the output (backward), the optimizer's step
        pre-hook."""
        import torch

        def on_output(module, args, output):
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(lambda grad: self.enter("backward"))

        self._handles.append(model.register_forward_pre_hook(lambda m, a: self.enter("forward")))
        self._handles.append(model.register_forward_hook(on_output))
        self._handles.append(optimizer.register_step_pre_hook(lambda o, a, k: self.enter("optimizer")))

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
