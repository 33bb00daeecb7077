"""`lmsys flash check` through the real CLI entry point."""

from __future__ import annotations

import json

import pytest

from lmsys.bench import flash_check


def _rows(out: str) -> list[dict]:
    return json.loads(out)["rows"]


@pytest.mark.parametrize("impl", ["flash-torch", "flash-triton"])
def test_flash_check_passes_and_covers_every_dtype(lmsys, impl):
    r = lmsys("flash", "check", "--impl", impl, "--device", "cpu", "--cases", "5", "--max-len", "40",
              "--format", "json")
    assert r.code == 0, r.err
    every = _rows(r.out)
    contract, rows = ([row for row in every if row["tier"] == tier] for tier in ("contract", "robust"))
    assert len(contract) == 5 and all(row["result"] == "pass" for row in contract)
    for row in contract:  # the handout's shapes: [batch, seq, d], powers of two from 16, d 16-128, fp32/bf16
        assert row["n_q"] in (16, 32) and row["n_k"] in (16, 32) and row["d"] in (16, 32, 64, 128)
        assert row["dtype"] in ("fp32", "bf16") and row["leading dims"].isdigit()  # [batch, seq, d]
    assert {row["causal"] for row in contract} == {True, False} and any(r["n_q"] != r["n_k"] for r in contract)
    assert len(rows) == 5 and all(row["result"] == "pass" for row in rows)
    assert {row["dtype"] for row in rows} == {"fp32", "fp16", "bf16"}
    assert {row["d"] for row in rows} == set(flash_check.HEAD_DIMS[:5])  # 64, 80, 16, 128, 256: padded ones too
    assert {row["heads q/kv"] for row in rows if row["case"] % 3 == 0} <= {"4/1", "4/2", "6/3", "8/2"}
    assert any(row["heads q/kv"] in ("4/1", "4/2", "6/3", "8/2") for row in rows)  # grouped-query cases
    assert all(flash_check.supported(impl, row["d"], row["dtype"]) for row in rows)
    for row in rows:
        assert 1 <= row["n_q"] <= 40 and 1 <= row["n_k"] <= 40
        assert all(0 <= row[f"{t} err"] <= row["tol"] for t in ("O", "L", "dQ", "dK", "dV"))


def test_flash_check_exits_1_when_a_case_fails(lmsys, monkeypatch):
    monkeypatch.setitem(flash_check.TOLERANCE, "fp32", 0.0)
    r = lmsys("flash", "check", "--impl", "flash-torch", "--device", "cpu", "--cases", "2", "--dtype", "fp32",
              "--max-len", "20")
    assert r.code == 1
    assert "FAIL" in r.out and "cases FAIL" in r.out


def test_flash_check_catches_a_wrong_kernel(lmsys, monkeypatch):
    """A kernel that drops the causal mask must fail the check, not pass it."""
    from lmsys.kernels import attention as attn

    def unmasked(q, k, v, is_causal):
        from lmsys.kernels.flash_torch import FlashAttentionTorch

        return FlashAttentionTorch.apply(q, k, v, False)

    monkeypatch.setitem(attn.IMPLS, "flash-torch", unmasked)
    r = lmsys("flash", "check", "--impl", "flash-torch", "--device", "cpu", "--cases", "6", "--seed", "1",
              "--format", "json")
    rows = _rows(r.out)
    assert r.code == 1
    assert all(row["result"] == ("FAIL" if row["causal"] and row["n_k"] > 1 else "pass") for row in rows)


@pytest.mark.parametrize("args,needle", [
    (("--impl", "naive"), "--impl must be one of flash-torch, flash-triton"),
    (("--dtype", "fp64"), "--dtype must be one of"),
    (("--cases", "0"), "--cases must be >= 1"),
    (("--max-len", "0"), "--max-len must be >= 1, got 0"),
    (("--tier", "easy"), "--tier must be one of contract, robust, all, not 'easy'"),
    (("--tier", "contract", "--seq-len", "100"), "--tier contract: --seq-len 100 outside the CS336 contract"),
    (("--tier", "contract", "--d-head", "80"), "--tier contract: --d-head 80 outside the CS336 contract"),
    (("--tier", "contract", "--dtype", "fp16"), "--tier contract: --dtype fp16 outside the CS336 contract"),
    (("--seq-len", "0"), "--seq-len must be >= 1, got 0"),
    (("--impl", "flash-triton", "--d-head", "12"), "head dim"),
])
def test_flash_check_user_errors(lmsys, args, needle):
    r = lmsys("flash", "check", "--device", "cpu", *args)
    assert r.code == 2 and needle in r.err
    assert "Traceback" not in r.err and len(r.err.strip().splitlines()) <= 2


def test_flash_check_runs_the_default_policys_levers(monkeypatch):
    """flash check checks what users run: the default policy's levers (tma_backward here) at tile pick i."""
    import dataclasses

    import torch

    from lmsys.kernels import flash

    monkeypatch.setattr(flash, "DEFAULT_POLICY", dataclasses.replace(flash.DEFAULT_POLICY, tma_backward=True))
    seen = []
    real = flash.FlashAttentionTriton.apply

    def spy(q, k, v, causal, deterministic, policy):
        seen.append((policy.pick, policy.tma_backward))
        return real(q, k, v, causal, deterministic, policy)

    monkeypatch.setattr(flash.FlashAttentionTriton, "apply", spy)
    cases = [flash_check.Case((2,), 19, 23, 80, True, "fp32", kv_heads=1), flash_check.Case((), 9, 9, 16, False, "bf16")]
    rows = list(flash_check.run_check("flash-triton", cases, device=torch.device("cpu"), seed=0))
    assert [row["result"] for row in rows] == ["pass", "pass"]
    assert seen == [(0, True), (1, True)]
    assert flash.DEFAULT_POLICY.pick is None  # the check's picks did not leak into the default


def test_pins_fix_every_case_and_the_tier_follows(lmsys):
    """--seq-len/--d-head/--batch-size/--causal pin every case of both tiers; pins outside the contract run
    the robust tier alone under the default --tier all, and say so."""
    r = lmsys("flash", "check", "--impl", "flash-torch", "--device", "cpu", "--cases", "3", "--seq-len", "32",
              "--d-head", "16", "--batch-size", "2", "--causal", "--format", "json")
    assert r.code == 0, r.err
    rows = _rows(r.out)
    assert [row["tier"] for row in rows] == ["contract"] * 3 + ["robust"] * 3
    assert all((row["n_q"], row["n_k"], row["d"], row["causal"]) == (32, 32, 16, True) for row in rows)
    assert all(row["leading dims"].split("×")[0] == "2" for row in rows)
    assert "seq 32, d 16, batch 2, causal" in json.loads(r.out)["meta"]["run"]
    r = lmsys("flash", "check", "--impl", "flash-torch", "--device", "cpu", "--cases", "2", "--seq-len", "24",
              "--format", "json")
    assert r.code == 0, r.err
    assert [row["tier"] for row in _rows(r.out)] == ["robust", "robust"]
    assert "--seq-len 24 outside the CS336 contract" in r.err and "the robust tier runs alone" in r.err


def test_robust_tier_is_todays_cases(lmsys):
    """--tier robust draws exactly the cases (shapes and inputs) flash check drew before tiers existed."""
    import torch

    expected = flash_check.random_cases(4, seed=7, dtypes=["fp32", "bf16", "fp16"], max_len=40)
    r = lmsys("flash", "check", "--impl", "flash-torch", "--device", "cpu", "--cases", "4", "--seed", "7",
              "--max-len", "40", "--tier", "robust", "--format", "json")
    assert r.code == 0, r.err
    rows = _rows(r.out)
    assert [(row["n_q"], row["n_k"], row["d"], row["dtype"], row["causal"]) for row in rows] == \
           [(c.n_q, c.n_k, c.d, c.dtype, c.causal) for c in expected]
    again = list(flash_check.run_check("flash-torch", expected, device=torch.device("cpu"), seed=7))
    assert [row["O err"] for row in again] == [row["O err"] for row in rows]


def test_constant_factor_and_its_cause(seed):
    import torch

    ref = torch.randn(3, 64, 64, dtype=torch.float64)
    assert flash_check.constant_factor(ref * 8, ref, 1e-4) == pytest.approx(8.0)
    assert flash_check.factor_cause("dK", 8.0, 64) == "dK is 8.0× the reference: a missing scale (1/√d, d 64)"
    assert flash_check.factor_cause("dQ", 0.125, 64).startswith("dQ is 0.125× the reference: the scale applied twice")
    assert flash_check.factor_cause("dV", 1.5, 64) == "dV is 1.5× the reference: a wrong scale"
    assert flash_check.constant_factor(ref + 0.5 * torch.randn_like(ref), ref, 1e-4) is None  # noise, no factor
    assert flash_check.constant_factor(ref * (1 + 1e-6), ref, 1e-4) is None  # within tolerance: no factor
    assert flash_check.constant_factor(torch.zeros_like(ref), ref, 1e-4) == 0.0
    assert flash_check.factor_cause("O", 0.0, 64) == "O is all zeros"


def test_shared_property_is_derived_from_which_cases_fail():
    def row(n_q, n_k, d=64, causal=False, dtype="fp32"):
        return {"n_q": n_q, "n_k": n_k, "d": d, "causal": causal, "dtype": dtype}

    passed = [row(64, 64), row(32, 16, causal=True), row(128, 128, 32)]
    assert flash_check.shared_property([row(55, 7), row(39, 47)], passed) == "lengths not a multiple of 16"
    assert flash_check.shared_property([row(64, 48), row(16, 80)], [row(64, 64), row(32, 128), row(128, 128, 32)]) \
           == "lengths not a multiple of 32"
    assert flash_check.shared_property([row(64, 64, causal=True), row(16, 16, causal=True)],
                                       [row(64, 64), row(16, 16)]) == "causal cases"
    assert flash_check.shared_property([row(64, 64, 80), row(55, 7)], passed) == \
           "lengths not a multiple of 16 or head dims not a power of two"
    assert flash_check.shared_property([row(64, 64)], []) is None  # nothing passed: nothing tells them apart
