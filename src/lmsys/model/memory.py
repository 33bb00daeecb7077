"""How much memory a training step of the LM needs, estimated before anything is built (no torch).

`train_memory_estimate`: fp32 weights + gradients + AdamW's two moments (16 bytes a parameter),
autocast's low-precision weight copies, and the activations autograd keeps for the batch (per layer and
token: ~14·d_model + 3·d_ff values in the compute dtype plus the fp32 residual and norm input; naive
attention's scores and probabilities, heads · S² per sequence; the logits in the compute dtype, their fp32
copy and its gradient). It errs high, which is what a check "will this fit" wants. `bench e2e` on a CPU
checks it against the RAM available (`check_fits_in_ram`), `ddp train` against free GPU memory before
its one-process rows (lmsys.distributed.memory).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from lmsys.core.errors import LmsysError
from lmsys.model.config import ModelConfig, parameter_count_formula


def train_memory_estimate(config: ModelConfig, *, batch_size: int, context_length: Optional[int] = None,
                          dtype: str = "fp32") -> int:
    """Bytes one process needs to train `config` on `batch_size` sequences (see the module docstring)."""
    params = parameter_count_formula(config)
    s = context_length or config.context_length
    act = 4 if dtype == "fp32" else 2
    tokens = batch_size * s
    d = config.d_model
    state = 16 * params + (2 * params if act == 2 else 0)
    per_layer = tokens * ((14 * d + 3 * config.d_ff) * act + 8 * d)
    if config.attn_impl == "naive":
        per_layer += batch_size * config.num_heads * s ** 2 * (act + 4)
    logits = tokens * config.vocab_size * (act + 4 + 4)
    return state + config.num_layers * per_layer + logits


def available_ram() -> Optional[int]:
    """MemAvailable from /proc/meminfo in bytes, else the free pages sysconf reports (None if neither)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (OSError, ValueError, AttributeError):
        return None


def check_fits_in_ram(config: ModelConfig, *, batch_size: int, dtype: str = "fp32", what: str = "the model",
                      available: Optional[int] = None) -> None:
    """A user error, before the model is built, when the estimate exceeds the RAM available now."""
    available = available_ram() if available is None else available
    if available is None:
        return
    need = train_memory_estimate(config, batch_size=batch_size, dtype=dtype)
    if need > available:
        from lmsys.core.parsing import about_bytes, format_bytes

        raise LmsysError(f"{what}: a training step (weights, gradients, AdamW state, activations) needs "
                         f"{about_bytes(need)}, but {format_bytes(available)} of RAM is available",
                         hint="use a smaller --size, --batch-size or --context-length, or a GPU")
