"""Attention implementations by name: lmsys's own, a CS336 adapters module's, and import paths.

Torch-free, so that the CLI lists and validates names before torch loads. `ATTENTION` is one
`lmsys.core.registry.Registry` of `AttentionSpec`s: each says what a command asks of the implementation
(its layout, grouped-query support, how it holds the scores, what device and install it needs, its head
dims, whether a user's PyTorch version may ignore is_causal) and which module provides its function.
`lmsys.kernels.attention` fills `IMPLS` with lmsys's functions when it is imported, and
`lmsys.profiling.nvtx` adds `annotated` (kernels import nothing above them). A user's attention joins
`IMPLS` under the name the user gave (`yours-torch`, `yours-triton` through `--adapters`, or
`pkg.module:Name` / `file.py:Name`) when `resolve` loads it: an `autograd.Function` subclass (called
`.apply(q, k, v, is_causal)`) or any callable `(q, k, v, is_causal) -> o`. Users' functions take
[batch, seq, d] (CS336's contract): `attention()` flattens leading dims and repeats shared heads for them.
`NAMES`, `ADAPTER_NAMES` and `REPEAT_KV` (lmsys.kernels.attention) are views of the specs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from lmsys.core.errors import LmsysError
from lmsys.core.imports import NotImplementedByUser, load_module, load_object
from lmsys.core.registry import Registry, Spec


@dataclass(frozen=True)
class AttentionSpec(Spec):
    """One attention implementation and what commands ask of it."""

    layout: str = "heads"  # heads: q [..., heads, n, d]; bsd: a user's [batch, seq, d] (three_d folds heads in)
    grouped_query: bool = True  # takes k, v with fewer heads than q as they are; False: repeated to q's first
    scores: str = "flash"  # naive (the chain of ops) | materialized (one s×s matrix, fused softmax) | flash (O(s))
    needs_cuda: bool = False  # CUDA tensors only
    interpreter: bool = False  # ...or any device under Triton's interpreter (TRITON_INTERPRET=1)
    needs_triton: bool = False  # the [triton] extra (refused up front without it)
    runs_triton: bool = False  # Triton code: runs where Triton runs (a GPU, or its interpreter)
    flash: bool = False  # lmsys's own FlashAttention-2 (flash check's subjects)
    triton_kernel: bool = False  # lmsys's Triton kernels: their head dims, fp32 to FP32_MAX_HEAD_DIM, tiles, --policy
    adapters: Optional[str] = None  # the CS336 adapters' getter of the autograd.Function (needs --adapters)
    may_ignore_causal: bool = False  # the handout lets this (a user's PyTorch FA2) ignore is_causal
    provider: str = "lmsys.kernels.attention"  # the module that puts the function in IMPLS when imported

    @property
    def user(self) -> bool:
        """A user's implementation ([batch, seq, d], a user's fp32 tolerance)."""
        return self.layout == "bsd"

    def check_head_dim(self, d: int) -> None:
        """Fail before any work on a head dim the implementation cannot take."""
        if self.triton_kernel:
            from lmsys.kernels.flash import check_head_dim

            check_head_dim(d)

    def check_device(self, device) -> None:
        """Fail before any work when the device (or this install) cannot run it: Triton's missing, or no
        CUDA (and no interpreter)."""
        if self.needs_triton:
            from lmsys.kernels.requirements import require_triton

            require_triton(self.name)
        if self.triton_kernel:
            from lmsys.kernels.flash import check_device

            check_device(device)

    def function(self, *, adapters: str | None = None) -> Callable:
        """The implementation, loaded now (see `resolve`)."""
        return resolve(self.name, adapters=adapters)


def _user_spec(name: str) -> AttentionSpec:
    return AttentionSpec(name, "your attention", layout="bsd", grouped_query=False)


ATTENTION: Registry[AttentionSpec] = Registry(
    "attention implementation", option="--impl", from_path=_user_spec,
    path_help="your autograd.Function (.apply(q, k, v, is_causal)) or callable, or path/to/file.py:Name",
    qualifier=lambda s: "with --adapters" if s.adapters else None)
for _spec in (
    AttentionSpec("naive", "softmax(q kᵀ/√d) v with the score matrix materialised (the assignment's baseline)",
                  grouped_query=False, scores="naive"),
    AttentionSpec("compiled", "naive under torch.compile", grouped_query=False, scores="materialized"),
    AttentionSpec("sdpa", "torch scaled_dot_product_attention (torch picks the backend)"),
    AttentionSpec("sdpa-flash", "SDPA pinned to its FlashAttention-2 backend (GPU)", needs_cuda=True),
    AttentionSpec("sdpa-cudnn", "SDPA pinned to cuDNN attention (GPU)", needs_cuda=True),
    AttentionSpec("sdpa-efficient", "SDPA pinned to memory-efficient attention"),
    AttentionSpec("sdpa-math", "SDPA pinned to its math backend", scores="materialized"),
    AttentionSpec("flash-torch", "lmsys FlashAttention-2 in PyTorch (FlashAttentionTorch)", flash=True),
    AttentionSpec("flash-triton", "lmsys FlashAttention-2 in Triton (FlashAttentionTriton; GPU or TRITON_INTERPRET=1)",
                  flash=True, triton_kernel=True, needs_cuda=True, interpreter=True, needs_triton=True,
                  runs_triton=True),
    AttentionSpec("annotated", "naive math in NVTX / record_function ranges (profile nsys --annotate-attention)",
                  grouped_query=False, scores="naive", provider="lmsys.profiling.nvtx"),
    # CS336 adapters: the function returning the autograd.Function
    AttentionSpec("yours-torch", "--adapters: your get_flashattention_autograd_function_pytorch()", layout="bsd",
                  grouped_query=False, adapters="get_flashattention_autograd_function_pytorch",
                  may_ignore_causal=True),
    AttentionSpec("yours-triton", "--adapters: your get_flashattention_autograd_function_triton()", layout="bsd",
                  grouped_query=False, adapters="get_flashattention_autograd_function_triton", runs_triton=True),
):
    ATTENTION.add(_spec)

# name -> fn(q, k, v, is_causal): lmsys's once their provider is imported, a user's once resolved
IMPLS: dict[str, Callable] = {}
NAMES: dict[str, str] = {s.name: s.help for s in ATTENTION.values() if not s.adapters}  # lmsys's own
_PROVIDER = {s.name: s.provider for s in ATTENTION.values() if s.provider != "lmsys.kernels.attention"}
ADAPTER_NAMES: dict[str, str] = {s.name: s.adapters for s in ATTENTION.values() if s.adapters}  # row -> getter
USER: set[str] = set()  # names in IMPLS that are a user's (they take [batch, seq, d])
_FROM: dict[str, str] = {}  # yours-* -> the adapters module it was loaded from


def spec(name: str) -> AttentionSpec:
    """The spec of a registered name, or a user's for an import path (nothing is loaded)."""
    return ATTENTION[name] if name in ATTENTION else _user_spec(name)


def register(name: str, fn: Callable | None = None):
    """`register(name, fn)`, or `@register(name)` on fn(q, k, v, is_causal) -> out. Returns fn."""
    if fn is None:
        return lambda f: register(name, f)
    IMPLS[name] = fn
    return fn


def listing(*, adapters: bool = True) -> list[tuple[str, str]]:
    """(name, description) of every name `--impl` / `--attn` accepts."""
    return ATTENTION.listing(where=None if adapters else (lambda s: not s.adapters))


def check_name(name: str, *, adapters: str | None = None, what: str = "attention implementation") -> str:
    """Fail before torch loads on a name that is none of lmsys's, `yours-*` without --adapters, or a
    malformed import path."""
    ATTENTION.check(name, what=what)
    if name in ATTENTION and ATTENTION[name].adapters and adapters is None:
        raise LmsysError(f"{what} {name} is your adapters' attention: add --adapters PATH "
                         "(a .py file or a module name)")
    return name


def resolve(name: str, *, adapters: str | None = None) -> Callable:
    """The function for `name`, loaded (and put in IMPLS) now. A user's getter that raises
    NotImplementedError, or is missing, gives a function that raises NotImplementedByUser."""
    check_name(name, adapters=adapters)
    got = ATTENTION.get(name)
    getter = got.adapters if got is not None else None
    if name in IMPLS and (getter is None or adapters is None or _FROM.get(name) == adapters):
        return IMPLS[name]
    if got is not None and getter is None:  # lmsys's: its provider registers it when imported
        import importlib

        importlib.import_module(got.provider)
        return IMPLS[name]
    if getter is not None:
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
