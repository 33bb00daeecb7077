"""The fast path trains the same model as the plain reference: losses over 20 steps on fixed data agree."""

import pytest
import torch

from lmsys.train import Workload, build_train_step, random_batch, run_step
from lmsys.model import ModelConfig

CFG = ModelConfig(d_model=64, d_ff=128, num_layers=3, num_heads=4, vocab_size=256, context_length=32)


def losses(workload: Workload, steps: int = 20) -> list[float]:
    device = torch.device("cpu")
    step = build_train_step(workload, device, seed=0)
    x, y = random_batch(workload, device, seed=1)
    out = []
    for _ in range(steps):
        out.append(float(run_step(step, x, y, mode="train")))
    return out


@pytest.fixture(scope="module")
def reference():
    return losses(Workload(CFG, batch_size=4, dtype="bf16", lr=3e-3))


def test_reference_learns(reference):
    assert reference[-1] < reference[0] - 1.0  # fixed data: the loss must drop


@pytest.mark.parametrize("options", [
    dict(fused_ce=True),
    dict(checkpoint="block"),
    dict(checkpoint="every:2", optimizer="adamw-fused"),
    dict(master_weights=True),
    dict(master_weights=True, fused_ce=True, checkpoint="block", optimizer="adamw-fused", attn="sdpa"),
], ids=["chunked-ce", "checkpoint-block", "checkpoint-every2-fused-adamw", "master-weights", "all"])
def test_fast_path_loss_matches_reference_after_20_steps(reference, options):
    options = dict(options)
    cfg = CFG.with_overrides(attn_impl=options.pop("attn", "naive"))
    fast = losses(Workload(cfg, batch_size=4, dtype="bf16", lr=3e-3, **options))
    # bf16 rounding differs between paths; the trajectories must stay within mixed-precision tolerance.
    assert fast[-1] == pytest.approx(reference[-1], rel=0.03, abs=0.05)
    assert max(abs(a - b) for a, b in zip(fast, reference)) < 0.1


def test_exact_paths_match_in_fp32():
    """Without low precision, chunked CE and checkpointing change nothing but rounding order."""
    ref = losses(Workload(CFG, batch_size=2, dtype="fp32", lr=3e-3), steps=5)
    fast = losses(Workload(CFG, batch_size=2, dtype="fp32", lr=3e-3, fused_ce=True, checkpoint="block",
                           optimizer="adamw-fused"), steps=5)
    assert fast == pytest.approx(ref, rel=1e-4)


def test_checkpointing_keeps_parameters_and_lowers_saved_activations():
    from torch.autograd.graph import saved_tensors_hooks

    def saved_bytes(workload):
        step = build_train_step(workload, torch.device("cpu"))
        x, y = random_batch(workload, torch.device("cpu"))
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with saved_tensors_hooks(pack, lambda t: t):
            loss = step.forward(x, y)
        return total, sum(p.numel() for p in step.model.parameters())

    plain, n_plain = saved_bytes(Workload(CFG, batch_size=2))
    ckpt, n_ckpt = saved_bytes(Workload(CFG, batch_size=2, checkpoint="block"))
    assert n_plain == n_ckpt
    assert ckpt < 0.5 * plain
