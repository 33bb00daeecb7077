"""Attention implementations by name: lmsys's own, a CS336 adapters module's, and import paths.

Torch-free, so that the CLI lists and validates names before torch loads. `NAMES` holds lmsys's own
names with one line each; `lmsys.kernels.attention` fills `IMPLS` with their functions when it is
imported, and `lmsys.profiling.nvtx` adds `annotated` (kernels import nothing above them). A user's
attention joins `IMPLS` under the name the user gave (`yours-torch`, `yours-triton` through `--adapters`,
or `pkg.module:Name` / `file.py:Name`) when `resolve` loads it: an `autograd.Function` subclass (called
`.apply(q, k, v, is_causal)`) or any callable `(q, k, v, is_causal) -> o`. Users' functions take
[batch, seq, d] (CS336's contract): `attention()` flattens leading dims and repeats shared heads for them.
"""

from __future__ import annotations

from typing import Callable

from lmsys.core.errors import LmsysError
from lmsys.core.imports import NotImplementedByUser, is_import_path, load_module, load_object

IMPLS: dict[str, Callable] = {}

NAMES: dict[str, str] = {
    "naive": "softmax(q kᵀ/√d) v with the score matrix materialised (the assignment's baseline)",
    "compiled": "naive under torch.compile",
    "sdpa": "torch scaled_dot_product_attention (torch picks the backend)",
    "sdpa-flash": "SDPA pinned to its FlashAttention-2 backend (GPU)",
    "sdpa-cudnn": "SDPA pinned to cuDNN attention (GPU)",
    "sdpa-efficient": "SDPA pinned to memory-efficient attention",
    "sdpa-math": "SDPA pinned to its math backend",
    "flash-torch": "lmsys FlashAttention-2 in PyTorch (FlashAttentionTorch)",
    "flash-triton": "lmsys FlashAttention-2 in Triton (FlashAttentionTriton; GPU or TRITON_INTERPRET=1)",
    "annotated": "naive math in NVTX / record_function ranges (profile nsys --annotate-attention)",
}
_PROVIDER = {"annotated": "lmsys.profiling.nvtx"}  # the module that registers a name; else kernels.attention

# CS336 adapters: row name -> the function returning the autograd.Function
ADAPTER_NAMES: dict[str, str] = {
    "yours-torch": "get_flashattention_autograd_function_pytorch",
    "yours-triton": "get_flashattention_autograd_function_triton",
}
USER: set[str] = set()  # names in IMPLS that are a user's (they take [batch, seq, d])
_FROM: dict[str, str] = {}  # yours-* -> the adapters module it was loaded from


def register(name: str, fn: Callable | None = None):
    """`register(name, fn)`, or `@register(name)` on fn(q, k, v, is_causal) -> out. Returns fn."""
    if fn is None:
        return lambda f: register(name, f)
    IMPLS[name] = fn
    return fn


def listing(*, adapters: bool = True) -> list[tuple[str, str]]:
    """(name, description) of every name `--impl` / `--attn` accepts."""
    rows = list(NAMES.items())
    if adapters:
        rows += [(name, f"--adapters: your {fn}()") for name, fn in ADAPTER_NAMES.items()]
    rows.append(("pkg.module:Name", "your autograd.Function (.apply(q, k, v, is_causal)) or callable, "
                 "or path/to/file.py:Name"))
    return rows


def check_name(name: str, *, adapters: str | None = None, what: str = "attention implementation") -> str:
    """Fail before torch loads on a name that is none of lmsys's, `yours-*` without --adapters, or a
    malformed import path."""
    if name in NAMES or is_import_path(name):
        return name
    if name in ADAPTER_NAMES:
        if adapters is None:
            raise LmsysError(f"{what} {name} is your adapters' attention: add --adapters PATH "
                             "(a .py file or a module name)")
        return name
    raise LmsysError(f"{what} must be one of {', '.join(NAMES)}, {', '.join(ADAPTER_NAMES)} (with "
                     f"--adapters) or pkg.module:Name, not {name!r}")


def resolve(name: str, *, adapters: str | None = None) -> Callable:
    """The function for `name`, loaded (and put in IMPLS) now. A user's getter that raises
    NotImplementedError, or is missing, gives a function that raises NotImplementedByUser."""
    check_name(name, adapters=adapters)
    if name in IMPLS and (name not in ADAPTER_NAMES or adapters is None or _FROM.get(name) == adapters):
        return IMPLS[name]
    if name in NAMES:
        import importlib

        importlib.import_module(_PROVIDER.get(name, "lmsys.kernels.attention"))
        return IMPLS[name]
    if name in ADAPTER_NAMES:
        getter = ADAPTER_NAMES[name]
        _FROM[name] = adapters
        module = load_module(adapters, what="--adapters")
        try:
            obj = getattr(module, getter)()
        except (NotImplementedError, AttributeError) as exc:
            if isinstance(exc, AttributeError) and hasattr(module, getter):
                raise
            return _install(name, _not_implemented(getter))
        return _install(name, _as_attention(obj, label=getter, what=f"{getter}()"))
    return _install(name, _as_attention(load_object(name, what="--impl"), label=name, what=name))


def _install(name: str, fn: Callable) -> Callable:
    IMPLS[name] = fn
    USER.add(name)
    return fn


def _not_implemented(label: str) -> Callable:
    def run(q, k, v, is_causal):
        raise NotImplementedByUser(label)

    return run


def _as_attention(obj, *, label: str, what: str) -> Callable:
    """fn(q, k, v, is_causal) over a user's autograd.Function class or callable; NotImplementedError
    inside it becomes NotImplementedByUser(label)."""
    fn = obj.apply if isinstance(obj, type) and hasattr(obj, "apply") else obj
    if not callable(fn):
        from lmsys.core.parsing import a_or_an

        raise LmsysError(f"{what} is {a_or_an(type(obj).__name__)}, not an autograd.Function or a callable "
                         "(q, k, v, is_causal) -> o")

    def run(q, k, v, is_causal):
        from lmsys.kernels import triton_compat

        triton_compat.patch_interpreter()  # a user's Triton kernel on triton 3.6/3.7's interpreter, numpy >= 2.4
        try:
            return fn(q, k, v, is_causal)
        except NotImplementedError as exc:  # the course's stub; or Triton's own, for an API it removed
            raise (triton_compat.missing_api(exc) or NotImplementedByUser(label)) from None

    return run


def three_d(fn: Callable, q, k, v, is_causal):
    """Call a user's [batch, seq, d] attention on q [..., n_q, d], k, v [..., n_k, d]: k, v repeated to
    q's heads (dim -3) when they have fewer, leading dims flattened into one, the output shaped back."""
    if q.dim() == 3 and k.shape[0] == q.shape[0]:
        return fn(q, k, v, is_causal)
    if q.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        k, v = (x.repeat_interleave(q.shape[-3] // x.shape[-3], dim=-3) for x in (k, v))
    lead, (n_q, d) = q.shape[:-2], q.shape[-2:]
    out = fn(q.reshape(-1, n_q, d), k.reshape(-1, *k.shape[-2:]), v.reshape(-1, *v.shape[-2:]), is_causal)
    return out.reshape(*lead, n_q, out.shape[-1])
