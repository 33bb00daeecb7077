"""The pipeline's point-to-point plan under NCCL's rules, simulated in pure Python (no torch.distributed).

NCCL ignores tags: a directed pair's k-th send meets the receiver's k-th recv. Every op of a rank runs
on one stream in posting order; a batch (`batch_isend_irecv`, one NCCL group) starts when the batch
before it on that rank is done and the compute posted before it is done (the NCCL stream waits on the
compute stream), and is done when every op's match has started (a large send blocks until its recv is
posted: the worst case, beyond NCCL's eager buffer). A compute waits for the batches holding the recvs
it was told to wait on. `simulate` runs that to a fixed point: every batch done, or a deadlock.
"""

from __future__ import annotations

import pytest

from lmsys.distributed.model_parallel.pipeline import needs, p2p_plan, produces, schedule


def plan_program(plan_row, *, pp, rank, stages, eager=False):
    """One rank's program for the new plan, in posting order: ("compute", action, batch ids it waits on)
    and ("batch", id, ops). As run_schedule does: an action waits on the batch its recv came in (eager:
    on every batch with a recv posted before it, a stricter order)."""
    program, arrived, recv_batches = [], {}, []
    for t, (action, ops) in enumerate(plan_row):
        if action is not None:
            need = needs(action, pp=pp, rank=rank, stages=stages)
            waits = set(recv_batches) if eager else ({arrived[need]} if need is not None else set())
            program.append(("compute", action, waits))
        if ops:
            bid = (rank, t)
            program.append(("batch", bid, [(o.send, o.peer, o.key) for o in ops]))
            for o in ops:
                if not o.send:
                    arrived[o.key] = bid
                    recv_batches.append(bid)
    return program


def old_program(actions, *, pp, rank, stages):
    """The order before the plan: one isend / irecv at a time, a recv just before the action that needs
    it (waited), a send just after the action that produced it."""
    program = []
    for i, action in enumerate(actions):
        waits = set()
        need = needs(action, pp=pp, rank=rank, stages=stages)
        if need is not None:
            program.append(("batch", (rank, i, "recv"), [(False, (rank + (1 if need[0] else -1)) % pp, need)]))
            waits = {(rank, i, "recv")}
        program.append(("compute", action, waits))
        out = produces(action, pp=pp, rank=rank, stages=stages)
        if out is not None:
            program.append(("batch", (rank, i, "send"), [(True, out[0], out[1])]))
    return program


def simulate(programs) -> str:
    """'ok', 'deadlock', or 'mismatch: ...' (a pair's k-th send and k-th recv carry different tensors)."""
    sends, recvs = {}, {}  # (src, dst) -> [(key, batch id)] in posting order
    for rank, program in enumerate(programs):
        for item in program:
            if item[0] == "batch":
                for send, peer, key in item[2]:
                    pair = (rank, peer) if send else (peer, rank)
                    (sends if send else recvs).setdefault(pair, []).append((key, item[1]))
    partner: dict = {}  # batch id -> the batch ids its ops need started
    for pair in set(sends) | set(recvs):
        s, r = sends.get(pair, []), recvs.get(pair, [])
        if len(s) != len(r):
            return f"mismatch: {pair} {len(s)} sends, {len(r)} recvs"
        for (ks, bs), (kr, br) in zip(s, r):
            if ks != kr:
                return f"mismatch: {pair} sends {ks} where the recv expects {kr}"
            partner.setdefault(bs, set()).add(br)
            partner.setdefault(br, set()).add(bs)
    started, done, computed = set(), set(), set()
    changed = True
    while changed:
        changed = False
        for rank, program in enumerate(programs):
            computes_before = []  # compute items posted before this point
            last_batch = None  # the batch before this one on the stream
            for j, item in enumerate(program):
                if item[0] == "compute":
                    prev_ok = not computes_before or computes_before[-1] in computed
                    if (rank, j) not in computed and prev_ok and item[2] <= done:
                        computed.add((rank, j))
                        changed = True
                    computes_before.append((rank, j))
                else:
                    bid = item[1]
                    if bid not in started and (last_batch is None or last_batch in done) \
                            and all(c in computed for c in computes_before):
                        started.add(bid)
                        changed = True
                    last_batch = bid
        for bid in started - done:
            if partner.get(bid, set()) <= started:
                done.add(bid)
                changed = True
    everything = {item[1] for program in programs for item in program if item[0] == "batch"}
    n_compute = sum(item[0] == "compute" for program in programs for item in program)
    return "ok" if done == everything and len(computed) == n_compute else "deadlock"


CASES = [(kind, pp, V, M)
         for pp in (2, 3, 4)
         for kind, V in (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 1), ("interleaved-1f1b", 2))
         for M in sorted({pp, 2 * pp, 2 * pp + 1, 3} | ({1} if kind == "gpipe" else set()))
         if (kind != "interleaved-1f1b" or M % pp == 0) and (kind == "gpipe" or M >= pp)]


@pytest.mark.parametrize("kind, pp, V, M", CASES)
def test_plan_never_deadlocks_under_nccl_rules(kind, pp, V, M):
    plan = p2p_plan(kind, pp=pp, microbatches=M, virtual_stages=V)
    stages = pp * V
    assert len({len(row) for row in plan}) == 1  # every rank has the same steps
    for rank, row in enumerate(plan):
        # the plan runs exactly the schedule's actions, in its order
        order = schedule(kind, pp=pp, rank=rank, microbatches=M, virtual_stages=V)
        assert [a for a, _ in row if a is not None] == order
        for t, (_, ops) in enumerate(row):
            assert len([o for o in ops if o.send]) <= 1  # one tensor per rank per step: one per pair and direction
            for o in ops:  # matched in the same step on the peer
                assert (not o.send, rank, o.key) in {(p.send, p.peer, p.key) for p in plan[o.peer][t][1]}
    for eager in (False, True):
        programs = [plan_program(row, pp=pp, rank=r, stages=stages, eager=eager) for r, row in enumerate(plan)]
        assert simulate(programs) == "ok", (kind, pp, V, M, eager)


@pytest.mark.parametrize("pp, M", [(2, 2), (2, 4), (3, 3), (3, 7), (4, 8)])
def test_one_op_at_a_time_deadlocked_1f1b(pp, M):
    """The simulation means something: the order run_schedule posted before the plan deadlocks 1F1B."""
    programs = [old_program(schedule("1f1b", pp=pp, rank=r, microbatches=M), pp=pp, rank=r, stages=pp)
                for r in range(pp)]
    assert simulate(programs) == "deadlock"
    gpipe = [old_program(schedule("gpipe", pp=pp, rank=r, microbatches=M), pp=pp, rank=r, stages=pp)
             for r in range(pp)]
    assert simulate(gpipe) == "ok"  # all forwards, then all backwards: no pair crosses


@pytest.mark.parametrize("kind, V", [("1f1b", 1), ("interleaved-1f1b", 2)])
def test_the_batch_is_what_keeps_the_plan_alive(kind, V):
    """The plan's own steps, each op posted alone (sends first), deadlock: the two ends of a step must be
    one batch (one NCCL group), as Megatron's send_forward_recv_backward is."""
    for pp in (2, 3, 4):
        plan = p2p_plan(kind, pp=pp, microbatches=2 * pp, virtual_stages=V)
        programs = []
        for rank, row in enumerate(plan):
            alone = []
            for item in plan_program(row, pp=pp, rank=rank, stages=pp * V):
                if item[0] != "batch":
                    alone.append(item)
                    continue
                for k, op in enumerate(sorted(item[2], key=lambda o: not o[0])):  # a recv keeps the id waited on
                    alone.append(("batch", item[1] if not op[0] else (*item[1], k), [op]))
            programs.append(alone)
        assert simulate(programs) == "deadlock", (kind, pp)


def test_one_op_at_a_time_failed_interleaved():
    """Interleaved, one op at a time: the pair's posting orders differ (NCCL pairs wrong tensors, or, as
    here, deadlocks) where gloo's tags saved it."""
    pp, V, M = 2, 2, 4
    programs = [old_program(schedule("interleaved-1f1b", pp=pp, rank=r, microbatches=M, virtual_stages=V),
                            pp=pp, rank=r, stages=pp * V) for r in range(pp)]
    assert simulate(programs) != "ok"


def test_pp1_plan_has_no_ops():
    (row,) = p2p_plan("1f1b", pp=1, microbatches=2)
    assert [a for a, _ in row] == [("F", 0, 0), ("B", 0, 0), ("F", 0, 1), ("B", 0, 1)]
    assert all(not ops for _, ops in row)
