"""What an attention implementation needs of the device and the install, asked of its spec before any work.

Torch-free until a spec needs the device checked (lmsys.kernels.flash then loads). The commands re-export
these from lmsys.commands._common under the same names.
"""

from __future__ import annotations

from typing import Optional

from lmsys.core.errors import LmsysError


def check_attention_impl(name: Optional[str], device) -> None:
    """An attention implementation the device (or this install) cannot run is the user's input, refused
    before any work: its spec says what it needs (flash-triton: Triton, the `[triton]` extra, and CUDA or
    TRITON_INTERPRET=1)."""
    if name is None:
        return
    from lmsys.kernels.registry import spec

    spec(name).check_device(device)


def require_triton(what: str) -> None:
    """One line naming the extra when Triton is not installed (a CPU install leaves it out)."""
    import importlib

    try:
        importlib.import_module("triton")
    except ImportError:
        raise LmsysError(f"{what} needs Triton, which is not installed",
                         hint="pip install 'lmsys[triton]' (torch's CUDA build brings it on a GPU machine)") from None
