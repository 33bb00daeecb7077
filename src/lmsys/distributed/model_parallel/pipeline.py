"""Pipeline parallelism written out: stages, the gpipe / 1f1b / interleaved-1f1b schedules, send/recv.

- `partition(config, chunks, ...)`: contiguous layer ranges, one per virtual stage. Balanced by cost =
  ½·(share of parameters) + ½·(share of FLOPs), the embedding counted with the first stage and the LM
  head with the last (a min-max linear partition); the interleaved schedule splits the layers equally.
- `PipelineModule`: what one pp rank holds (its chunks' blocks, the embedding on the first virtual stage,
  final norm + head on the last); parameter names stay the full model's (`layers.3.ffn.w1.weight`).
  Virtual stage s = chunk·pp + rank (Megatron's interleaving: rank r holds chunks r, r+pp, ...). The one
  stage module of both pipelines: `run_schedule` calls `chunk_forward` (the last chunk returns the loss),
  torch.distributed.pipelining calls `forward` on a module of one chunk (the last returns the logits;
  the loss is the schedule's), as model_parallel.torch_parallel builds them.
- `schedule(kind, pp=, rank=, microbatches=, virtual_stages=)`: this rank's list of ("F"|"B", chunk,
  microbatch). gpipe: every forward, then every backward. 1f1b: pp-rank-1 warm-up forwards, then one
  forward one backward, then the cool-down backwards. interleaved-1f1b: Megatron's order (microbatches
  in groups of pp, chunks cycled; warm-up 2·(pp-rank-1) + (V-1)·pp).
- `p2p_plan(kind, pp=, microbatches=, virtual_stages=)`: for every pp rank at once, the steps that run
  the schedule: in step t a rank runs at most one action, then posts its point-to-point ops of step t as
  one `dist.batch_isend_irecv`. Every op of step t is matched by its peer's opposite op in the same step,
  and a rank sends at most one tensor per step, so both ends of every pair post their ops in the same
  order (NCCL ignores tags and matches a pair's ops in posting order) and no step waits on a later one:
  no deadlock, whatever the sizes (a large NCCL send blocks until its recv is posted). Megatron-LM's
  p2p_communication.py batches the same way (send_forward_recv_backward, ...).
- `run_schedule(...)`: runs this rank's steps; activations go forward and their gradients back on the pp
  group, still tagged by (virtual stage, microbatch, direction) for gloo, which matches by tag. Returns
  the loss and the peak activation bytes the schedule held (saved tensors of forwards whose backward has
  not run yet); the compute and the waits on batches that hold a needed recv go to the caller's
  RegionTimer (CUDA events on a GPU: nothing synchronises inside the step).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn


# ------------------------------------------------------------------------------------------ stages


def unit_costs(config, *, tokens: int) -> tuple[list[float], float, float]:
    """Per-block cost, embedding cost, head cost (½ parameter share + ½ FLOP share)."""
    d, f, h, kv, dh, v = config.d_model, config.d_ff, config.num_heads, config.kv_heads, config.d_head, config.vocab_size
    block_params = d * (h + 2 * kv) * dh + d * d + 3 * d * f + 2 * d
    block_flops = 2 * tokens * (block_params - 2 * d) + 4 * tokens * config.context_length * d  # matmuls + attention
    emb_params, emb_flops = v * d, 0
    head_params, head_flops = v * d + d, 2 * tokens * v * d
    L = config.num_layers
    total_p = L * block_params + emb_params + head_params
    total_f = L * block_flops + emb_flops + head_flops
    cost = lambda p, fl: 0.5 * p / total_p + 0.5 * fl / total_f  # noqa: E731
    return [cost(block_params, block_flops)] * L, cost(emb_params, emb_flops), cost(head_params, head_flops)


def partition(config, chunks: int, *, tokens: int, equal: bool = False) -> list[list[int]]:
    """Layer indices of each of `chunks` virtual stages (each non-empty, contiguous)."""
    L = config.num_layers
    if equal:
        n = L // chunks
        return [list(range(c * n, (c + 1) * n)) for c in range(chunks)]
    blocks, emb, head = unit_costs(config, tokens=tokens)
    best: dict[tuple[int, int], tuple[float, list[int]]] = {}

    def solve(start: int, k: int):  # min over splits of max stage cost, layers start.. into k stages
        if (start, k) in best:
            return best[(start, k)]
        first = start == 0
        if k == 1:
            c = sum(blocks[start:]) + head + (emb if first else 0)
            best[(start, k)] = (c, [L])
            return best[(start, k)]
        result = (float("inf"), [])
        for end in range(start + 1, L - k + 2):
            c = sum(blocks[start:end]) + (emb if first else 0)
            rest, cuts = solve(end, k - 1)
            if max(c, rest) < result[0]:
                result = (max(c, rest), [end] + cuts)
        best[(start, k)] = result
        return result

    cuts = [0] + solve(0, chunks)[1]
    return [list(range(cuts[i], cuts[i + 1])) for i in range(chunks)]


class PipelineModule(nn.Module):
    """One pp rank's share of a TransformerLM (possibly tensor-parallel already); `chunk_forward(c, x)`.
    `first` / `last`: it holds the first / last virtual stage (its chunk 0 embeds, its last chunk ends in
    the head). `loss_fn(module, hidden, targets)`: what the last chunk returns; None: the logits."""

    def __init__(self, model, chunks: list[list[int]], *, first: bool, last: bool, loss_fn=None):
        super().__init__()
        self.config = model.config
        self.chunks = chunks
        self.first, self.last = first, last
        self.token_embeddings = model.token_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for chunk in chunks for i in chunk})
        self.ln_final = model.ln_final if last else None
        self.lm_head = model.lm_head if last else None
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)
        self.tp = getattr(model, "tp", None)
        names = {n for n, _ in self.named_parameters()}
        self.tp_layout = {k: v for k, v in getattr(model, "tp_layout", {}).items() if k in names}
        self._loss_fn = loss_fn
        self.before_forward = None  # called before each chunk's forward (FSDP installs its root unit)
        self.seq_len = model.config.context_length  # of what `forward` receives past the first stage

    def forward(self, x):
        """torch.distributed.pipelining's call, on a module of one chunk: token ids [b, S] (first stage) or
        activations [b, S or S/tp, D] in; activations or (last stage, no loss_fn) logits out."""
        return self.chunk_forward(0, x, x.shape[1] if self.token_embeddings is not None else self.seq_len)

    def chunk_forward(self, c: int, x: torch.Tensor, seq_len: int, targets=None) -> torch.Tensor:
        """Chunk c: token ids (first virtual stage) or activations in; activations or the loss out."""
        if self.before_forward is not None:
            self.before_forward()
        if c == 0 and self.first:
            x = self.token_embeddings(x)
        cos, sin = self.rope_cos[:seq_len], self.rope_sin[:seq_len]
        for i in self.chunks[c]:
            x = self.layers[str(i)](x, cos, sin)
        if c == len(self.chunks) - 1 and self.last:
            h = self.ln_final(x)
            return self.lm_head(h) if self._loss_fn is None else self._loss_fn(self, h, targets)
        return x


# --------------------------------------------------------------------------------------- schedules


def schedule(kind: str, *, pp: int, rank: int, microbatches: int, virtual_stages: int = 1) -> list[tuple[str, int, int]]:
    M, V = microbatches, virtual_stages
    if kind == "gpipe":
        return [("F", 0, m) for m in range(M)] + [("B", 0, m) for m in range(M)]
    if kind == "1f1b":
        warm = min(pp - rank - 1, M)
        acts = [("F", 0, m) for m in range(warm)]
        for i in range(M - warm):
            acts += [("F", 0, warm + i), ("B", 0, i)]
        return acts + [("B", 0, m) for m in range(M - warm, M)]
    if kind == "interleaved-1f1b":  # Megatron-LM's forward_backward_pipelining_with_interleaving order
        total = M * V

        def unit(k: int, forward: bool) -> tuple[int, int]:
            in_group = k % (pp * V)
            chunk = in_group // pp
            return (chunk if forward else V - 1 - chunk), (k // (pp * V)) * pp + in_group % pp

        fwd = [("F", *unit(k, True)) for k in range(total)]
        bwd = [("B", *unit(k, False)) for k in range(total)]
        warm = min((pp - rank - 1) * 2 + (V - 1) * pp, total)
        acts = fwd[:warm]
        for i in range(total - warm):
            acts += [fwd[warm + i], bwd[i]]
        return acts + bwd[total - warm:]
    raise ValueError(f"unknown schedule {kind!r}")


def ideal_bubble(kind: str, *, pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """(p-1)/(m+p-1), divided by V for the interleaved schedule (Narayanan et al. 2021)."""
    b = (pp - 1) / (microbatches + pp - 1)
    return b / virtual_stages if kind == "interleaved-1f1b" else b


# ------------------------------------------------------------------------------ point-to-point plan


@dataclass(frozen=True)
class Transfer:
    """One point-to-point op of a plan step, as the rank that posts it sees it."""

    send: bool  # else a recv
    peer: int  # the other end's pp rank
    grad: bool  # an activation's gradient (going back), else an activation (going forward)
    vstage: int  # the virtual stage that consumes the tensor
    microbatch: int

    @property
    def key(self) -> tuple[bool, int, int]:
        return self.grad, self.vstage, self.microbatch


Step = tuple[Optional[tuple[str, int, int]], tuple[Transfer, ...]]  # (action or None, ops posted after it)


def needs(action: tuple[str, int, int], *, pp: int, rank: int, stages: int) -> Optional[tuple[bool, int, int]]:
    """The key (grad, virtual stage, microbatch) of the tensor `action` receives, or None."""
    op, c, m = action
    s = c * pp + rank
    if op == "F":
        return (False, s, m) if s > 0 else None
    return (True, s, m) if s < stages - 1 else None


def produces(action: tuple[str, int, int], *, pp: int, rank: int, stages: int) -> Optional[tuple[int, tuple]]:
    """(destination pp rank, key) of the tensor `action` sends, or None."""
    op, c, m = action
    s = c * pp + rank
    if op == "F":
        return ((rank + 1) % pp, (False, s + 1, m)) if s < stages - 1 else None
    return ((rank - 1) % pp, (True, s - 1, m)) if s > 0 else None


def p2p_plan(kind: str, *, pp: int, microbatches: int, virtual_stages: int = 1) -> list[list[Step]]:
    """Every pp rank's steps (the same number on each): in step t, rank r runs `plan[r][t][0]` (an action
    of its `schedule`, or None) and then posts `plan[r][t][1]` as one batch. Built by running all ranks
    together: in each step every rank runs its next action if what it receives arrived in an earlier
    step; the tensor that action sends is sent in this step and received in this step by its consumer.
    So each op has its match in the same step on the peer, a directed pair carries at most one tensor
    per step (its order is the step order on both ends), and step t needs only steps before it."""
    V = virtual_stages if kind == "interleaved-1f1b" else 1
    stages = pp * V
    acts = [schedule(kind, pp=pp, rank=r, microbatches=microbatches, virtual_stages=V) for r in range(pp)]
    nxt, have = [0] * pp, [set() for _ in range(pp)]
    plan: list[list[Step]] = [[] for _ in range(pp)]
    while any(nxt[r] < len(acts[r]) for r in range(pp)):
        ran: list = [None] * pp
        ops: list[list[Transfer]] = [[] for _ in range(pp)]
        for r in range(pp):
            if nxt[r] == len(acts[r]):
                continue
            action = acts[r][nxt[r]]
            need = needs(action, pp=pp, rank=r, stages=stages)
            if need is not None and need not in have[r]:
                continue  # waits for a later step
            ran[r] = action
            nxt[r] += 1
            out = produces(action, pp=pp, rank=r, stages=stages)
            if out is not None:
                dst, (grad, vstage, m) = out
                ops[r].append(Transfer(True, dst, grad, vstage, m))
                ops[dst].append(Transfer(False, r, grad, vstage, m))
        if not any(ran):
            raise ValueError(f"{kind} schedule stalls (pp={pp}, microbatches={microbatches}, V={V})")
        for r in range(pp):
            have[r].update(t.key for t in ops[r] if not t.send)
            plan[r].append((ran[r], tuple(ops[r])))
    return plan


# ---------------------------------------------------------------------------------------- running


@dataclass
class StepResult:
    loss: torch.Tensor | None  # mean over microbatches (last stage only)
    peak_activation_bytes: int | None = 0


def run_schedule(stage: PipelineModule, steps: Iterable[Step], *, inputs: list[torch.Tensor],
                 targets: list[torch.Tensor], pp_ranks: list[int], pp_rank: int, group, act_shape: tuple[int, ...],
                 autocast=None, device=None, timer, measure_activations: bool = True) -> StepResult:
    """Run this rank's `steps` (its row of `p2p_plan`). inputs/targets: per-microbatch [b, S] tensors;
    act_shape: the activation one microbatch sends ([b, S or S/tp, D]). `timer` (a core.timing.RegionTimer):
    regions "compute" around each forward / backward and "pp" around each wait on a batch that holds a
    recv an action needs (waited just before that action) and the final wait on the rest; nothing
    synchronises the device. `measure_activations`: count the bytes autograd saves (a hook on every saved
    tensor: leave it off in timed steps)."""
    pp, V, M = len(pp_ranks), len(stage.chunks), len(inputs)
    seq_len = inputs[0].shape[1]
    if device is None:
        device = next(stage.parameters()).device  # NCCL receives into device memory only
    params = {p.data_ptr() for p in stage.parameters()} if measure_activations else set()
    held: dict[tuple[int, int], tuple] = {}
    sizes: dict[tuple[int, int], int] = {}
    losses = []
    res = StepResult(loss=None, peak_activation_bytes=0 if measure_activations else None)
    current = [0]
    region = timer.region
    outbox: dict[tuple, torch.Tensor] = {}  # key -> tensor an action produced, sent in the same step
    arrived: dict[tuple, tuple[torch.Tensor, list]] = {}  # key -> (buffer, its batch's works, not yet waited)
    batches: list[list] = []  # every batch's works (and the tensors it sends, alive until the end)

    def pack(t):
        if t.data_ptr() not in params:
            current[0] += t.numel() * t.element_size()
        return t

    def saved():
        if measure_activations:
            return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        return nullcontext()

    def tag(key) -> int:  # gloo matches by tag; NCCL ignores it (the plan's order matches there)
        grad, vstage, m = key
        return (vstage * M + m) * 2 + int(grad)

    def post(ops: tuple[Transfer, ...]) -> None:
        p2p, works = [], []
        for t in ops:
            if t.send:
                x = outbox.pop(t.key)
                p2p.append(dist.P2POp(dist.isend, x, pp_ranks[t.peer], group=group, tag=tag(t.key)))
            else:
                buf = torch.empty(act_shape, device=device, dtype=torch.float32)
                arrived[t.key] = (buf, works)
                p2p.append(dist.P2POp(dist.irecv, buf, pp_ranks[t.peer], group=group, tag=tag(t.key)))
        works.extend(dist.batch_isend_irecv(p2p) or [])
        batches.append((works, p2p))

    def take(key) -> torch.Tensor:
        buf, works = arrived.pop(key)
        if works:
            with region("pp"):
                for work in works:
                    work.wait()
            works.clear()  # the batch is done: its other recvs need no wait
        return buf

    for action, ops in steps:
        if action is not None:
            op, c, m = action
            s = c * pp + pp_rank  # virtual stage
            last = s == pp * V - 1
            if op == "F":
                x = inputs[m] if s == 0 else take((False, s, m)).requires_grad_()
                current[0] = 0
                with region("compute"), saved(), (autocast() if autocast else nullcontext()):
                    y = stage.chunk_forward(c, x, seq_len, targets[m] if last else None)
                held[(c, m)] = (x, y)
                if measure_activations:
                    sizes[(c, m)] = current[0]
                    res.peak_activation_bytes = max(res.peak_activation_bytes, sum(sizes[k] for k in held))
                if last:
                    losses.append(y.detach())
                else:
                    outbox[(False, s + 1, m)] = y.detach().float().contiguous()
            else:
                x, y = held.pop((c, m))
                grad = None if last else take((True, s, m))
                with region("compute"):
                    if last:
                        (y / M if M > 1 else y).backward()
                    else:
                        torch.autograd.backward(y, grad)
                if s > 0:
                    outbox[(True, s - 1, m)] = x.grad.float().contiguous()
        if ops:
            post(ops)
    waiting = [work for works, _ in batches for work in works]
    if waiting:
        with region("pp"):
            for work in waiting:
                work.wait()
    if losses:
        res.loss = torch.stack(losses).mean() if len(losses) > 1 else losses[0]
    return res
