"""The optimizer inside the backward (`OptimizerInBackward`) gives the same parameters as the optimizer
stepped after the backward, for every numerics path, and really runs during the backward."""

import json

import pytest
import torch

from lmsys.bench import e2e
from lmsys.core import devices
from lmsys.train import Workload, build_train_step, random_batch, run_step
from lmsys.train.optim import OptimizerInBackward, update_groups
from lmsys.model import ModelConfig

CFG = ModelConfig(d_model=64, d_ff=96, num_layers=3, num_heads=4, vocab_size=131, context_length=24)
CPU = torch.device("cpu")


def trained(workload: Workload, steps: int = 4, device=CPU) -> list[torch.Tensor]:
    """Parameters after `steps` train steps, each on a fresh random batch."""
    step = build_train_step(workload, device, seed=0)
    for i in range(steps):
        x, y = random_batch(workload, device, seed=10 + i)
        run_step(step, x, y, mode="train")
    return [p.detach().float().clone() for p in step.model.parameters()]


@pytest.mark.parametrize("options", [
    dict(dtype="fp32"),
    dict(dtype="fp32", optimizer="adamw-fused"),
    dict(dtype="bf16"),
    dict(dtype="bf16", master_weights=True),
    dict(dtype="bf16", master_weights=True, checkpoint="every:2"),
    dict(dtype="fp32", checkpoint="block", fused_ce=True),
], ids=["fp32", "fp32-fused", "bf16-autocast", "bf16-master", "bf16-master-checkpoint", "fp32-checkpoint-ce"])
def test_in_backward_equals_step_after_backward(options):
    reference = trained(Workload(CFG, batch_size=2, lr=3e-3, **options))
    in_backward = trained(Workload(CFG, batch_size=2, lr=3e-3, optimizer_in_backward=True, **options))
    assert len(reference) == len(in_backward) == 3 * 7 + 3
    moved = [not torch.equal(p, q) for p, q in zip(reference, trained(Workload(CFG, batch_size=2, lr=3e-3,
                                                                               **options), steps=1))]
    assert all(moved)  # every parameter kept moving after the first step: the comparison is not vacuous
    for p, q in zip(reference, in_backward):
        # AdamW is elementwise per tensor: one optimizer per block gives the very same bits.
        torch.testing.assert_close(q, p, rtol=0, atol=0)


def test_updates_happen_during_backward_and_free_the_gradients():
    workload = Workload(CFG, batch_size=2, dtype="fp32", optimizer_in_backward=True)
    step = build_train_step(workload, CPU)
    x, y = random_batch(workload, CPU)
    before = [p.detach().clone() for p in step.model.parameters()]
    step.backward(step.forward(x, y))
    assert all(p.grad is None for p in step.model.parameters())
    after_backward = [p.detach().clone() for p in step.model.parameters()]
    assert all(not torch.equal(a, b) for a, b in zip(before, after_backward))
    step.optimizer_step()  # the optimizer phase only finishes: nothing left to update
    assert all(torch.equal(a, p) for a, p in zip(after_backward, step.model.parameters()))
    assert step.optimizer.state[next(step.model.parameters())]["step"] == 1


def test_fwd_bwd_mode_keeps_gradients_and_weights():
    workload = Workload(CFG, batch_size=2, dtype="fp32", optimizer_in_backward=True)
    step = build_train_step(workload, CPU)
    x, y = random_batch(workload, CPU)
    before = [p.detach().clone() for p in step.model.parameters()]
    run_step(step, x, y, mode="fwd-bwd")
    assert all(p.grad is not None for p in step.model.parameters())
    assert all(torch.equal(a, p) for a, p in zip(before, step.model.parameters()))
    step.zero_grad()
    assert all(p.grad is None for p in step.model.parameters())


def test_groups_are_blocks_and_lone_parameters_and_a_partial_group_finishes_in_step():
    workload = Workload(CFG, batch_size=2)
    model = build_train_step(workload, CPU).model
    groups = update_groups(model)
    assert [len(g) for g in groups] == [7, 7, 7, 1, 1, 1]
    assert sum(len(g) for g in groups) == len(list(model.parameters()))

    torch.manual_seed(0)
    used, unused = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
    ref = [p.detach().clone().requires_grad_() for p in used.parameters()]
    opt = OptimizerInBackward([list(used.parameters()) + list(unused.parameters())],
                              lambda ps: torch.optim.AdamW(ps, lr=0.1))
    opt_ref = torch.optim.AdamW(ref, lr=0.1)
    x = torch.randn(8, 5)
    used(x).square().sum().backward()  # two of the group's four parameters get gradients
    assert all(p.grad is not None for p in used.parameters())  # the group waits for the others
    opt.step()
    torch.nn.functional.linear(x, ref[0], ref[1]).square().sum().backward()
    opt_ref.step()
    for p, q in zip(used.parameters(), ref):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
        assert p.grad is None
    opt.remove_hooks()


@pytest.mark.slow
def test_whole_model_compile_with_hooks_on_tiny():
    """Under torch.compile of model + loss the hooks fire on AccumulateGrad, outside the graph."""
    cfg = CFG.with_overrides(num_layers=1)
    options = dict(batch_size=2, lr=3e-3, compile="model")
    reference = trained(Workload(cfg, **options), steps=2)
    in_backward = trained(Workload(cfg, optimizer_in_backward=True, **options), steps=2)
    for p, q in zip(reference, in_backward):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)


def test_carveout_is_on_from_the_first_update_until_step():
    """The matmuls leave SMs to the updates only while updates can run: from the first hook's update
    (the rest of the backward) until the optimizer phase has waited for them."""
    events = []

    class Recorder:
        def on(self):
            events.append(("on", sum(p.grad is None for p in model.parameters())))

        def off(self):
            events.append(("off", None))

    workload = Workload(CFG, batch_size=2, dtype="fp32")
    step = build_train_step(workload, CPU)
    model = step.model
    opt = OptimizerInBackward(update_groups(model), lambda ps: torch.optim.AdamW(ps, lr=1e-3), carveout=Recorder())
    x, y = random_batch(workload, CPU)
    with torch.autocast("cpu", enabled=False):
        step.loss_fn(x, y).backward()
    n_params = len(list(model.parameters()))
    first_on = events[0]
    assert first_on[0] == "on" and first_on[1] < n_params  # on when the first group's gradients arrived
    assert ("off", None) not in events  # still on at the end of the backward
    opt.step()
    assert events[-1] == ("off", None)
    opt.remove_hooks()


@pytest.mark.gpu
@pytest.mark.parametrize("compile_scope, carveout", [("none", None), ("blocks", None), ("blocks", 16)])
def test_side_stream_equals_step_after_backward_on_cuda(compile_scope, carveout):
    cuda = torch.device("cuda")
    options = dict(batch_size=2, lr=3e-3, dtype="bf16", master_weights=True, compile=compile_scope)
    library_before = torch.backends.cuda.preferred_blas_library()
    reference = trained(Workload(CFG, **options), device=cuda)
    side = trained(Workload(CFG, optimizer_in_backward=True, optimizer_stream=True, sm_carveout=carveout,
                            **options), device=cuda)
    assert torch._C._get_sm_carveout_experimental() in (None, 0)  # restored after every step
    assert torch.backends.cuda.preferred_blas_library() == library_before
    # the carveout routes the backward's matmuls through cuBLASLt, whose kernels may sum in another order:
    # one bf16 ulp apart there (bitwise equal on the H200, 2026-12-01), bitwise otherwise
    rtol = 2**-7 if carveout is not None else 0
    for p, q in zip(reference, side):
        torch.testing.assert_close(q, p, rtol=rtol, atol=0)


def test_carveout_ends_when_the_backward_fails():
    """An OOM half-way through the backward (bench e2e marks the row and goes on) must not leave the
    matmuls of the next rows with SMs carved out."""
    events = []

    class Recorder:
        def on(self):
            events.append("on")

        def off(self):
            events.append("off")

    class FailsInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise torch.cuda.OutOfMemoryError("injected")

    workload = Workload(CFG, batch_size=2, dtype="fp32")
    step = build_train_step(workload, CPU)
    step.optimizer = OptimizerInBackward(update_groups(step.model), lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                                         carveout=Recorder())
    # the first block's output fails in backward: the later blocks' groups update first (carveout on)
    step.model.layers[0].register_forward_hook(lambda module, args, out: FailsInBackward.apply(out))
    x, y = random_batch(workload, CPU)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        step.backward(step.forward(x, y))
    assert events[0] == "on" and events[-1] == "off", events
    step.optimizer.remove_hooks()


def test_fast_path_switches(monkeypatch):
    cuda, cpu = torch.device("cuda"), CPU
    monkeypatch.setattr(devices, "sm_count", lambda device: 132)  # an H200, on any machine
    fast = e2e.step_options(cuda, "bf16", fast=True, attn=None, compile_scope=None, optimizer="auto",
                            master_weights=False, fused_ce="auto", tf32=False)
    # --fast leaves the optimizer after the backward (measured no faster inside it on an H200)
    assert not fast["optimizer_in_backward"] and not fast["optimizer_stream"] and fast["compile"] == "model"
    on = e2e.step_options(cuda, "bf16", fast=True, attn=None, compile_scope="blocks", optimizer="auto",
                          master_weights=False, fused_ce="auto", tf32=False, optimizer_in_backward=True,
                          optimizer_stream=True)
    assert on["optimizer_in_backward"] and on["optimizer_stream"] and on["compile"] == "blocks"
    same_stream = e2e.step_options(cuda, "bf16", fast=True, attn=None, compile_scope=None, optimizer="auto",
                                   master_weights=False, fused_ce="auto", tf32=False, optimizer_in_backward=True,
                                   optimizer_stream=False)
    assert same_stream["optimizer_in_backward"] and not same_stream["optimizer_stream"]
    for device, dtype in ((cuda, "fp32"), (cpu, "bf16")):
        opts = e2e.step_options(device, dtype, fast=True, attn=None, compile_scope=None, optimizer="auto",
                                master_weights=False, fused_ce="auto", tf32=False)
        assert not opts["optimizer_in_backward"] and not opts["optimizer_stream"]
    mine = Workload(CFG, dtype="bf16", compile="blocks", master_weights=True, optimizer_in_backward=True,
                    optimizer_stream=True)
    for _, plain in e2e.reference_workloads(mine):
        assert not plain.optimizer_in_backward and not plain.optimizer_stream
    assert mine.describe().endswith("optimizer in backward (side stream)")
    carved = Workload(CFG, dtype="bf16", compile="blocks", master_weights=True, optimizer_in_backward=True,
                      optimizer_stream=True, sm_carveout=16)
    assert carved.describe().endswith("optimizer in backward (side stream, matmuls leave it 16 SMs)")
    for _, plain in e2e.reference_workloads(carved):
        assert plain.sm_carveout is None
    carve = e2e.step_options(cuda, "bf16", fast=True, attn=None, compile_scope="blocks", optimizer="auto",
                             master_weights=False, fused_ce="auto", tf32=False, optimizer_in_backward=True,
                             optimizer_stream=True, sm_carveout=16)
    assert carve["sm_carveout"] == 16
    from lmsys.core.errors import LmsysError

    with pytest.raises(LmsysError, match="leaves no SM to the matmuls: this GPU has 132"):
        e2e.step_options(cuda, "bf16", fast=True, attn=None, compile_scope="blocks", optimizer="auto",
                         master_weights=False, fused_ce="auto", tf32=False, optimizer_in_backward=True,
                         optimizer_stream=True, sm_carveout=132)


def test_cli_on_cpu_says_the_switch_is_on(lmsys):
    r = lmsys("bench", "e2e", "--size", "tiny", "--layers", "1", "--context-length", "16", "--steps", "2",
              "--warmup", "1", "--mode", "all", "--optimizer-in-backward", "--device", "cpu", "-f", "json")
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    assert doc["meta"]["lmsys path"].endswith("optimizer in backward")
    rows = {row["mode"]: row for row in doc["rows"]}
    assert rows["train"]["status"] == "ok" and rows["train"]["optimizer ms"]["mean"] >= 0
    assert rows["fwd-bwd"]["optimizer ms"] is None


def test_fp16_grad_scaler_is_refused():
    from lmsys.core.errors import LmsysError

    with pytest.raises(LmsysError, match="GradScaler"):
        Workload(CFG, dtype="fp16", optimizer_in_backward=True)


@pytest.mark.parametrize("args, message", [
    (("--optimizer-stream",), "add --optimizer-in-backward"),
    (("--optimizer-in-backward", "--optimizer-stream"), "--optimizer-stream needs a CUDA GPU"),
    (("--optimizer-in-backward", "--compile", "--cuda-graphs"), "--cuda-graphs is not supported"),
    (("--optimizer-in-backward", "--sm-carveout", "16"), "add --optimizer-in-backward --optimizer-stream"),
    (("--sm-carveout", "16"), "add --optimizer-in-backward --optimizer-stream"),
])
def test_refused_combinations_exit_2_with_one_line(lmsys, args, message):
    r = lmsys("bench", "e2e", "--size", "tiny", "--layers", "1", "--context-length", "16", "--steps", "1",
              "--warmup", "0", "--device", "cpu", *args)
    assert r.code == 2, r.out
    assert message in r.err and "Traceback" not in r.err
    assert len(r.err.strip().splitlines()) <= 2
