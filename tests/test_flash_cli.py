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
    rows = _rows(r.out)
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
