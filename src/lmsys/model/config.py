"""Model configuration, the named size presets (the CS336 table, plus `tiny` for CPUs), and how a
command line resolves them: the default preset and context per device, a preset or YAML plus overrides."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from lmsys.core.errors import LmsysError


@dataclass(frozen=True)
class ModelConfig:
    d_model: int
    d_ff: int
    num_layers: int
    num_heads: int
    vocab_size: int = 10_000
    context_length: int = 512
    rope_theta: float = 10_000.0
    attn_impl: str = "naive"
    num_kv_heads: int | None = None  # key/value heads (grouped-query attention); None: num_heads
    model: str = "lmsys"  # lmsys's TransformerLM, hf:NAME or pkg.module:Name (lmsys.model.user)
    model_kwargs: str = ""  # the user's model's extra keyword arguments, as JSON text

    def __post_init__(self):
        # A YAML file can carry any type: check them here, so a string or 12.5 is a one-line error.
        for name in ("d_model", "d_ff", "num_layers", "num_heads", "vocab_size", "context_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LmsysError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.rope_theta, (int, float)) or isinstance(self.rope_theta, bool) or self.rope_theta <= 0:
            raise LmsysError(f"rope_theta must be a positive number, got {self.rope_theta!r}")
        if not isinstance(self.model, str) or not isinstance(self.model_kwargs, str):
            raise LmsysError(f"model must be a model name, got {self.model!r}")
        if not isinstance(self.attn_impl, str):
            raise LmsysError(f"attn_impl must be an implementation name, got {self.attn_impl!r}")
        if self.d_model % self.num_heads:
            raise LmsysError(
                f"d_model {self.d_model} is not divisible by num_heads {self.num_heads}"
            )
        if self.num_kv_heads is not None:
            if not isinstance(self.num_kv_heads, int) or isinstance(self.num_kv_heads, bool) or self.num_kv_heads < 1:
                raise LmsysError(f"num_kv_heads must be a positive integer, got {self.num_kv_heads!r}")
            if self.num_heads % self.num_kv_heads:
                raise LmsysError(f"num_kv_heads {self.num_kv_heads} does not divide num_heads {self.num_heads}")
        if self.d_head % 2:
            raise LmsysError(f"head size d_model/num_heads = {self.d_head} must be even for RoPE")

    @property
    def d_head(self) -> int:
        return self.d_model // self.num_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: num_kv_heads, or num_heads when it is not set (plain multi-head attention)."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    def with_overrides(self, **overrides) -> "ModelConfig":
        """Return a copy with every non-None override applied (and validated)."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})

    def as_dict(self) -> dict:
        return asdict(self)


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(d_model=128, d_ff=512, num_layers=2, num_heads=4),
    "small": ModelConfig(d_model=768, d_ff=3072, num_layers=12, num_heads=12),
    "medium": ModelConfig(d_model=1024, d_ff=4096, num_layers=24, num_heads=16),
    "large": ModelConfig(d_model=1280, d_ff=5120, num_layers=36, num_heads=20),
    "xl": ModelConfig(d_model=1600, d_ff=6400, num_layers=48, num_heads=25),
    "2.7b": ModelConfig(d_model=2560, d_ff=10240, num_layers=32, num_heads=32),
    "10b": ModelConfig(d_model=4608, d_ff=12288, num_layers=50, num_heads=36),
}


def default_size(device_type: str) -> str:
    """`small` on a GPU; `tiny` on a CPU so that the quick start measures something real in seconds."""
    return "small" if device_type == "cuda" else "tiny"


def default_context_length(device_type: str) -> int:
    """`ddp train`'s default context: the presets' 512 on GPUs, 128 for the gloo processes on a CPU."""
    return 512 if device_type == "cuda" else 128


def resolve_configs(sizes: list[str], *, context_length: int, vocab_size: int | None = None,
                    d_model: int | None = None, d_ff: int | None = None, layers: int | None = None,
                    heads: int | None = None, attn_impl: str | None = None, model: str | None = None,
                    model_kwargs: str = "") -> list[tuple[str, ModelConfig]]:
    """Preset names (or YAML files) with the command-line overrides applied; all validated up front.
    `attn_impl`: None keeps each config's own (a preset's naive, or what its YAML says).
    `model`: lmsys.model.user's name (lmsys, hf:NAME, pkg.module:Name), built with the preset's sizes."""
    from lmsys.kernels.attention import check_impl
    from lmsys.model.user import SIZE_OPTIONS, check_builds, check_sizes_taken, with_model

    if attn_impl is not None:
        check_impl(attn_impl)
    if context_length < 1:
        raise LmsysError(f"--context-length must be >= 1, got {context_length}")
    out = []
    for name in sizes:
        cfg = get_config(name).with_overrides(
            d_model=d_model, d_ff=d_ff, num_layers=layers, num_heads=heads, vocab_size=vocab_size,
            context_length=context_length,
        )
        impl = cfg.attn_impl if attn_impl is None else attn_impl
        cfg = with_model(cfg.with_overrides(attn_impl=check_impl(impl, d_head=cfg.d_head)), model, model_kwargs)
        check_builds(cfg)
        given = {"d_model": d_model, "d_ff": d_ff, "num_layers": layers, "num_heads": heads, "vocab_size": vocab_size}
        check_sizes_taken(cfg, {k: SIZE_OPTIONS[k] for k, v in given.items() if v is not None})
        out.append((name, cfg))
    return out


def resolve_size(size: str | None, context_length: int | None, *, backend: str, dtype: str,
                 model: str | None = None, model_kwargs: str = "") -> tuple[str, int]:
    """(size, context length) of the model a multi-process run (`ddp train`, `parallel train`) builds,
    resolved and checked once in the launching process (not on every rank): the defaults for the
    backend's device, the dtype on that device, a bad preset or YAML, a --model that does not build."""
    from lmsys.core.devices import check_dtype_for_device, resolve_device

    device_type = "cuda" if backend == "nccl" else "cpu"
    check_dtype_for_device(dtype, resolve_device(device_type))
    size = size or default_size(device_type)
    if context_length is None:  # an explicit 0 must reach the check, not become the default
        context_length = default_context_length(device_type)
    resolve_configs([size], context_length=context_length, model=model, model_kwargs=model_kwargs)
    return size, context_length


def get_config(name: str) -> ModelConfig:
    """A preset by name, or a YAML file (keys are ModelConfig fields; `preset:` as a base)."""
    if not isinstance(name, str):
        raise LmsysError(f"model size must be a preset name or a .yaml path, got {name!r}")
    if name in PRESETS:
        return PRESETS[name]
    if name.endswith((".yaml", ".yml")):
        return config_from_yaml(name)
    raise LmsysError(f"unknown model size {name!r}; presets: {', '.join(PRESETS)} (or a .yaml file)")


def config_from_yaml(path: str | Path, *, _chain: tuple[Path, ...] = ()) -> ModelConfig:
    """A ModelConfig from a YAML mapping of its fields. `preset:` names a base: a preset, or another
    YAML file, relative to this file's folder; a chain of files that comes back to itself is an error."""
    import yaml

    path = Path(path)
    if path.is_dir():
        raise LmsysError(f"model config {path} is a directory, not a .yaml file")
    if not path.is_file():
        raise LmsysError(f"model config file {path} does not exist")
    resolved = path.resolve()
    if resolved in _chain:
        cycle = " -> ".join(p.name for p in (*_chain, resolved))
        raise LmsysError(f"{path}: `preset:` chain comes back to itself ({cycle})")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise LmsysError(f"{path}: not valid YAML ({exc.__class__.__name__})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise LmsysError(f"{path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    if not isinstance(data, dict):
        raise LmsysError(f"{path}: expected a mapping of ModelConfig fields")
    odd = [k for k in data if not isinstance(k, str)]
    if odd:
        raise LmsysError(f"{path}: keys must be ModelConfig field names, got {', '.join(map(repr, odd))}")
    base = data.pop("preset", None)
    known = {f.name for f in fields(ModelConfig)}
    unknown = set(data) - known
    if unknown:
        raise LmsysError(f"{path}: unknown keys {sorted(unknown)}; known: {sorted(known)}")
    _check_names(path, data)
    if base is not None:
        if not isinstance(base, str):
            raise LmsysError(f"{path}: `preset:` must be a preset name or a .yaml path, got {base!r}")
        if base in PRESETS:
            return _in_file(path, lambda: PRESETS[base].with_overrides(**data))
        if base.endswith((".yaml", ".yml")):
            base_path = Path(base).expanduser()
            if not base_path.is_absolute():
                base_path = path.parent / base_path  # relative to the file that names it
            parent = config_from_yaml(base_path, _chain=(*_chain, resolved))
            return _in_file(path, lambda: parent.with_overrides(**data))
        raise LmsysError(f"{path}: unknown `preset:` {base!r}; presets: {', '.join(PRESETS)} (or a .yaml file)")
    missing = {"d_model", "d_ff", "num_layers", "num_heads"} - set(data)
    if missing:
        raise LmsysError(f"{path}: missing keys {sorted(missing)} (or give `preset:` as a base)")
    return _in_file(path, lambda: ModelConfig(**data))


def _check_names(path: Path, data: dict) -> None:
    """A YAML's `attn_impl:` and `model:` are refused as the command line refuses --impl and --model
    (torch-free, before any work), in one line naming the file and the key."""
    from lmsys.kernels.registry import check_name
    from lmsys.model.user import check_model

    if isinstance(data.get("attn_impl"), str):
        check_name(data["attn_impl"], what=f"{path}: attn_impl")
    if isinstance(data.get("model"), str):
        check_model(data["model"], what=f"{path}: model")


def _in_file(path: Path, build):
    """build(), with a bad value's message (`d_model must be a positive integer`) naming the file."""
    try:
        return build()
    except LmsysError as exc:
        raise LmsysError(f"{path}: {exc.message}", hint=exc.hint) from None


def parameter_count_formula(cfg: ModelConfig) -> int:
    """Closed form: embedding + layers (Q and out 2D², K and V 2·D·Hkv·d_head, SwiGLU 3·D·F, two norms) +
    final norm + LM head."""
    D, F, V, L = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.num_layers
    kv = cfg.kv_heads * cfg.d_head
    return V * D + L * (2 * D * D + 2 * D * kv + 3 * D * F + 2 * D) + D + D * V
