"""How much memory a training step of the LM needs, estimated before anything is built.

`train_memory_estimate` is a closed form (no torch): weights + gradients + AdamW's two moments, plus the
activations saved for the backward (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", eq. 1: s·b·h·(34 + 5·a·s/h) bytes per layer with 16-bit activations; fp32 doubles
it) and the logits with their gradient. It errs high (no recomputation, naive attention's S×S scores
kept), which is what a check "will this fit" wants. `check_fits_in_ram` compares it with the memory the
OS says is available, so `bench e2e --size 10b --device cpu` is one line instead of an OOM kill.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from lmsys.core.errors import LmsysError
from lmsys.model.config import ModelConfig, parameter_count_formula

_ACT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def train_memory_estimate(config: ModelConfig, *, batch_size: int, context_length: Optional[int] = None,
                          dtype: str = "fp32") -> int:
    """Bytes one training step (forward, backward, AdamW step) holds at its peak, fp32 master weights."""
    n = parameter_count_formula(config)
    s = context_length or config.context_length
    b, h, a, L, V = batch_size, config.d_model, config.num_heads, config.num_layers, config.vocab_size
    states = 16 * n  # fp32 weights 4 + gradients 4 + AdamW exp_avg 4 + exp_avg_sq 4 bytes per parameter
    scale = _ACT_BYTES.get(dtype, 4) / 2  # the paper's formula counts 16-bit activations
    activations = int(L * s * b * h * (34 + 5 * a * s / h) * scale)
    logits = 2 * b * s * V * 4  # fp32 logits and their gradient
    return states + activations + logits


def available_ram() -> Optional[int]:
    """MemAvailable from /proc/meminfo in bytes (None where there is no /proc)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_fits_in_ram(config: ModelConfig, *, batch_size: int, dtype: str = "fp32", what: str = "the model",
                      available: Optional[int] = None) -> None:
    """A user error, before the model is built, when the estimate exceeds the RAM available now."""
    available = available_ram() if available is None else available
    if available is None:
        return
    need = train_memory_estimate(config, batch_size=batch_size, dtype=dtype)
    if need > available:
        raise LmsysError(f"{what}: a training step needs about {need / 2**30:.1f} GiB (weights, gradients, AdamW "
                         f"state, activations) but {available / 2**30:.1f} GiB of RAM is available",
                         hint="use a smaller --size, --batch-size or --context-length, or a GPU")
