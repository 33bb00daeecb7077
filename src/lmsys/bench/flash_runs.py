"""`flash check`'s options checked and its cases run: torch-free at import, so the options are checked before
torch loads (`resolve`); `run` imports lmsys.bench.flash_check, the cases and their checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from lmsys.core.errors import LmsysError

TIERS = ("contract", "robust", "all")


@dataclass
class FlashCheck:
    """What `flash check` runs: implementations, device, dtypes, the drawn cases' parameters."""

    names: list[str]
    adapters: Optional[str]
    device: object
    dtypes: list[str]
    max_len: int
    pins: object
    tiers: list[str]
    cases: int
    seed: int
    notes: list[str] = field(default_factory=list)  # what was chosen, said on stderr before the run


def resolve(*, impl: Optional[str], adapters: Optional[str], device: str, cases: int, seed: int,
            max_len: Optional[int], dtype: Optional[str], tier: str, seq_len: Optional[str], d_head: Optional[str],
            batch_size: Optional[str], causal: Optional[bool]) -> FlashCheck:
    """Every option checked: the torch-free ones first (a typo answers before torch loads), then the device
    and each implementation against it (lmsys.kernels.requirements: what its device and this install run)."""
    from lmsys.core.parsing import choose, parse_int_list, parse_list

    if not 0 <= seed < 2**63:  # torch.manual_seed takes a 64-bit seed
        raise LmsysError(f"--seed must be in 0 .. 2**63-1, got {seed}")
    choose(tier, TIERS, what="--tier")
    pinned = dict(seq_len=tuple(parse_int_list(seq_len, what="--seq-len")),
                  d_head=tuple(parse_int_list(d_head, what="--d-head")),
                  batch=tuple(parse_int_list(batch_size, what="--batch-size")), causal=causal)

    from lmsys.bench import flash_check
    from lmsys.core.devices import resolve_device

    dev = resolve_device(device)
    builtin = flash_check.default_impl(dev)  # flash-triton where Triton runs (a GPU or its interpreter)
    from lmsys.kernels.registry import ATTENTION
    from lmsys.kernels.requirements import check_attention_impl

    # with --adapters: your versions, yours-triton where lmsys's own Triton kernel runs too
    default = ",".join(ATTENTION.names(lambda s: s.adapters and (not s.runs_triton or ATTENTION[builtin].runs_triton))) \
        if adapters else builtin
    names = [flash_check.check_impl(n, adapters=adapters)
             for n in dict.fromkeys(parse_list(impl or default, str, what="--impl"))]
    for one in names:
        check_attention_impl(one, dev)
    dtypes = parse_list(dtype, flash_check.check_dtype, what="--dtype") if dtype else flash_check.device_dtypes(dev)
    length = flash_check.default_max_len(dev) if max_len is None else max_len
    pins = flash_check.Pins(**pinned)
    for one in names:
        flash_check.check_pins(one, pins)
    tiers, tier_notes = flash_check.plan_tiers(tier, pins, dtypes)
    return FlashCheck(names=names, adapters=adapters, device=dev, dtypes=dtypes, max_len=length, pins=pins,
                      tiers=tiers, cases=cases, seed=seed, notes=tier_notes)


def run(plan: FlashCheck):
    """(the Report, the implementations that failed): every implementation's drawn cases against float64."""
    from lmsys.bench import flash_check
    from lmsys.core import progress
    from lmsys.kernels.registry import ADAPTER_NAMES

    rows, verdicts, failed_impls = [], [], []
    for one in plan.names:
        user = flash_check.is_user(one)
        common = dict(seed=plan.seed, dtypes=plan.dtypes, max_len=plan.max_len, impl=one, pins=plan.pins)
        drawn = flash_check.contract_cases(plan.cases, **common) if "contract" in plan.tiers else []
        if "robust" in plan.tiers:
            drawn += flash_check.random_cases(plan.cases, three_d=user, **common)
        checked = (flash_check.run_user_check(one, drawn, device=plan.device, seed=plan.seed, adapters=plan.adapters)
                   if user else flash_check.run_check(one, drawn, device=plan.device, seed=plan.seed))
        named = len(plan.names) > 1  # several: every row says whose it is (a user's rows always do)
        mine = [{"impl": one, **row} if named else row
                for row in progress.rows(checked, total=len(drawn), description=f"flash check {one}")]
        lines, failed = flash_check.summarize(mine, one, contract_gates=one in ADAPTER_NAMES)
        rows += mine
        verdicts += lines
        if failed:
            failed_impls.append(one)
    return _report(plan, rows, verdicts), failed_impls


def _report(plan: FlashCheck, rows: list[dict], verdicts: list[str]):
    from lmsys.bench import flash_check
    from lmsys.core.devices import environment
    from lmsys.core.results import Report
    from lmsys.kernels.registry import ADAPTER_NAMES

    name, pins, names = ", ".join(plan.names), plan.pins, plan.names
    meta = environment(plan.device)
    pinned_text = f", pinned: {pins.describe()}" if pins.describe() else ""
    meta["run"] = (f"impl {name}, tier {' + '.join(plan.tiers)}, {plan.cases} cases per tier, seed {plan.seed}"
                   f"{pinned_text}, reference float64 on the CPU")
    skipped = sum(r["result"].startswith("not implemented") for r in rows)
    failed = sum(flash_check.counts_as_failed(r["result"]) for r in rows)
    notes = [
        "err = max |x - ref| / max(max |ref|, 1) for O, the saved logsumexp L, and dQ, dK, dV (dO random); "
        "tolerance fp32 1e-4 (your code's fp32 on a GPU: 1e-2, the handout's tests' tolerance, which TF32 dots meet), "
        "bf16/fp16 2e-2.",
        f"{len(rows) - failed - skipped} of {len(rows) - skipped} cases pass." if not failed
        else f"{failed} of {len(rows) - skipped} cases FAIL.",
        *verdicts,
    ]
    if any(one in ADAPTER_NAMES for one in names) and "contract" in plan.tiers:
        notes.append("The exit code follows the CS336 contract tier for your adapters' rows (the handout's "
                     "promises); the robust tier says what lies beyond them.")
    if any(flash_check.is_user(n) for n in names):
        notes.append("Your attention gets CS336's [batch, seq, d]. off: the tensors beyond the tolerance, their shape "
                     "and max abs / max rel error against float64 (and the factor where one is a constant multiple "
                     "of the reference). CS336 saved L: whether the saved tensors are exactly one fp32 L of shape "
                     "q.shape[:-1] beside q, k, v, o (not part of pass/FAIL).")
    return Report(f"flash check: {name}", rows, meta, notes)
