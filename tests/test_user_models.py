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
