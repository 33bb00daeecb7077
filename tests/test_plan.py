"""lmsys.core.hardware and lmsys.plan: the GPU table, the memory and time models, the search, the CLI."""

from __future__ import annotations

import pytest

from lmsys.core import hardware
from lmsys.core.errors import LmsysError


# ------------------------------------------------------------------------------------------- hardware

@pytest.mark.parametrize("torch_name, part", [
    ("NVIDIA H200", "H200 SXM"), ("NVIDIA H200 NVL", "H200 NVL"), ("NVIDIA H100 80GB HBM3", "H100 SXM"),
    ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA H100 NVL", "H100 NVL"), ("NVIDIA A100-SXM4-80GB", "A100 80GB SXM"),
    ("NVIDIA A100-SXM4-40GB", "A100 40GB SXM"), ("NVIDIA A100 80GB PCIe", "A100 80GB PCIe"),
    ("NVIDIA A100-PCIE-40GB", "A100 40GB PCIe"), ("NVIDIA B200", "B200"), ("h100-sxm", "H100 SXM"),
    ("A100 80GB SXM", "A100 80GB SXM"),
])
def test_gpu_lookup_by_torch_name_and_table_name(torch_name, part):
    assert hardware.find_gpu(torch_name).name == part


def test_table_figures_are_dense_and_sourced():
    h100 = hardware.GPUS["H100 SXM"]
    assert (h100.bf16, h100.tf32, h100.fp32, h100.fp8) == (989.5, 494.5, 67.0, 1979.0)  # half the sparse 1979/989/3958
    assert hardware.GPUS["A100 80GB SXM"].hbm_GBps == 2039.0 and hardware.GPUS["A100 40GB SXM"].hbm_GBps == 1555.0
    assert hardware.GPUS["B200"].bf16 == 36_000 / 8 / 2  # HGX B200: 36 PFLOP/s sparse for 8 GPUs
    for gpu in hardware.GPUS.values():
        assert set(gpu.sources) == {"compute", "memory", "links", "network"}
        assert gpu.bf16 == gpu.fp16 and gpu.tf32 == pytest.approx(gpu.bf16 / 2, rel=0.01)


def test_mfu_peak_names_the_peak_and_refuses_unknown_gpus():
    assert hardware.mfu_peak("NVIDIA H200", "bf16") == (989.5, "H200 SXM dense bf16 989.5 TFLOP/s")
    assert hardware.mfu_peak("NVIDIA A100-SXM4-80GB", "fp32", tf32=True)[0] == 156.0
    assert hardware.mfu_peak("NVIDIA A100-SXM4-80GB", "fp32")[0] == 19.5
    for name in ("NVIDIA GB200", "Tesla V100-SXM2-32GB", None):
        with pytest.raises(LmsysError, match=r"known: B200, .*A100 40GB SXM.*--peak-tflops"):
            hardware.mfu_peak(name, "bf16")
    with pytest.raises(LmsysError, match="no fp8"):
        hardware.mfu_peak("NVIDIA A100-SXM4-80GB", "fp8")
    assert hardware.mfu(1e12, 1000.0, 2.0) == pytest.approx(0.5)


def test_devices_peak_delegates_to_the_table():
    from lmsys.core import devices

    assert devices.peak_tflops_for("NVIDIA H100 PCIe", "bf16", tf32=False) == 756.5
    assert devices.peak_tflops_for("NVIDIA B200", "fp32", tf32=True) == 1125.0
    assert devices.peak_tflops_for("Tesla V100", "bf16", tf32=False) is None  # callers: no MFU, as before
    assert devices.peak_rates("NVIDIA H200").startswith("H200 SXM, dense TFLOP/s bf16 989.5")


def test_given_peak_is_what_every_mfu_divides_by():
    import torch

    from lmsys.core import devices

    cpu = torch.device("cpu")
    assert devices.peak_tflops(cpu, "bf16") is None and "MFU peak" not in devices.environment(cpu)
    assert devices.peak_tflops(cpu, "bf16", given=2.5) == 2.5
    with devices.given_peak(4.0):  # what a rank job sets from --peak-tflops
        assert devices.peak_tflops(cpu, "fp32") == 4.0
        assert devices.environment(cpu)["MFU peak"] == "4 TFLOP/s dense per device (--peak-tflops)"
    assert devices.peak_tflops(cpu, "fp32") is None
    assert devices.peak_rates("NVIDIA RTX 6000 Ada").endswith("MFU left empty (give its dense peak with "
                                                            "--peak-tflops X)")
    with pytest.raises(LmsysError, match="--peak-tflops must be a positive number"):
        hardware.check_peak(0.0)


def test_peak_tflops_option_gives_bench_and_ddp_an_mfu(lmsys):
    import json

    from lmsys.model.config import get_config
    from lmsys.model.user import model_flops

    cfg = get_config("tiny")
    r = lmsys("bench", "e2e", "--device", "cpu", "--size", "tiny", "--context-length", "16", "--batch-size", "2",
              "--steps", "1", "--warmup", "0", "--peak-tflops", "0.25", "--format", "json")
    assert r.code == 0, r.err
    out = json.loads(r.out)
    row, = out["rows"]
    flops = model_flops(cfg.with_overrides(context_length=16), batch_size=2, seq_len=16, backward=True)
    assert row["MFU %"] == pytest.approx(100 * flops / (row["ms/step"]["mean"] * 1e-3) / 0.25e12, rel=1e-6)
    assert out["meta"]["MFU peak"] == "0.25 TFLOP/s dense per device (--peak-tflops)"
    r = lmsys("ddp", "train", "--strategy", "naive", "--size", "tiny", "--context-length", "16", "--batch-size", "2",
              "--steps", "1", "--warmup", "0", "--world-size", "2", "--backend", "gloo", "--peak-tflops", "0.25",
              "--format", "json")
    assert r.code == 0, r.err
    out = json.loads(r.out)
    assert out["meta"]["MFU peak"] == "0.25 TFLOP/s dense per device (--peak-tflops)"
    for row in out["rows"]:
        ranks = 1 if row["strategy"].startswith("single") else 2
        tokens = 2 * 16 * ranks
        flops = model_flops(cfg.with_overrides(context_length=16), batch_size=tokens // 16, seq_len=16, backward=True)
        assert row["MFU %"] == pytest.approx(100 * flops / (row["ms/step"] * 1e-3) / (0.25e12 * ranks), rel=1e-6), row


# ------------------------------------------------------------------------------------------- memory

from lmsys.plan import memory as mem  # noqa: E402
from lmsys.plan import search as srch  # noqa: E402
from lmsys.plan import time as ptime  # noqa: E402
from dataclasses import replace  # noqa: E402

from lmsys.plan.shape import GPT_PRESETS, ModelShape, from_mapping, load_shape, params  # noqa: E402

SMALL = ModelShape(name="small-test", vocab=100, d_model=8, d_ff=16, layers=2, heads=2, kv_heads=1, seq=4)


def test_memory_of_a_small_config_term_by_term():
    # By hand: h 8, f 16, kv_dim 4 (2 heads of 4, one kv head), V 100, s 4; fp32; dp 2 with ZeRO-1; b 2.
    # Block matmuls: Q and out 2·8·8 = 128, K and V 2·8·4 = 64, SwiGLU 3·8·16 = 384 -> 576; norms 2·8 -> 592.
    # Model: embedding 800 + 2·592 + final norm 8 + head 800 = 2792 parameters.
    assert params(SMALL) == 2792
    lay = mem.Layout(dp=2, zero=1, micro_batch=2)
    m = mem.memory(SMALL, lay, mem.PRECISIONS["fp32"], capacity=80e9)
    assert (m.weights, m.optimizer, m.parts["gradients (all)"]) == (2792 * 4, 2792 * 8 / 2, 2792 * 4)
    # Per block (fp32, sbh = 4·2·8 = 64 elements): two RMSNorms' fp32 input and x·rsqrt, QKV input, Q,
    # output-projection input, MLP input: 8·64·4 = 2048; K and V 2·32·4 = 256; log-sum-exp 2 heads·4·2·4 B
    # = 64; gate, up, silu, product 4·128·4 = 2048 -> 4416 bytes; two blocks, one micro-batch -> 8832.
    assert mem.layer_activation_bytes(SMALL, lay, mem.PRECISIONS["fp32"]) == 4416
    # Head: final norm's input and x·rsqrt + head input 64·(4 + 4 + 4) = 768; log-probabilities 8 tokens·100·4.
    assert m.parts["embedding and head"] == 768 + 3200
    # A block's backward: the incoming gradient 64·4 + 2 × the largest saved tensor (gate, 128·4) = 1280.
    assert m.parts["block backward transient"] == 256 + 2 * 512
    buffers = 2 * 25 * 2**20 + mem.CUBLAS_WORKSPACE_BYTES  # two DDP buckets, cuBLAS's two workspaces
    state = 2792 * 4 + 2792 * 8 / 2  # weights and optimizer state, at every phase
    # forward (no gradient yet: set to None before the step): saved 8832 + 3968, the logits 800·4 alive
    # backward start: the saved tensors + the loss's two fp32 gradients 800·8 (more than the last block's
    # backward: head gradients 808·4 + 1280 - the head's 3968 saved); backward end: every gradient + the
    # first block's 4416 + 1280 less its 592·4 and the embedding's 800·4 gradients not made yet = 128.
    assert m.parts["phases"] == pytest.approx({
        "forward": state + 12800 + 3200 + buffers, "backward start": state + 12800 + 6400 + buffers,
        "backward end": state + 2792 * 4 + 128 + buffers, "optimizer": state + 2792 * 4 + buffers})
    assert m.phase == "backward start" and m.grads == 0 and m.activations == 12800 + 6400
    assert m.buffers == buffers
    assert m.total == state + 12800 + 6400 + buffers
    assert m.headroom == pytest.approx(80e9 - (2**30 + 0.05 * 80e9) - m.total)
    # two micro-batches accumulated: the second forward runs with every gradient there; the head's gradient
    # arrives as a new buffer added into the old one
    acc = mem.memory(SMALL, replace(lay, microbatches=2), mem.PRECISIONS["fp32"], capacity=80e9)
    assert acc.parts["phases"]["forward"] == pytest.approx(state + 2792 * 4 + 12800 + 3200 + buffers)
    assert acc.parts["phases"]["backward start"] == pytest.approx(state + 2792 * 4 + 12800 + 6400 + buffers)
    assert acc.parts["phases"]["backward end"] == pytest.approx(state + 2792 * 4 + 4416 + 1280 + buffers)
    assert (acc.phase, acc.grads) == ("backward start", 2792 * 4)
    # on a CPU: no cuBLAS workspace
    assert mem.memory(SMALL, lay, mem.PRECISIONS["fp32"], capacity=80e9, device="cpu").buffers == 2 * 25 * 2**20


@pytest.mark.parametrize("zero, w, g, o", [(0, 1, 1, 1), (1, 1, 1, 4), (2, 1, 4, 4), (3, 4, 4, 4)])
def test_zero_stages_shard_over_data_parallel(zero, w, g, o):
    prec = mem.PRECISIONS["master"]
    m = mem.memory(SMALL, mem.Layout(dp=4, zero=zero), prec, capacity=80e9)
    assert (m.weights, m.parts["gradients (all)"], m.optimizer) == (2792 * 2 / w, 2792 * 4 / g, 2792 * 12 / o)


def test_tensor_and_pipeline_parallel_parameters():
    # GPT-22B, tp 8: block matmuls and column biases / 8, norms and row biases whole; pp 1: tied head is the embedding.
    m = GPT_PRESETS["gpt-22b"]
    h = 6144
    block = 12 * h * h + 13 * h
    per_gpu_block = (12 * h * h + (3 * h + 4 * h)) / 8 + 4 * h + 2 * h
    lay = mem.Layout(tp=8)
    assert params(m) == 48 * block + 51200 * h + 2048 * h + 2 * h
    assert mem.stage_params(m, lay, first=True, last=True) == pytest.approx(
        48 * per_gpu_block + 51200 * h / 8 + 2048 * h + 2 * h)
    lay = mem.Layout(tp=8, pp=8, schedule="1f1b", microbatches=8)
    last = mem.stage_params(m, lay, first=False, last=True)
    assert last == pytest.approx(6 * per_gpu_block + 2 * h + 51200 * h / 8)  # the head's copy on the last stage


@pytest.mark.parametrize("t, sp, recompute", [(1, False, "none"), (8, False, "none"), (8, True, "none"),
                                              (8, True, "selective"), (4, False, "selective"), (8, True, "full"),
                                              (2, False, "full")])
@pytest.mark.parametrize("name", ["gpt-22b", "gpt-1t"])
def test_gpt_block_activations_match_korthikanti(name, t, sp, recompute):
    m = GPT_PRESETS[name]
    lay = mem.Layout(tp=t, sp=sp, checkpoint=recompute, micro_batch=2)
    got = mem.layer_activation_bytes(m, lay, mem.PRECISIONS["master"])
    expected = mem.korthikanti(s=2048, b=2, h=m.d_model, a=m.heads, t=t, sp=sp, recompute=recompute)
    assert got == pytest.approx(expected, rel=1e-12)
    if (t, sp, recompute) == (1, False, "none"):  # sbh(34 + 5as/h), written out
        assert got == pytest.approx(2048 * 2 * m.d_model * (34 + 5 * m.heads * 2048 / m.d_model), rel=1e-12)


def test_pipeline_in_flight_microbatches():
    m = GPT_PRESETS["gpt-175b"]
    prec = mem.PRECISIONS["master"]
    per_layer = mem.korthikanti(s=2048, b=1, h=12288, a=96, t=8, sp=True, recompute="selective")
    for schedule, chunks, m_, layers in (("1f1b", 1, 64, 96), ("1f1b", 1, 4, 12 * 4), ("gpipe", 1, 64, 12 * 64),
                                         ("interleaved", 2, 64, 96 * (1 + 7 / 16))):
        lay = mem.Layout(tp=8, pp=8, sp=True, schedule=schedule, chunks=chunks, microbatches=m_, checkpoint="selective")
        first = mem._stage_memory(m, lay, prec, capacity=80e9, stage="first")
        assert first.parts["layers"] == pytest.approx(layers * per_layer), schedule


def test_autocast_weight_copies_per_microbatch_in_flight():
    # By hand, SMALL: block matmuls 576 per block, 2 blocks -> 1152; head 100·8 = 800 (the embedding and norms
    # are not cast) -> 1952 weights autocast casts to 2 bytes; fp32 weights cast nothing.
    bf16, fp32 = mem.PRECISIONS["autocast"], mem.PRECISIONS["fp32"]
    gpipe = mem.Layout(schedule="gpipe", microbatches=4)  # pp = 1: every forward before the first backward
    seq = mem.Layout(microbatches=4)  # gradient accumulation (parallel train's 1f1b at pp = 1, bench e2e)
    got = {(name, p.name): mem.memory(SMALL, lay, p, capacity=80e9) for name, lay in (("gpipe", gpipe), ("seq", seq))
           for p in (bf16, fp32)}
    assert got["gpipe", "autocast"].parts["autocast weight copies"] == 4 * 1952 * 2
    assert got["seq", "autocast"].parts["autocast weight copies"] == 1952 * 2
    assert got["gpipe", "fp32"].parts["autocast weight copies"] == got["seq", "fp32"].parts["autocast weight copies"] == 0
    one = mem.memory(SMALL, mem.Layout(micro_batch=4), bf16, capacity=80e9)  # bench e2e: one micro-batch of 4
    assert one.parts["autocast weight copies"] == 1952 * 2
    # the activations of GPipe's four micro-batches, the head's (logits) included, are held together
    for p in ("autocast", "fp32"):
        assert got["gpipe", p].parts["layers"] == 4 * got["seq", p].parts["layers"]
        assert got["gpipe", p].parts["embedding and head"] == 4 * got["seq", p].parts["embedding and head"]
        # at the end of the forwards (no gradient yet under GPipe; all of them in accumulation's later ones)
        gpipe_fwd, seq_fwd = (got[k, p].parts["phases"]["forward"] for k in ("gpipe", "seq"))
        assert gpipe_fwd - seq_fwd == pytest.approx(
            3 * (got["seq", p].parts["layers"] + got["seq", p].parts["embedding and head"])
            + 3 * got["seq", p].parts["autocast weight copies"] - got["seq", p].parts["gradients (all)"])
    # full recomputation saves no block's copy: the blocks' live in autocast's cache through one forward,
    # the head's are saved per micro-batch
    full = mem.memory(SMALL, replace(gpipe, checkpoint="full"), bf16, capacity=80e9)
    assert full.parts["autocast weight copies"] == 1152 * 2 + 4 * 800 * 2
    # 1F1B on 2 stages, 4 micro-batches: the first stage holds 2 micro-batches' copies of its block, the last 1
    lay = mem.Layout(pp=2, schedule="1f1b", microbatches=4)
    assert mem.autocast_copies(SMALL, lay, bf16, stage="first") == 2 * 576 * 2
    assert mem.autocast_copies(SMALL, lay, bf16, stage="last") == (576 + 800) * 2
    with pytest.raises(LmsysError, match="schedule '1f1b' with pp=1"):
        mem.check_layout(SMALL, mem.Layout(schedule="1f1b"))


def test_autocast_casts_in_the_time_model_by_hand():
    # per micro-batch and block: forward read 4 + write 2 bytes per matmul weight (576), backward the
    # gradient's read 2 + write 4; the head's 800 likewise; full recomputation casts the blocks again.
    bf16 = mem.PRECISIONS["autocast"]
    no_cast = replace(bf16, cast=0)
    rates = _rates()  # 100 GB/s -> 1e8 bytes per ms
    lay = mem.Layout(microbatches=3, checkpoint="full")
    st, st0 = (ptime.step_time(SMALL, lay, p, rates, gpus_per_node=1) for p in (bf16, no_cast))
    assert st.parts["autocast casts block ms"] == pytest.approx(12 * 576 / 1e8)
    assert st0.parts["autocast casts block ms"] == 0
    assert st.compute - st0.compute == pytest.approx(3 * (2 * 12 * 576 + 12 * 800) / 1e8)
    assert st.recompute - st0.recompute == pytest.approx(3 * 2 * 6 * 576 / 1e8)
    fp32 = ptime.step_time(SMALL, lay, mem.PRECISIONS["fp32"], rates, gpus_per_node=1)
    assert fp32.parts["autocast casts block ms"] == 0


def test_llama_yaml_and_lmsys_presets(tmp_path):
    f = tmp_path / "llama.yaml"
    f.write_text("vocab_size: 128256\nhidden_size: 4096\nintermediate_size: 14336\nnum_hidden_layers: 32\n"
                 "num_attention_heads: 32\nnum_key_value_heads: 8\nmax_position_embeddings: 8192\n"
                 "hidden_act: silu\nrms_norm_eps: 1.0e-5\ntie_word_embeddings: false\n")
    shape = load_shape(str(f))
    assert (shape.kv_dim, shape.seq, shape.mlp) == (1024, 8192, "swiglu")
    assert params(shape) == 8_030_261_248  # Llama 3 8B's published count
    from lmsys.model.config import PRESETS, parameter_count_formula

    for name, cfg in PRESETS.items():
        assert params(load_shape(name)) == parameter_count_formula(cfg), name
    with pytest.raises(LmsysError, match="missing sizes d_ff"):
        from_mapping({"vocab_size": 1, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2}, name="x")


def test_flops_per_token_is_core_flops_convention():
    from lmsys.core.flops import model_flops_per_token
    from lmsys.model.config import PRESETS
    from lmsys.plan.shape import flops_per_token

    cfg = PRESETS["xl"]
    shape = load_shape("xl")
    assert flops_per_token(shape) == model_flops_per_token(
        d_model=cfg.d_model, d_ff=cfg.d_ff, num_layers=cfg.num_layers, vocab_size=cfg.vocab_size,
        seq_len=cfg.context_length, backward=True)


# --------------------------------------------------------------------------------------------- time

A100 = hardware.GPUS["A100 80GB SXM"]


def test_bubble_and_interleaving():
    m = GPT_PRESETS["gpt-175b"]
    prec, rates = mem.PRECISIONS["master"], ptime.table_rates(A100, "bf16")
    lay = mem.Layout(tp=8, pp=8, sp=True, schedule="1f1b", microbatches=64, checkpoint="selective")
    st = ptime.step_time(m, lay, prec, rates, gpus_per_node=8)
    assert st.bubble == pytest.approx(7 * st.parts["stage ms per micro-batch"])
    inter = ptime.step_time(m, mem.Layout(tp=8, pp=8, sp=True, schedule="interleaved", chunks=2, microbatches=64,
                                          checkpoint="selective"), prec, rates, gpus_per_node=8)
    assert inter.bubble == pytest.approx(7 / 2 * inter.parts["stage ms per micro-batch"])
    # one block by hand: forward matmuls 24·s·h²/t at 0.770 × 312 TFLOP/s (the table's curve), scores likewise
    gemm = 2 * 2048 * 12 * 12288**2 / 8 / (0.770 * 312e9)
    assert st.parts["fwd block ms"] > gemm and st.parts["bwd block ms"] > 2 * gemm


@pytest.mark.parametrize("name, pp, batch, published", [("gpt-22b", 1, 4, 41.5), ("gpt-175b", 8, 64, 51.4),
                                                        ("gpt-530b", 35, 280, 56.0), ("gpt-1t", 64, 512, 56.3)])
def test_korthikanti_mfu_within_15_percent(name, pp, batch, published):
    # docs/plan.md's table: A100 80GB, TP 8, SP + selective recomputation, micro-batch 1, 1F1B.
    m = GPT_PRESETS[name]
    lay = mem.Layout(tp=8, pp=pp, sp=True, schedule="1f1b" if pp > 1 else "none", microbatches=batch,
                     checkpoint="selective")
    st = ptime.step_time(m, lay, mem.PRECISIONS["master"], ptime.table_rates(A100, "bf16"), gpus_per_node=8)
    predicted = 100 * ptime.mfu(st, gpus=8 * pp, peak_tflops=312.0)
    assert abs(predicted - published) / published < 0.15
    assert mem.memory(m, lay, mem.PRECISIONS["master"], capacity=80e9).headroom > 0  # they ran


def test_korthikanti_runs_are_device_bound():
    # the host terms are for small steps: on the published runs the host hides under the device
    for name, pp, batch in (("gpt-22b", 1, 4), ("gpt-175b", 8, 64), ("gpt-1t", 64, 512)):
        lay = mem.Layout(tp=8, pp=pp, sp=True, schedule="1f1b" if pp > 1 else "none", microbatches=batch,
                         checkpoint="selective")
        st = ptime.step_time(GPT_PRESETS[name], lay, mem.PRECISIONS["master"], ptime.table_rates(A100, "bf16"),
                             gpus_per_node=8)
        assert st.host == 0.0
        assert st.parts["host fwd ms"] < st.parts["fwd block ms"] * GPT_PRESETS[name].layers / pp


def test_optimizer_bytes_by_hand():
    # read the gradient 4, read + write the fp32 parameter 8, both moments 16; a master copy also writes the
    # 16-bit weights (2); gradients are set to None, never zeroed
    assert ptime.optimizer_bytes(mem.PRECISIONS["fp32"]) == 28
    assert ptime.optimizer_bytes(mem.PRECISIONS["autocast"]) == 28
    assert ptime.optimizer_bytes(mem.PRECISIONS["master"]) == 30


def _rates(**kw):
    base = dict(matmul_tflops=1.0, attention_tflops=1.0, hbm_GBps=100.0, intra_GBps=10.0, inter_GBps=None,
                latency_us=0.0, source="test")
    return ptime.Rates(**{**base, **kw})


def test_elementwise_bytes_by_hand():
    # SMALL: s 4, b 2, h 8, f 16, kv_dim 4, a 2; fp32 (act = residual = 4); no TP.
    prec = mem.PRECISIONS["fp32"]
    sbh, sbf, skv, ass = 4 * 2 * 8, 4 * 2 * 16, 4 * 2 * 4, 2 * 4 * 4 * 2
    # two RMSNorms r/w (2·2·4), two residual adds r2 w1 (2·3·4); RoPE r/w on Q (sbh) and K (kv) 2·4;
    # SiLU r/w and the gate product r2 w1 on sbf: 5·4
    outside = (16 + 24) * sbh + 8 * (sbh + skv) + 20 * sbf
    naive_shape = replace(SMALL, attention="naive")
    naive = ptime.elementwise_bytes(naive_shape, b=2, prec=prec, tp=1, sp=False)
    # naive attention over the s×s scores: scale, mask, fp32 softmax, cast: (6·4 + 8) bytes an element
    assert naive == (outside, 32 * ass)
    flash = ptime.elementwise_bytes(SMALL, b=2, prec=prec, tp=1, sp=False)
    assert flash == (outside, 0.0)  # the fused kernel moves no s×s scores
    fused = ptime.elementwise_bytes(replace(SMALL, attention="materialized"), b=2, prec=prec, tp=1, sp=False)
    assert fused == (outside, 2 * 4 * ass)  # one fused softmax r/w
    st_naive = ptime.step_time(naive_shape, mem.Layout(micro_batch=2), prec, _rates(launch_us=0.0), gpus_per_node=1)
    assert st_naive.parts["elementwise fwd block ms"] == pytest.approx((outside + 32 * ass) / 100e9 * 1e3)
    st = ptime.step_time(naive_shape, mem.Layout(micro_batch=2), prec, _rates(launch_us=0.0, elementwise_GBps=50.0),
                         gpus_per_node=1)
    assert st.parts["elementwise fwd block ms"] == pytest.approx((outside + 32 * ass) / 50e9 * 1e3)


def test_attention_kind_comes_from_attn_impl():
    from lmsys.model.config import get_config
    from lmsys.plan.shape import from_model_config

    cfg = get_config("tiny")
    assert from_model_config(cfg, name="t").attention == "naive"
    assert from_model_config(replace(cfg, attn_impl="sdpa"), name="t").attention == "flash"
    assert from_model_config(replace(cfg, attn_impl="flash-triton"), name="t").attention == "flash"
    assert from_model_config(replace(cfg, attn_impl="compiled"), name="t").attention == "materialized"


def test_optimizer_and_host_terms_by_hand():
    prec = mem.PRECISIONS["fp32"]
    ops = ptime.OpCounts(fwd_layer=10, bwd_layer=20, recompute_layer=15, fwd_other=3, bwd_other=5, opt_base=2,
                         opt_per_tensor=4)
    # SMALL's tensors: per block fused QKV, output, 3 MLP matmuls, 2 norms = 7, two blocks, + embedding,
    # final norm, head = 17; 2792 parameters
    assert ptime.param_tensors(SMALL, mem.Layout()) == 17
    lay = mem.Layout(checkpoint="full")
    cpu = ptime.step_time(SMALL, lay, prec, _rates(launch_us=100.0, overlap=False, ops=ops, optimizer_GBps=2.0),
                          gpus_per_node=1)
    fwd, bwd, opt = (2 * 10 + 3) * 0.1, (2 * (20 + 15) + 5) * 0.1, (2 + 4 * 17) * 0.1
    assert (cpu.parts["host fwd ms"], cpu.parts["host bwd ms"], cpu.parts["host optimizer ms"]) == \
        pytest.approx((fwd, bwd, opt))
    assert cpu.optimizer == pytest.approx(2792 * 28 / 2e9 * 1e3)
    assert cpu.host == pytest.approx(fwd + bwd + opt)  # a CPU: host and device one after the other
    gpu = ptime.step_time(SMALL, lay, prec, _rates(launch_us=100.0, ops=ops, optimizer_GBps=2.0), gpus_per_node=1)
    # a GPU: each phase is max(device, host); the device's work here is far below the host's
    dev_fwd = 2 * gpu.parts["fwd block ms"] + gpu.parts["head ms"] / 3 + (gpu.compute - 2 * (
        gpu.parts["fwd block ms"] + gpu.parts["bwd block ms"]) - gpu.parts["head ms"]) / 3
    assert gpu.host == pytest.approx(fwd + bwd + opt - gpu.compute - gpu.recompute - gpu.optimizer)
    assert gpu.total == pytest.approx(fwd + bwd + opt)
    assert 0 < dev_fwd < fwd
    # a device-bound step: no host term at all
    slow = ptime.step_time(SMALL, lay, prec, _rates(matmul_tflops=1e-6, launch_us=100.0, ops=ops,
                                                    optimizer_GBps=1e-4), gpus_per_node=1)
    assert slow.host == 0.0
    # host-bound forward and backward, a device-bound optimizer (10 ms): one stage, so the host's launches of
    # the next forward run under the optimizer: the step is the longer total, not the sum of per-phase maxima
    mixed = ptime.step_time(SMALL, lay, prec, _rates(launch_us=100.0, ops=ops, optimizer_GBps=2792 * 28 / 1e-2 / 1e9),
                            gpus_per_node=1)
    assert mixed.optimizer == pytest.approx(10.0)
    assert mixed.total == pytest.approx(max(fwd + bwd + opt, mixed.compute + mixed.recompute + 10.0))
    # stages pace each other per micro-batch: there each phase is max(device, host), the optimizer's too
    staged = ptime.step_time(SMALL, mem.Layout(checkpoint="full", pp=2, microbatches=2), prec,
                             _rates(launch_us=100.0, ops=ops, optimizer_GBps=2792 * 28 / 1e-2 / 1e9), gpus_per_node=2)
    assert staged.host == pytest.approx(2 * (staged.parts["host fwd ms"] + staged.parts["host bwd ms"])
                                        - staged.compute - staged.recompute, rel=1e-6)


def test_matmul_rates_by_shape_by_hand():
    from lmsys.plan.shape import block_gemms, head_gemm, layer_matmul_params

    # SMALL at b 1, s 4: QKV 4×8·8×16 (Q 8 + K, V one head of 4 each), out 4×8·8×8, gate and up 4×8·8×16,
    # down 4×16·16×8, head 4×8·8×100; their FLOPs are the block's 2·tokens·matmul weights
    gemms = block_gemms(SMALL, tokens=4)
    assert gemms == [("QKV", 4, 8, 16), ("attention out", 4, 8, 8), ("MLP gate", 4, 8, 16), ("MLP up", 4, 8, 16),
                     ("MLP out", 4, 16, 8)]
    assert sum(2 * M * K * N for _, M, K, N in gemms) == 2 * 4 * layer_matmul_params(SMALL)
    assert block_gemms(SMALL, tokens=4, tp=2)[:2] == [("QKV", 4, 8, 8), ("attention out", 4, 4, 8)]
    assert head_gemm(SMALL, tokens=4, tp=2) == ("LM head", 4, 8, 50)
    # rates by shape: each matmul at its nearest measured shape (log space), forward and backward apart;
    # none measured: the one matmul rate
    flat = _rates(matmul_tflops=2.0)
    shaped = _rates(matmul_tflops=2.0, gemm=((4, 8, 16, 1.0, 4.0), (4, 16, 8, 0.5, 0.5), (4, 8, 100, 2.0, 2.0)))
    assert flat.matmul_ms(4, 8, 16) == pytest.approx(2 * 4 * 8 * 16 / 2e9)
    assert shaped.matmul_ms(4, 8, 16) == pytest.approx(2 * 4 * 8 * 16 / 1e9)
    assert shaped.matmul_ms(4, 8, 16, backward=True) == pytest.approx(4 * 4 * 8 * 16 / 4e9)
    assert shaped.matmul_ms(4, 8, 8) == pytest.approx(2 * 4 * 8 * 8 / 1e9)  # nearest: 4×8·8×16
    assert shaped.matmul_ms(4, 16, 8) == pytest.approx(2 * 4 * 16 * 8 / 0.5e9)
    prec, lay = mem.PRECISIONS["fp32"], mem.Layout()
    a, b = (ptime.step_time(SMALL, lay, prec, r, gpus_per_node=1) for r in (flat, shaped))
    expect = sum(shaped.matmul_ms(M, K, N) - flat.matmul_ms(M, K, N) for _, M, K, N in gemms)
    assert a.parts["fwd block ms"] + expect == pytest.approx(b.parts["fwd block ms"])
    expect = sum(shaped.matmul_ms(M, K, N, backward=True) - flat.matmul_ms(M, K, N, backward=True) for _, M, K, N in gemms)
    assert a.parts["bwd block ms"] + expect == pytest.approx(b.parts["bwd block ms"])
    # s×s products (naive attention): QKᵀ and ·V over batch × heads at the nearest measured shape
    naive = replace(SMALL, attention="naive")
    scored = replace(flat, scores=((2, 4, 4, 0.25, 0.5),))
    c, d = (ptime.step_time(naive, lay, prec, r, gpus_per_node=1) for r in (flat, scored))
    fwd_flops = 4 * 2 * 4 * 4 * 4  # 2 products of 2·s·s·d over 2 heads
    assert d.parts["fwd block ms"] - c.parts["fwd block ms"] == pytest.approx(fwd_flops / 0.25e9 - fwd_flops / 2e9)
    assert d.parts["bwd block ms"] - c.parts["bwd block ms"] == pytest.approx(2 * fwd_flops / 0.5e9 - 2 * fwd_flops / 2e9)


def test_collective_times_from_measured_points_and_from_the_table():
    # measured all-reduce busbw on 2 ranks at 1 KiB and 1 MiB: t = bytes · 2(n-1)/n / busbw = bytes / busbw
    measured = _rates(busbw={2: {1024: 1024 / 1e6, 2**20: 2**20 / 4e6}}, latency_us=50.0)  # 1 ms, 4 ms
    assert measured.collective_ms("all-reduce", 2, nbytes=1024) == pytest.approx(1.0)
    assert measured.collective_ms("all-reduce", 2, nbytes=16) == pytest.approx(1.0)  # below: the latency floor
    middle = (1024 + 2**20) / 2
    assert measured.collective_ms("all-reduce", 2, nbytes=middle) == pytest.approx(2.5)  # linear between
    assert measured.collective_ms("all-reduce", 2, nbytes=2**22) == pytest.approx(16.0)  # above: the last busbw
    # the others by their bus factor on 2 ranks (all-gather, reduce-scatter 1/2; a send 1), no latency added
    assert measured.collective_ms("all-gather", 2, nbytes=2**20) == pytest.approx(2.0)
    assert measured.collective_ms("send", 2, nbytes=2**20) == pytest.approx(4.0)
    # not measured on 4 ranks: the table's 10 GB/s and 50 µs a collective (two for an all-reduce)
    assert measured.collective_ms("all-reduce", 4, nbytes=1e6) == pytest.approx(1e6 * 1.5 / 1e7 + 0.1)
    assert measured.collective_ms("reduce-scatter", 4, nbytes=1e6) == pytest.approx(1e6 * 0.75 / 1e7 + 0.05)
    with pytest.raises(LmsysError, match="no bandwidth between 4 ranks"):
        _rates(intra_GBps=0.0, busbw={2: {1024: 1.0}}).collective_ms("all-reduce", 4, nbytes=1e6)


def test_recomputation_repeats_host_ops_and_forward_flops_by_hand():
    # SMALL with naive attention, fp32, micro-batch 1 × 3 micro-batches, 2 blocks; 1 TFLOP/s, 100 GB/s,
    # 0.1 ms per op on a CPU (host and device one after the other).
    m, prec = replace(SMALL, attention="naive"), mem.PRECISIONS["fp32"]
    ops = ptime.OpCounts(fwd_layer=10, bwd_layer=20, recompute_layer=15, recompute_core=7, fwd_other=3, bwd_other=5,
                         opt_base=2, opt_per_tensor=4)
    rates = _rates(launch_us=100.0, overlap=False, ops=ops, optimizer_GBps=2.0)
    st = {c: ptime.step_time(m, mem.Layout(microbatches=3, checkpoint=c), prec, rates, gpus_per_node=1)
          for c in ("none", "selective", "full")}
    # host per micro-batch: forward (2·10 + 3) ops; backward (2·20 + 5), + 2·7 (selective: the attention core
    # again), + 2·15 (full: the block's forward again); the optimizer (2 + 4·17) once per step
    fwd, opt = 23 * 0.1, 70 * 0.1
    for c, bwd_ops in (("none", 45), ("selective", 59), ("full", 75)):
        assert st[c].parts["host bwd ms"] == pytest.approx(bwd_ops * 0.1)
        assert st[c].host == pytest.approx(3 * (fwd + bwd_ops * 0.1) + opt)
    # a calibrated rate for the recomputed ops (the checkpoint's Python with them): 0.3 ms each, the rest 0.1
    slow_again = replace(rates, launch_us_recompute=300.0)
    for c, again in (("none", 0), ("selective", 14), ("full", 30)):
        got = ptime.step_time(m, mem.Layout(microbatches=3, checkpoint=c), prec, slow_again, gpus_per_node=1)
        assert got.parts["host bwd ms"] == pytest.approx(45 * 0.1 + again * 0.3)
    # device, one block, one micro-batch (s 4, b 1, h 8): matmuls 2·4·576 = 4608 FLOPs, scores 4·1·4²·8 = 512;
    # elementwise 2944 bytes outside the core, 32 B × 32 score elements in it (test_elementwise_bytes_by_hand)
    attn_fwd, core = 512 / 1e9, 1024 / 1e8
    block_fwd = (4608 + 512) / 1e9 + (2944 + 1024) / 1e8
    assert st["none"].parts["fwd block ms"] == pytest.approx(block_fwd)
    # recomputation: 1x the block's forward (full) or the core's forward (selective), per block per
    # micro-batch, counted once: not in compute, not in MFU's model FLOPs
    assert st["none"].recompute == 0.0
    assert st["full"].recompute == pytest.approx(3 * 2 * block_fwd)
    assert st["selective"].recompute == pytest.approx(3 * 2 * (attn_fwd + core))
    for c in ("selective", "full"):
        assert st[c].compute == pytest.approx(st["none"].compute) and st[c].flops == st["none"].flops
        assert st[c].total - st["none"].total == pytest.approx(st[c].recompute + st[c].host - st["none"].host)
    # data parallelism overlaps the whole backward, recomputation included: dp 2, ZeRO-0, 2792 fp32
    # gradients all-reduced over 10 GB/s, no latency: 2 × 2792·4/2 bytes / 1e7 bytes per ms
    block_bwd = 2 * (4608 + 512) / 1e9 + 2 * (2944 + 1024) / 1e8
    allreduce = 2 * 2792 * 4 / 2 / 1e7
    for c, hidden in (("none", 2 * block_bwd), ("full", 2 * (block_bwd + block_fwd))):
        dp = ptime.step_time(m, mem.Layout(dp=2, checkpoint=c), prec, rates, gpus_per_node=2)
        assert dp.dp_comm == pytest.approx(allreduce - hidden)


# ------------------------------------------------------------------------------------------- search

def _cluster(gpus, name="H100 SXM"):
    return srch.Cluster(hardware.GPUS[name], gpus, 8)


def test_search_ranks_fitting_layouts_by_tokens_per_second():
    m = load_shape("2.7b")
    prec = mem.PRECISIONS["master"]
    rates = ptime.table_rates(hardware.GPUS["A100 40GB SXM"], "bf16")
    plans = srch.search(m, prec=prec, rates=rates, cluster=_cluster(8, "A100 40GB SXM"), global_batch=32,
                        peak_tflops=312.0)
    speeds = [p.tokens_per_s_per_gpu for p in plans]
    assert speeds == sorted(speeds, reverse=True) and all(p.fits for p in plans)
    every = list(srch.candidates(m, gpus=8, gpus_per_node=8, global_batch=32, fixed={}))
    evaluated = [srch.evaluate(m, lay, prec, rates, _cluster(8, "A100 40GB SXM"), peak_tflops=312.0) for lay in every]
    assert len(plans) == sum(p.fits for p in evaluated) < len(evaluated)  # some do not fit, and are dropped
    for lay in every:
        assert lay.gpus == 8 and lay.global_batch == 32 and m.heads % lay.tp == 0 and m.layers % lay.pp == 0


def test_nothing_fits_says_what_overflows_and_by_how_much():
    m = load_shape("10b")
    rates = ptime.table_rates(hardware.GPUS["A100 40GB SXM"], "bf16")
    with pytest.raises(LmsysError, match=r"nothing fits on 1 × A100 40GB SXM: the closest layout .* needs [\d.]+ GiB "
                                         r"per GPU .*, [\d.]+ GiB over the 37.3 GiB it has \(weights"):
        srch.search(m, prec=mem.PRECISIONS["master"], rates=rates, cluster=_cluster(1, "A100 40GB SXM"),
                    global_batch=8, peak_tflops=312.0)


def test_mesh_that_does_not_divide_the_model_says_which():
    m = load_shape("xl")  # 25 heads, 48 layers
    rates = ptime.table_rates(hardware.GPUS["H100 SXM"], "bf16")
    with pytest.raises(LmsysError, match=r"tp=2 does not divide heads \(25\).*pp=5 does not divide layers \(48\)"):
        srch.search(m, prec=mem.PRECISIONS["master"], rates=rates, cluster=_cluster(10), global_batch=10,
                    peak_tflops=989.5, fixed=srch.parse_mesh("dp=1,tp=2,pp=5"))
    with pytest.raises(LmsysError, match="is 4 GPUs, not the 8"):
        srch.search(m, prec=mem.PRECISIONS["master"], rates=rates, cluster=_cluster(8), global_batch=8,
                    peak_tflops=989.5, fixed=srch.parse_mesh("dp=2,tp=1,pp=2"))
    with pytest.raises(LmsysError, match="--mesh: cannot read 'xx=1'"):
        srch.parse_mesh("dp=2,xx=1")


# ---------------------------------------------------------------------------------------------- CLI

def test_plan_train_cli(lmsys, tmp_path):
    import json

    r = lmsys("plan", "train", "--size", "medium", "--gpus", "4", "--gpu", "NVIDIA H100 80GB HBM3",
              "--global-batch", "16", "--top", "3", "--format", "json")
    assert r.code == 0, r.err
    out = json.loads(r.out)
    rows = out["rows"]
    assert len(rows) == 3 and rows[0]["tokens/s/GPU"] >= rows[1]["tokens/s/GPU"] >= rows[2]["tokens/s/GPU"]
    assert out["meta"]["MFU peak"] == "H100 SXM dense bf16 989.5 TFLOP/s"
    for row in rows:
        parts = sum(row[k] for k in ("compute ms", "recompute ms", "tp comm ms", "pp comm ms", "dp comm ms",
                                     "bubble ms", "optimizer ms", "host ms"))
        assert row["step ms"] == pytest.approx(parts)
    r = lmsys("plan", "train", "--size", "tiny", "--gpu", "V100", "--format", "json")
    assert r.code == 2 and "unknown GPU 'V100'; known: B200" in r.err
    r = lmsys("plan", "train", "--size", "xl", "--gpus", "2", "--gpu", "h100", "--mesh", "tp=2")
    assert r.code == 2 and "tp=2 does not divide heads (25)" in r.err
    cluster = tmp_path / "c.yaml"
    cluster.write_text("gpu: H100 SXM\ngpus: 16\ngpus_per_node: 8\nnetwork_GBps: 25\n")
    r = lmsys("plan", "train", "--size", "small", "--cluster", str(cluster), "--mesh", "dp=16,zero=3,mb=1",
              "--global-batch", "16", "--format", "json")
    assert r.code == 0, r.err
    assert {row["mesh"] for row in json.loads(r.out)["rows"]} == {"dp16 tp1 pp1"}


def test_plan_train_terminal_view_groups_columns_and_files_keep_them(lmsys):
    import io
    import json

    from lmsys.core.results import Report, print_rich, to_csv
    from lmsys.plan.train import GROUPS, plan_train

    rows, meta, _, notes = plan_train(size="small", gpus=4, gpu="H100", global_batch=8, top=2)
    report = Report("plan train", rows, meta, notes, groups=GROUPS)
    cols, shown = report.terminal_view()
    assert len(report.columns) == 25 and len(cols) == 25 - 2 - 6 - 8 + 3  # memory peak: a column of its own
    assert report.columns[report.columns.index("headroom GiB") + 1] == "memory peak"
    assert cols.index("memory GiB (w/g/o/a/b/free)") == report.columns.index("weights GiB") - 1  # mb/size took 2
    parts = shown[0]["ms (comp/recomp/tp/pp/dp/bubble/opt/host)"].split("/")
    assert [float(p) for p in parts] == pytest.approx([rows[0][k] for k in GROUPS[2][1]], rel=5e-3, abs=1e-3)
    buf = io.StringIO()
    print_rich(report, file=buf)
    assert "memory GiB (w/g/o/a/b/free)" in buf.getvalue() and "weights GiB" not in buf.getvalue()
    header = next(line for line in to_csv(report).splitlines() if line.startswith("mesh"))
    assert header.count("GiB") == 6  # files keep a column each
    plain = Report("other", [{"a": 1.0, "b": 2.0}], groups=[("a/c", ("a", "c"))])  # a group missing a column
    assert plain.terminal_view()[0] == ["a", "b"]
    r = lmsys("plan", "train", "--size", "small", "--gpus", "4", "--gpu", "H100", "--top", "1", "--format", "json")
    assert "weights GiB" in json.loads(r.out)["rows"][0]


def test_help_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys; from lmsys.cli import app; assert 'torch' not in sys.modules; print('ok')"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "ok"


# ---------------------------------------------------------------------------- calibrate and validate

def test_calibrate_then_validate_on_the_cpu(lmsys, tmp_path):
    import json

    import yaml

    model = tmp_path / "micro.yaml"
    model.write_text("d_model: 32\nd_ff: 64\nnum_layers: 1\nnum_heads: 2\nvocab_size: 80\ncontext_length: 32\n")
    profile = tmp_path / "cpu.yaml"
    r = lmsys("plan", "calibrate", "--size", str(model), "--device", "cpu", "--profile", str(profile),
              "--warmup", "0", "--steps", "2", "--format", "json")
    assert r.code == 0, r.err
    prof, rows = yaml.safe_load(profile.read_text()), json.loads(r.out)["rows"]
    # the model's matmuls as it runs them (QKV, output, SwiGLU's gate and up of one shape, down, LM head),
    # forward and backward apart, each shape in the profile with both rates
    matmuls = [row for row in rows if row["what"].startswith("matmul")]
    assert [row["what"] for row in matmuls[::2]] == ["matmul QKV", "matmul attention out", "matmul MLP gate / MLP up",
                                                     "matmul MLP out", "matmul LM head"]
    assert all(row["what"] == fwd["what"] + " backward" for fwd, row in zip(matmuls[::2], matmuls[1::2]))
    assert [point[:3] for point in prof["gemm_tflops"]["fp32"]] == [[32, 32, 96], [32, 32, 32], [32, 32, 64],
                                                                    [32, 64, 32], [32, 32, 80]]
    for (M, K, N, fwd, bwd), row, back in zip(prof["gemm_tflops"]["fp32"], matmuls[::2], matmuls[1::2]):
        assert fwd == pytest.approx(2 * M * K * N / row["ms"] / 1e9) == pytest.approx(row["TFLOP/s"])
        assert bwd == pytest.approx(4 * M * K * N / back["ms"] / 1e9) == pytest.approx(back["TFLOP/s"])
    # naive attention: its s×s products timed at the model's heads, sequence and head size
    (point,) = prof["scores_tflops"]["fp32"]
    assert point[:3] == [2, 32, 16] and min(point[3:]) > 0
    # all-reduce on 2 gloo processes through lmsys.bench.comm's job: every size, positive; the latency is the
    # smallest size's time; busbw grows from 1 KiB (latency-bound) to 4 MiB
    from lmsys.plan.calibrate import CPU_BUSBW_SIZES

    comm = [row for row in rows if row["what"] == "all-reduce on 2 processes (gloo)"]
    assert sorted(prof["busbw"]) == [2] and sorted(prof["busbw"][2]) == list(CPU_BUSBW_SIZES) == sorted(CPU_BUSBW_SIZES)
    assert len(comm) == len(CPU_BUSBW_SIZES) and all(row["ms"] > 0 and row["GB/s"] > 0 for row in comm)
    assert [row["GB/s"] for row in comm] == [prof["busbw"][2][size] for size in CPU_BUSBW_SIZES]
    assert prof["latency_us"] == pytest.approx(comm[0]["ms"] * 1e3)
    assert prof["busbw"][2][CPU_BUSBW_SIZES[-1]] > prof["busbw"][2][CPU_BUSBW_SIZES[0]]
    # the time model's all-reduce on 2 ranks is the measured time at each size (busbw = bytes · 2(n-1)/n / t)
    from lmsys.plan.profile import rates as profile_rates

    rates = profile_rates(prof, "fp32")
    for size, row in zip(CPU_BUSBW_SIZES, comm):
        assert rates.collective_ms("all-reduce", 2, nbytes=size) == pytest.approx(row["ms"], rel=1e-9)
    # the profile's matmul rate is all the GEMMs' FLOPs over all their time
    flops = sum(row["TFLOP/s"] * row["ms"] for row in matmuls)
    assert prof["matmul_tflops"]["fp32"] == pytest.approx(flops / sum(row["ms"] for row in matmuls), rel=1e-9)
    assert prof["hbm_GBps"] > 0 and prof["attention_tflops"]["fp32"] > 0
    assert prof["elementwise_GBps"] > 0 and prof["optimizer_GBps"] > 0 and prof["host_overlap"] is False
    host = next(row for row in rows if row["what"] == "host, per dispatched op")
    assert prof["launch_us"]["fp32"] == pytest.approx(host["µs/op"]) and host["µs/op"] > 0
    again = next(row for row in rows if row["what"] == "host, per recomputed op")
    assert prof["launch_us_recompute"]["fp32"] == pytest.approx(again["µs/op"]) and again["µs/op"] > 0
    assert profile_rates(prof, "fp32").launch_us_recompute == pytest.approx(again["µs/op"])
    assert prof["ops"]["fp32"]["fwd_layer"] > 20 and prof["ops"]["fp32"]["opt_per_tensor"] > 0  # AdamW, not fused
    # plan train takes the CPU's facts from its profile: its RAM as the capacity, its measured matmul rate
    # as the peak MFU divides by (said in the header), no --gpu needed
    assert prof["memory_GB"] > 0
    r = lmsys("plan", "train", "--profile", str(profile), "--size", str(model), "--dtype", "fp32", "--format", "json")
    assert r.code == 0, r.err
    train = json.loads(r.out)
    assert f"{prof['memory_GB']:g} GB each" in train["meta"]["cluster"] and "measured matmul rate" in train["meta"]["MFU peak"]
    assert train["rows"] and all(row["MFU %"] > 0 for row in train["rows"])
    r = lmsys("plan", "validate", "--profile", str(profile), "--size", str(model), "--device", "cpu",
              "--warmup", "0", "--steps", "1", "--mesh", "none", "--format", "json")
    assert r.code == 0, r.err
    out = json.loads(r.out)
    assert [(row["checkpoint"], row["status"]) for row in out["rows"]] == [("none", "ok"), ("block", "ok")]
    for row in out["rows"]:
        assert row["predicted ms"] > 0 and row["measured ms"] > 0 and row["measured MiB"] is None
        assert "time spread %" not in row and row["bound"] == "host"  # one run; a CPU: the host computes
        assert row["time error %"] == pytest.approx(100 * (row["predicted ms"] - row["measured ms"]) / row["measured ms"])
    assert any("memory: not measurable here" in note for note in out["notes"])
    errs = [abs(row["time error %"]) for row in out["rows"]]
    assert f"max {max(errs):.1f} %" in " ".join(out["notes"])
    # --host-rate beside (the default): the host's cost per op measured around the size's rows, in this
    # process, stands in for the profile's; the rest of the prediction is the profile's
    from lmsys.model.config import get_config
    from lmsys.plan.shape import from_model_config

    none = out["rows"][0]
    assert none["host µs/op"] > 0 and none["host µs/op"] != prof["launch_us"]["fp32"]
    beside = {**prof, "launch_us": {"fp32": none["host µs/op"]}}
    st = ptime.step_time(from_model_config(get_config(str(model)), name="micro"), mem.Layout(), mem.PRECISIONS["fp32"],
                         profile_rates(beside, "fp32"), gpus_per_node=1)
    assert none["predicted ms"] == pytest.approx(st.total, rel=1e-9)
    assert any(note.startswith("host µs/op: the host's cost per dispatched op") for note in out["notes"])


MICRO2 = "d_model: 32\nd_ff: 64\nnum_layers: 2\nnum_heads: 2\nvocab_size: 64\ncontext_length: 32\n"
CPU_PROFILE = {"device": "test cpu", "matmul_tflops": {"fp32": 0.01}, "attention_tflops": {"fp32": 0.005},
               "hbm_GBps": 5.0, "elementwise_GBps": 2.0, "optimizer_GBps": 1.0, "host_overlap": False,
               "launch_us": {"fp32": 20.0}, "busbw": {2: {1024: 0.001, 2**22: 0.5}}, "latency_us": 100.0}


def test_validate_repeats_hold_the_median_run_against_the_twins_median(monkeypatch):
    # --repeats: a row runs that many times between host twins; its median run is held against the
    # prediction from the twins' median, with the runs' spread; a run that fails fails the row
    import torch

    from lmsys.bench import e2e
    from lmsys.core.timing import Stats
    from lmsys.model.config import get_config
    from lmsys.plan import calibrate
    from lmsys.plan import validate as val
    from lmsys.plan.profile import rates as profile_rates
    from lmsys.plan.shape import from_model_config

    shape = from_model_config(get_config("tiny"), name="tiny")
    ops, _ = calibrate.host_ops(shape, device=torch.device("cpu"), dtype="fp32")
    twins = iter([10.0, 30.0, 20.0, 25.0])  # before, between the runs, after: median 22.5
    monkeypatch.setattr(calibrate, "measure_host", lambda *a, **k: (next(twins), 5.0, ops, {}))
    runs = iter([[(100, "ok"), (200, "ok")], [(200, "ok"), (260, "out of memory")], [(120, "ok"), (220, "ok")]])

    def run_e2e(workloads, **kw):
        for (_, _), (ms, status) in zip(workloads, next(runs)):
            yield {"ms/step": Stats((ms, ms + 1, ms - 1)), "peak step MiB": ms / 10, "status": status}

    monkeypatch.setattr(e2e, "run_e2e", run_e2e)
    none, block = val.e2e_rows(sizes=["tiny"], dtypes=["fp32"], checkpoints=["none", "block"], batch_size=1,
                               warmup=0, steps=3, device=torch.device("cpu"), profile=CPU_PROFILE, repeats=3)
    assert none["measured ms"] == 120 and none["measured MiB"] == 20 and none["status"] == "ok"  # the median, not the mean
    assert none["time spread %"] == pytest.approx(100 * (200 - 100) / 120)
    assert none["host µs/op"] == 22.5 and none["bound"] == "host"  # a CPU: the host's time adds in full
    twin = {**CPU_PROFILE, "launch_us": {"fp32": 22.5}, "launch_us_recompute": {"fp32": 5.0}, "ops": {"fp32": ops}}
    st = ptime.step_time(shape, mem.Layout(), mem.PRECISIONS["fp32"], profile_rates(twin, "fp32"), gpus_per_node=1)
    assert none["predicted ms"] == pytest.approx(st.total, rel=1e-9)
    assert block["status"] == "out of memory" and block["measured ms"] is None and block["time error %"] is None
    with pytest.raises(StopIteration):
        next(twins)  # four twins for three runs: before, twice between, after


def test_validate_summary_gives_the_device_bound_rows_apart():
    from lmsys.plan.validate import summary

    rows = [{"time error %": -20.0, "memory error %": 1.0, "bound": "host"},
            {"time error %": 4.0, "memory error %": -3.0, "bound": "device"},
            {"time error %": -2.0, "memory error %": None, "bound": "device"},
            {"time error %": None, "memory error %": None, "bound": None, "status": "out of memory"}]
    got = summary(rows)
    assert got["time error %"] == (pytest.approx(26 / 3), 20.0) and got["memory error %"] == (2.0, 3.0)
    assert got["device-bound time error %"] == (3.0, 4.0)
    assert "device-bound time error %" not in summary(rows[1:])  # all device-bound: nothing to give apart
    assert "host-bound time spread %" not in got  # one run each: no spread
    repeated = [{**rows[0], "time spread %": 30.0}, {**rows[1], "time spread %": 1.0},
                {**rows[0], "time spread %": 10.0}, rows[3]]
    assert summary(repeated)["host-bound time spread %"] == (20.0, 30.0)  # the host-bound rows' alone


def test_validate_repeats_relaunch_the_mesh_rows_between_twins(monkeypatch):
    import torch

    from lmsys.model.config import get_config
    from lmsys.plan import calibrate
    from lmsys.plan import validate as val
    from lmsys.plan.shape import from_model_config

    ops, _ = calibrate.host_ops(from_model_config(get_config("tiny"), name="tiny"), device=torch.device("cpu"),
                                dtype="fp32")
    twins = []

    def measure_host(*a, **k):
        twins.append(len(twins))
        return 10.0 * len(twins), 5.0, ops, {}  # 10, 20, 30: median 20

    launches = iter([[[{"ms/step": 50.0, "peak MiB/rank": 3.0, "status": "ok"}],
                      [{"ms/step": 80.0, "peak MiB/rank": 2.0, "status": "ok"}]],
                     [[{"ms/step": 70.0, "peak MiB/rank": 3.5, "status": "ok"}],
                      [{"status": "error: rank 0 died"}]]])
    calls = []

    def launch(plan, labels, jobs, *, world_size, warmup, steps):
        calls.append((tuple(labels), tuple(jobs), world_size))
        return next(launches)

    monkeypatch.setattr(calibrate, "measure_host", measure_host)
    monkeypatch.setattr(val, "_launch", launch)
    plan = val.MeshPlan(meshes=["dp=1,tp=1,pp=1"], size="tiny", context_length=32, backend="gloo", micro_batch=1,
                        microbatches=2)
    none, block = val.mesh_rows(plan, dtypes=["fp32"], checkpoints=["none", "block"], warmup=0, steps=1,
                                profile=CPU_PROFILE, repeats=2)
    assert calls == [(("dp=1,tp=1,pp=1",), (("fp32", "none"), ("fp32", "block")), 1)] * 2
    assert len(twins) == 3 and none["host µs/op"] == 20.0  # before, between, after: their median
    assert none["measured ms"] == 60.0 and none["measured MiB"] == 3.5 and none["status"] == "ok"
    assert none["time spread %"] == pytest.approx(100 * 20 / 60)
    assert block["status"] == "error: rank 0 died" and block["measured ms"] is None  # a failed round fails the row


def test_validate_rows_say_what_bounds_them_with_a_margin_for_the_host():
    # bound: "host" when a host HOST_MARGIN slower than the measured one would add time to the step, so a
    # row the twin's rate puts just under the device (the twins ran up to 20 % fast) is not counted as
    # device-bound; one stage: the host term is max(0, host total - device total)
    from lmsys.model.config import get_config
    from lmsys.plan import validate as val
    from lmsys.plan.shape import from_model_config

    shape = from_model_config(get_config("small"), name="small")
    lay = mem.Layout(micro_batch=4)
    gpu = {**CPU_PROFILE, "host_overlap": True}

    def row(launch_us):
        return val._compare(shape, lay, dtype="fp32", profile={**gpu, "launch_us": {"fp32": launch_us}},
                            gpus_per_node=1, scale=1.0, ms=None, peak_mib=None)

    from lmsys.plan.profile import rates as profile_rates

    st = ptime.step_time(shape, lay, mem.PRECISIONS["fp32"], profile_rates({**gpu, "launch_us": {"fp32": 1.0}}, "fp32"),
                         gpus_per_node=1)
    host_per_us = st.parts["host fwd ms"] + st.parts["host bwd ms"] + st.parts["host optimizer ms"]
    device = st.total  # the host term is 0 at 1 µs an op
    assert st.host == 0
    under = 0.9 * device / host_per_us  # a host total 10 % under the device's: no host term, yet within the margin
    assert row(under)["predicted ms"] == pytest.approx(device) and row(under)["bound"] == "host"
    assert row(0.7 * device / host_per_us)["bound"] == "device"  # 30 % under: device-bound even 25 % slower
    assert row(2 * device / host_per_us)["bound"] == "host"


def test_validate_repeats_must_be_positive(lmsys, tmp_path):
    import yaml

    profile = tmp_path / "cpu.yaml"
    profile.write_text(yaml.safe_dump(CPU_PROFILE))
    r = lmsys("plan", "validate", "--profile", str(profile), "--repeats", "0", "--device", "cpu")
    assert r.code == 2 and r.err.strip() == "error: --repeats must be >= 1, got 0", r.err


def test_validate_runs_parallel_train_meshes_on_gloo_and_predicts_each_layout(lmsys, tmp_path):
    import json

    import yaml

    from lmsys.model.config import get_config
    from lmsys.plan.profile import rates as profile_rates
    from lmsys.plan.shape import from_model_config

    model, profile = tmp_path / "micro2.yaml", tmp_path / "cpu.yaml"
    model.write_text(MICRO2)
    profile.write_text(yaml.safe_dump(CPU_PROFILE))
    r = lmsys("plan", "validate", "--profile", str(profile), "--size", str(model), "--parallel-size", str(model),
              "--context-length", "32", "--device", "cpu", "--warmup", "0", "--steps", "1", "--host-rate", "profile",
              "--format", "json")
    assert r.code == 0, r.err
    e2e, meshes = json.loads(r.out)
    assert {row["host µs/op"] for row in e2e["rows"] + meshes["rows"]} == {20.0}  # the profile's
    assert [row["status"] for row in e2e["rows"]] == ["ok", "ok"]
    # the CPU defaults: dp=2, tp=2 and pp=2 on 2 gloo processes, 4 micro-batches of 1 sequence, each policy
    got = [(row["world size"], row["mesh"], row["checkpoint"], row["status"]) for row in meshes["rows"]]
    assert got == [(2, mesh, ckpt, "ok") for mesh in ("dp=2,tp=1,pp=1", "dp=1,tp=2,pp=1", "dp=1,tp=1,pp=2")
                   for ckpt in ("none", "block")]
    shape = from_model_config(get_config(str(model)), name="micro2")
    rates = profile_rates(CPU_PROFILE, "fp32")  # no `threads` in the profile: the rates as they are
    layouts = {"dp=2,tp=1,pp=1": mem.Layout(dp=2), "dp=1,tp=2,pp=1": mem.Layout(tp=2),
               "dp=1,tp=1,pp=2": mem.Layout(pp=2, schedule="1f1b")}
    for row in meshes["rows"]:
        lay = replace(layouts[row["mesh"]], microbatches=4, checkpoint="full" if row["checkpoint"] == "block" else "none")
        st = ptime.step_time(shape, lay, mem.PRECISIONS["fp32"], rates, gpus_per_node=2)
        assert row["predicted ms"] == pytest.approx(st.total, rel=1e-9)
        assert row["predicted MiB"] == pytest.approx(
            mem.memory(shape, lay, mem.PRECISIONS["fp32"], capacity=float("inf")).total / 2**20, rel=1e-9)
        assert row["measured ms"] > 0 and row["measured MiB"] is None and row["memory error %"] is None
        assert row["time error %"] == pytest.approx(100 * (row["predicted ms"] - row["measured ms"]) / row["measured ms"])
    # communication came from the measured all-reduce points (2 ranks): the dp row's exposed all-reduce
    dp_none = ptime.step_time(shape, replace(layouts["dp=2,tp=1,pp=1"], microbatches=4), mem.PRECISIONS["fp32"],
                              rates, gpus_per_node=2)
    assert dp_none.dp_comm > 0
    errs = [abs(row["time error %"]) for row in meshes["rows"]]
    assert f"time error: mean |error| {sum(errs) / len(errs):.1f} %, max {max(errs):.1f} %" in meshes["notes"]
    assert any("memory: not measurable here" in note for note in meshes["notes"])


def test_validate_rows_that_cannot_run_say_why(lmsys, tmp_path):
    import json

    import yaml

    model, profile = tmp_path / "micro2.yaml", tmp_path / "cpu.yaml"
    model.write_text(MICRO2)
    profile.write_text(yaml.safe_dump(CPU_PROFILE))
    base = ("plan", "validate", "--profile", str(profile), "--size", str(model), "--parallel-size", str(model),
            "--context-length", "32", "--checkpoint", "none", "--warmup", "0", "--steps", "1", "--format", "json")
    # nccl without GPUs: the default mesh of one GPU, not run; the bench e2e rows still run on the CPU
    r = lmsys(*base, "--backend", "nccl")
    assert r.code == 0, r.err
    e2e, meshes = json.loads(r.out)
    assert [row["status"] for row in e2e["rows"]] == ["ok"]
    (row,) = meshes["rows"]
    assert row["mesh"] == "dp=1,tp=1,pp=1" and row["status"].startswith("cannot run: nccl needs CUDA GPUs")
    assert row["measured ms"] is None and row["predicted ms"] > 0 and row["time error %"] is None
    # meshes the model does not divide: said before any process starts, the others still run
    r = lmsys(*base, "--device", "cpu", "--mesh", "tp=4", "--mesh", "pp=3")
    assert r.code == 0, r.err
    _, meshes = json.loads(r.out)
    status = {row["mesh"]: row["status"] for row in meshes["rows"]}
    assert "tp=4 does not divide the model's heads (2)" in status["dp=1,tp=4,pp=1"]
    assert "2 layers cannot fill pp=3" in status["dp=1,tp=1,pp=3"]
    assert all(s.startswith("cannot run: ") for s in status.values())
    # option mistakes are one line, before anything runs
    for args, message in ((("--mesh", "none", "--mesh", "dp=2"), "--mesh none leaves out"),
                          (("--mesh", "dp=2", "--world-size", "4"), "runs 2 processes, not one of --world-size 4"),
                          (("--mesh", "xp=2"), "each part is DIM=N"), (("--dp-strategy", "torch-ddp"), "--dp-strategy"),
                          (("--parallel-size", "tiny,small"), "not a list"), (("--microbatches", "0"), "--microbatches"),
                          (("--host-rate", "now"), "--host-rate")):
        r = lmsys("plan", "validate", "--profile", str(profile), *args)
        assert r.code == 2 and message in r.err and "Traceback" not in r.err, (args, r.err)


def test_validate_layouts_and_default_meshes():
    from lmsys.distributed.mesh import parse_mesh
    from lmsys.plan import validate as val

    plan = val.MeshPlan(meshes=[], size="tiny", context_length=128, backend="gloo", micro_batch=2, microbatches=4,
                        dp_strategy="fsdp", pp_schedule="interleaved-1f1b", virtual_stages=2, sequence_parallel=True)
    assert val.layout(parse_mesh("dp=2,tp=2,pp=2"), plan, checkpoint="block") == mem.Layout(
        dp=2, tp=2, pp=2, zero=2, sp=True, schedule="interleaved", chunks=2, micro_batch=2, microbatches=4,
        checkpoint="full")
    assert val.layout(parse_mesh("tp=1"), replace(plan, dp_strategy="bucketed"), checkpoint="none") == mem.Layout(
        micro_batch=2, microbatches=4)
    # pp = 1: parallel train's 1f1b runs the micro-batches in turn, its gpipe all forwards first
    assert val.layout(parse_mesh("tp=1"), replace(plan, pp_schedule="1f1b"), checkpoint="none").schedule == "none"
    assert val.layout(parse_mesh("tp=1"), replace(plan, pp_schedule="gpipe"), checkpoint="none").schedule == "gpipe"
    assert val.default_meshes(1) == ["dp=1,tp=1,pp=1"]
    assert val.default_meshes(2) == ["dp=2,tp=1,pp=1", "dp=1,tp=2,pp=1", "dp=1,tp=1,pp=2"]
    assert val.default_meshes(4)[-1] == "dp=2,tp=2,pp=1"
    assert val.default_world_sizes("gloo") == [2]
    assert val.resolve_meshes(None, world_sizes=[2, 4], backend="gloo") == val.default_meshes(2) + val.default_meshes(4)
    assert val.resolve_meshes(["tp=2", "dp=1,tp=2"], world_sizes=None, backend="gloo") == ["dp=1,tp=2,pp=1"]
    # a CPU rank computes with its share of the threads the profile was measured with
    assert val.thread_scale({"threads": 4}, "gloo", 2) * 4 == pytest.approx(__import__(
        "lmsys.distributed.launch", fromlist=["rank_threads"]).rank_threads(2))
    assert val.thread_scale({"threads": 4}, "nccl", 2) == 1.0 and val.thread_scale({}, "gloo", 2) == 1.0


def test_host_op_counts_predict_a_deeper_model():
    # counted on 1 and 2 blocks, the per-block and fixed parts give a 3-block step's count exactly
    import torch

    from lmsys.plan import calibrate as cal

    shape = load_shape("tiny")
    ops, _ = cal.host_ops(shape, device=torch.device("cpu"), dtype="fp32")
    counts = {}
    for checkpoint in ("none", "block"):
        step, inputs, targets = cal._tiny_step(shape, layers=3, checkpoint=checkpoint, device=torch.device("cpu"),
                                               dtype="fp32")
        tensors = sum(1 for _ in step.model.parameters())
        for _ in range(2):
            step.zero_grad()
            with cal._Count() as fwd:
                loss = step.forward(inputs, targets)
            with cal._Count() as bwd:
                step.backward(loss)
            with cal._Count() as opt:
                step.optimizer_step()
        counts[checkpoint] = (fwd.n, bwd.n, opt.n)
    assert counts["none"] == (3 * ops["fwd_layer"] + ops["fwd_other"], 3 * ops["bwd_layer"] + ops["bwd_other"],
                              ops["opt_base"] + ops["opt_per_tensor"] * tensors)
    assert counts["block"][1] == 3 * (ops["bwd_layer"] + ops["recompute_layer"]) + ops["bwd_other"]
    assert ptime.param_tensors(replace(shape, layers=3), mem.Layout()) == tensors  # the planner's count
    # selective recomputation runs the attention core's forward again: at least its ops, fewer than the block's
    from lmsys.kernels.attention import attention

    q, k, v = (torch.randn(1, 2, 8, 8, requires_grad=True) for _ in range(3))
    with cal._Count() as core:
        attention(q, k, v, is_causal=True, impl="naive")
    assert core.n <= ops["recompute_core"] < ops["recompute_layer"]


def test_plan_train_with_a_profile_of_a_device_the_table_lacks(tmp_path):
    from lmsys.plan.train import resolve

    old = tmp_path / "old.yaml"  # a CPU profile written before calibrate recorded the device's memory
    old.write_text("device: x86_64\nmatmul_tflops: {fp32: 0.2}\nattention_tflops: {fp32: 0.05}\nhbm_GBps: 20\n")
    kw = dict(size="tiny", context_length=None, gpus=None, gpus_per_node=None, gpu=None, cluster=None,
              dtype="fp32", master_weights=False, peak_tflops=None)
    with pytest.raises(LmsysError, match="'x86_64' is not in the GPU table and the profile has no memory_GB"):
        resolve(profile=str(old), **kw)
    new = tmp_path / "new.yaml"
    new.write_text(old.read_text() + "memory_GB: 64\n")
    _, _, clu, rates, peak, label = resolve(profile=str(new), **kw)
    assert (clu.capacity, peak, rates.matmul_tflops) == (64e9, 0.2, 0.2) and "measured matmul rate" in label
    with pytest.raises(LmsysError, match="no matmul_tflops for bf16"):
        resolve(profile=str(new), **{**kw, "dtype": "bf16"})
    _, _, _, _, peak, label = resolve(profile=str(new), **{**kw, "peak_tflops": 1.5})
    assert peak == 1.5 and label.endswith("(--peak-tflops)")


@pytest.mark.parametrize("args, message", [
    (("--size", "bogus"), "unknown model 'bogus'"), (("--context-length", "0"), "--context-length must be >= 1, got 0"),
    (("--top", "0"), "--top must be >= 1"), (("--dtype", "fp8"), "--dtype must be one of"),
    (("--global-batch-tokens", "1000"), "not a whole number of 512-token sequences"),
    (("--mesh", "dp=2"), "do not divide the 1 GPUs"), ((), None),
    (("--gpu", "h100", "--gpus", "5", "--global-batch", "2"), "no layout of 5 GPUs"),
])
def test_plan_train_user_errors_are_one_line(lmsys, args, message):
    base = (("plan", "train") + (() if "--size" in args else ("--size", "small"))  # an option given twice is refused
            + (() if "--gpu" in args else ("--gpu", "A100")))
    r = lmsys(*base, *args)
    if message is None:
        assert r.code == 0, r.err
        return
    assert r.code == 2 and message in r.err and "Traceback" not in r.err, r.err


def test_block_elementwise_rate_is_a_blocks_device_time_less_its_matmuls(monkeypatch):
    # plan calibrate's block elementwise rate, with planted device times for the 1- and 3-block steps:
    # one block's time is half their difference; less the block's matmuls at the profile's rates it
    # leaves the elementwise kernels' ms, over which the bytes the time model counts give the rate;
    # capped at the contiguous multiply's rate (also where the matmuls alone exceed the block's time)
    import torch

    from lmsys.plan import calibrate as cal
    from lmsys.plan.profile import rates as profile_rates

    m = load_shape("tiny")
    profile = {"device": "cpu", "matmul_tflops": {"bf16": 1e-3}, "attention_tflops": {"bf16": 1e-3},
               "hbm_GBps": 50.0, "elementwise_GBps": 40.0}
    bc = ptime.block_cost(m, b=2, t=1, sp=False, prec=mem.precision("bf16", master_weights=False),
                          rates=profile_rates(profile, "bf16"))
    matmuls, moved = bc.matmul_fwd + bc.matmul_bwd, bc.bytes_fwd + bc.bytes_bwd
    assert bc.cast_bytes > 0 and moved > bc.cast_bytes  # autocast: the weights' casts count as moved bytes

    def planted(times):
        it = iter(times)
        monkeypatch.setattr(cal, "kernel_ms", lambda fn, **kw: next(it))

    elementwise_ms = moved / 10e9 * 1e3  # as if they ran at 10 GB/s
    planted([5.0, 5.0 + 2 * (matmuls + elementwise_ms)])
    gbps, row = cal._block_elementwise(m, profile, device=torch.device("cpu"), dtype="bf16", batch_size=2,
                                       warmup=0, steps=1)
    assert gbps == pytest.approx(10.0) and row["ms"] == pytest.approx(elementwise_ms)
    assert row["what"] == "elementwise, a block's own kernels" and row["shape"] == f"3 - 1 blocks, b2 s{m.seq}"
    planted([5.0, 5.0 + 2 * (matmuls + moved / 400e9 * 1e3)])  # faster than the multiply: its rate
    assert cal._block_elementwise(m, profile, device=torch.device("cpu"), dtype="bf16", batch_size=2,
                                  warmup=0, steps=1)[0] == 40.0
    planted([5.0, 5.0 + matmuls])  # the matmuls took more than the block: the multiply's rate
    assert cal._block_elementwise(m, profile, device=torch.device("cpu"), dtype="bf16", batch_size=2,
                                  warmup=0, steps=1)[0] == 40.0


def test_profile_rates_take_the_blocks_elementwise_rate_for_its_dtype():
    from lmsys.plan.profile import rates as profile_rates

    profile = {"device": "x", "matmul_tflops": {"bf16": 1.0, "fp32": 1.0}, "attention_tflops": {"bf16": 1.0, "fp32": 1.0},
               "hbm_GBps": 50.0, "elementwise_GBps": 40.0, "block_elementwise_GBps": {"bf16": 12.5}}
    assert profile_rates(profile, "bf16").elementwise_GBps == 12.5
    assert profile_rates(profile, "fp32").elementwise_GBps == 40.0  # not measured for fp32: the multiply's
    del profile["elementwise_GBps"], profile["block_elementwise_GBps"]
    assert profile_rates(profile, "fp32").elementwise_GBps is None  # an older profile: the HBM rate


def test_block_elementwise_runs_the_models_blocks_on_a_cpu():
    # unpatched: the 1- and 3-block steps at the model's width and sequence, timed (a CPU: wall time); with
    # matmuls that take no time and no cap, all of a block's time is elementwise: its ms and the rate it gives
    import torch

    from lmsys.plan import calibrate as cal

    m = load_shape("tiny")
    profile = {"device": "cpu", "matmul_tflops": {"fp32": 1e9}, "attention_tflops": {"fp32": 1e9},
               "hbm_GBps": 1e9, "elementwise_GBps": 1e9}
    gbps, row = cal._block_elementwise(m, profile, device=torch.device("cpu"), dtype="fp32", batch_size=1,
                                       warmup=1, steps=1)
    bc = ptime.block_cost(m, b=1, t=1, sp=False, prec=mem.PRECISIONS["fp32"], rates=_rates())
    assert row["ms"] > 0 and gbps == pytest.approx((bc.bytes_fwd + bc.bytes_bwd) / (row["ms"] * 1e-3) / 1e9)
    assert gbps < 1e9 and row["what"] == "elementwise, a block's own kernels"


def test_block_elementwise_without_kernels_says_it_took_the_multiplys_rate(monkeypatch):
    # a calibration under nsys or ncu: the profiler records no kernels; the multiply's rate, and the row says so
    import torch

    from lmsys.plan import calibrate as cal

    monkeypatch.setattr(cal, "kernel_ms", lambda fn, **kw: 0.0)
    profile = {"device": "cpu", "matmul_tflops": {"bf16": 1.0}, "attention_tflops": {"bf16": 1.0},
               "hbm_GBps": 50.0, "elementwise_GBps": 40.0}
    gbps, row = cal._block_elementwise(load_shape("tiny"), profile, device=torch.device("cpu"), dtype="bf16",
                                       batch_size=1, warmup=0, steps=1)
    assert gbps == 40.0 and "no kernel time recorded" in row["what"]


def test_block_elementwise_times_lmsys_block_at_the_models_width(monkeypatch):
    # a GPT-style model (GeLU MLP, LayerNorm, biases): the block timed is lmsys's at its width, heads and
    # sequence, and the matmuls and bytes taken off are that block's, not the GPT block's
    import torch

    from lmsys.plan import calibrate as cal
    from lmsys.plan.profile import rates as profile_rates
    from lmsys.plan.shape import from_model_config

    gpt = replace(GPT_PRESETS["gpt-22b"], d_model=64, d_ff=256, heads=4, kv_heads=4, seq=32, layers=2)
    built = []
    monkeypatch.setattr(cal, "_tiny_step", lambda m, **kw: built.append(kw) or (None, None, None))
    it = iter([1.0, 3.0])
    monkeypatch.setattr(cal, "kernel_ms", lambda fn, **kw: next(it))
    profile = {"device": "cpu", "matmul_tflops": {"bf16": 1.0}, "attention_tflops": {"bf16": 1.0},
               "hbm_GBps": 50.0, "elementwise_GBps": 1e9}
    _, row = cal._block_elementwise(gpt, profile, device=torch.device("cpu"), dtype="bf16", batch_size=2,
                                    warmup=0, steps=1)
    assert [kw["layers"] for kw in built] == [1, 3] and all(kw["seq"] == 32 and kw["batch"] == 2 for kw in built)
    twin = from_model_config(cal.twin_config(gpt, layers=1, width="model", seq=32), name="twin")
    assert (twin.mlp, twin.d_ff, twin.attention) == ("swiglu", 256, "flash")
    bc = ptime.block_cost(twin, b=2, t=1, sp=False, prec=mem.precision("bf16", master_weights=False),
                          rates=profile_rates(profile, "bf16"))
    assert row["ms"] == pytest.approx(1.0 - bc.matmul_fwd - bc.matmul_bwd)


def test_calibrate_sustain_times_each_gemm_back_to_back(monkeypatch):
    # --sustain: after the GEMM bursts, the largest GEMM for that long, then about a second of each forward shape
    # timed as one region: a row per shape [M, K, N, burst, sustained] (largest first) and the rate of them all;
    # no fraction where the table lacks the part (a CPU); the report's note beside the bursts
    import torch

    from lmsys.plan import calibrate as cal

    monkeypatch.setattr(cal, "MEASUREMENTS", (cal.measure_compute, cal.measure_sustained))
    profile, rows = cal.calibrate(load_shape("tiny"), device=torch.device("cpu"), dtypes=["fp32"], batch_size=1,
                                  warmup=0, steps=1, collectives=False, sustain=0.05)
    sus = profile["gemm_sustained"]["fp32"]
    shapes = [tuple(r[:3]) for r in profile["gemm_tflops"]["fp32"]]
    assert [tuple(r[:3]) for r in sus["rows"]] == sorted(shapes, key=lambda s: -s[0] * s[1] * s[2])
    assert all(r[3] == dict((tuple(g[:3]), g[3]) for g in profile["gemm_tflops"]["fp32"])[tuple(r[:3])] for r in sus["rows"])
    assert all(r[4] > 0 for r in sus["rows"]) and sus["heat_s"] == 0.05 and sus["fraction"] is None
    flops = [2 * r[0] * r[1] * r[2] for r in sus["rows"]]
    assert min(r[4] for r in sus["rows"]) <= sus["TFLOPs"] <= max(r[4] for r in sus["rows"])
    assert len([r for r in rows if r["what"] == "sustained matmul"]) == len(flops)
    (note,) = cal.sustained_notes(profile)
    assert note.startswith(f"fp32 GEMMs back to back (after 0.05 s of the largest): {sus['TFLOPs']:.4g} TFLOP/s over")
    # off by default: nothing measured
    profile, _ = cal.calibrate(load_shape("tiny"), device=torch.device("cpu"), dtypes=["fp32"], batch_size=1,
                               warmup=0, steps=1, collectives=False)
    assert "gemm_sustained" not in profile and cal.sustained_notes(profile) == []


def test_calibrate_sustain_must_be_seconds(lmsys, tmp_path):
    r = lmsys("plan", "calibrate", "--sustain", "-1", "--profile", str(tmp_path / "p.yaml"))
    assert r.code == 2 and r.err.strip() == "error: --sustain must be seconds >= 0 (0: not measured), got -1.0"
    assert not (tmp_path / "p.yaml").exists()


def test_curve_note_says_when_the_gemms_cannot_give_a_launch_time():
    # GEMMs all large (the committed H100 --sustain run's: 7B, 13B, 175B widths): the fit's fixed term comes out
    # below zero (-21.7 µs); the note says the shapes cannot give it instead of printing it
    from pathlib import Path

    import yaml

    from lmsys.plan.calibrate import curve_notes

    path = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "plan-h100-sustain-profile.yaml"
    (note,) = curve_notes(yaml.safe_load(path.read_text()))
    assert note.startswith("bf16 GEMM curve (H100 SXM): 0.701 of the 989.5 TFLOP/s peak; these GEMMs are too alike")
    assert "(the fit's -21.7 µs is below zero)" in note and "+ -" not in note


def test_calibrate_times_with_the_one_timer_module():
    # the CUDA-graph and profiler timers are core.timing's (their GPU paths are tested there with stand-ins);
    # plan calibrate's measurements call them, and kernel_ms stays importable from plan.calibrate
    from lmsys.core import timing
    from lmsys.plan import calibrate as cal

    assert cal.kernel_ms is timing.kernel_ms and cal.time_graph is timing.time_graph
    assert not hasattr(cal, "_device_ms")


def test_calibrate_runs_its_measurements_in_order(monkeypatch):
    # plan calibrate is a list of measurement functions: each reads the Calibration (models, device, dtypes,
    # batch, the timer's warm-up and steps) and adds its profile fields and rows, in MEASUREMENTS' order;
    # the GPU-only one (a block's elementwise rate) adds nothing on a CPU
    import torch

    from lmsys.plan import calibrate as cal

    assert [f.__name__ for f in cal.MEASUREMENTS] == [
        "measure_compute", "measure_copy", "measure_multiply", "measure_optimizer", "measure_block_elementwise",
        "measure_host_rates", "measure_collectives", "measure_sustained"]
    seen = []

    def stand_in(name):
        def measure(c):
            seen.append((name, c.dtypes, c.batch_size, c.timing))
            c.profile[name] = len(seen)
            c.rows.append({"what": name})
        return measure

    monkeypatch.setattr(cal, "MEASUREMENTS", (stand_in("a"), cal.measure_block_elementwise, stand_in("b")))
    profile, rows = cal.calibrate(load_shape("tiny"), device=torch.device("cpu"), dtypes=["fp32"], batch_size=3,
                                  warmup=1, steps=2, collectives=False)
    assert [r["what"] for r in rows] == ["a", "b"] and (profile["a"], profile["b"]) == (1, 2)
    assert seen[0][1:] == (["fp32"], 3, {"device": torch.device("cpu"), "warmup": 1, "steps": 2})
    assert profile["device"] and "block_elementwise_GBps" not in profile
