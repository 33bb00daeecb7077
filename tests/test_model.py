import pytest
import torch

from lmsys.core.errors import LmsysError
from lmsys.model import PRESETS, ModelConfig, config_from_yaml, get_config, parameter_count_formula
from lmsys.model.transformer import TransformerLM, apply_rope, rope_tables
from lmsys.train.build import count_parameters

TINY = ModelConfig(d_model=32, d_ff=64, num_layers=2, num_heads=4, vocab_size=50, context_length=24)


@pytest.mark.parametrize("name", list(PRESETS))
def test_parameter_count_matches_closed_formula_without_allocating(name):
    cfg = PRESETS[name]
    assert count_parameters(cfg) == parameter_count_formula(cfg)


def test_preset_table():
    # The table, verbatim: (d_model, d_ff, layers, heads).
    table = {"tiny": (128, 512, 2, 4), "small": (768, 3072, 12, 12), "medium": (1024, 4096, 24, 16),
             "large": (1280, 5120, 36, 20), "xl": (1600, 6400, 48, 25), "2.7b": (2560, 10240, 32, 32),
             "10b": (4608, 12288, 50, 36)}
    for name, dims in table.items():
        c = PRESETS[name]
        assert (c.d_model, c.d_ff, c.num_layers, c.num_heads) == dims
        assert (c.vocab_size, c.context_length) == (10_000, 512)
    assert parameter_count_formula(PRESETS["small"]) == 10_000 * 768 * 2 + 12 * (4 * 768**2 + 3 * 768 * 3072 + 2 * 768) + 768


@pytest.mark.parametrize("impl", ["naive", "sdpa"])
def test_causality_future_tokens_do_not_change_past_logits(impl):
    torch.manual_seed(0)
    model = TransformerLM(TINY.with_overrides(attn_impl=impl)).double()
    x = torch.randint(0, TINY.vocab_size, (2, 20))
    y = x.clone()
    cut = 11
    y[:, cut:] = torch.randint(0, TINY.vocab_size, (2, 20 - cut))
    lx, ly = model(x), model(y)
    torch.testing.assert_close(lx[:, :cut], ly[:, :cut], rtol=1e-12, atol=1e-12)
    assert (lx[:, cut:] - ly[:, cut:]).abs().max() > 1e-6  # the future did change


def test_naive_and_sdpa_models_agree():
    torch.manual_seed(1)
    model = TransformerLM(TINY).double()
    x = torch.randint(0, TINY.vocab_size, (3, 17))
    ref = model(x)
    for layer in model.layers:
        layer.attn.attn_impl = "sdpa"
    torch.testing.assert_close(model(x), ref, rtol=1e-10, atol=1e-10)


def test_rope_scores_depend_only_on_relative_position():
    torch.manual_seed(2)
    d = 16
    cos, sin = rope_tables(128, d, 10_000.0)
    cos, sin = cos.double(), sin.double()
    q, k = torch.randn(d, dtype=torch.float64), torch.randn(d, dtype=torch.float64)

    def score(m, n):
        qm = apply_rope(q.expand(128, d), cos, sin)[m]
        kn = apply_rope(k.expand(128, d), cos, sin)[n]
        return float(qm @ kn)

    for offset in (0, 3, 17):
        ref = score(5 + offset, 5)
        for m in (9, 30, 50):
            assert score(m + offset, m) == pytest.approx(ref, rel=1e-6, abs=1e-6)  # float32 tables
    assert score(10, 0) != pytest.approx(score(20, 0))
    # Rotation preserves norms.
    x = torch.randn(3, 128, d, dtype=torch.float64)
    torch.testing.assert_close(apply_rope(x, cos, sin).norm(dim=-1), x.norm(dim=-1))


@pytest.mark.parametrize("impl", ["naive", "sdpa"])
def test_fp32_gradients_of_every_parameter_match_a_float64_run(impl):
    """The cross-entropy's gradient in float32 against the same weights and batch in float64: every
    parameter gets one, and each is within float32 rounding of the float64 one (an odd length, 13)."""
    cfg = TINY.with_overrides(attn_impl=impl)
    model = TransformerLM(cfg)
    model64 = TransformerLM(cfg).double()
    model64.load_state_dict(model.state_dict())
    x = torch.randint(0, cfg.vocab_size, (3, 13))
    y = torch.randint(0, cfg.vocab_size, (3, 13))
    for m in (model, model64):
        torch.nn.functional.cross_entropy(m(x).flatten(0, 1), y.flatten()).backward()
    for (name, p), p64 in zip(model.named_parameters(), model64.parameters()):
        assert p.grad is not None and p64.grad is not None, name
        scale = p64.grad.abs().max().item()
        assert scale > 0, name  # the comparison is not vacuous: this parameter does get a gradient
        err = (p.grad.double() - p64.grad).abs().max().item()
        assert err <= 1e-5 * scale, (name, err, scale)  # measured ~6e-7 of scale


def test_sequence_longer_than_context_is_rejected():
    model = TransformerLM(TINY)
    with pytest.raises(ValueError):
        model(torch.zeros(1, TINY.context_length + 1, dtype=torch.long))


def test_config_validation():
    with pytest.raises(LmsysError, match="not divisible"):
        ModelConfig(d_model=100, d_ff=4, num_layers=1, num_heads=3)
    with pytest.raises(LmsysError, match="unknown model size"):
        get_config("huge")
    with pytest.raises(LmsysError, match="positive"):
        ModelConfig(d_model=8, d_ff=0, num_layers=1, num_heads=2)


def test_config_from_yaml(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("preset: small\nnum_layers: 3\ncontext_length: 128\n")
    cfg = config_from_yaml(p)
    assert (cfg.d_model, cfg.num_layers, cfg.context_length) == (768, 3, 128)
    p.write_text("d_model: 64\nd_ff: 128\nnum_layers: 1\nnum_heads: 2\n")
    assert get_config(str(p)).d_head == 32
    p.write_text("d_model: 64\nbogus: 1\n")
    with pytest.raises(LmsysError, match="unknown keys"):
        config_from_yaml(p)
    for bad, message in (("d_model: abc", "d_model must be a positive integer, got 'abc'"),
                         ("d_model: 12.5", "d_model must be a positive integer, got 12.5"),
                         ("num_layers: true", "num_layers must be a positive integer"),
                         ("rope_theta: x", "rope_theta must be a positive number")):
        p.write_text(f"preset: tiny\n{bad}\n")
        with pytest.raises(LmsysError, match=message):
            config_from_yaml(p)


def test_grouped_query_attention_model():
    """num_kv_heads 2 for 4 query heads: smaller k/v projections, the formula agrees, and every attention
    path (naive repeats k/v, SDPA enable_gqa, both flash implementations read them in place) gives the
    same logits as the naive model with the shared heads repeated by hand."""
    mha = TINY.with_overrides(d_model=64)  # d_head 16: flash-triton's smallest
    cfg = mha.with_overrides(num_kv_heads=2)
    assert cfg.kv_heads == 2 and mha.kv_heads == mha.num_heads and PRESETS["small"].num_kv_heads is None
    assert count_parameters(cfg) == parameter_count_formula(cfg) < parameter_count_formula(mha)
    torch.manual_seed(4)
    model = TransformerLM(cfg).double()
    assert model.layers[0].attn.qkv_proj.weight.shape == ((4 + 2 * 2) * 16, 64)
    x = torch.randint(0, cfg.vocab_size, (2, 19))
    ref = model(x)
    for impl, tol in (("sdpa", 1e-10), ("flash-torch", 1e-5), ("flash-triton", 1e-4)):  # flash: float32 inside
        for layer in model.layers:
            layer.attn.attn_impl = impl
        if impl == "flash-triton":
            model.float()
        torch.testing.assert_close(model(x).double(), ref, rtol=tol, atol=tol)
    # by hand: a multi-head model whose k/v weights repeat the two shared heads
    full = TransformerLM(mha).double()
    with torch.no_grad():
        for a, b in zip(full.parameters(), model.double().parameters()):
            if a.shape == b.shape:
                a.copy_(b)
        for lf, lg in zip(full.layers, model.layers):
            wq, wk, wv = lg.attn.qkv_proj.weight.split([64, 32, 32])
            rep = [w.view(2, 16, 64).repeat_interleave(2, dim=0).reshape(64, 64) for w in (wk, wv)]
            lf.attn.qkv_proj.weight.copy_(torch.cat([wq, *rep]))
    torch.testing.assert_close(full(x), ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kv,needle", [(3, "does not divide num_heads 4"), (0, "positive integer"),
                                        ("2", "positive integer")])
def test_num_kv_heads_validation(kv, needle):
    with pytest.raises(LmsysError, match=needle):
        TINY.with_overrides(num_kv_heads=kv)
