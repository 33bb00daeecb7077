"""Models by name (lmsys.train.build.build_model builds them): lmsys's TransformerLM, a user's
`pkg.module:Name` / `file.py:Name` (a class or a factory), and Hugging Face's `hf:llama`, `hf:gpt2`,
`hf:qwen2`, `hf:mistral` (random weights from the config class, nothing downloaded; needs the `[hf]` extra).

A user's model is built with the preset's sizes passed by keyword to whichever of `SIZE_NAMES` its
constructor takes (`--model-kwargs` adds or overrides), under `torch.device(device)`, and wrapped in
`UserLM` (`_user_lm()`: defined on first use, so this module stays torch-free), which maps ids [B, S] to logits [B, S, V] (`.logits` accepted) and exposes the model's blocks
(`find_blocks`: the largest ModuleList of modules of one type) as `.layers` for per-block compile and the
in-backward optimizer. Parameters and FLOPs come from the built module (lmsys.core.flops.module_matmul_params).
Names and kwargs are checked torch-free (`check_model`, `parse_model_kwargs`).
"""

from __future__ import annotations

import inspect
import json
from functools import lru_cache
from pathlib import Path

from lmsys.core.errors import LmsysError
from lmsys.core.imports import is_import_path, load_object

LMSYS = "lmsys"
SIZE_NAMES = ("vocab_size", "context_length", "d_model", "num_layers", "num_heads", "d_ff", "rope_theta",
              "num_kv_heads")
# hf:NAME -> (transformers config class, model class, config keyword per lmsys size name)
_LLAMA_KEYS = {"vocab_size": "vocab_size", "context_length": "max_position_embeddings", "d_model": "hidden_size",
               "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads", "d_ff": "intermediate_size",
               "rope_theta": "rope_theta", "num_kv_heads": "num_key_value_heads"}
HF_MODELS = {
    "hf:llama": ("LlamaConfig", "LlamaForCausalLM", _LLAMA_KEYS),
    "hf:qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _LLAMA_KEYS),
    "hf:mistral": ("MistralConfig", "MistralForCausalLM", _LLAMA_KEYS),
    "hf:gpt2": ("GPT2Config", "GPT2LMHeadModel", {"vocab_size": "vocab_size", "context_length": "n_positions",
                                                  "d_model": "n_embd", "num_layers": "n_layer", "num_heads": "n_head",
                                                  "d_ff": "n_inner"}),
}
HF_EXTRA = "pip install 'lmsys[hf]' (or pip install transformers)"


def listing() -> list[tuple[str, str]]:
    rows = [(LMSYS, "lmsys TransformerLM (RoPE, RMSNorm, SwiGLU): the default")]
    rows += [(name, f"transformers {model}, random weights from {cfg} with the preset's sizes (the [hf] extra)")
             for name, (cfg, model, _) in HF_MODELS.items()]
    rows.append(("pkg.module:Name", "your model class or factory (or path/to/file.py:Name), ids [B, S] -> logits "
                 "[B, S, V]; built with the sizes its signature takes"))
    return rows


def check_model(name: str, *, what: str = "--model") -> str:
    """Before torch loads: lmsys, hf:NAME, or an import path."""
    if name == LMSYS or name in HF_MODELS or is_import_path(name) and not name.startswith("hf:"):
        return name
    raise LmsysError(f"{what} must be lmsys, {', '.join(HF_MODELS)} or pkg.module:Name, not {name!r}")


def parse_model_kwargs(text: str | None) -> str:
    """--model-kwargs: YAML or JSON text, or a .yaml/.json file, holding a mapping -> canonical JSON ('' for none)."""
    if not text:
        return ""
    import yaml

    source = text
    if text.endswith((".yaml", ".yml", ".json")):
        path = Path(text).expanduser()
        if not path.is_file():
            raise LmsysError(f"--model-kwargs: no such file {text}")
        source = path.read_text()
    try:
        data = yaml.safe_load(source)  # JSON is YAML
    except yaml.YAMLError as exc:
        raise LmsysError(f"--model-kwargs: not valid YAML or JSON ({exc.__class__.__name__})") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise LmsysError(f"--model-kwargs: expected a mapping of keyword arguments, got {text!r}")
    try:
        return json.dumps(data, sort_keys=True)
    except TypeError as exc:
        raise LmsysError(f"--model-kwargs: values must be plain YAML/JSON values ({exc})") from None


def with_model(config, model: str | None, model_kwargs: str = ""):
    """`config` for `model` with the kwargs that name a size (vocab_size, ...) applied to the config too,
    so that the data and the FLOPs follow them."""
    if model is None or model == LMSYS and not model_kwargs:
        return config
    kwargs = json.loads(model_kwargs) if model_kwargs else {}
    sizes = {k: v for k, v in kwargs.items() if k in SIZE_NAMES}
    return config.with_overrides(model=check_model(model), model_kwargs=model_kwargs, **sizes)


def is_user_model(config) -> bool:
    return getattr(config, "model", LMSYS) != LMSYS


def _constructor_kwargs(factory, config, kwargs: dict, *, what: str) -> dict:
    sizes = {name: getattr(config, name) for name in SIZE_NAMES if getattr(config, name) is not None}
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return {**sizes, **kwargs}
    named = [k for k in sizes if k in params]
    if not named and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return {**sizes, **kwargs}  # def f(**config): every size
    unknown = set(kwargs) - set(params) if not any(p.kind is inspect.Parameter.VAR_KEYWORD
                                                   for p in params.values()) else set()
    if unknown:
        raise LmsysError(f"--model-kwargs: {what} takes no {', '.join(sorted(unknown))}; it takes "
                         f"{', '.join(params)}")
    return {**{k: v for k, v in sizes.items() if k in params}, **kwargs}


def _hf_model(name: str, config, kwargs: dict):
    try:
        import transformers
    except ImportError:
        raise LmsysError(f"--model {name} needs transformers: {HF_EXTRA}") from None
    cfg_cls, model_cls, keys = HF_MODELS[name]
    values = {hf: getattr(config, mine) for mine, hf in keys.items() if getattr(config, mine) is not None}
    if "num_kv_heads" in keys and config.num_kv_heads is None:  # lmsys: as many as query heads; Qwen2Config
        values[keys["num_kv_heads"]] = config.num_heads       # defaults to 32 of them, MistralConfig to 8
    values.update(kwargs)
    hf_config = getattr(transformers, cfg_cls)(**values)
    return getattr(transformers, model_cls)(hf_config)


def build_user_model(config, *, device):
    """The user's or Hugging Face's model `config.model` names, on `device`, wrapped in UserLM: the factory
    lmsys.train.build.build_model uses for such a config (build through that, not this)."""
    import torch

    kwargs = json.loads(config.model_kwargs) if config.model_kwargs else {}
    kwargs = {k: v for k, v in kwargs.items() if k not in SIZE_NAMES}  # with_model put those on config
    with torch.device(device):
        if config.model in HF_MODELS:
            return _user_lm()(_hf_model(config.model, config, kwargs), hf=True)
        factory = load_object(config.model, what="--model")
        kw = _constructor_kwargs(factory, config, kwargs, what=config.model)
        try:
            model = factory(**kw)
        except Exception as exc:  # noqa: BLE001 - the user's constructor: one line
            raise LmsysError(f"--model {config.model}: building it with {', '.join(kw) or 'no arguments'} raised "
                             f"{type(exc).__name__}: {' '.join(str(exc).split())}") from None
    if not isinstance(model, torch.nn.Module):
        from lmsys.core.parsing import a_or_an

        raise LmsysError(f"--model {config.model} returned {a_or_an(type(model).__name__)}, not a torch.nn.Module")
    return _user_lm()(model)


def find_blocks(model):
    """The model's list of blocks: the largest ModuleList (by length, then parameters) whose children are
    all of one type; None when it has none of at least two."""
    import torch

    best, key = None, (1, 0)
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) >= 2:
            if len({type(child) for child in module}) != 1:
                continue
            size = (len(module), sum(p.numel() for p in module.parameters()))
            if size > key:
                best, key = module, size
    return best


@lru_cache(maxsize=None)
def _user_lm():
    import torch

    class UserLM(torch.nn.Module):
        """A user's model as the training step sees it: ids [B, S] -> logits tensor [B, S, V]."""

        def __init__(self, model: torch.nn.Module, *, hf: bool = False):
            super().__init__()
            self.model = model
            self.hf = hf

        @property
        def layers(self):
            blocks = find_blocks(self.model)
            if blocks is None:
                raise LmsysError("this model has no list of blocks (a ModuleList of modules of one type)")
            return blocks

        def forward(self, ids):
            out = self.model(input_ids=ids, use_cache=False) if self.hf else self.model(ids)
            logits = getattr(out, "logits", out)
            if not (torch.is_tensor(logits) and logits.dim() == 3 and logits.shape[:2] == ids.shape):
                shape = tuple(logits.shape) if torch.is_tensor(logits) else type(logits).__name__
                raise LmsysError(f"the model maps ids {tuple(ids.shape)} to {shape}, not logits [B, S, V]")
            return logits

    return UserLM


@lru_cache(maxsize=None)
def _meta_counts(config, seq_len: int) -> tuple[int, int, int, int]:
    """(parameters, matmul parameters per token, blocks, d_model) of the module built on the meta device."""
    import torch

    from lmsys.core.flops import module_matmul_params

    with torch.device("meta"):  # the factory itself: no values, so nothing to seed (train.build is above)
        model = build_user_model(config, device="meta")
    params = sum(p.numel() for p in model.parameters())
    blocks = find_blocks(model)
    layers = len(blocks) if blocks is not None else config.num_layers
    d_model = max((m.weight.shape[1] for m in model.modules() if isinstance(m, torch.nn.Embedding)),
                  default=config.d_model)
    return params, module_matmul_params(model), layers, d_model


def check_builds(config) -> None:
    """A user's model built on the meta device now: a constructor that fails is one line before any work."""
    if is_user_model(config):
        _meta_counts(config, config.context_length)


def model_flops(config, *, batch_size: int, seq_len: int, backward: bool) -> float:
    """lmsys.core.flops.model_flops for lmsys's model; for a user's, the same convention from the built
    module: 2 FLOPs per matmul weight per token (its Linear shapes, the LM head included, embeddings not)
    plus attention's 4·S·d_model per token per block, ×3 with backward."""
    from lmsys.core import flops

    if not is_user_model(config):
        return flops.model_flops(config, batch_size=batch_size, seq_len=seq_len, backward=backward)
    _, matmul, layers, d_model = _meta_counts(config, seq_len)
    forward = 2 * matmul + 4 * seq_len * d_model * layers
    return (3 * forward if backward else forward) * batch_size * seq_len
