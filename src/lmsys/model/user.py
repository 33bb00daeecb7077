"""Models by name (lmsys.train.build.build_model builds them): lmsys's TransformerLM, a user's
`pkg.module:Name` / `file.py:Name` (a class or a factory), and Hugging Face's `hf:llama`, `hf:gpt2`,
`hf:qwen2`, `hf:mistral` (random weights from the config class, nothing downloaded; needs the `[hf]` extra).

A user's model is built with the preset's sizes (`constructor_plan`, read from the signature, torch-free):
- by keyword, under whichever spelling of each size its constructor takes (`ALIASES`: d_model, n_embd, dim,
  hidden_size, ...); a factory taking **kwargs gets lmsys's names;
- or, when the constructor takes one config object (nanoGPT's `GPT(GPTConfig)`, gpt-fast's and torchtitan's
  `Transformer(ModelArgs)`), that object, built from the config class (the annotation, else the module's
  one dataclass whose fields spell sizes) with its own field names filled from the preset.
Sizes it has no name for are `unmapped` (an explicit option for one is refused: `check_sizes_taken`).
Fields named *dropout*/*pdrop* are set to 0 (so that data-parallel parity holds; the header says so) unless
--model-kwargs gives them. `--model-kwargs` adds or overrides keywords (or config fields).

The module is built under `torch.device(device)` and wrapped in `UserLM` (`_user_lm()`: defined on first
use, so this module stays torch-free), which maps ids [B, S] to logits [B, S, V]: `.logits`, or the first
[B, S, V] tensor of a tuple; a model that gives only the last position's logits without targets
(nanoGPT) is called with them and its own loss is the step's (`UserLM.own_loss`). It exposes the model's
blocks (`find_blocks`: the largest ModuleList of modules of one type) as `.layers` for per-block compile
and the in-backward optimizer. Parameters and FLOPs come from the built module
(lmsys.core.flops.module_matmul_params). Names and kwargs are checked torch-free (`check_model`,
`parse_model_kwargs`).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import sys
import typing
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from lmsys.core.errors import LmsysError
from lmsys.core.imports import is_import_path, load_object
from lmsys.core.registry import Registry, Spec

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


@dataclass(frozen=True)
class ModelSpec(Spec):
    """A model `--model` takes by name, and how it is built: lmsys's TransformerLM from the preset, a
    transformers class from its config class (`hf`: config class, model class, config keyword per lmsys
    size), or a user's class or factory from the sizes its signature takes (`constructor_plan`)."""

    build: str = "user"  # lmsys | hf | user
    hf: tuple | None = None  # build == "hf": (config class, model class, {lmsys size: config keyword})

    @property
    def lmsys(self) -> bool:
        return self.build == "lmsys"


def _user_model(name: str) -> ModelSpec:
    return ModelSpec(name, "your model", build="user")


MODELS: Registry[ModelSpec] = Registry(
    "model", option="--model", must="must be", from_path=_user_model,
    is_path=lambda name: is_import_path(name) and not name.startswith("hf:"),
    path_help="your model class or factory (or path/to/file.py:Name), ids [B, S] -> logits [B, S, V] (or a tuple "
              "starting with them); built with the sizes its signature takes, or its config object's fields "
              "(GPT(GPTConfig), Transformer(ModelArgs))")
MODELS.add(ModelSpec(LMSYS, "lmsys TransformerLM (RoPE, RMSNorm, SwiGLU): the default", build="lmsys"))
for _name, (_cfg, _model, _keys) in HF_MODELS.items():
    MODELS.add(ModelSpec(_name, f"transformers {_model}, random weights from {_cfg} with the preset's sizes (the "
                         "[hf] extra)", build="hf", hf=(_cfg, _model, _keys)))


def model_spec(name: str | None) -> ModelSpec:
    """The spec of `name` (None: lmsys's), a user's for any other; nothing is loaded."""
    name = LMSYS if name is None else name
    return MODELS[name] if name in MODELS else _user_model(name)


def is_lmsys_model(name: str | None) -> bool:
    """`name` (None: the default) is lmsys's own TransformerLM."""
    return model_spec(name).lmsys


def _is_hf(name: str | None) -> bool:
    return model_spec(name).build == "hf"
# lmsys's size name -> the spellings constructors and config classes use for it, first match wins (CS336,
# nanoGPT, gpt-fast, torchtitan / Llama, Hugging Face, Mistral, x-transformers, ...)
ALIASES = {
    "vocab_size": ("vocab_size", "n_vocab", "vocab", "num_tokens", "padded_vocab_size"),
    "context_length": ("context_length", "block_size", "max_seq_len", "max_seq_length", "max_position_embeddings",
                       "n_positions", "n_ctx", "seq_len", "max_len"),
    "d_model": ("d_model", "n_embd", "dim", "hidden_size", "n_embed", "embed_dim", "emb_dim", "d_embed", "width"),
    "num_layers": ("num_layers", "n_layer", "n_layers", "num_hidden_layers", "depth"),
    "num_heads": ("num_heads", "n_head", "n_heads", "num_attention_heads", "heads"),
    "d_ff": ("d_ff", "intermediate_size", "ffn_dim", "ffn_hidden_size", "hidden_dim", "n_inner", "dim_feedforward",
             "mlp_dim", "d_hidden"),
    "rope_theta": ("rope_theta", "rope_base", "theta"),
    "num_kv_heads": ("num_kv_heads", "n_kv_heads", "num_key_value_heads", "n_local_heads", "n_kv_head",
                     "n_query_groups"),
}
SIZE_OPTIONS = {"d_model": "--d-model", "d_ff": "--d-ff", "num_layers": "--layers", "num_heads": "--heads",
                "vocab_size": "--vocab-size"}
TARGET_NAMES = ("targets", "target", "labels", "y")  # a forward's second argument that makes it give every position


def listing() -> list[tuple[str, str]]:
    return MODELS.listing()


def check_model(name: str, *, what: str = "--model") -> str:
    """Before torch loads: lmsys, hf:NAME, or an import path."""
    return MODELS.check(name, what=what)


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
    if model is None or is_lmsys_model(model) and not model_kwargs:
        return config
    kwargs = json.loads(model_kwargs) if model_kwargs else {}
    sizes = {k: v for k, v in kwargs.items() if k in SIZE_NAMES}
    return config.with_overrides(model=check_model(model), model_kwargs=model_kwargs, **sizes)


def is_user_model(config) -> bool:
    return not is_lmsys_model(getattr(config, "model", None))


@dataclass(frozen=True)
class ConstructorPlan:
    """How a --model is called for a config, in the model's own names (constructor_plan)."""

    how: str                                    # "keywords" | "config" (one config object) | "hf"
    sizes: tuple[tuple[str, str, object], ...]  # (lmsys's name, the model's name, value) passed
    unmapped: tuple[str, ...]                   # lmsys's sizes the model has no name for (not passed)
    extra: tuple[tuple[str, object], ...] = ()  # --model-kwargs passed besides the sizes
    dropout_off: tuple[tuple[str, object], ...] = ()  # (field, its default) set to 0.0 for parity
    config_class: object = dataclasses.field(default=None, compare=False)  # how == "config": the class
    constructor_extra: tuple[tuple[str, object], ...] = ()  # how == "config": kwargs for the constructor itself

    @property
    def kwargs(self) -> dict:
        """What the constructor (or the config class) is called with."""
        return {**{own: v for _, own, v in self.sizes}, **{k: 0.0 for k, _ in self.dropout_off}, **dict(self.extra)}

    def header(self) -> str:
        """'GPTConfig(n_embd 128, n_layer 2, ...); not mapped: d_ff (no field for it); dropout off (...)'."""
        order = ("d_model", "d_ff", "num_layers", "num_heads", "num_kv_heads", "vocab_size", "context_length")
        shown = sorted((s for s in self.sizes if s[0] in order), key=lambda s: order.index(s[0]))
        text = ", ".join(f"{own} {v}" for _, own, v in shown)
        if self.how == "config":
            text = f"{getattr(self.config_class, '__name__', 'config')}({text})"
        parts = [text]
        unmapped = [n for n in self.unmapped if n not in ("rope_theta", "num_kv_heads", "context_length")]
        if unmapped:
            parts.append(f"not mapped: {', '.join(unmapped)} (no field or argument for "
                         f"{'it' if len(unmapped) == 1 else 'them'}: the model's own)")
        if self.dropout_off:
            parts.append("dropout off for parity (" + ", ".join(f"{k} {v:g}" for k, v in self.dropout_off) + " -> 0)")
        return "; ".join(parts)


def _is_dropout(name: str) -> bool:
    return "dropout" in name or name.endswith("pdrop")


def _parameters(obj) -> dict | None:
    """The constructor's parameters (self left out), or None when its signature cannot be read."""
    try:
        return dict(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        return None


def _map_sizes(values: dict, names) -> tuple[list, list]:
    """(passed (lmsys, own, value), unmapped lmsys names): each size under the first of its ALIASES in `names`."""
    passed, unmapped = [], []
    for lm, value in values.items():
        own = next((a for a in ALIASES[lm] if a in names), None)
        if own is None:
            unmapped.append(lm)
        else:
            passed.append((lm, own, value))
    return passed, unmapped


def _dropouts(defaults: dict, given: dict) -> tuple:
    """(field, default) for each dropout field with a non-zero default that --model-kwargs leaves alone."""
    return tuple((k, v) for k, v in defaults.items() if _is_dropout(k) and k not in given
                 and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0)


def _config_fields(cls) -> dict:
    """name -> default (inspect.Parameter.empty when required) of a config class: dataclass fields, else its
    constructor's parameters."""
    if dataclasses.is_dataclass(cls):
        out = {}
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            if f.default is not dataclasses.MISSING:
                out[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                out[f.name] = None
            else:
                out[f.name] = inspect.Parameter.empty
        return out
    params = _parameters(cls) or {}
    return {n: p.default for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def _alias_count(cls) -> int:
    names = set(_config_fields(cls))
    return sum(any(a in names for a in aliases) for aliases in ALIASES.values())


def _config_class(factory, param: inspect.Parameter, *, what: str):
    """The class of the config object `param` takes: its annotation, else the one class of the factory's
    module (a dataclass, or named *Config / *Args) whose fields spell the most sizes."""
    target = factory.__init__ if inspect.isclass(factory) else factory
    annotation = param.annotation
    try:
        annotation = typing.get_type_hints(target).get(param.name, annotation)
    except Exception:  # noqa: BLE001 - a forward reference the module cannot resolve: look it up by name below
        pass
    module = sys.modules.get(getattr(factory, "__module__", ""), None)
    if isinstance(annotation, str) and module is not None:
        annotation = getattr(module, annotation.split(".")[-1].strip("'\""), annotation)
    for arg in typing.get_args(annotation) or (annotation,):  # Optional[ModelArgs]
        if inspect.isclass(arg) and _alias_count(arg):
            return arg
    candidates = [obj for obj in vars(module).values() if inspect.isclass(obj)
                  and obj.__module__ == module.__name__
                  and (dataclasses.is_dataclass(obj) or obj.__name__.endswith(("Config", "Args", "Params")))
                  and _alias_count(obj)] if module is not None else []
    if not candidates:
        raise LmsysError(f"--model {what} takes a config object ({param.name}) and lmsys found no config class for it "
                         f"(a dataclass whose fields name the sizes): annotate it ({param.name}: MyConfig) or pass "
                         "a factory that takes the sizes by keyword")
    best = max(_alias_count(c) for c in candidates)
    top = [c for c in candidates if _alias_count(c) == best]
    named = [c for c in top if c.__name__.startswith(getattr(factory, "__name__", "?"))]
    if len(top) > 1 and len(named) != 1:
        raise LmsysError(f"--model {what} takes a config object ({param.name}) and its module has "
                         f"{len(top)} candidate classes ({', '.join(c.__name__ for c in top)}): annotate it "
                         f"({param.name}: {top[0].__name__})")
    return named[0] if len(top) > 1 else top[0]


@lru_cache(maxsize=None)
def constructor_plan(config) -> ConstructorPlan:
    """How `config.model` is called with `config`'s sizes (see the module docstring); a keyword it does not
    take is one LmsysError naming what it takes."""
    kwargs = json.loads(config.model_kwargs) if config.model_kwargs else {}
    kwargs = {k: v for k, v in kwargs.items() if k not in SIZE_NAMES}  # with_model put those on config
    values = {n: getattr(config, n) for n in SIZE_NAMES if getattr(config, n) is not None}
    if _is_hf(config.model):
        return _hf_plan(config.model, config, kwargs)
    factory = load_object(config.model, what="--model")
    params = _parameters(factory)
    if params is None:  # a builtin or C extension: lmsys's names
        return ConstructorPlan("keywords", tuple((n, n, v) for n, v in values.items()), (), tuple(kwargs.items()))
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    plain = {n: p for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    passed, unmapped = _map_sizes(values, plain)
    if not passed and var_kw:  # def f(**config): every size, by lmsys's names
        return ConstructorPlan("keywords", tuple((n, n, v) for n, v in values.items()), (), tuple(kwargs.items()))
    required = [p for p in plain.values() if p.default is p.empty]
    if not passed and plain and (len(required) == 1 or len(plain) == 1):
        param = required[0] if required else next(iter(plain.values()))
        return _config_plan(factory, param, values, kwargs, plain, var_kw, what=config.model)
    unknown = set() if var_kw else set(kwargs) - set(plain)
    if unknown:
        raise LmsysError(f"--model-kwargs: {config.model} takes no {', '.join(sorted(unknown))}; it takes "
                         f"{', '.join(params)}")
    defaults = {n: p.default for n, p in plain.items()}
    return ConstructorPlan("keywords", tuple(passed), tuple(unmapped), tuple(kwargs.items()),
                           _dropouts(defaults, kwargs))


def _config_plan(factory, param, values: dict, kwargs: dict, params: dict, var_kw: bool, *, what: str
                 ) -> ConstructorPlan:
    cls = _config_class(factory, param, what=what)
    fields = _config_fields(cls)
    passed, unmapped = _map_sizes(values, fields)
    to_config = {k: v for k, v in kwargs.items() if k in fields}
    to_model = {k: v for k, v in kwargs.items() if k not in fields}
    unknown = set() if var_kw else set(to_model) - (set(params) - {param.name})
    if unknown:
        raise LmsysError(f"--model-kwargs: neither {cls.__name__} nor {what} takes {', '.join(sorted(unknown))}; "
                         f"{cls.__name__} has {', '.join(fields)}")
    return ConstructorPlan("config", tuple(passed), tuple(unmapped), tuple(to_config.items()),
                           _dropouts(fields, to_config), config_class=cls, constructor_extra=tuple(to_model.items()))


def _hf_plan(name: str, config, kwargs: dict) -> ConstructorPlan:
    try:
        import transformers
    except ImportError:
        raise LmsysError(f"--model {name} needs transformers: {HF_EXTRA}") from None
    cfg_cls, _, keys = MODELS[name].hf
    passed = [(mine, hf, getattr(config, mine)) for mine, hf in keys.items() if getattr(config, mine) is not None]
    if "num_kv_heads" in keys and config.num_kv_heads is None:  # lmsys: as many as query heads; Qwen2Config
        passed.append(("num_kv_heads", keys["num_kv_heads"], config.num_heads))  # defaults to 32, MistralConfig 8
    unmapped = [n for n in SIZE_NAMES if n not in keys and getattr(config, n) is not None]
    defaults = getattr(transformers, cfg_cls)().to_dict()
    return ConstructorPlan("hf", tuple(passed), tuple(unmapped), tuple(kwargs.items()), _dropouts(defaults, kwargs),
                           config_class=getattr(transformers, cfg_cls))


def check_sizes_taken(config, given: dict) -> None:
    """A size option (`given`: lmsys name -> the option as typed) that `config.model` has no name for is one
    line, not a size printed as if it were used."""
    if not is_user_model(config):
        return
    plan = constructor_plan(config)
    refused = [n for n in plan.unmapped if n in given]
    if refused:
        lm, option = refused[0], given[refused[0]]
        where = f"{plan.config_class.__name__} has" if plan.how == "config" else "its constructor takes"
        raise LmsysError(f"{option}: --model {config.model} has no {lm} to set ({where} none of "
                         f"{', '.join(ALIASES[lm])}); leave {option} out, or set its own name in --model-kwargs")


def describe_user(config) -> str:
    """The header line of a user's model: what it was called with, in its own names, and how it is called."""
    plan = constructor_plan(config)
    text = plan.header()
    if "context_length" in plan.unmapped:
        text += f"; sequences of {config.context_length}"
    contract = _FORWARD.get(config)
    if contract is not None and contract.targets:
        text += (f"; forward called with {contract.targets}= (it gives only the last position's logits without "
                 "them) and its own loss")
    return text


def build_user_model(config, *, device):
    """The user's or Hugging Face's model `config.model` names, on `device`, wrapped in UserLM: the factory
    lmsys.train.build.build_model uses for such a config (build through that, not this)."""
    import torch

    plan = constructor_plan(config)
    with torch.device(device):
        if plan.how == "hf":
            import transformers

            model_cls = getattr(transformers, MODELS[config.model].hf[1])
            return _user_lm()(model_cls(plan.config_class(**plan.kwargs)), hf=True)
        factory = load_object(config.model, what="--model")
        if plan.how == "config":
            try:
                cfg = plan.config_class(**plan.kwargs)
            except Exception as exc:  # noqa: BLE001 - the user's config class: one line
                raise LmsysError(f"--model {config.model}: {plan.config_class.__name__}({', '.join(plan.kwargs)}) "
                                 f"raised {type(exc).__name__}: {' '.join(str(exc).split())}") from None
            call, shown = (lambda: factory(cfg, **dict(plan.constructor_extra))), plan.config_class.__name__
        else:
            call, shown = (lambda: factory(**plan.kwargs)), ", ".join(plan.kwargs) or "no arguments"
        try:
            model = call()
        except Exception as exc:  # noqa: BLE001 - the user's constructor: one line
            raise LmsysError(f"--model {config.model}: building it with {shown} raised "
                             f"{type(exc).__name__}: {' '.join(str(exc).split())}") from None
    if not isinstance(model, torch.nn.Module):
        from lmsys.core.parsing import a_or_an

        raise LmsysError(f"--model {config.model} returned {a_or_an(type(model).__name__)}, not a torch.nn.Module")
    contract = _FORWARD.get(config) or _probe(model, config, device=device)
    return _user_lm()(model, targets=contract.targets)


def find_blocks(model):
    """The model's list of blocks: the largest ModuleList or ModuleDict (torchtitan keeps its layers in
    one; by length, then parameters) whose children are all of one type, as a ModuleList (the list itself,
    or one over the dict's values); None when it has none of at least two."""
    import torch

    best, key = None, (1, 0)
    for module in model.modules():
        if isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)) and len(module) >= 2:
            children = list(module.values() if isinstance(module, torch.nn.ModuleDict) else module)
            if len({type(child) for child in children}) != 1:
                continue
            size = (len(module), sum(p.numel() for p in module.parameters()))
            if size > key:
                best, key = module, size
    if isinstance(best, torch.nn.ModuleDict):
        return torch.nn.ModuleList(best.values())
    return best


@dataclass(frozen=True)
class ForwardContract:
    """How the model's forward gives logits for every position: plainly (targets None), or when called with
    its `targets` keyword (nanoGPT's forward(idx, targets=None) gives the last position's only without)."""

    targets: str | None = None


_FORWARD: dict = {}  # config -> ForwardContract, from the probe of the first build (meta or real)


def logits_of(out, ids):
    """The logits in a model's output: `.logits`, the first tensor of a tuple shaped [B, S, V] (else its first
    tensor), or the tensor itself."""
    import torch

    out = getattr(out, "logits", out)
    if isinstance(out, (tuple, list)):
        tensors = [t for t in out if torch.is_tensor(t)]
        full = [t for t in tensors if t.dim() == 3 and t.shape[:2] == ids.shape]
        return (full or tensors or [out])[0]
    return out


def _probe(model, config, *, device) -> ForwardContract:
    """Call the model once on [1, S] ids (no grad, eval mode: no dropout, no RNG drawn) and learn whether it
    gives every position's logits, or needs its targets for that; the answer is cached per config. A model
    that cannot run where it was built (the meta device) is probed again on the real build."""
    import torch

    seq = min(4, config.context_length)
    ids = torch.zeros(1, seq, dtype=torch.long, device=device)
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            try:
                logits = logits_of(model(ids), ids)
            except (Exception, SystemExit):  # noqa: BLE001 - its first real step says what fails (a sys.exit too,
                return ForwardContract()  # (where a rank or the step's child process reports it as the user's)
            if not (torch.is_tensor(logits) and logits.dim() == 3 and logits.shape[0] == 1 and logits.shape[1] == 1
                    and seq > 1):
                _FORWARD[config] = ForwardContract()
                return _FORWARD[config]
            params = _parameters(model.forward) or {}
            name = next((n for n in TARGET_NAMES if n in params), None)
            if name is None:
                raise LmsysError(f"--model {config.model} returns logits for the last position only "
                                 f"({tuple(logits.shape)} for ids (1, {seq})) and its forward takes no targets: "
                                 "lmsys needs every position's logits [B, S, V] (make forward return them)")
            _FORWARD[config] = ForwardContract(targets=name)
            return _FORWARD[config]
    finally:
        model.train(was)


@lru_cache(maxsize=None)
def _user_lm():
    import torch
    import torch.nn.functional as F

    class UserLM(torch.nn.Module):
        """A user's model as the training step sees it: ids [B, S] -> logits tensor [B, S, V]. `targets`:
        the forward keyword that makes the model give every position (then `own_loss` is its loss)."""

        def __init__(self, model: torch.nn.Module, *, hf: bool = False, targets: str | None = None):
            super().__init__()
            self.model = model
            self.hf = hf
            self.targets = targets

        @property
        def layers(self):
            blocks = find_blocks(self.model)
            if blocks is None:
                raise LmsysError("this model has no list of blocks (a ModuleList of modules of one type)")
            return blocks

        def _call(self, ids, targets=None):
            if self.hf:
                return self.model(input_ids=ids, use_cache=False)
            if self.targets is not None:  # any ids of the right shape give every position's logits
                return self.model(ids, **{self.targets: ids if targets is None else targets})
            return self.model(ids)

        def forward(self, ids):
            return self._logits(self._call(ids), ids)

        def own_loss(self, ids, targets):
            """The step's loss: the model's own when it computes one from its targets, else the mean
            next-token cross-entropy of its logits (lmsys.train.step.lm_loss's)."""
            out = self._call(ids, targets)
            if self.targets is not None and isinstance(out, (tuple, list)):
                scalars = [t for t in out if torch.is_tensor(t) and t.dim() == 0]
                if scalars:
                    return scalars[0]
            logits = self._logits(out, ids)
            return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))

        @staticmethod
        def _logits(out, ids):
            logits = logits_of(out, ids)
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


TP_STYLES = ("colwise", "rowwise")  # torch's ColwiseParallel / RowwiseParallel (Hugging Face's plan words)


def tp_plan(config, plan_file: str | None = None) -> dict | None:
    """The tensor-parallel plan of `config.model`, {module pattern under UserLM: style}: `plan_file` (YAML,
    patterns relative to the model: `layers.*.attn.q: colwise`), else the plan the model declares (Hugging
    Face's config `base_model_tp_plan`, relative to its base model; a class attribute `base_model_tp_plan`
    or `tp_plan`); None when there is none. A style other than TP_STYLES is one line."""
    if plan_file is not None:
        import yaml

        path = Path(plan_file).expanduser()
        if not path.is_file():
            raise LmsysError(f"--tp-plan: no such file {plan_file}")
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise LmsysError(f"--tp-plan {plan_file}: not valid YAML ({exc.__class__.__name__})") from None
        if not isinstance(data, dict) or not data:
            raise LmsysError(f"--tp-plan {plan_file}: expected a mapping of module patterns to colwise | rowwise")
        plan, prefix, where = data, "model.", f"--tp-plan {plan_file}"
    elif _is_hf(config.model):
        plan_owner = constructor_plan(config).config_class()
        plan = getattr(plan_owner, "base_model_tp_plan", None)
        import transformers

        base = getattr(transformers, MODELS[config.model].hf[1]).base_model_prefix
        prefix, where = f"model.{base}.", f"{config.model}'s base_model_tp_plan"
    else:
        factory = load_object(config.model, what="--model")
        plan = getattr(factory, "base_model_tp_plan", None) or getattr(factory, "tp_plan", None)
        prefix, where = "model.", f"{config.model}.tp_plan"
    if not plan or not isinstance(plan, dict):
        return None
    odd = {k: v for k, v in plan.items() if v not in TP_STYLES}
    if odd:
        key, style = next(iter(odd.items()))
        raise LmsysError(f"{where}: {key}: {style!r} is not a style lmsys applies ({' | '.join(TP_STYLES)})")
    return {prefix + str(k): v for k, v in plan.items()}


def check_parallel(config, spec, *, plan_file: str | None, pp_schedule: str) -> None:
    """Before any rank starts: what a --model needs for the mesh `spec` (one line saying what is missing):
    tp a plan (`tp_plan`), pp its blocks (at least one per stage, no weight tied across them)."""
    if not is_user_model(config):
        return
    if spec.tp > 1 and tp_plan(config, plan_file) is None:
        raise LmsysError(f"--mesh {spec.label}: tp needs a tensor-parallel plan, and --model {config.model} declares "
                         "none (Hugging Face's base_model_tp_plan, or a tp_plan class attribute): give one with "
                         "--tp-plan FILE.yaml (module pattern: colwise | rowwise), or drop tp")
    if spec.pp > 1:
        where = blocks_of(config)
        count = int(where.rsplit(": ", 1)[1].split(" ")[0]) if where else 0
        if count < spec.pp:
            raise LmsysError(f"--mesh {spec.label}: pp splits --model {config.model} at its blocks, and it has "
                             + (f"{count} ({where}) for {spec.pp} stages" if where else
                                "no list of blocks (a ModuleList or ModuleDict of modules of one type)"))
        if spec.tp > 1:
            raise LmsysError(f"--mesh {spec.label}: tp and pp together on --model {config.model} are not supported "
                             "(its pipeline stages are traced graphs): use tp or pp")
        if pp_schedule == "interleaved-1f1b":
            raise LmsysError(f"--pp-schedule interleaved-1f1b on --model {config.model} is not supported: use "
                             "gpipe or 1f1b")
        tied = tied_parameters(config)
        if tied:
            raise LmsysError(f"--mesh {spec.label}: --model {config.model} ties {' and '.join(tied)} (one weight), "
                             "which pp would put on two stages: use dp or tp")


@lru_cache(maxsize=None)
def tied_parameters(config) -> tuple[str, ...]:
    """Names of the first parameter the model shares between two modules (weight tying), or ()."""
    import torch

    with torch.device("meta"):
        model = build_user_model(config, device="meta")
    seen: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen and seen[id(p)] != name:
            return seen[id(p)], name
        seen.setdefault(id(p), name)
    return ()


@lru_cache(maxsize=None)
def blocks_of(config) -> str | None:
    """'transformer.h: 48 × Block': where the model's blocks are (find_blocks, on the meta device), or None."""
    import torch

    with torch.device("meta"):
        model = build_user_model(config, device="meta")
    blocks = find_blocks(model)
    if blocks is None:
        return None
    first = blocks[0]
    path = next((name.removeprefix("model.").rsplit(".", 1)[0] for name, m in model.named_modules() if m is first),
                "?")
    return f"{path}: {len(blocks)} × {type(first).__name__}"


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
