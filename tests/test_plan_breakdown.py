"""`lmsys plan breakdown`: a step's kernels (CPU: top-level ops) by kind beside the time model's parts."""

from __future__ import annotations

import json

import pytest

from lmsys.plan import memory as mem
from lmsys.plan import time as ptime
from lmsys.plan.shape import load_shape

MICRO = "d_model: 32\nd_ff: 64\nnum_layers: 2\nnum_heads: 2\nvocab_size: 80\ncontext_length: 16\n"
PROFILE = {"device": "cpu", "matmul_tflops": {"fp32": 0.05}, "attention_tflops": {"fp32": 0.05}, "hbm_GBps": 5.0,
           "elementwise_GBps": 2.0, "optimizer_GBps": 3.0, "host_overlap": False, "launch_us": {"fp32": 20.0}}


@pytest.mark.parametrize("name, kind", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_cluster1x2x1", "GEMM"),
    ("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT", "GEMM"),
    ("ampere_sgemm_128x64_tn", "GEMM"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float>", "GEMM"),
    ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", "attention"),
    ("fmha_cutlassB_bf16_aligned_64x64_k128_sm80", "attention"),  # memory-efficient attention: CUTLASS, still attention
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "elementwise"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>", "elementwise"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>", "elementwise"),
    ("triton_poi_fused__to_copy_mul_0", "elementwise"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", "communication"),
    ("Memset (Device)", "the rest"),
    ("Memcpy HtoD (Pageable -> Device)", "the rest"),
    # a CPU's top-level ops
    ("aten::linear", "GEMM"),
    ("aten::matmul", "GEMM"),
    ("autograd::engine::evaluate_function: MmBackward0", "GEMM"),
    ("autograd::engine::evaluate_function: BmmBackward0", "GEMM"),
    ("aten::scaled_dot_product_attention", "attention"),
    ("autograd::engine::evaluate_function: ScaledDotProductFlashAttentionForCpuBackward0", "attention"),
    ("aten::mul", "elementwise"),
    ("aten::mm_like_but_not", "elementwise"),
    ("autograd::engine::evaluate_function: MulBackward0", "elementwise"),
    ("Optimizer.step#AdamW.step", "optimizer"),
    ("gloo:all_reduce", "communication"),
])
def test_kind_of_names_kernels_and_cpu_ops(name, kind):
    from lmsys.plan.breakdown import kind_of

    assert kind_of(name) == kind


@pytest.mark.parametrize("attention", ["naive", "flash"])
def test_predicted_parts_add_up_to_the_time_models_step(attention):
    # the parts by kind are the time model's: GEMM the blocks' matmuls (naive: the s×s products too) and the
    # head's, attention a fused kernel's (backward 2.5× forward), elementwise the rest of the compute; the
    # device's sum and the step are step_time's; on a GPU profile the step is the longer of host and device
    from dataclasses import replace

    from lmsys.plan.breakdown import predict_parts
    from lmsys.plan.shape import head_gemm
    from lmsys.plan.validate import rates_for

    shape = replace(load_shape("small"), attention=attention)
    for overlap in (False, True):
        profile = {**PROFILE, "host_overlap": overlap}
        parts = predict_parts(shape, profile, dtype="fp32", batch_size=2)
        rates = rates_for(profile, "fp32")
        prec, lay = mem.PRECISIONS["fp32"], mem.Layout(micro_batch=2)
        st = ptime.step_time(shape, lay, prec, rates, gpus_per_node=1)
        bc = ptime.block_cost(shape, b=2, t=1, sp=False, prec=prec, rates=rates)
        _, M, K, N = head_gemm(shape, tokens=2 * shape.seq, tp=1)
        head = rates.matmul_ms(M, K, N) + rates.matmul_ms(M, K, N, backward=True)
        if attention == "naive":
            assert parts["GEMM"] == pytest.approx(shape.layers * (bc.matmul_fwd + bc.matmul_bwd) + head)
            assert parts["attention"] == 0.0
        else:
            assert parts["attention"] == pytest.approx(shape.layers * 3.5 * bc.attn_fwd)
            assert parts["GEMM"] == pytest.approx(shape.layers * (bc.matmul_fwd + bc.matmul_bwd - 3.5 * bc.attn_fwd)
                                                  + head)
        assert parts["elementwise"] > 0 and parts["optimizer"] == st.optimizer and parts["communication"] == 0.0
        kinds = parts["GEMM"] + parts["attention"] + parts["elementwise"] + parts["optimizer"]
        assert kinds == pytest.approx(parts["device"]) == pytest.approx(st.compute + st.optimizer)
        assert parts["host"] == pytest.approx(st.parts["host fwd ms"] + st.parts["host bwd ms"]
                                              + st.parts["host optimizer ms"])
        assert parts["step"] == st.total
        expect = max(parts["device"], parts["host"]) if overlap else parts["device"] + parts["host"]
        assert parts["step"] == pytest.approx(expect)


def test_breakdown_runs_a_step_on_the_cpu(lmsys, tmp_path):
    # a real step on the CPU: its top-level ops by kind add up to the `CPU ops, all` row; the predictions are
    # the time model's for the profile; no host-issue measurement (the host is the device); the largest ops
    # come sorted, at most --top per row, with their kinds
    import yaml

    from lmsys.plan.breakdown import KINDS, kind_of, predict_parts
    from lmsys.plan.shape import from_model_config

    model, profile = tmp_path / "micro.yaml", tmp_path / "cpu.yaml"
    model.write_text(MICRO)
    profile.write_text(yaml.safe_dump(PROFILE))
    r = lmsys("plan", "breakdown", "--size", str(model), "--device", "cpu", "--profile", str(profile),
              "--batch-size", "2", "--warmup", "1", "--steps", "2", "--top", "4", "--format", "json")
    assert r.code == 0, r.err
    main, largest = json.loads(r.out)
    rows = {row["part"]: row for row in main["rows"]}
    assert list(rows) == [f"{k} CPU ops" for k in KINDS] + ["CPU ops, all", "host issue",
                                                             "step (host-bound in the model)"]
    assert all(rows[f"{k} CPU ops"]["measured ms"] > 0 for k in ("GEMM", "elementwise", "optimizer"))
    assert rows["attention CPU ops"]["measured ms"] == 0 and rows["communication CPU ops"]["measured ms"] == 0
    assert sum(rows[f"{k} CPU ops"]["measured ms"] for k in KINDS) == pytest.approx(rows["CPU ops, all"]["measured ms"])
    assert rows["host issue"]["measured ms"] is None and rows["step (host-bound in the model)"]["measured ms"] > 0
    from lmsys.model.config import get_config

    parts = predict_parts(from_model_config(get_config(str(model)), name="micro"), PROFILE, dtype="fp32",
                          batch_size=2)
    for kind in ("GEMM", "elementwise", "optimizer"):
        row = rows[f"{kind} CPU ops"]
        assert row["predicted ms"] == pytest.approx(parts[kind])
        assert row["error %"] == pytest.approx(100 * (row["predicted ms"] - row["measured ms"]) / row["measured ms"])
    assert rows["the rest CPU ops"]["predicted ms"] is None
    assert main["meta"]["profile"].endswith("(cpu)") and "top-level CPU ops" in " ".join(main["notes"])
    ops = largest["rows"]
    assert 0 < len(ops) <= 4 and [o["ms"] for o in ops] == sorted((o["ms"] for o in ops), reverse=True)
    assert all(o["kind"] == kind_of(o["op"]) for o in ops)


def test_breakdown_without_a_profile_calibrates_first(lmsys, tmp_path, monkeypatch):
    from lmsys.plan import calibrate as cal

    calls = []
    monkeypatch.setattr(cal, "calibrate", lambda shapes, **kw: calls.append((shapes, kw)) or (dict(PROFILE), []))
    model = tmp_path / "micro.yaml"
    model.write_text(MICRO)
    r = lmsys("plan", "breakdown", "--size", str(model), "--device", "cpu", "--batch-size", "1", "--warmup", "0",
              "--steps", "1", "--format", "json")
    assert r.code == 0, r.err
    (shapes, kw), = calls
    assert [s.d_model for s in shapes] == [32] and kw["collectives"] is False and kw["batch_size"] == 1
    report = json.loads(r.out)[0]
    assert report["meta"]["profile"].startswith("calibrated here first")


@pytest.mark.parametrize("args, message", [
    (("--dtype", "fp64"), "--dtype"),
    (("--size", "nope"), "nope"),
    (("--top", "0"), "--top"),
    (("--steps", "0"), "--steps"),
    (("--profile", "/nonexistent/p.yaml"), "--profile"),
    (("--device", "cuda"), "cuda"),
])
def test_breakdown_user_errors_are_one_line(lmsys, args, message):
    r = lmsys("plan", "breakdown", *(() if "--device" in args else ("--device", "cpu")), *args)
    assert r.code == 2 and message in r.err and "Traceback" not in r.err, r.err
