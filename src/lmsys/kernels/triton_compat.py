"""The Triton the user has: what it lacks, said in one line, and the interpreter bugs lmsys works around.

- Block pointers (`tl.make_block_ptr`, `tl.advance`), the API CS336's handout teaches, were removed in
  triton 3.9: the names stay and raise NotImplementedError ("Block pointers have been removed in favor of
  the tensor descriptor API"), inside an InterpreterError under TRITON_INTERPRET=1 or a CompilationError
  on a GPU. `missing_api(exc)` turns such an error from a user's kernel into `TritonTooNew`, whose
  `status` names the API, the installed version and what to install. CS336 pins torch~=2.11, which brings
  triton 3.6.
- Triton 3.6 and 3.7's interpreter converts a one-element array to an int with `int(array)`, an error
  from numpy 2.4 on ("only 0-dimensional arrays can be converted to Python scalars"): every kernel whose
  loop bounds are computed in the kernel dies in nested InterpreterErrors. `patch_interpreter()` makes
  that conversion squeeze the array first, as triton 3.8 does, so lmsys's kernels and the user's run;
  `numpy_mismatch(exc)` names both versions where the error still comes (`InterpreterNumpyError`).
- The interpreter multiplies bfloat16 tiles in tl.dot as their raw 16-bit integers (3.6 to 3.9):
  `patch_interpreter()` widens them to float32 first, so a user's correct bf16 kernel is not judged wrong
  for it (lmsys's own kernels widen them themselves).

Torch-free; Triton and numpy are imported only when a function here is called.
"""

from __future__ import annotations

import re
import traceback

from lmsys.core.errors import LmsysError

# API -> (the triton release that removed it, what to install instead)
REMOVED = {"make_block_ptr": ("3.9", "triton<3.9"), "advance": ("3.9", "triton<3.9")}
_REMOVED_TEXT = ("Block pointers have been removed",)
_SCALAR_TEXT = "only 0-dimensional arrays can be converted to Python scalars"


def triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def numpy_version() -> str | None:
    try:
        import numpy
    except ImportError:
        return None
    return numpy.__version__


class TritonTooNew(Exception):
    """A user's kernel calls an API that the installed Triton no longer has."""

    def __init__(self, api: str, version: str, removed_in: str, install: str):
        super().__init__(api)
        self.api, self.version, self.removed_in, self.install = api, version, removed_in, install

    @property
    def status(self) -> str:
        return (f"needs tl.{self.api}, removed in triton {self.removed_in} (installed: {self.version}): "
                f"pip install '{self.install}'")


class InterpreterNumpyError(LmsysError):
    """Triton's interpreter cannot run with the installed numpy (exit 2: the environment, not the code)."""


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _release(version: str) -> tuple[int, ...]:
    """'3.9.0+git1234' -> (3, 9, 0)."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def missing_api(exc: BaseException) -> TritonTooNew | None:
    """The removed Triton API `exc` (or an error it wraps) comes from, as a TritonTooNew, where the installed
    Triton is one without it; else None (an error raised inside tl.make_block_ptr on a Triton that has it,
    a block shape it refuses, is the user's)."""
    version = triton_version()
    if version is None:
        return None
    for err in _chain(exc):
        text = str(err)
        named = None
        for frame in traceback.extract_tb(err.__traceback__):  # the builtin that raised, inside triton
            if frame.name in REMOVED and "triton" in frame.filename.replace("\\", "/").split("/"):
                named = frame.name
        if named is None:
            found = re.search(r"(?:tl|language)\.(\w+)", text) or re.search(r"has no attribute '(\w+)'", text)
            if found and found.group(1) in REMOVED and ("has no attribute" in text or any(
                    t in text for t in _REMOVED_TEXT)):
                named = found.group(1)
        if named is None and any(t in text for t in _REMOVED_TEXT):
            named = "make_block_ptr"  # block pointers start there; tl.advance only moves one
        if named is not None:
            removed_in, install = REMOVED[named]
            if _release(version) < _release(removed_in):
                return None
            return TritonTooNew(named, version, removed_in, install)
    return None


def describe(exc: BaseException) -> str:
    """One line for a user's kernel that raised: `Type: message`. Triton's CompilationError carries the
    kernel's source between its position and its cause ("at 8:14: def flash_fwd_kernel(... ^ arange's range
    must be a power of 2"): the position and the cause's line, not the source."""
    text = str(exc).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if type(exc).__name__ == "CompilationError" and len(lines) > 2:
        text = f"{lines[0]} {lines[-1]}"
    return f"{type(exc).__name__}: {' '.join(text.split())}"


def numpy_mismatch(exc: BaseException) -> InterpreterNumpyError | None:
    """One-line error for Triton's interpreter failing on the installed numpy, or None."""
    if not any(_SCALAR_TEXT in str(err) for err in _chain(exc)):
        return None
    return InterpreterNumpyError(
        f"Triton {triton_version()}'s interpreter (TRITON_INTERPRET=1) does not run with numpy {numpy_version()}: "
        "it converts one-element arrays to Python ints, which numpy 2.4 made an error",
        hint="pip install 'numpy<2.4', or triton>=3.8 (the interpreter's fix)")


_PATCHED = False


def patch_interpreter() -> None:
    """Under TRITON_INTERPRET=1, two fixes to Triton's interpreter so that lmsys's kernels and the user's
    run there as compiled: (1) its tensor-to-int conversion squeezes its array first (triton 3.8's code), so
    triton 3.6 and 3.7 run under numpy >= 2.4; (2) its tl.dot widens bfloat16 operands to float32 (it
    multiplies them as their raw 16-bit integers, up to 3.9 at least: a correct bf16 kernel gives garbage).
    Idempotent; a no-op without the interpreter, without Triton, or where the interpreter is laid out
    differently."""
    global _PATCHED
    from lmsys.kernels import triton_interpreted

    if _PATCHED or not triton_interpreted():
        return
    _PATCHED = True
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    to_int = getattr(interpreter, "_patch_lang_tensor", None)
    if to_int is not None and not getattr(to_int, "_lmsys", False):
        def patched(tensor, scope, *args, **kwargs):
            to_int(tensor, scope, *args, **kwargs)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))  # restored with the rest

        patched._lmsys = True
        interpreter._patch_lang_tensor = patched
    builder, handle = getattr(interpreter, "InterpreterBuilder", None), getattr(interpreter, "TensorHandle", None)
    dot = getattr(builder, "create_dot", None)
    if dot is not None and handle is not None and not getattr(dot, "_lmsys", False):
        def widened(x):  # bf16 is held as uint16 bit patterns: the high half of a float32
            if x.dtype != tl.bfloat16:
                return x
            return handle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

        def create_dot(self, a, b, d, *args, **kwargs):
            return dot(self, widened(a), widened(b), d, *args, **kwargs)

        create_dot._lmsys = True
        builder.create_dot = create_dot
