"""The model as the planner sees it: sizes and the few choices that change memory and time.

`ModelShape` comes from an lmsys ModelConfig (a preset or lmsys YAML), a Llama-style YAML (Hugging Face
keys: hidden_size, intermediate_size, num_hidden_layers, ...), or the planner's own presets for the
standard GPT of Megatron-LM's papers (GeLU MLP of 4h, LayerNorm, biases, learned positions, dropout,
tied embeddings, vocabulary 51200). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from lmsys.core.errors import LmsysError
from lmsys.core.parsing import choose

MLPS = ("swiglu", "gelu")
ATTENTIONS = ("flash", "materialized", "naive")  # fused O(s) kernel | s×s scores, fused softmax | lmsys naive


@dataclass(frozen=True)
class ModelShape:
    name: str
    vocab: int
    d_model: int
    d_ff: int
    layers: int
    heads: int
    kv_heads: int
    seq: int
    mlp: str = "swiglu"
    attention: str = "flash"
    norm: str = "rms"  # rms | layer (LayerNorm: weight and bias)
    bias: bool = False  # linear layers carry biases
    learned_positions: bool = False  # a seq × d_model position table (else RoPE: no parameters)
    tied: bool = False  # the LM head is the embedding table
    dropout: bool = False  # dropout after attention, MLP and embedding (1-byte masks kept for backward)
    logit_bytes: int = 0  # bytes kept per logit for the loss; 0: compute dtype + fp32 copy + its gradient
    low_precision_norm: bool = False  # the norms run in the compute dtype and keep their input in it (MPT's)
    fused_norm: bool = False  # a fused norm kernel (torchtitan's fused_rmsnorm): keeps its input, compute dtype

    def __post_init__(self):
        for f in ("vocab", "d_model", "d_ff", "layers", "heads", "kv_heads", "seq"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise LmsysError(f"{self.name}: {f} must be a positive integer, got {v!r}")
        choose(self.mlp, MLPS, what=f"{self.name}: mlp")
        choose(self.attention, ATTENTIONS, what=f"{self.name}: attention")
        if self.d_model % self.heads:
            raise LmsysError(f"{self.name}: d_model {self.d_model} is not divisible by heads {self.heads}")
        if self.heads % self.kv_heads:
            raise LmsysError(f"{self.name}: kv heads {self.kv_heads} do not divide heads {self.heads}")

    @property
    def d_head(self) -> int:
        return self.d_model // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.d_head

    def with_seq(self, seq: int | None) -> "ModelShape":
        return self if seq is None else replace(self, seq=seq)

    def describe(self) -> str:
        kv = f" ({self.kv_heads} kv)" if self.kv_heads != self.heads else ""
        return (f"{self.name}: d_model {self.d_model}, d_ff {self.d_ff} ({self.mlp}), {self.layers} layers, "
                f"{self.heads} heads{kv}, vocab {self.vocab}, sequence {self.seq}, {self.attention} attention, "
                f"{_count(params(self))} parameters")


# ------------------------------------------------------------------------------------------ parameters

def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def layer_matmul_params(m: ModelShape) -> int:
    """Weights of one block's matmuls: Q and output h², K and V h·kv_dim each, MLP 2·h·f (GeLU) or 3·h·f."""
    h = m.d_model
    return 2 * h * h + 2 * h * m.kv_dim + (3 if m.mlp == "swiglu" else 2) * h * m.d_ff


def block_gemms(m: ModelShape, *, tokens: int, tp: int = 1) -> list[tuple[str, int, int, int]]:
    """(name, M, K, N) of one block's matmuls on one GPU of a tp group, `tokens` rows each, as the model
    runs them: Q, K and V fused (lmsys and Megatron-LM), the attention output, the MLP's (SwiGLU: gate and
    up apart, then down; GeLU: in and out). Column-parallel ones split N by tp, row-parallel ones K; their
    2·M·K·N sum to 2·tokens·layer_matmul_params / tp."""
    h, f = m.d_model, _split(m.d_ff, tp)
    mlp_in = [("MLP gate", tokens, h, f), ("MLP up", tokens, h, f)] if m.mlp == "swiglu" else [("MLP in", tokens, h, f)]
    return [("QKV", tokens, h, _split(h + 2 * m.kv_dim, tp)), ("attention out", tokens, _split(h, tp), h), *mlp_in,
            ("MLP out", tokens, f, h)]


def head_gemm(m: ModelShape, *, tokens: int, tp: int = 1) -> tuple[str, int, int, int]:
    """(name, M, K, N) of the LM head's matmul (vocabulary-parallel over tp)."""
    return ("LM head", tokens, m.d_model, _split(m.vocab, tp))


def _split(n: int, parts: int) -> int:
    return -(-n // parts)


def layer_params(m: ModelShape) -> int:
    """All of one block: matmuls, biases (Q, K, V, out; MLP in and out), norms (1 or 2 vectors each)."""
    h = m.d_model
    bias = (2 * h + 2 * m.kv_dim + (m.d_ff * (2 if m.mlp == "swiglu" else 1) + h)) if m.bias else 0
    return layer_matmul_params(m) + bias + 2 * norm_params(m)


def norm_params(m: ModelShape) -> int:
    return m.d_model * (2 if m.norm == "layer" else 1)


def params(m: ModelShape) -> int:
    """Every parameter: embedding (+ positions), blocks, final norm, LM head unless tied."""
    embed = m.vocab * m.d_model + (m.seq * m.d_model if m.learned_positions else 0)
    head = 0 if m.tied else m.vocab * m.d_model
    return embed + m.layers * layer_params(m) + norm_params(m) + head


def flops_per_token(m: ModelShape) -> float:
    """Training FLOPs per token, lmsys.core.flops' convention (PaLM): 6 × matmul weights (blocks and LM
    head, tied or not) + 12·layers·seq·d_model for attention's two matmuls, causal counted in full."""
    return 6 * (m.layers * layer_matmul_params(m) + m.vocab * m.d_model) + 12 * m.layers * m.seq * m.d_model


# ----------------------------------------------------------------------------------------- converters

def from_model_config(cfg, *, name: str) -> ModelShape:
    """An lmsys ModelConfig (SwiGLU, RMSNorm, RoPE, no biases or dropout, untied head)."""
    return ModelShape(name=name, vocab=cfg.vocab_size, d_model=cfg.d_model, d_ff=cfg.d_ff, layers=cfg.num_layers,
                      heads=cfg.num_heads, kv_heads=cfg.kv_heads, seq=cfg.context_length,
                      attention=attention_kind(cfg.attn_impl))


def attention_kind(attn_impl: str) -> str:
    """How an attention implementation moves the s×s scores: lmsys's naive chain (naive, annotated), a
    materialized score matrix with a fused softmax (torch.compile'd naive, SDPA's math backend), or a fused
    O(s) kernel (every other: SDPA, flash, cuDNN, a user's): the spec's `scores`."""
    from lmsys.kernels.registry import spec

    return spec(attn_impl).scores


def gpt(name: str, *, d_model: int, layers: int, heads: int, seq: int = 2048, vocab: int = 51200) -> ModelShape:
    """The standard GPT of Megatron-LM's papers: 4h GeLU MLP, LayerNorm, biases, learned positions,
    dropout, tied embeddings, s×s scores through a fused softmax, fp32 logits for the loss."""
    return ModelShape(name=name, vocab=vocab, d_model=d_model, d_ff=4 * d_model, layers=layers, heads=heads,
                      kv_heads=heads, seq=seq, mlp="gelu", attention="materialized", norm="layer", bias=True,
                      learned_positions=True, tied=True, dropout=True, logit_bytes=4)


# Korthikanti et al. 2022, Table 3: the four GPT models (heads, hidden size, layers).
GPT_PRESETS = {
    "gpt-22b": gpt("gpt-22b", d_model=6144, layers=48, heads=64),
    "gpt-175b": gpt("gpt-175b", d_model=12288, layers=96, heads=96),
    "gpt-530b": gpt("gpt-530b", d_model=20480, layers=105, heads=128),
    "gpt-1t": gpt("gpt-1t", d_model=25600, layers=128, heads=160),
}

# Llama-style (Hugging Face) and GPT-style key spellings -> ModelShape fields.
ALIASES = {
    "vocab_size": "vocab", "padded_vocab_size": "vocab", "vocab": "vocab",
    "hidden_size": "d_model", "d_model": "d_model", "n_embd": "d_model",
    "intermediate_size": "d_ff", "d_ff": "d_ff", "ffn_hidden_size": "d_ff", "n_inner": "d_ff",
    "num_hidden_layers": "layers", "num_layers": "layers", "n_layer": "layers", "layers": "layers",
    "num_attention_heads": "heads", "num_heads": "heads", "n_head": "heads", "heads": "heads",
    "num_key_value_heads": "kv_heads", "num_kv_heads": "kv_heads", "kv_heads": "kv_heads",
    "max_position_embeddings": "seq", "context_length": "seq", "seq_length": "seq", "n_positions": "seq",
    "seq": "seq", "tie_word_embeddings": "tied", "mlp": "mlp", "attention": "attention", "norm": "norm",
    "bias": "bias", "learned_positions": "learned_positions", "dropout": "dropout", "logit_bytes": "logit_bytes",
    "low_precision_norm": "low_precision_norm",
}
ACTIVATIONS = {"silu": "swiglu", "swiglu": "swiglu", "gelu": "gelu", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu"}


def from_mapping(data: dict, *, name: str) -> ModelShape:
    """A Llama-style (or GPT-style) mapping of sizes; keys that do not size the model are ignored."""
    fields: dict = {}
    for key, value in data.items():
        if key in ALIASES:
            fields[ALIASES[key]] = value
    act = data.get("hidden_act", data.get("activation_function"))
    if act is not None and "mlp" not in fields:
        if act not in ACTIVATIONS:
            raise LmsysError(f"{name}: activation {act!r} not modelled; one of {', '.join(ACTIVATIONS)}")
        fields["mlp"] = ACTIVATIONS[act]
    missing = [k for k in ("vocab", "d_model", "d_ff", "layers", "heads") if k not in fields]
    if missing:
        raise LmsysError(f"{name}: missing sizes {', '.join(missing)} (e.g. vocab_size, hidden_size, intermediate_size, "
                         "num_hidden_layers, num_attention_heads)")
    fields.setdefault("kv_heads", fields["heads"])
    fields.setdefault("seq", 2048)
    return ModelShape(name=name, **fields)


def load_shape(spec: str, *, seq: int | None = None) -> ModelShape:
    """A preset (lmsys's or gpt-22b/175b/530b/1t), an lmsys YAML, or a Llama-style YAML / JSON config."""
    from lmsys.model.config import PRESETS, ModelConfig, get_config

    if spec in GPT_PRESETS:
        return GPT_PRESETS[spec].with_seq(seq)
    if spec in PRESETS:
        return from_model_config(PRESETS[spec], name=spec).with_seq(seq)
    if not spec.endswith((".yaml", ".yml", ".json")):
        raise LmsysError(f"unknown model {spec!r}; presets: {', '.join([*PRESETS, *GPT_PRESETS])} "
                         "(or an lmsys / Llama-style .yaml or .json config)")
    path = Path(spec)
    if not path.is_file():
        raise LmsysError(f"model config file {path} does not exist")
    data = _read_mapping(path)
    own = {"preset", *ModelConfig.__dataclass_fields__}
    if set(data) <= own and "preset" in data or {"d_model", "num_layers"} <= set(data) <= own:
        return from_model_config(get_config(spec), name=path.stem).with_seq(seq)
    return from_mapping(data, name=path.stem).with_seq(seq)


def _read_mapping(path: Path) -> dict:
    import json

    import yaml

    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as exc:
        raise LmsysError(f"{path}: cannot read it as a mapping ({exc.__class__.__name__})") from None
    if not isinstance(data, dict):
        raise LmsysError(f"{path}: expected a mapping of model sizes")
    return data
