"""Models as people write them (issue 41 item 4): a constructor taking a config object (nanoGPT's
GPT(GPTConfig), gpt-fast's Transformer(ModelArgs), torchtitan's), a tuple output, last-position logits
without targets, size options a model does not take, Hugging Face's dropout off.

Fixtures in tests/fixtures/byo (written for these tests): nanogpt_style.py, gptfast_style.py, models.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

BYO = Path(__file__).parent / "fixtures" / "byo"
NANOGPT = f"{BYO / 'nanogpt_style.py'}:GPT"
GPTFAST = f"{BYO / 'gptfast_style.py'}:Transformer"
TITAN = f"{BYO / 'gptfast_style.py'}:TitanTransformer"
MODELS = str(BYO / "models.py")
TINY_RUN = ["--context-length", "16", "--batch-size", "2", "--steps", "1", "--warmup", "0", "--device", "cpu"]


def _config(model: str, preset: str = "tiny", kwargs: str = "", **overrides):
    from lmsys.model.config import get_config
    from lmsys.model.user import with_model

    return with_model(get_config(preset).with_overrides(**overrides), model, kwargs)


def one_line(result, code: int = 2) -> str:
    assert result.code == code, (result.out, result.err)
    assert "Traceback" not in result.err + result.out
    lines = [ln for ln in result.err.splitlines() if ln.strip() and not ln.startswith("hint:")]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.err
    return lines[0]


def test_nanogpt_style_config_is_filled_in_its_own_names():
    from lmsys.model.user import constructor_plan

    plan = constructor_plan(_config(NANOGPT, context_length=64))
    assert plan.how == "config" and plan.config_class.__name__ == "GPTConfig"
    assert plan.kwargs == {"n_embd": 128, "n_layer": 2, "n_head": 4, "vocab_size": 10000, "block_size": 64}
    assert plan.unmapped == ("d_ff", "rope_theta")  # nanoGPT's MLP is 4·n_embd, learned positions


def test_nanogpt_style_loss_is_its_own_with_targets_and_matches_cross_entropy(seed):
    """Called with targets (it gives the last position only without them): the step's loss is the model's
    own, equal to the plain cross-entropy of its full logits; forward alone still gives [B, S, V]."""
    from lmsys.train.build import build_model
    from lmsys.train.step import lm_loss

    cfg = _config(NANOGPT, context_length=12, vocab_size=97)
    model = build_model(cfg, device="cpu")
    assert model.targets == "targets"
    ids, targets = torch.randint(0, 97, (3, 11)), torch.randint(0, 97, (3, 11))
    logits = model(ids)
    assert logits.shape == (3, 11, 97)
    direct, _ = model.model(ids, targets)
    expected = F.cross_entropy(direct.double().flatten(0, 1), targets.flatten())
    loss = lm_loss(model, ids, targets, fused_ce=False)
    assert torch.allclose(loss.double(), expected, atol=1e-5)
    loss.backward()
    assert model.model.lm_head.weight.grad is not None


def test_nanogpt_style_runs_bench_e2e_as_written(lmsys):
    r = lmsys("bench", "e2e", "--model", NANOGPT, *TINY_RUN, "--mode", "all", "--format", "json")
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    from lmsys.train.build import count_parameters

    cfg = _config(NANOGPT, context_length=16)
    D, L, V = 128, 2, 10000
    # tied head (counted once), learned positions, LayerNorms and biases: qkv 3D²+3D, proj D²+D, MLP 8D²+5D
    assert count_parameters(cfg) == V * D + 16 * D + L * (12 * D * D + 13 * D) + 2 * D
    for row in doc["rows"]:
        assert row["status"] == "ok" and row["params"] == count_parameters(cfg)
        assert abs(row["loss"] - math.log(V)) < 0.5
    header = doc["meta"]["tiny"]
    assert header.startswith(f"{NANOGPT}: GPTConfig(n_embd 128, n_layer 2, n_head 4, vocab_size 10000, block_size 16)")
    assert "not mapped: d_ff" in header and "forward called with targets=" in header


def test_gptfast_style_model_args_and_titan_args():
    from lmsys.model.user import constructor_plan, find_blocks
    from lmsys.train.build import build_model

    cfg = _config(GPTFAST, vocab_size=64, context_length=8)
    plan = constructor_plan(cfg)
    assert plan.config_class.__name__ == "ModelArgs"
    assert plan.kwargs == {"vocab_size": 64, "block_size": 8, "dim": 128, "n_layer": 2, "n_head": 4,
                           "intermediate_size": 512, "rope_base": 10000.0}
    model = build_model(cfg, device="cpu")
    assert model.model.config.n_local_heads == 4 and model.model.layers[0].feed_forward.w1.out_features == 512
    assert model(torch.randint(0, 64, (2, 8))).shape == (2, 8, 64)

    titan = _config(TITAN, vocab_size=64, context_length=8)
    plan = constructor_plan(titan)
    assert plan.config_class.__name__ == "TitanArgs" and "d_ff" in plan.unmapped
    assert plan.kwargs["dropout"] == 0.0 and plan.dropout_off == (("dropout", 0.1),)
    model = build_model(titan, device="cpu")
    assert model(torch.randint(0, 64, (2, 8))).shape == (2, 8, 64)  # the first tensor of its tuple
    blocks = find_blocks(model)  # its layers are a ModuleDict
    assert len(blocks) == 2 and blocks[0] is model.model.layers["0"]
    assert "dropout off for parity (dropout 0.1 -> 0)" in constructor_plan(titan).header()


def test_model_kwargs_go_to_the_config_object():
    from lmsys.model.user import constructor_plan

    plan = constructor_plan(_config(NANOGPT, kwargs='{"bias": false, "dropout": 0.2}'))
    assert plan.kwargs["bias"] is False and plan.kwargs["dropout"] == 0.2 and plan.dropout_off == ()


@pytest.mark.parametrize("option, value, words", [
    ("--d-ff", "64", "error: --d-ff: --model {m} has no d_ff to set (GPTConfig has none of d_ff, intermediate_size"),
    ("--layers", "3", None),
])
def test_size_options_a_model_does_not_take_are_refused(lmsys, option, value, words):
    model = NANOGPT if words else f"{MODELS}:Partial"
    line = one_line(lmsys("bench", "e2e", "--model", model, option, value, *TINY_RUN))
    if words:
        assert line.startswith(words.format(m=model))
    else:
        assert line.startswith(f"error: --layers: --model {model} has no num_layers to set (its constructor takes "
                               "none of num_layers, n_layer")


def test_last_position_logits_without_targets_is_one_line(lmsys):
    line = one_line(lmsys("bench", "e2e", "--model", f"{MODELS}:LastOnly", *TINY_RUN))
    assert "returns logits for the last position only ((1, 1, 10000) for ids (1, 4)) and its forward takes no " \
           "targets" in line


def test_hf_dropout_is_off_and_said(lmsys):
    pytest.importorskip("transformers")
    from lmsys.train.build import build_model

    model = build_model(_config("hf:gpt2", context_length=16), device="cpu")
    cfg = model.model.config
    assert cfg.resid_pdrop == cfg.embd_pdrop == cfg.attn_pdrop == 0.0
    r = lmsys("bench", "e2e", "--model", "hf:gpt2", *TINY_RUN, "--format", "json")
    assert r.code == 0, r.err
    assert "dropout off for parity (resid_pdrop 0.1, embd_pdrop 0.1, attn_pdrop 0.1" in json.loads(r.out)["meta"]["tiny"]
    kept = _config("hf:gpt2", kwargs='{"resid_pdrop": 0.1}')
    assert build_model(kept, device="meta").model.config.resid_pdrop == 0.1  # --model-kwargs wins


# ----------------------------------------------------------------------------- the fast path on a --model


def _workloads(model: str, *, device: str, **options):
    from lmsys.bench import e2e

    opts = e2e.step_options(torch.device(device), "fp32", fast=True, attn=None, optimizer="auto",
                            master_weights=False, fused_ce="auto", tf32=False, **options)
    opts.pop("attn_impl")
    configs = e2e.sweep_configs(["tiny"], context_lengths=[16], heads=[None], model=model)
    return e2e.resolve_workloads(configs, checkpoints=["none"], batch_sizes=[2], cuda_graphs=False, **opts)


def test_fast_compiles_a_users_model_per_block_and_says_what_it_changed():
    """On a GPU --fast compiles lmsys's model whole; a --model's blocks one by one (the list find_blocks
    finds), unless --compile asked for the whole; the header names the blocks."""
    (_, w), = _workloads(NANOGPT, device="cuda", compile_scope=None)
    assert w.compile == "blocks" and w.optimizer == "adamw-fused" and w.tf32
    assert w.describe() == "compile each block (transformer.h: 2 × Block), fused AdamW, TF32"
    (_, w), = _workloads(NANOGPT, device="cuda", compile_scope="model")
    assert w.compile == "model" and w.describe().startswith("compile the whole model and loss")
    (_, w), = _workloads("lmsys", device="cuda", compile_scope=None)
    assert w.compile == "model"


def test_compile_is_announced_on_stderr_in_one_line(capsys, monkeypatch):
    from lmsys.core import progress

    monkeypatch.delenv("RANK", raising=False)
    with progress.announced("compiling each block of M (transformer.h: 2 × Block)"):
        pass
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("compiling each block of M (transformer.h: 2 × Block) ... ")
    assert err.rstrip().endswith(" s")
    progress.set_quiet(True)
    try:
        with progress.announced("compiling"):
            pass
    finally:
        progress.set_quiet(False)
    assert capsys.readouterr().err == ""


def test_compare_on_a_users_model_adds_lmsys_at_the_same_sizes():
    from lmsys.bench import e2e

    (_, w), = _workloads(GPTFAST, device="cuda", compile_scope=None)
    (eager_path, eager), (fast_path, fast) = e2e.lmsys_workloads(w, torch.device("cuda"))
    assert (eager_path, fast_path) == ("lmsys eager", "lmsys --fast")
    for ref in (eager, fast):
        assert ref.config.model == "lmsys" and ref.config.model_kwargs == ""
        assert (ref.config.d_model, ref.config.num_layers, ref.config.context_length, ref.batch_size) == (128, 2, 16, 2)
    assert eager.compile == "none" and eager.config.attn_impl == "naive"
    assert fast.compile == "model" and fast.config.attn_impl == "sdpa" and fast.optimizer == "adamw-fused"
    assert e2e.lmsys_workloads(eager, torch.device("cuda")) == []  # lmsys's own: nothing to add
    from lmsys.core.results import MeanStd

    def row(path, ms):
        return {"path": path, "mode": "train", "ms/step": MeanStd(ms, 0.0, ms), "status": "ok"}

    refs = [row("plain eager", 200.0), row("plain compiled", 120.0), row("lmsys eager", 150.0),
            row("lmsys --fast", 73.2)]
    group = [*refs, row("your model", 106.3)]
    e2e._add_speedups(group, refs)
    assert group[-1]["× vs lmsys --fast"] == pytest.approx(73.2 / 106.3)
    assert list(group[-1])[-1] == "status"


def test_attention_is_named_from_the_kernels_or_operators():
    from lmsys.profiling.summary import Timed, TimeProfile, attention_seen

    def seen(*names, unit="kernel"):
        return attention_seen(TimeProfile(engine="nsys", unit=unit, top=[Timed(n, 1, 1.0) for n in names]))

    assert seen("ampere_sgemm_128x64_tn", "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64>>(")\
        .startswith("sdpa: flash (pytorch_flash::flash_fwd_kernel")
    assert seen("fmha_cutlassF_f32_aligned_64x64_rf_sm80(").startswith("sdpa: memory-efficient")
    assert seen("aten::_scaled_dot_product_flash_attention_for_cpu", unit="operator").startswith("sdpa: flash")
    assert seen("aten::_log_softmax", "aten::mm", unit="operator") is None  # cross-entropy is not attention
    assert seen("aten::_log_softmax", "aten::_softmax", unit="operator") == "naive: matmul + softmax (aten::_softmax)"


@pytest.mark.parametrize("model, words", [(f"{MODELS}:NaiveLM", "attention naive: matmul + softmax (aten::_softmax"),
                                          (f"{MODELS}:CS336LM", "attention sdpa: flash (aten::_scaled_dot_product")])
def test_profile_nsys_names_the_attention_a_users_model_runs(lmsys, tmp_path, model, words):
    r = lmsys("profile", "nsys", "--model", model, "--engine", "torch", "--device", "cpu", "--context-length", "16",
              "--batch-size", "2", "--steps", "1", "--warmup", "0", "--out-dir", str(tmp_path), "--format", "json")
    assert r.code == 0, r.err
    text = r.out
    assert words in text and "from its operators" in text


# ----------------------------------------------------------------------------- parallel train --model

PARALLEL = ["--world-size", "2", "--backend", "gloo", "--context-length", "16", "--steps", "1", "--warmup", "1",
            "--format", "json"]


@pytest.fixture
def no_torchrun(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def _mesh_rows(r):
    assert r.code == 0, r.err
    rows = json.loads(r.out)["rows"]
    return [row for row in rows if row["mesh"] != "-"]


@pytest.mark.slow
def test_parallel_train_takes_a_users_model_on_dp_and_fsdp_and_pp(lmsys, no_torchrun):
    for mesh, strategy in (("dp=2", "bucketed"), ("dp=2", "fsdp")):
        r = lmsys("parallel", "train", "--model", f"{MODELS}:CS336LM", "--mesh", mesh, "--dp-strategy", strategy,
                  "--batch-size", "2", "--microbatches", "1", *PARALLEL)
        (row,) = _mesh_rows(r)
        assert row["status"] == "ok" and row["parity max|Δθ|"] < 1e-4 and row["|Δloss|"] < 1e-5, row
    r = lmsys("parallel", "train", "--model", GPTFAST, "--mesh", "pp=2", "--batch-size", "4", "--microbatches", "2",
              *PARALLEL)
    (row,) = _mesh_rows(r)
    assert row["status"] == "ok" and row["parity max|Δθ|"] < 1e-4 and row["schedule"] == "1f1b, M=2", row


@pytest.mark.slow
def test_parallel_train_tp_by_the_plan_the_model_declares_or_a_file(lmsys, no_torchrun, tmp_path):
    pytest.importorskip("transformers")
    r = lmsys("parallel", "train", "--model", "hf:llama", "--mesh", "tp=2", "--batch-size", "2", "--microbatches",
              "1", *PARALLEL)
    (row,) = _mesh_rows(r)
    assert row["status"] == "ok" and row["parity max|Δθ|"] < 2e-4, row
    plan = tmp_path / "mlp.yaml"
    plan.write_text("model.layers.*.mlp.gate_proj: colwise\nmodel.layers.*.mlp.up_proj: colwise\n"
                    "model.layers.*.mlp.down_proj: rowwise\n")
    from lmsys.model.user import tp_plan

    assert tp_plan(_config("hf:llama"), str(plan)) == {"model.model.layers.*.mlp.gate_proj": "colwise",
                                                       "model.model.layers.*.mlp.up_proj": "colwise",
                                                       "model.model.layers.*.mlp.down_proj": "rowwise"}
    r = lmsys("parallel", "train", "--model", "hf:llama", "--tp-plan", str(plan), "--mesh", "tp=2", "--batch-size",
              "2", "--microbatches", "1", *PARALLEL)
    (row,) = _mesh_rows(r)
    assert row["status"] == "ok" and row["parity max|Δθ|"] < 2e-4 and row["params/rank"] < 3_000_000, row


def test_parallel_train_says_what_a_users_model_lacks(lmsys, no_torchrun, tmp_path):
    line = one_line(lmsys("parallel", "train", "--model", f"{MODELS}:CS336LM", "--mesh", "tp=2", *PARALLEL))
    assert line == (f"error: --mesh dp=1,tp=2,pp=1: tp needs a tensor-parallel plan, and --model {MODELS}:CS336LM "
                    "declares none (Hugging Face's base_model_tp_plan, or a tp_plan class attribute): give one with "
                    "--tp-plan FILE.yaml (module pattern: colwise | rowwise), or drop tp")
    line = one_line(lmsys("parallel", "train", "--model", NANOGPT, "--mesh", "pp=2", *PARALLEL))
    assert "ties model.transformer.wte.weight and model.lm_head.weight (one weight), which pp would put on two " \
           "stages" in line
    bad = tmp_path / "bad.yaml"
    bad.write_text("layers.*.qkv: sequence\n")
    line = one_line(lmsys("parallel", "train", "--model", f"{MODELS}:CS336LM", "--tp-plan", str(bad), "--mesh", "tp=2",
                          *PARALLEL))
    assert line == f"error: --tp-plan {bad}: layers.*.qkv: 'sequence' is not a style lmsys applies (colwise | rowwise)"
    line = one_line(lmsys("parallel", "train", "--tp-plan", str(bad), "--mesh", "tp=2", *PARALLEL))
    assert "--tp-plan gives the tensor-parallel plan of a --model" in line
