"""Tensor and sequence parallelism written out, Megatron style, applied to a TransformerLM from outside.

`apply_tensor_parallel(model, group, sequence_parallel=False)` replaces, in place, each block's attention
and SwiGLU and the embedding / LM head with sharded modules built from the full (identical on every rank)
weights:
- q/k/v column-parallel: the fused `qkv_proj` rows [q heads | k heads | v heads] are taken head group by
  head group (rank r keeps query heads r·H/tp ... and their key/value heads), so no model change is
  needed. Key/value heads are split when tp divides them; otherwise (tp a multiple of them) every rank
  keeps all of them in a replicated `kv_proj` and reads the ones its query heads use; that weight's
  gradient is partial per rank and is all-reduced in backward (`copy_to_tp` on the weight).
- attention output and w2 row-parallel; w1 and w3 column-parallel.
- `copy_to_tp` (identity forward, all-reduce backward) before each column-parallel pair and
  `reduce_from_tp` (all-reduce forward, identity backward) after each row-parallel linear: Megatron's f/g.
- vocab-parallel embedding (rows of the vocabulary; out-of-range ids give zeros, then the sum over ranks)
  and LM head (columns of the vocabulary) with `vocab_parallel_cross_entropy`: max, sum of exponentials
  and the target logit are reduced over the group, so no rank ever holds [tokens, vocab] logits.
- sequence_parallel: the norms and residuals run on [B, S/tp, D] sequence shards; `gather_seq`
  (all-gather forward, reduce-scatter backward) before a column-parallel linear, `scatter_seq`
  (reduce-scatter forward, all-gather backward) after a row-parallel one. A norm weight sees only its
  shard's tokens, so its gradient is all-reduced (`copy_to_tp` on the weight).

`timed_collectives(timer)`: while active, every collective here is a region "tp" of that RegionTimer.
`model.tp_layout[name] = (dim, index)`: the rows/columns of the full parameter `name` this rank holds
(absent: a full copy), for gathering the full model (`gather_full_parameters`).
Limits: sequence length divisible by tp with sequence parallelism; no weight tying.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from lmsys.model.transformer import CausalSelfAttention, TransformerLM

# ------------------------------------------------------------------------------- the conjugate ops

_TIMER = [None]  # a core.timing.RegionTimer while `timed_collectives` is active: every collective below in region "tp"


@contextmanager
def timed_collectives(timer):
    """Time every tensor-parallel collective (forward, backward, the loss's) in `timer`'s region "tp"."""
    _TIMER[0] = timer
    try:
        yield
    finally:
        _TIMER[0] = None


def _region():
    return nullcontext() if _TIMER[0] is None else _TIMER[0].region("tp")


def _all_reduce(x, group, op=dist.ReduceOp.SUM):
    x = x.contiguous()
    with _region():
        dist.all_reduce(x, op=op, group=group)
    return x


def _all_gather(x, dim, group):
    world = dist.get_world_size(group)
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((world * x.shape[0], *x.shape[1:]))
    with _region():
        dist.all_gather_into_tensor(out, x, group=group)
    return out.movedim(0, dim)


def _reduce_scatter(x, dim, group):
    world = dist.get_world_size(group)
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
    with _region():
        dist.reduce_scatter_tensor(out, x, group=group)
    return out.movedim(0, dim)


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSeq(torch.autograd.Function):
    """Sequence shards -> full sequence (all-gather); backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, 1, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, 1, ctx.group), None


class _ScatterSeq(torch.autograd.Function):
    """Partial sums of the full sequence -> this rank's summed sequence shard (reduce-scatter); backward all-gathers."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, 1, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, 1, ctx.group), None


def copy_to_tp(x, group):
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x, group):
    return _ReduceFromTP.apply(x, group)


def gather_seq(x, group):
    return _GatherSeq.apply(x, group)


def scatter_seq(x, group):
    return _ScatterSeq.apply(x, group)


class _TPContext:
    """The group and mode every sharded module shares: the input to a column-parallel pair, the output
    of a row-parallel linear."""

    def __init__(self, group, sequence_parallel: bool):
        self.group, self.sp = group, sequence_parallel
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def enter(self, x):  # [B, S/tp or S, D] -> [B, S, D] replicated, grads summed over the group
        return gather_seq(x, self.group) if self.sp else copy_to_tp(x, self.group)

    def leave(self, partial):  # partial sums [B, S, D] -> [B, S/tp or S, D]
        return scatter_seq(partial, self.group) if self.sp else reduce_from_tp(partial, self.group)


# ------------------------------------------------------------------------------------ sharded modules


def _param(full: torch.Tensor, index: torch.Tensor | None, dim: int = 0) -> nn.Parameter:
    data = full.detach() if index is None else full.detach().index_select(dim, index.to(full.device))
    return nn.Parameter(data.clone())


class TPAttention(CausalSelfAttention):
    """`attn`'s heads split over the tp group (Megatron): q, k, v column-parallel (each rank its heads),
    the output row-parallel (partial sums, reduced on the way out); the attention is CausalSelfAttention's."""

    def __init__(self, attn: nn.Module, tp: _TPContext, layout: dict, prefix: str):
        nn.Module.__init__(self)  # the projections are this rank's rows of `attn`'s, not built from a config
        self.tp, self.attn_impl, self.d_head = tp, attn.attn_impl, attn.d_head
        H, Hkv, d, r, n = attn.num_heads, attn.kv_heads, attn.d_head, tp.rank, tp.size
        self.num_heads = H // n
        heads = torch.arange(r * self.num_heads, (r + 1) * self.num_heads)
        rows = lambda hs, base: (base + hs[:, None] * d + torch.arange(d)).reshape(-1)  # noqa: E731
        w = attn.qkv_proj.weight
        self.split_kv = Hkv % n == 0
        if self.split_kv:
            self.kv_heads = Hkv // n
            kv = torch.arange(r * self.kv_heads, (r + 1) * self.kv_heads)
            index = torch.cat([rows(heads, 0), rows(kv, H * d), rows(kv, (H + Hkv) * d)])
            self.qkv_proj = _Linear(_param(w, index))
            layout[f"{prefix}.qkv_proj.weight"] = (f"{prefix}.qkv_proj.weight", 0, index)
        else:  # tp a multiple of Hkv: keep every k/v head, read those of this rank's query heads
            self.kv_heads = 1
            index = rows(heads, 0)
            self.qkv_proj = _Linear(_param(w, index))
            kv_index = torch.arange(H * d, (H + 2 * Hkv) * d)
            self.kv_proj = _Linear(_param(w, kv_index))
            layout[f"{prefix}.qkv_proj.weight"] = (f"{prefix}.qkv_proj.weight", 0, index)
            layout[f"{prefix}.kv_proj.weight"] = (f"{prefix}.qkv_proj.weight", 0, kv_index)
            self.kv_head = (r * self.num_heads) // (H // Hkv)  # the one key/value head this rank's queries read
            self.all_kv = Hkv
        cols = rows(heads, 0)
        self.output_proj = _Linear(_param(attn.output_proj.weight, cols, 1))
        layout[f"{prefix}.output_proj.weight"] = (f"{prefix}.output_proj.weight", 1, cols)

    def project(self, x):
        x = self.tp.enter(x)  # [B, S, D]
        if self.split_kv:
            return super().project(x)  # this rank's H/tp query and Hkv/tp key/value heads
        q = rearrange(self.qkv_proj(x), "b s (h d) -> b h s d", d=self.d_head)
        w = copy_to_tp(self.kv_proj.weight, self.tp.group)  # each rank's gradient is partial: sum it
        k, v = rearrange(F.linear(x, w), "b s (h d) -> b h s d", d=self.d_head).split(self.all_kv, dim=1)
        return q, k[:, self.kv_head:self.kv_head + 1], v[:, self.kv_head:self.kv_head + 1]

    def project_out(self, out):  # [B, S, H/tp·d_head] -> partial sums -> [B, S/tp or S, D]
        return self.tp.leave(self.output_proj(out))


class TPSwiGLU(nn.Module):
    def __init__(self, ffn: nn.Module, tp: _TPContext, layout: dict, prefix: str):
        super().__init__()
        self.tp = tp
        n = ffn.w1.weight.shape[0] // tp.size
        index = torch.arange(tp.rank * n, (tp.rank + 1) * n)
        self.w1 = _Linear(_param(ffn.w1.weight, index))
        self.w3 = _Linear(_param(ffn.w3.weight, index))
        self.w2 = _Linear(_param(ffn.w2.weight, index, 1))
        for name, dim in (("w1", 0), ("w3", 0), ("w2", 1)):
            layout[f"{prefix}.{name}.weight"] = (f"{prefix}.{name}.weight", dim, index)

    def forward(self, x):
        x = self.tp.enter(x)
        return self.tp.leave(self.w2(F.silu(self.w1(x)) * self.w3(x)))


class SPNorm(nn.Module):
    """RMSNorm on a sequence shard: the same math, the weight's gradient summed over the group."""

    def __init__(self, norm: nn.Module, tp: _TPContext):
        super().__init__()
        self.tp, self.eps = tp, norm.eps
        self.weight = norm.weight

    def forward(self, x):
        in_dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * copy_to_tp(self.weight, self.tp.group).float()).to(in_dtype)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, emb: nn.Module, tp: _TPContext, layout: dict, prefix: str):
        super().__init__()
        self.tp = tp
        n = emb.weight.shape[0] // tp.size
        self.start, self.end = tp.rank * n, (tp.rank + 1) * n
        index = torch.arange(self.start, self.end)
        self.weight = _param(emb.weight, index)
        layout[f"{prefix}.weight"] = (f"{prefix}.weight", 0, index)

    def forward(self, token_ids):  # [B, S] -> [B, S/tp or S, D]
        outside = (token_ids < self.start) | (token_ids >= self.end)
        local = (token_ids - self.start).masked_fill(outside, 0)
        partial = self.weight[local] * (~outside).unsqueeze(-1).to(self.weight.dtype)
        return scatter_seq(partial, self.tp.group) if self.tp.sp else reduce_from_tp(partial, self.tp.group)


class VocabParallelHead(nn.Module):
    """The LM head's vocabulary columns; forward returns this rank's logits [B, S, V/tp]."""

    def __init__(self, head: nn.Module, tp: _TPContext, layout: dict, prefix: str):
        super().__init__()
        self.tp = tp
        n = head.weight.shape[0] // tp.size
        self.start = tp.rank * n
        index = torch.arange(self.start, self.start + n)
        self.weight = _param(head.weight, index)
        layout[f"{prefix}.weight"] = (f"{prefix}.weight", 0, index)

    def forward(self, h):
        return F.linear(self.tp.enter(h), self.weight)


class _Linear(nn.Module):
    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight

    def forward(self, x):
        return F.linear(x, self.weight)


# ------------------------------------------------------------------------------ vocab-parallel loss


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, start, group):
        # logits [N, V/tp] (this rank's columns), targets [N] global ids -> per-token loss [N]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 -> fp32, fp64 stays
        m = _all_reduce(logits.max(dim=-1).values, group, dist.ReduceOp.MAX)
        shifted = logits - m.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = _all_reduce(exp.sum(-1), group)
        n = logits.shape[-1]
        local = targets - start
        here = (local >= 0) & (local < n)
        local = local.masked_fill(~here, 0)
        target_logit = _all_reduce(shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * here, group)
        ctx.save_for_backward(exp, sum_exp, local, here)
        return sum_exp.log() - target_logit  # log Σ exp - z_target

    @staticmethod
    def backward(ctx, grad):  # d loss_i / d z_ij = softmax_ij - [j = target_i]
        exp, sum_exp, local, here = ctx.saved_tensors
        g = exp / sum_exp.unsqueeze(-1)
        g.scatter_add_(-1, local.unsqueeze(-1), -here.to(g.dtype).unsqueeze(-1))
        return g * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor, *, vocab_start: int,
                                 group) -> torch.Tensor:
    """Mean cross-entropy of [..., V/tp] logit shards (columns vocab_start...) against global target ids;
    the same value on every rank of `group`, equal to F.cross_entropy of the full logits."""
    losses = _VocabParallelCE.apply(local_logits.flatten(0, -2), targets.flatten(), vocab_start, group)
    return losses.mean()


# ------------------------------------------------------------------------------------------ applying


def apply_tensor_parallel(model: TransformerLM, group, *, sequence_parallel: bool = False) -> TransformerLM:
    """Shard `model` in place over `group` (see the module docstring); returns it, with `tp_layout`,
    `tp_loss(inputs, targets)` reading the sharded head, and `tp` (the shared context)."""
    tp = _TPContext(group, sequence_parallel)
    layout: dict = {}
    model.tp, model.tp_layout = tp, layout
    if tp.size == 1:
        return model
    blocks = model.layers.items() if isinstance(model.layers, nn.ModuleDict) else enumerate(model.layers)
    for i, block in blocks:
        block.attn = TPAttention(block.attn, tp, layout, f"layers.{i}.attn")
        block.ffn = TPSwiGLU(block.ffn, tp, layout, f"layers.{i}.ffn")
        if sequence_parallel:
            block.ln1, block.ln2 = SPNorm(block.ln1, tp), SPNorm(block.ln2, tp)
    if getattr(model, "token_embeddings", None) is not None:
        model.token_embeddings = VocabParallelEmbedding(model.token_embeddings, tp, layout, "token_embeddings")
    if getattr(model, "lm_head", None) is not None:
        if sequence_parallel:
            model.ln_final = SPNorm(model.ln_final, tp)
        model.lm_head = VocabParallelHead(model.lm_head, tp, layout, "lm_head")
    return model


def tp_loss(model, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss from final-norm hidden states (sequence shards with SP): the vocab-parallel
    cross-entropy when the head is sharded, else the plain one."""
    head = model.lm_head
    if isinstance(head, VocabParallelHead):
        return vocab_parallel_cross_entropy(head(hidden), targets, vocab_start=head.start, group=head.tp.group)
    return F.cross_entropy(head(hidden).flatten(0, 1).float(), targets.flatten())


def seq_shard(x: torch.Tensor, tp: _TPContext) -> torch.Tensor:
    """This rank's [B, S/tp, ...] slice of a sequence (the rotary tables stay full: attention sees the whole sequence)."""
    if not tp.sp or tp.size == 1:
        return x
    n = x.shape[1] // tp.size
    return x[:, tp.rank * n:(tp.rank + 1) * n]
