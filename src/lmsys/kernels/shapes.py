"""Shape checks every attention implementation shares (imported by attention.py and the flash modules)."""

from __future__ import annotations

from lmsys.core.errors import LmsysError


def check_qkv(q, k, v, *, impl: str) -> None:
    """Shapes every implementation needs: q [..., Hq, n_q, d], k and v [..., Hkv, n_k, d], the same leading
    dims, Hq a multiple of Hkv (grouped-query attention), one dtype and device. Raises LmsysError naming
    `impl` and the shapes."""
    def shapes() -> str:  # formatted only for a message: the checks run on every attention call
        return f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"

    if q.dim() < 2 or k.dim() != q.dim() or v.dim() != q.dim():
        raise LmsysError(f"{impl}: q, k and v must be [..., n, d] with the same number of dims; got {shapes()}")
    if k.shape != v.shape or q.shape[:-3] != k.shape[:-3] or q.shape[-1] != k.shape[-1] or (
            q.dim() == 2 and q.shape[:-2] != k.shape[:-2]):
        raise LmsysError(f"{impl}: expected q [..., n_q, d] and k, v [..., n_k, d] with the same leading dims "
                         f"and d; got {shapes()}")
    if q.dim() >= 3 and q.shape[-3] % k.shape[-3]:
        raise LmsysError(f"{impl}: q has {q.shape[-3]} heads (dim -3), k and v {k.shape[-3]}: the query heads must "
                         f"be a multiple of the key/value heads ({shapes()})")
    if q.shape[-2] == 0 or k.shape[-2] == 0 or q.shape[-1] == 0:
        raise LmsysError(f"{impl}: empty sequence or head dim ({shapes()})")
    if not (q.dtype == k.dtype == v.dtype):
        raise LmsysError(f"{impl}: q, k and v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise LmsysError(f"{impl}: q, k and v must be on one device; got {q.device}, {k.device}, {v.device}")

