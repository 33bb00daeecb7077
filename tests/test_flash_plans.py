"""flash-triton's launch plans (lmsys.kernels.plans): one per key (shapes, strides, dtypes, device, 16-byte
alignment, causal, policy), recorded from the normal path and replayed on later calls. Under the
interpreter the plans are off by default; here they are turned on, and a replay passes the recorded
arguments (with the new tensors in their places) through Triton's normal launch, so everything but the
compiled launcher's call is checked against float64. The `gpu` tests check the direct launch itself."""

from __future__ import annotations

import inspect
from dataclasses import replace

import pytest
import torch

from lmsys.bench.flash_check import reference_attention, relative_error
from lmsys.kernels import flash, flash_triton, plans

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}


@pytest.fixture
def planned(monkeypatch):
    """Plans on (also under the interpreter), none kept from before."""
    monkeypatch.setattr(plans, "ENABLED", True)
    plans.clear()
    yield plans
    plans.clear()


def _qkv(lead, n_q, n_k, d, dtype, grad=True):
    q = torch.randn(*lead, n_q, d).to(dtype)
    k, v = (torch.randn(*lead, n_k, d).to(dtype) for _ in range(2))
    return tuple(x.to(DEVICE).requires_grad_(grad) for x in (q, k, v))


def _fwd_bwd(q, k, v, causal, do, policy=None):
    out = flash.FlashAttentionTriton.apply(q, k, v, causal, None, policy)
    lse = out.grad_fn.saved_tensors[4]
    grads = torch.autograd.grad(out, (q, k, v), do)
    return (out, lse, *grads), flash.kernels_ran(out)


def _check_reference(q, k, v, causal, do, got):
    q64, k64, v64 = (x.detach().double().cpu().requires_grad_() for x in (q, k, v))
    o_ref, lse_ref = reference_attention(q64, k64, v64, causal)
    refs = torch.autograd.grad(o_ref, (q64, k64, v64), do.double().cpu())
    for name, x, ref in zip(("O", "L", "dQ", "dK", "dV"), got, (o_ref, lse_ref, *refs)):
        assert x.shape == ref.shape, name
        assert relative_error(x, ref) < TOL[q.dtype], name


# awkward shapes: batch 1, lengths that are no multiple of the tiles, n_q != n_k both ways, grouped heads,
# 3-D and 5-D inputs
AWKWARD = [
    ((1, 2), 37, 53, 16, False, torch.float32),
    ((1, 2), 45, 29, 64, True, torch.bfloat16),
    ((2, 1, 2), 33, 81, 32, True, torch.float16),
    ((1,), 1, 17, 64, False, torch.float32),
]


@pytest.mark.parametrize("lead,n_q,n_k,d,causal,dtype", AWKWARD)
def test_replayed_plan_matches_the_normal_path_and_float64(planned, lead, n_q, n_k, d, causal, dtype):
    """The second and third calls of a key replay its plans (forward and backward) on new tensors: the same
    bits as the normal path on those tensors, within tolerance of float64, and the same kernels named."""
    first = _qkv(lead, n_q, n_k, d, dtype)
    _fwd_bwd(*first, causal, torch.randn(*lead, n_q, d).to(dtype).to(DEVICE))  # records the plans
    assert planned.STATS == {"hits": 0, "misses": 2, "normal": 0}
    assert all(isinstance(p, plans.Plan) for p in planned._PLANS.values()) and len(planned._PLANS) == 2
    for call in range(2):
        q, k, v = _qkv(lead, n_q, n_k, d, dtype)
        do = torch.randn(*lead, n_q, d).to(dtype).to(DEVICE)
        got, ran = _fwd_bwd(q, k, v, causal, do)
        assert planned.STATS["hits"] == 2 * (call + 1)
        _check_reference(q, k, v, causal, do, got)
        planned.ENABLED = False  # the normal path on the same tensors
        normal, normal_ran = _fwd_bwd(q, k, v, causal, do)
        planned.ENABLED = True
        assert ran == normal_ran
        for x, y in zip(got, normal):
            assert torch.equal(x, y)


def test_replay_after_an_aliased_first_call_reads_each_tensor(planned):
    """A plan recorded from q, k, v that are one tensor names each argument by its parameter, not by its
    address: replayed on three different tensors (grouped heads: 4 query heads, 2 key/value heads) it
    reads each of them."""
    x = torch.randn(1, 2, 40, 16).to(DEVICE)
    flash_triton.launch_forward(torch.randn(1, 4, 40, 16).to(DEVICE), x, x, True)  # k is v
    q = torch.randn(1, 4, 40, 16).to(DEVICE)
    k, v = (torch.randn(1, 2, 40, 16).to(DEVICE) for _ in range(2))
    o, lse, _ = flash_triton.launch_forward(q, k, v, True)
    assert planned.STATS["hits"] == 1
    o_ref, lse_ref = reference_attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), True)
    assert relative_error(o, o_ref) < 1e-4 and relative_error(lse, lse_ref) < 1e-4


def _misaligned(shape, dtype, offset=1, device=DEVICE):
    """A tensor of `shape` whose data starts `offset` elements past a 16-byte boundary."""
    n = torch.Size(shape).numel()
    buf = torch.randn(n + 16).to(dtype).to(device)
    return buf[offset:offset + n].view(shape)


def test_plan_keys_by_shape_dtype_strides_alignment_policy_and_causal(planned):
    """A new length, dtype, layout (strides), pointer alignment, policy or causal flag is a miss (the normal
    path, recorded into a plan of its own); the same again is a hit."""
    shape = (1, 2, 24, 16)
    q, k, v = _qkv(shape[:2], 24, 24, 16, torch.float32, grad=False)

    def call(*args, causal=False, policy=None):
        before = dict(planned.STATS)
        out = flash_triton.launch_forward(*args, causal, policy=policy)
        o_ref, _ = reference_attention(*(x.double().cpu() for x in args), causal)
        assert relative_error(out[0], o_ref) < TOL[args[0].dtype]
        return "hit" if planned.STATS["hits"] > before["hits"] else "miss"

    assert call(q, k, v) == "miss"
    assert call(q, k, v) == "hit"
    assert call(*(torch.randn_like(x) for x in (q, k, v))) == "hit"  # new tensors, same key
    assert call(*_qkv(shape[:2], 25, 24, 16, torch.float32, grad=False)) == "miss"  # a new length
    assert call(*(x.to(torch.bfloat16) for x in (q, k, v))) == "miss"  # a new dtype
    assert call(q, k, v, causal=True) == "miss"
    # another policy than the one a call without one gets (default_policy(): pick=0 under
    # LMSYS_FLASH_AUTOTUNE=0, as the GPU test runs set it)
    other = replace(flash.default_policy(), deterministic=not flash.default_policy().deterministic)
    assert call(q, k, v, policy=other) == "miss"
    assert call(q, k, v, policy=replace(other)) == "hit"  # an equal policy
    # k as a view of a wider tensor: other strides, same shape
    k_wide = torch.randn(*shape[:-1], 32).to(DEVICE)[..., :16]
    assert k_wide.shape == k.shape and k_wide.stride() != k.stride()
    assert call(q, k_wide, v) == "miss"
    assert call(q, torch.randn(*shape[:-1], 32).to(DEVICE)[..., :16], v) == "hit"
    # alignment: q whose address is not a multiple of 16 bytes (Triton compiles pointers apart on this)
    q_odd = _misaligned(shape, torch.float32)
    q_odd.copy_(q)
    assert q_odd.data_ptr() % 16 and q_odd.stride() == q.stride()
    assert call(q_odd, k, v) == "miss"
    assert call(_misaligned(shape, torch.float32, offset=3), k, v) == "hit"  # also off 16 bytes
    assert call(q, k, v) == "hit"  # aligned again: the first plan


def test_alignment_and_every_specialized_integer_enter_the_key():
    """What Triton specializes a launch on is in the key: each tensor's 16-byte alignment (a pointer and
    any tensor a descriptor is built on), shapes and strides (every integer argument is one of them or a
    function of them), dtype and device."""
    head = ("fwd", False, flash.DEFAULT_POLICY)
    q = torch.randn(2, 3, 8, 16)
    odd = _misaligned((2, 3, 8, 16), torch.float32, device="cpu")  # not .cpu() of a GPU one: a copy is aligned
    assert odd.data_ptr() % 16
    base = plans.key(head, (q, q, q))
    assert plans.key(head, (q, q, q)) == base
    for i in range(3):
        tensors = [q, q, q]
        tensors[i] = odd
        assert plans.key(head, tensors) != base
    assert plans.key(head, (q.transpose(1, 2), q, q)) != base
    assert plans.key(head, (q.half(), q, q)) != base
    assert plans.key(("fwd", True, flash.DEFAULT_POLICY), (q, q, q)) != base
    previous = torch.get_float32_matmul_precision()  # fp32's dots follow it (flash_triton.fp32_dots)
    try:
        torch.set_float32_matmul_precision("high" if previous == "highest" else "highest")
        assert plans.key(head, (q, q, q)) != base
    finally:
        torch.set_float32_matmul_precision(previous)
    assert plans.key(head, (q, q, q)) == base


def test_policy_hash_is_computed_once_and_follows_equality():
    """Policy's hash (part of every plan key) is computed at construction: equal policies hash alike,
    a changed field changes it, and a pickled policy gets this process's hash back."""
    import pickle

    policy = replace(flash.DEFAULT_POLICY, configs={"fwd": []}, pick=1)
    assert hash(policy) == hash(replace(policy)) and policy == replace(policy)
    assert hash(replace(policy, pick=2)) != hash(policy)
    again = pickle.loads(pickle.dumps(policy))
    assert again == policy and hash(again) == hash(policy) and b"_hash" not in pickle.dumps(policy)


def test_a_call_the_plan_cannot_replay_takes_the_normal_path(planned):
    """The atomic backward casts its float32 dQ into q's dtype after the launch: not an allocation a plan
    replays, so that key takes the normal path on every call (and stays right)."""
    policy = replace(flash.DEFAULT_POLICY, deterministic=False)
    for call in range(2):
        q, k, v = _qkv((1, 1), 40, 24, 16, torch.bfloat16)
        do = torch.randn(1, 1, 40, 16).to(torch.bfloat16).to(DEVICE)
        got, ran = _fwd_bwd(q, k, v, False, do, policy)
        _check_reference(q, k, v, False, do, got)
    assert planned.STATS == {"hits": 1, "misses": 2, "normal": 1}  # the forward replays; the backward cannot
    assert list(planned._PLANS.values()).count(plans.NORMAL) == 1


@pytest.mark.parametrize("lead", [(2, 1), (3,)])
def test_a_zero_stride_gradient_is_copied_by_the_plan_too(planned, lead):
    """`.sum().backward()` hands the backward a zero-stride gradient of ones, which the launchers copy before
    the kernels read it: the plan replays that copy (plans.contiguous), so later calls hit the plan, with
    gradients right against float64 on fresh inputs each call."""
    for call in range(3):
        q, k, v = _qkv(lead, 45, 29, 16, torch.float32)
        out = flash.FlashAttentionTriton.apply(q, k, v, True)
        lse = out.grad_fn.saved_tensors[4]
        out.sum().backward()
        _check_reference(q, k, v, True, torch.ones(out.shape), (out, lse, q.grad, k.grad, v.grad))
    assert planned.STATS == {"hits": 4, "misses": 2, "normal": 0}
    bwd = next(p for k, p in planned._PLANS.items() if k[0][0] == "bwd")
    assert any(type(step) is plans.Copy for step in bwd.steps)


def test_build_refuses_what_it_cannot_name(monkeypatch):
    """A tensor among a launch's arguments that no name points at, or a named argument that is a copy of
    the call's tensor, makes the key NORMAL (a plan would pin the old tensor, or read the input uncopied)."""
    monkeypatch.setattr(plans, "INTERPRET", True)  # steps replayed through Triton's launch: no kernel needed
    q = torch.randn(4, 8)
    out = torch.empty(4, 8)

    def recorded(args, names):
        rec = plans.Recording()
        rec.allocs["o"] = (out, (4, 8), torch.float32, out.device)
        rec.steps.append((flash_triton._attn_bwd_preprocess, None, (1, 1, 1), args, {}, names))
        return plans.Plan.build(rec, {"q": q}, (out,), {})

    extra = torch.randn(4, 8)
    assert recorded((q, out, extra), ("q", "o")) is plans.NORMAL  # extra has no name
    assert recorded((q.clone(), out), ("q", "o")) is plans.NORMAL  # a copy of q
    assert isinstance(recorded((q, out, 1.0), ("q", "o")), plans.Plan)


def test_recorded_without_grad_starts_the_backward_compiles_once_a_backward_follows(planned, monkeypatch):
    """A forward key first seen under no_grad has a plan that never started the backward's compiles: the
    first call that needs a backward starts them, later ones do not."""
    started = []
    monkeypatch.setattr(flash, "_precompile_backward", lambda *args: started.append(args[-2:]))
    q, k, v = _qkv((1, 1), 20, 20, 16, torch.float32, grad=False)
    flash.FlashAttentionTriton.apply(q, k, v, False)  # no input needs a gradient
    assert started == []
    for x in (q, k, v):
        x.requires_grad_()
    for _ in range(2):
        flash.FlashAttentionTriton.apply(q, k, v, False).sum().backward()
    assert started == [(False, flash.default_policy())]  # pick=0 under LMSYS_FLASH_AUTOTUNE=0


def test_a_plan_keeps_no_tensor_of_the_call_it_recorded(planned):
    """The plan holds the arguments that are not tensors; the recorded call's inputs and outputs are freed
    with the caller's last reference (a plan pinning them would hold GPU memory for the process's life)."""
    import gc
    import weakref

    q, k, v = _qkv((1, 2), 24, 40, 16, torch.float32)
    out = flash.FlashAttentionTriton.apply(q, k, v, True)
    out.sum().backward()
    refs = [weakref.ref(x) for x in (q, k, v, out, q.grad)]
    assert len(planned._PLANS) == 2
    del q, k, v, out
    gc.collect()
    assert all(r() is None for r in refs)


def test_lmsys_flash_plans_0_turns_them_off():
    """LMSYS_FLASH_PLANS=0: every call takes the normal path (read at import); plans are on by default
    where kernels are compiled (not under the interpreter)."""
    import os
    import subprocess
    import sys

    code = "from lmsys.kernels import plans; print(plans.ENABLED)"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    env.pop("LMSYS_FLASH_PLANS", None)
    on = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    off = subprocess.run([sys.executable, "-c", code], env={**env, "LMSYS_FLASH_PLANS": "0"}, capture_output=True,
                         text=True, check=True)
    interpreted = subprocess.run([sys.executable, "-c", code], env={**env, "TRITON_INTERPRET": "1"},
                                 capture_output=True, text=True, check=True)
    assert (on.stdout.strip(), off.stdout.strip(), interpreted.stdout.strip()) == ("True", "False", "False")


@pytest.mark.parametrize("hooked", [False, True])
def test_direct_steps_call_the_compiled_kernels_launcher(monkeypatch, hooked):
    """Where kernels are compiled, a step calls the CompiledKernel's launcher with the grid, the stream,
    the function handle, the packed metadata, the launch metadata the kernel gives, the hooks, and every
    argument with the new call's tensors in their places: their addresses, or the tensors themselves where
    a launch hook (a profiler's) may read them (a fake kernel records the call, on the CPU)."""
    from triton import knobs

    monkeypatch.setattr(plans, "INTERPRET", False)
    if hooked:
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda metadata: None)
    calls = []

    class Compiled:  # what the normal launch returned
        function, packed_metadata = "function", "packed"

        class metadata:
            global_scratch_size = 0

        def run(self, *args):
            calls.append(args)

        def launch_metadata(self, grid, stream, *args):  # as JITFunction.run asks for it
            assert grid == (16, 2, 1) and stream == "stream" and len(args) == 15
            return "launch metadata"

    class Driver:
        class active:
            get_current_stream = staticmethod(lambda device: "stream")

    monkeypatch.setattr(plans, "_driver", Driver)
    o, d, g = torch.empty(3, 4), torch.empty(3), torch.empty(3, 4)
    q = torch.randn(3, 4)
    rec = plans.Recording()
    rec.allocs["o"] = (o, (3, 4), torch.float32, o.device)
    rec.allocs["delta"] = (d, (3,), torch.float32, d.device)
    rec.allocs["dq32"] = (g, (3, 4), torch.float32, g.device)
    rec.steps.append((flash_triton._attn_bwd_preprocess, Compiled(), lambda meta: (meta["BLOCK_M"], 2),
                      (o, q, d, g, 4, 1, 4, 4, 1, 4, 1, 3), dict(HEAD_DIM=4, HEAD_DIM_PAD=4, BLOCK_M=16),
                      ("o", "do", "delta", "dq32")))
    plan = plans.Plan.build(rec, {"do": q}, (o, d), {"pre": "16"})
    assert isinstance(plan, plans.Plan) and plan.direct and not plan.scratch
    q2 = torch.randn(3, 4)
    o2, d2 = plan.run({"do": q2})
    assert len(calls) == 1
    (*head, o_arg, q_arg, d_arg, g_arg), rest = calls[0][:13], calls[0][13:]
    if hooked:
        hooks = [knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook]
        assert head[:7] == [16, 2, 1, "stream", "function", "packed", "launch metadata"] and head[7:] == hooks
        assert o_arg is o2 and q_arg is q2 and d_arg is d2 and g_arg.shape == (3, 4) and g_arg is not g
    else:  # Triton's empty hook chains: no launch metadata built, no hook for the launcher to call
        assert head == [16, 2, 1, "stream", "function", "packed", None, None, None]
        assert [o_arg, q_arg, d_arg] == [o2.data_ptr(), q2.data_ptr(), d2.data_ptr()] and g_arg not in (0, g.data_ptr())
    assert o2.data_ptr() != o.data_ptr()
    assert list(rest) == [4, 1, 4, 4, 1, 4, 1, 3, 4, 4, 16]  # the rest as recorded, constexprs included


def test_launch_call_matches_triton():
    """The direct launch calls a CompiledKernel's launcher as JITFunction.run does after its cache lookup
    (triton 3.6 and 3.9 alike); a Triton that changes that call must fail here, not launch wrongly."""
    from triton.runtime.jit import JITFunction

    source = " ".join(inspect.getsource(JITFunction.run).split())
    assert ("kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, "
            "launch_metadata, knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, "
            "*bound_args.values())") in source
    assert "launch_metadata = kernel.launch_metadata(grid, stream, *bound_args.values())" in source
    plan_source = " ".join(inspect.getsource(plans.Plan.run).split())
    assert "step.run(g0, g1, g2, stream, step.function, step.packed, meta, enter, leave, *args)" in plan_source


@pytest.mark.gpu
@pytest.mark.parametrize("host_bound", [True, False])  # False: descriptors and Gluon at these small sizes too
@pytest.mark.parametrize("lead,n_q,n_k,d,causal,dtype", AWKWARD + [
    ((8, 1), 256, 256, 64, True, torch.bfloat16),  # the Gluon forward on Hopper (host_bound False)
    ((1, 2), 4096, 4096, 128, True, torch.bfloat16),  # and the Gluon backward
])
def test_direct_launch_matches_the_normal_path_on_a_gpu(lead, n_q, n_k, d, causal, dtype, host_bound):
    """On a GPU the plans launch the compiled kernels directly: the same bits as the normal path, aligned
    or not (a misaligned q has a plan, and a kernel, of its own)."""
    plans.clear()
    policy = flash.default_policy() if host_bound else replace(flash.default_policy(), host_bound_flops=0)
    for make in (lambda: _qkv(lead, n_q, n_k, d, dtype),
                 lambda: (_misaligned((*lead, n_q, d), dtype).requires_grad_(), *_qkv(lead, n_q, n_k, d, dtype)[1:])):
        _fwd_bwd(*make(), causal, torch.randn(*lead, n_q, d, device=DEVICE).to(dtype), policy)
        q, k, v = make()
        do = torch.randn(*lead, n_q, d, device=DEVICE).to(dtype)
        hits = plans.STATS["hits"]
        got, ran = _fwd_bwd(q, k, v, causal, do, policy)
        assert plans.STATS["hits"] == hits + 2
        plans.ENABLED = False
        try:
            normal, normal_ran = _fwd_bwd(q, k, v, causal, do, policy)
        finally:
            plans.ENABLED = True
        assert ran == normal_ran
        for name, x, y in zip(("O", "L", "dQ", "dK", "dV"), got, normal):
            if name == "dQ" and "bwd" in ran:  # the Gluon backward adds dQ with atomics: not bitwise
                assert relative_error(x, y) < TOL[dtype]
            else:
                assert torch.equal(x, y), name
        _check_reference(q, k, v, causal, do, got)


def test_the_backward_keys_on_its_forwards_key_and_do(planned):
    """FlashAttentionTriton's backward key is its forward's key and dO's shape, strides, dtype and alignment
    (q, k, v, O and L follow from the forward's): dO in another layout is a miss with its own plan, the same
    again a hit; launch_backward without the forward's key keys all six tensors, a plan apart. Gradients
    within tolerance of float64 on every call."""
    q, k, v = _qkv((1, 2), 24, 40, 16, torch.float32)
    do = torch.randn(1, 2, 24, 16).to(DEVICE)
    do_t = torch.randn(1, 2, 16, 24).to(DEVICE).transpose(-1, -2)  # same shape, other strides
    for do_, plans_kept in ((do, 2), (do, 2), (do_t, 3), (do_t, 3)):
        got, _ = _fwd_bwd(q, k, v, True, do_)
        _check_reference(q, k, v, True, do_, got)
        assert len(planned._PLANS) == plans_kept
    o, lse = got[:2]
    before = dict(planned.STATS)
    grads = flash.launch_backward(q, k, v, o.detach(), lse, do, True, policy=flash.default_policy())[:3]
    assert planned.STATS["misses"] == before["misses"] + 1 and len(planned._PLANS) == 4
    _check_reference(q, k, v, True, do, (o, lse, *grads))


def test_a_plan_remakes_an_allocation_like_an_input_only_where_its_strides_match(planned):
    """An allocation is made by torch.empty_like of an input with its shape, dtype, device and strides (dQ
    like q); k and v as views of wider tensors have other strides, and no other input has their length, so
    dK and dV are allocated as recorded. Replayed gradients are contiguous, the normal path's bits."""
    q = torch.randn(1, 2, 24, 16).to(DEVICE).requires_grad_()
    k, v = (torch.randn(1, 2, 40, 32).to(DEVICE)[..., :16].requires_grad_() for _ in range(2))
    do = torch.randn(1, 2, 24, 16).to(DEVICE)
    for _ in range(2):
        got, _ = _fwd_bwd(q, k, v, False, do)
    bwd = next(p for key, p in planned._PLANS.items() if key[0][0] == "bwd")
    like = {name: src for name, *_rest, src in bwd.allocs}
    assert like["dq"] == "q" and like["dk"] is None and like["dv"] is None
    assert all(g.is_contiguous() for g in got[2:])
    planned.ENABLED = False
    normal, _ = _fwd_bwd(q, k, v, False, do)
    assert all(torch.equal(x, y) for x, y in zip(got, normal))


def _stand_in_launcher():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent / "helpers" / "fake_tensordesc_launcher.py"
    spec = importlib.util.spec_from_file_location("fake_tensordesc_launcher", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _descriptor_kernel(q_desc, o, k_desc, n, BLOCK):  # the parameters of a kernel taking two descriptors
    pass


class _Desc:  # a host tensor descriptor as Gluon's: what the launcher reads of one
    def __init__(self, base, block):
        self.base, self.shape, self.strides = base, list(base.shape), list(base.stride())
        self.block_shape, self.layout, self.padding = block, "layout", "zero"


@pytest.mark.parametrize("hooked", [False, True])
def test_descriptors_are_encoded_once_per_address_and_launched_as_tritons_wrapper_would(monkeypatch, hooked):
    """A step whose kernel takes tensor descriptors (the Gluon kernels' q, k, v, dO, dQ) calls triton 3.6's
    raw launcher itself (plans.Expanded) with, in each descriptor's place, its CUtensorMap, shape and
    strides, encoded once per base address: the arguments Triton's wrapper builds, argument for argument
    (a stand-in launcher of that structure records both calls, on the CPU). A new address is encoded once;
    under a launch hook, or for a launcher of another structure, Triton's own path runs."""
    from triton import knobs

    fake = _stand_in_launcher()
    monkeypatch.setattr(plans, "INTERPRET", False)
    if hooked:
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda metadata: None)
    raw_calls = []
    signature = {"q_desc": "tensordesc<fp32[8,4]>", "o": "*fp32", "k_desc": "tensordesc<fp32[8,4]>",
                 "n": "i32", "BLOCK": "constexpr"}
    metas = [{"swizzle": 128}, {"swizzle": 64}]

    class Compiled:
        function, packed_metadata = "function", "packed"
        run = fake.Launcher(lambda *args: raw_calls.append(args), signature, metas)

        class metadata:
            global_scratch_size = 0

        def launch_metadata(self, grid, stream, *args):
            return "launch metadata"

    class Driver:
        class active:
            get_current_stream = staticmethod(lambda device: "stream")

    class Fn:  # the jit function: plans reads its parameters
        fn = _descriptor_kernel

    monkeypatch.setattr(plans, "_driver", Driver)
    q, k, o = torch.randn(24, 4), torch.randn(40, 4), torch.empty(24, 4)
    rec = plans.Recording()
    rec.allocs["o"] = (o, (24, 4), torch.float32, o.device)
    rec.steps.append((Fn, Compiled(), (3, 2), (_Desc(q, [8, 4]), o, _Desc(k, [8, 4]), 24), {"BLOCK": 8},
                      ("q", "o", "k")))
    plan = plans.Plan.build(rec, {"q": q, "k": k}, (o,), {})
    step = plan.steps[0]
    assert isinstance(step.expand, plans.Expanded)

    def wrapper_call(env):  # what Triton's path passes the raw launcher for the same tensors
        n = len(raw_calls)
        step.run(3, 2, 1, "stream", "function", "packed", None, None, None, *step.args(env, True))
        return raw_calls.pop(n)

    q2, k2, q3 = torch.randn(24, 4), torch.randn(40, 4), torch.randn(24, 4)
    fake.ENCODED.clear()
    for inputs, encoded in (({"q": q2, "k": k2}, [q2, k2]), ({"q": q2, "k": k2}, []),
                            ({"q": q3, "k": k2}, [q3])):
        before = len(fake.ENCODED)
        (o2,) = plan.run(dict(inputs))
        got = raw_calls.pop()
        if hooked:  # Triton's own path: every descriptor encoded on every call, the hooks called
            assert fake.ENCODED[before:] == [inputs["q"].data_ptr(), inputs["k"].data_ptr()]
            assert got[10:13] == ("launch metadata", knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
            continue
        assert fake.ENCODED[before:] == [t.data_ptr() for t in encoded]
        assert got == wrapper_call({**inputs, "o": o2})
        assert got[:13] == (3, 2, 1, "stream", "function", False, True, None, None, "packed", None, None, None)
        assert got[13:] == (("map", inputs["q"].data_ptr(), (8, 4), 128), 24, 4, 4, 1, o2.data_ptr(),
                            ("map", k2.data_ptr(), (8, 4), 64), 40, 4, 4, 1, 24, 8)
    # any other launcher: Triton's path
    assert plans.Expanded.of(plans.Step(Fn, Compiled(), (3, 2, 1), [None, None, None, 24, 8], step.slots, {},
                                        True)) is not None
    for launcher in (fake.Launcher(lambda *a: None, signature, metas, scratch=64),
                     fake.Launcher(lambda *a: None, signature, [metas[0], None]),
                     lambda *args: None):
        Compiled.run = launcher
        assert plans.Step(Fn, Compiled(), (3, 2, 1), [None, None, None, 24, 8], step.slots, {}, True).expand is None
    # an expansion of another width than the descriptor's shape and strides: refused on every call, never launched
    fake.make_tensordesc_arg = lambda arg, meta: ["map", 24, 4]
    Compiled.run = fake.Launcher(lambda *args: raw_calls.append(args), signature, metas)
    odd = plans.Step(Fn, Compiled(), (3, 2, 1), [None, None, None, 24, 8], step.slots, {}, True)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="expanded to 3 arguments, not 5"):
            odd.expand((3, 2, 1), "stream", "function", {"q": q2, "k": k2, "o": torch.empty(24, 4)})
    assert not raw_calls


def test_tritons_own_descriptor_wrapper_is_recognised_where_it_is_the_release_plans_expand():
    """Under triton 3.6 (CI's second run) its real wrap_handle_tensordesc closure is the structure
    plans.Expanded reads; any other release, whose launcher differs, is not expanded (Triton's path)."""
    import triton
    from triton.backends.nvidia import driver

    launcher = type("L", (), {"global_scratch_size": 0, "profile_scratch_size": 0,
                              "launch_cooperative_grid": False, "launch_pdl": False})()
    launcher.launch = driver.wrap_handle_tensordesc(lambda *a: None, {"q_desc": "tensordesc<fp32[8,4]>",
                                                                      "o": "*fp32"}, [{"swizzle": 128}])
    step = type("S", (), {})()
    step.run, step.packed = launcher, "packed"
    step.template, step.slots = [None, None], ((0, "q", _Desc(torch.empty(8, 4), [8, 4])), (1, "o", None))
    expanded = plans.Expanded.of(step)
    assert (expanded is not None) == triton.__version__.startswith("3.6.")
