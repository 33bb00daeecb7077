"""The one timed training loop, the one-process run the multi-process rows are held against, and what
their rows say of a step time (MFU).

- `timed_loop(step, batches, warmup=, ...)`: `run_step` over batches already on the device, the first
  `warmup` untimed; the device synchronised once, before the first timed step, never inside or between
  steps; each timed step's parts in the one timer's regions (CUDA events on a GPU). `bench e2e`
  (`timed_steps`: one batch, the peak memory after the forward and over the step), `ddp train`
  (`train_loop`: the wrapper's hooks, the comm wait), `parallel train` (a ParallelStep, a timer per step
  for its per-step comm sums) and `plan calibrate` (the host twins) all run it.
- `train_loop`: `ddp train`'s and the one-process run's loop (a DDP wrapper's batch-start hook and
  gradient sync after backward, the first step's gradients kept).
- `train_one_process`: the model built from the seed, trained by `train_loop` in this process (the
  runners' 1-process rows and their parity references), kept on the host as asked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

import torch

from lmsys.core import progress
from lmsys.core.devices import free_memory, peak_memory, reset_peak_memory
from lmsys.core.timing import RegionTimer, synchronize
from lmsys.model.config import ModelConfig
from lmsys.train.build import build_model
from lmsys.train.optim import DDP_TRAIN_LR, make_optimizer, optimizer_state_bytes
from lmsys.train.step import TIMER_NAMES, TrainStep, no_range, run_step


def timed_loop(step, batches, *, warmup: int, device, mode: str = "train", names: Mapping[str, str] = TIMER_NAMES,
               hooks: Optional[Callable[[int], dict]] = None, after_step: Optional[Callable[[int], None]] = None,
               timer_per_step: bool = False, losses: Optional[list] = None, label: str = "steps"):
    """`run_step(step, ...)` of `mode` on each (inputs, targets) of `batches` (on the device already; the
    same pair again and again for a benchmark of one batch). Steps before `warmup` run outside any range;
    the device is synchronised once before the first timed step (so what the warm-up queued is not
    timed); from there each step's parts go to a RegionTimer's regions under `names`, nothing
    synchronises. `hooks(i)`: step i's run_step hooks (before, after_forward, after_backward);
    `after_step(i)`: runs after step i. `losses`: each step's detached loss is appended (on the device).
    Returns the RegionTimer of the timed steps, or with `timer_per_step` a list of one per timed step
    (a row that sums a step's regions, as parallel train's comm columns do)."""
    timer, timers = RegionTimer(device), []
    progress.plan_steps(len(batches), label)
    for i, (inputs, targets) in enumerate(batches):
        if i == warmup:
            synchronize(device)
        if timer_per_step and i >= warmup:
            timer = RegionTimer(device)
            timers.append(timer)
        loss = run_step(step, inputs, targets, mode=mode, range_fn=timer.region if i >= warmup else no_range,
                        names=names, **(hooks(i) if hooks is not None else {}))
        if after_step is not None:
            after_step(i)
        if losses is not None:
            losses.append(loss)
        progress.step()
    return timers if timer_per_step else timer


def train_loop(model, optimizer, batches, *, device, dtype: str, warmup: int, before=None, after_backward=None,
               on_first_grads=None, tracker=None, losses: Optional[list] = None) -> RegionTimer:
    """`timed_loop` of a TrainStep of `model`: warmup + timed steps; regions: step (forward, backward, comm
    wait, optimizer). `before` and `after_backward` default to the model's on_train_batch_start /
    finish_gradient_synchronization;
    `on_first_grads()` runs once, after the first step's backward and gradient synchronisation. With
    `tracker` (a PhaseTracker), the gradient sync after backward enters its `comm` phase. `losses`: each
    step's detached loss is appended (on the device: nothing synchronises)."""
    step = TrainStep(model, optimizer, device=device, dtype=dtype)
    before = before or getattr(model, "on_train_batch_start", None)
    after_backward = after_backward or getattr(model, "finish_gradient_synchronization", None)
    if after_backward is not None and tracker is not None:
        after_backward = tracker.in_phase("comm", after_backward)

    def first_sync():  # step 1's: the gradient sync, then the gradients are kept
        if after_backward is not None:
            after_backward()
        on_first_grads()

    def hooks(i):
        first = i == 0 and on_first_grads is not None
        return dict(before=before, after_backward=first_sync if first else after_backward)

    names = {**TIMER_NAMES, "after_backward": "comm wait"}
    timer = timed_loop(step, batches, warmup=warmup, device=device, names=names, hooks=hooks, losses=losses)
    synchronize(device)
    return timer


@dataclass
class OneProcess:
    """What `train_one_process` measured and kept."""

    timer: RegionTimer  # the timed steps' regions (step, forward, backward, optimizer)
    peak_bytes: Optional[int]  # torch's peak allocation over the run (GPU only)
    optimizer_bytes: int  # the optimizer's state tensors
    n_params: int
    params: Optional[dict] = None  # name -> the final parameter on the host (keep_params)
    first_grads: dict = field(default_factory=dict)  # name -> its gradient after step 1, on the host (keep_first_grads)
    losses: Optional[list] = None  # every step's loss as a float (keep_losses)


def train_one_process(config: ModelConfig, batches, *, device, dtype: str, warmup: int, seed: int,
                    kind: str = "adamw", keep_params: bool = False, keep_first_grads: bool = False,
                    keep_losses: bool = False) -> OneProcess:
    """The model `build_model` makes from `seed`, trained with the runners' AdamW (lr DDP_TRAIN_LR, `kind`)
    on `batches` (on the device already) by `train_loop`, from a clean allocator (the peak is this run's);
    the model and optimizer are freed before it returns. `keep_first_grads` copies the gradients to the host
    inside step 1 (a synchronisation there: not for a run timed with --warmup 0); the parameters and the
    losses are copied after the last step. torch's OutOfMemoryError propagates."""
    free_memory(device)
    reset_peak_memory(device)
    model = build_model(config, device=device, seed=seed)
    optimizer = make_optimizer(model.parameters(), lr=DDP_TRAIN_LR, kind=kind)
    pin = torch.device(device).type == "cuda"  # pinned: fast copies back for every parity check

    def host(t):
        return t.detach().cpu().pin_memory() if pin else t.detach().clone()

    grads, losses = {}, [] if keep_losses else None

    def keep_grads():
        grads.update({name: host(p.grad) for name, p in model.named_parameters() if p.grad is not None})

    timer = train_loop(model, optimizer, batches, device=device, dtype=dtype, warmup=warmup,
                       on_first_grads=keep_grads if keep_first_grads else None, losses=losses)
    run = OneProcess(timer=timer, peak_bytes=peak_memory(device), optimizer_bytes=optimizer_state_bytes(optimizer),
                     n_params=sum(p.numel() for p in model.parameters()), first_grads=grads)
    if keep_params:
        run.params = {name: host(p) for name, p in model.named_parameters()}
    if losses is not None:
        run.losses = torch.stack(losses).double().tolist()  # one copy to the host, after the timed steps
    del model, optimizer
    free_memory(device)
    return run


def mfu_percent(config: ModelConfig, *, tokens: int, step_ms: float, device, dtype: str, processes: int):
    """Model FLOPs utilisation of all `processes` GPUs together (lmsys.core.flops' convention: 6·N per
    token plus attention), or None off a GPU or for a GPU without a known peak."""
    from lmsys.core.devices import peak_tflops
    from lmsys.core.flops import mfu
    from lmsys.model.user import model_flops

    flops = model_flops(config, batch_size=tokens // config.context_length, seq_len=config.context_length,
                        backward=True)
    peak = peak_tflops(torch.device(device), dtype)
    util = mfu(flops, step_ms, None if peak is None else peak * processes)
    return None if util is None else 100 * util


