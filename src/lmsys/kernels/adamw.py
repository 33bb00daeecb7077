"""AdamW for low-precision weights with fp32 master copies, one fused pass per tensor.

`MasterWeightAdamW` keeps, per parameter, an fp32 master copy and fp32 moments; the model's weights and
gradients stay bf16. One Triton kernel reads the bf16 gradient and the fp32 state and writes the new
state and the bf16 weight: 28 bytes per parameter, the same traffic as PyTorch's fused AdamW over fp32
weights, without autocast's per-step weight casts (6 bytes/param forward) and gradient up-casts (6 more).

Update (as torch.optim.AdamW): w ← w·(1 − lr·λ); m ← β₁m + (1 − β₁)g; v ← β₂v + (1 − β₂)g²;
w ← w − lr/(1 − β₁ᵗ) · m / (√v / √(1 − β₂ᵗ) + ε).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from lmsys.kernels import triton_compat, triton_interpreted

triton_compat.patch_interpreter()  # triton 3.6/3.7's interpreter under numpy >= 2.4


@triton.jit
def _adamw_tile(P, G, W, M, V, tile, n_elements, lr, beta1, beta2, eps, weight_decay, bias_correction1,
                sqrt_bias_correction2, BLOCK: tl.constexpr):
    offs = tl.cast(tile, tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    g = tl.load(G + offs, mask=mask).to(tl.float32)
    w = tl.load(W + offs, mask=mask)
    m = tl.load(M + offs, mask=mask)
    v = tl.load(V + offs, mask=mask)
    w = w * (1.0 - lr * weight_decay)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    w = w - (lr / bias_correction1) * m / (tl.sqrt(v) / sqrt_bias_correction2 + eps)
    tl.store(W + offs, w, mask=mask)
    tl.store(M + offs, m, mask=mask)
    tl.store(V + offs, v, mask=mask)
    tl.store(P + offs, w.to(P.dtype.element_ty), mask=mask)


@triton.jit
def _adamw_kernel(
    P, G, W, M, V,  # bf16/fp16 weight, its gradient, fp32 master, fp32 moments
    n_elements,
    lr, beta1, beta2, eps, weight_decay, bias_correction1, sqrt_bias_correction2,
    BLOCK: tl.constexpr,
    LOOP: tl.constexpr,  # a grid smaller than the tile count: each program strides over the tiles
):
    if LOOP:
        for tile in range(tl.program_id(0), tl.cdiv(n_elements, BLOCK), tl.num_programs(0)):
            _adamw_tile(P, G, W, M, V, tile, n_elements, lr, beta1, beta2, eps, weight_decay,
                        bias_correction1, sqrt_bias_correction2, BLOCK)
    else:
        _adamw_tile(P, G, W, M, V, tl.program_id(0), n_elements, lr, beta1, beta2, eps, weight_decay,
                    bias_correction1, sqrt_bias_correction2, BLOCK)


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or triton_interpreted()


def adamw_update_(param, grad, master, exp_avg, exp_avg_sq, *, step: int, lr: float, beta1: float,
                  beta2: float, eps: float, weight_decay: float, programs: int | None = None) -> None:
    """One AdamW step on one tensor, in place (Triton on CUDA or under the interpreter, else PyTorch).
    `programs` caps the Triton grid (each program then loops over tiles): a kernel that runs beside
    others keeps to that many CTAs instead of flooding every SM."""
    bc1 = 1.0 - beta1**step
    sqrt_bc2 = math.sqrt(1.0 - beta2**step)
    if _use_triton(param):
        n = param.numel()
        BLOCK = 4096
        tiles = triton.cdiv(n, BLOCK)
        grid = tiles if programs is None else max(1, min(programs, tiles))
        _adamw_kernel[(grid,)](
            param, grad, master, exp_avg, exp_avg_sq, n,
            lr, beta1, beta2, eps, weight_decay, bc1, sqrt_bc2, BLOCK=BLOCK, LOOP=grid < tiles, num_warps=8,
        )
        return
    g = grad.float()
    master.mul_(1.0 - lr * weight_decay)
    exp_avg.lerp_(g, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    master.addcdiv_(exp_avg, exp_avg_sq.sqrt().div_(sqrt_bc2).add_(eps), value=-lr / bc1)
    param.copy_(master)


class MasterWeightAdamW(torch.optim.Optimizer):
    """AdamW over low-precision parameters with fp32 master weights and moments in its state."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["master"] = p.detach().float().contiguous()  # always a copy (p may be fp32)
                    if state["master"].data_ptr() == p.data_ptr():
                        state["master"] = state["master"].clone()
                    state["exp_avg"] = torch.zeros_like(state["master"])
                    state["exp_avg_sq"] = torch.zeros_like(state["master"])
                state["step"] += 1
                if not (p.is_contiguous() and p.grad.is_contiguous()):
                    raise ValueError("MasterWeightAdamW needs contiguous parameters and gradients")
                adamw_update_(p, p.grad, state["master"], state["exp_avg"], state["exp_avg_sq"],
                              step=state["step"], lr=group["lr"], beta1=beta1, beta2=beta2,
                              eps=group["eps"], weight_decay=group["weight_decay"])
        return loss
