"""issue 40 item 4: one timed loop (lmsys.train.loop.timed_loop), one attention forward (CausalSelfAttention's,
the tensor-parallel and torch-DTensor versions override the projections only), one pipeline stage module."""

import copy

import pytest
import torch
import torch.nn.functional as F

from lmsys.model import ModelConfig
from lmsys.model.transformer import CausalSelfAttention, TransformerLM
from lmsys.train.build import build_model
from lmsys.train.loop import timed_loop
from lmsys.train.optim import make_optimizer
from lmsys.train.step import ParallelStep, TrainStep, lm_loss

CFG = ModelConfig(d_model=32, d_ff=64, num_layers=3, num_heads=4, num_kv_heads=2, vocab_size=61, context_length=12)
CPU = torch.device("cpu")


def _batches(n, *, seed):
    gen = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(0, CFG.vocab_size, (3, 12), generator=gen) for _ in range(2)) for _ in range(n)]


def test_timed_loop_trains_as_plain_pytorch_and_times_only_the_timed_steps():
    batches = _batches(5, seed=7)
    model = build_model(CFG, device=CPU, seed=3)
    ref = copy.deepcopy(model).double()
    model.double()
    step = TrainStep(model, make_optimizer(model.parameters(), lr=1e-2), device=CPU, dtype="fp32")
    seen, after, losses = [], [], []
    timer = timed_loop(step, batches, warmup=2, device=CPU, hooks=lambda i: dict(before=lambda: seen.append(i)),
                       after_step=after.append, losses=losses)
    # the reference: forward, cross-entropy, backward, AdamW, written out
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    for (x, y), loss in zip(batches, losses):
        opt.zero_grad()
        ref_loss = F.cross_entropy(ref(x).flatten(0, 1).float(), y.flatten())  # lmsys's loss: fp32 logits
        ref_loss.backward()
        opt.step()
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-9)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-9)
    assert seen == after == [0, 1, 2, 3, 4] and len(losses) == 5
    for region in ("step", "forward", "backward", "optimizer"):
        assert len(timer.samples(region)) == 3  # the timed steps only
    stats = timer.stats()
    assert stats["step"].median >= stats["forward"].median  # the parts are inside the step


def test_timed_loop_gives_a_timer_per_step_and_the_fwd_mode_leaves_the_weights():
    batches = _batches(4, seed=8)
    model = build_model(CFG, device=CPU, seed=3)
    before = [p.detach().clone() for p in model.parameters()]
    step = TrainStep(model, make_optimizer(model.parameters(), lr=1e-2), device=CPU, dtype="fp32")
    timers = timed_loop(step, batches, warmup=1, device=CPU, mode="fwd", timer_per_step=True)
    assert len(timers) == 3 and all(len(t.samples("step")) == len(t.samples("forward")) == 1 for t in timers)
    assert all(not t.samples("backward") for t in timers)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


class _OneStageModel:
    """parallelize's interface on one process: train_step runs forward and backward, times "compute"."""

    def __init__(self, model):
        self.model = model
        self.calls = []

    def train_step(self, inputs, targets, *, microbatches, autocast, device, timer, measure_activations):
        from lmsys.distributed.model_parallel.pipeline import StepResult

        self.calls.append(measure_activations)
        with timer.region("compute"):
            loss = lm_loss(self.model, inputs, targets, fused_ce=False)
            loss.backward()
        return StepResult(loss=loss.detach(), peak_activation_bytes=123 if measure_activations else None)


def test_a_parallel_step_is_a_step_with_its_own_forward_backward():
    batches = _batches(4, seed=9)
    plain = build_model(CFG, device=CPU, seed=4)
    split = copy.deepcopy(plain)
    timed_loop(TrainStep(plain, make_optimizer(plain.parameters(), lr=1e-2), device=CPU, dtype="fp32"), batches,
               warmup=1, device=CPU)
    pm = _OneStageModel(split)
    step = ParallelStep(pm, make_optimizer(split.parameters(), lr=1e-2), microbatches=1)
    losses = []
    timers = timed_loop(step, batches, warmup=1, device=CPU, names={"step": "step"}, timer_per_step=True,
                        losses=losses)
    for p, q in zip(plain.parameters(), split.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)  # the same ops in the same order
    assert pm.calls == [True, False, False, False] and step.activation_bytes == 123
    assert len(timers) == 3 and all(len(t.samples("compute")) == len(t.samples("step")) == 1 for t in timers)
    assert len(losses) == 4 and all(loss.ndim == 0 for loss in losses)
    with pytest.raises(ValueError, match="takes no hooks"):
        timed_loop(step, batches[:1], warmup=0, device=CPU, hooks=lambda i: dict(after_forward=lambda: None))


def test_one_attention_forward():
    from lmsys.distributed.model_parallel.tensor_parallel import TPAttention
    from lmsys.distributed.model_parallel.torch_parallel import TorchAttention

    for cls in (TPAttention, TorchAttention):
        assert issubclass(cls, CausalSelfAttention)
        assert {"forward", "attend"}.isdisjoint(vars(cls)), f"{cls.__name__} writes its own attention again"
    torch.manual_seed(0)
    attn = TransformerLM(CFG).double().layers[0].attn
    x = torch.randn(2, 12, CFG.d_model, dtype=torch.float64)
    cos, sin = _rope(12)
    ref = _attention_reference(attn, x, cos, sin)
    torch.testing.assert_close(attn(x, cos, sin), ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(TorchAttention(attn)(x, cos, sin), ref, rtol=1e-10, atol=1e-10)


def _rope(seq):
    """cos, sin of position·θ^(-2i/d), i < d/2, in float64: [seq, d/2]."""
    i = torch.arange(CFG.d_head // 2, dtype=torch.float64)
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * CFG.rope_theta ** (-2 * i / CFG.d_head)
    return angles.cos(), angles.sin()


def _attention_reference(attn, x, cos, sin):
    """Grouped-query causal attention written out in float64: split q/k/v, rotate pairs, softmax."""
    H, Hkv, d = CFG.num_heads, CFG.kv_heads, CFG.d_head
    q, k, v = (x @ attn.qkv_proj.weight.T).split([H * d, Hkv * d, Hkv * d], dim=-1)
    q, k, v = (t.unflatten(-1, (-1, d)).transpose(1, 2) for t in (q, k, v))  # [B, heads, S, d]

    def rotate(t):  # pairs (i, i + d/2) rotated by position·θ_i (lmsys's layout)
        a, b = t[..., :d // 2], t[..., d // 2:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

    q, k = rotate(q), rotate(k)
    k, v = (t.repeat_interleave(H // Hkv, dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) / d**0.5
    scores = scores.masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).flatten(2)
    return out @ attn.output_proj.weight.T


def test_one_stage_module_for_both_pipelines():
    from lmsys.distributed.model_parallel.pipeline import PipelineModule
    from lmsys.distributed.model_parallel.torch_parallel import StageModule

    assert StageModule is PipelineModule
    torch.manual_seed(0)
    model = TransformerLM(CFG).double()
    ids = torch.randint(0, CFG.vocab_size, (2, 12))
    # torch's pipelining: a module of one chunk per stage, `forward`, logits out of the last
    first = PipelineModule(model, [[0, 1]], first=True, last=False)
    last = PipelineModule(model, [[2]], first=False, last=True)
    torch.testing.assert_close(last(first(ids)), model(ids), rtol=0, atol=0)
    assert {n for n, _ in first.named_parameters()} | {n for n, _ in last.named_parameters()} == \
        {n for n, _ in model.named_parameters()}  # the full model's names
    # lmsys's schedule: chunk_forward, the loss out of the last chunk
    whole = PipelineModule(model, [[0, 1], [2]], first=True, last=True,
                           loss_fn=lambda m, h, t: F.cross_entropy(m.lm_head(h).flatten(0, 1), t.flatten()))
    targets = torch.randint(0, CFG.vocab_size, (2, 12))
    loss = whole.chunk_forward(1, whole.chunk_forward(0, ids, 12), 12, targets)
    torch.testing.assert_close(loss, F.cross_entropy(model(ids).flatten(0, 1), targets.flatten()), rtol=0, atol=0)
