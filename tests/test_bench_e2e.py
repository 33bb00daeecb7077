import json
import math

import pytest
import torch

from lmsys.bench import e2e
from lmsys.model import describe
from lmsys.model.config import PRESETS, parameter_count_formula, resolve_configs

FAST = ("--context-length", "32", "--steps", "2", "--warmup", "1", "--device", "cpu")


def test_e2e_json_rows_for_every_mode(lmsys, tmp_path):
    out = tmp_path / "e2e.json"
    r = lmsys("bench", "e2e", "--size", "tiny", "--mode", "all", *FAST, "--format", "json", "--output", str(out))
    assert r.code == 0, r.err
    doc = json.loads(out.read_text())
    assert json.loads(r.out) == doc
    assert doc["meta"]["torch"] == torch.__version__ and "tiny" in doc["meta"]
    rows = {row["mode"]: row for row in doc["rows"]}
    assert set(rows) == {"fwd", "fwd-bwd", "train"}
    assert rows["fwd"]["backward ms"] is None and rows["fwd"]["optimizer ms"] is None
    assert rows["fwd-bwd"]["optimizer ms"] is None
    train = rows["train"]
    assert train["status"] == "ok" and train["params"] == 3_084_928
    for col in ("forward ms", "backward ms", "optimizer ms", "ms/step"):
        assert train[col]["mean"] > 0
    # The step contains its phases.
    phases = sum(train[c]["mean"] for c in ("forward ms", "backward ms", "optimizer ms"))
    assert train["ms/step"]["mean"] >= 0.95 * phases
    assert train["tokens/s"] == pytest.approx(4 * 32 / (train["ms/step"]["mean"] / 1e3))


def test_e2e_default_on_cpu_is_tiny_with_warmup_zero_and_overrides(lmsys):
    r = lmsys("bench", "e2e", "--context-length", "16", "--steps", "1", "--warmup", "0", "--layers", "1",
              "--d-model", "64", "--heads", "2", "--device", "cpu", "-f", "json")
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    cfg = PRESETS["tiny"].with_overrides(d_model=64, num_layers=1, num_heads=2, context_length=16)
    assert doc["meta"]["tiny"] == describe(cfg)
    [row] = doc["rows"]
    assert (row["size"], row["mode"], row["status"]) == ("tiny", "train", "ok")
    assert row["params"] == parameter_count_formula(cfg)
    # random weights and targets: the loss starts near ln(vocab)
    assert row["loss"] == pytest.approx(math.log(cfg.vocab_size), rel=0.1)
    assert row["tokens/s"] == pytest.approx(4 * 16 / (row["ms/step"]["mean"] / 1e3))


def test_e2e_bf16_and_sweep_of_sizes(lmsys, tmp_path):
    yaml = tmp_path / "t.yaml"
    yaml.write_text("preset: tiny\n")  # a second size: a list item given twice is refused
    r = lmsys("bench", "e2e", "--size", f"tiny,{yaml}", "--dtype", "bf16", "--layers", "1", *FAST, "-f", "json")
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    cfg = PRESETS["tiny"].with_overrides(num_layers=1, context_length=32)
    assert [(row["mode"], row["status"]) for row in doc["rows"]] == [("train", "ok")] * 2
    assert all(row["params"] == parameter_count_formula(cfg) for row in doc["rows"])
    # the same seed and data in both rows: the same loss, near ln(vocab) (bf16 autocast rounding only)
    first, second = (row["loss"] for row in doc["rows"])
    assert first == pytest.approx(second, rel=1e-5) and first == pytest.approx(math.log(cfg.vocab_size), rel=0.1)
    assert doc["meta"]["run"].startswith("batch 4, bf16 autocast, fp32 weights, warmup 1, steps 2")


def test_oom_row_and_sweep_goes_on(monkeypatch):
    real = e2e._measure_config

    def flaky(workload, *a, **kw):
        if workload.config.num_layers == 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
        yield from real(workload, *a, **kw)

    monkeypatch.setattr(e2e, "_measure_config", flaky)
    cfgs = resolve_configs(["tiny", "tiny"], context_length=16)
    cfgs[1] = ("tiny-1", cfgs[1][1].with_overrides(num_layers=1))
    workloads = e2e.resolve_workloads(cfgs, checkpoints=["none"], batch_size=2)
    rows = list(e2e.run_e2e(workloads, modes=["fwd", "train"], warmup=0, steps=1, device=torch.device("cpu")))
    assert [(r["size"], r["mode"], r["status"]) for r in rows] == [
        ("tiny", "fwd", "OOM"), ("tiny", "train", "OOM"), ("tiny-1", "fwd", "ok"), ("tiny-1", "train", "ok")]


def test_compare_runs_references_once_and_reports_speedups(lmsys):
    r = lmsys("bench", "e2e", "--size", "tiny", "--layers", "1", "--fast", "--compare", "--checkpoint", "none,block",
              "--context-length", "16", "--steps", "2", "--warmup", "0", "--device", "cpu", "-f", "json")
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    paths = [(row["path"], row["checkpoint"]) for row in doc["rows"]]
    assert paths == [("plain eager", "none"), ("plain compiled", "none"), ("lmsys", "none"), ("lmsys", "block")]
    eager, compiled, fast, _ = doc["rows"]
    assert eager["× vs eager"] == pytest.approx(1.0)
    assert fast["× vs compiled"] == pytest.approx(compiled["ms/step"]["mean"] / fast["ms/step"]["mean"])
    # Same seed, same data: every path starts from the same weights and sees the same batch.
    assert fast["loss"] == pytest.approx(eager["loss"], rel=1e-3)
    assert "sdpa" in doc["meta"]["lmsys path"] and "torch.compile" in doc["meta"]["plain compiled"]


@pytest.mark.parametrize("args, message", [
    (("--size", "huge"), "unknown model size"),
    (("--d-model", "130"), "not divisible"),
    (("--dtype", "fp16"), "fp16 needs a CUDA GPU"),
    (("--dtype", "fp8"), "--dtype must be one of"),
    (("--mode", "sideways"), "--mode must be one of"),
    (("--attn", "magic"), "--attn must be one of"),
    (("--format", "xml"), "--format must be one of"),
    (("--output", "/nonexistent/dir/x.md"), "does not exist"),
    (("--steps", "0"), "--steps must be >= 1, got 0"),
    (("--batch-size", "0"), "--batch-size must be >= 1, got 0"),
    (("--context-length", "0"), "--context-length"),
    (("--checkpoint", "every:0"), "--checkpoint must be"),
    (("--master-weights",), "--master-weights"),
    (("--cuda-graphs",), "--cuda-graphs works through torch.compile"),
    (("--compile", "--compile-blocks"), "exclusive"),
    (("--fused-ce", "maybe"), "--fused-ce"),
    (("--size", "tiny", "--heads", "16", "--attn", "flash-triton"), "head dim 8 is not supported"),
])
def test_bad_input_exits_2_with_one_line(lmsys, args, message):
    r = lmsys("bench", "e2e", "--device", "cpu", *args)
    assert r.code == 2
    assert message in r.err and "Traceback" not in r.err
    assert len(r.err.strip().splitlines()) <= 2  # the message, and at most a hint


def test_2_7b_head_dim_80_is_accepted_by_flash_triton():
    [(name, cfg)] = resolve_configs(["2.7b"], context_length=128, attn_impl="flash-triton")
    assert cfg.d_head == 80 and cfg.attn_impl == "flash-triton"


def test_cuda_requested_without_gpu(lmsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    r = lmsys("bench", "e2e", "--device", "cuda")
    assert r.code == 2 and "no CUDA GPU" in r.err


def test_precision_command(lmsys):
    r = lmsys("precision", "--device", "cpu", "-f", "json")
    assert r.code == 0, r.err
    walk, acc = json.loads(r.out)
    dtypes = {(row["autocast"], row["tensor"]): row["dtype"] for row in walk["rows"]}
    assert dtypes[("bf16", "fc1 output")] == "bfloat16"
    assert dtypes[("fp16", "fc1 output")] == "float16"
    assert dtypes[("bf16", "parameters (fc1.weight)")] == "float32"
    assert dtypes[("bf16", "loss")] == "float32"
    assert dtypes[("fp16", "gradient fc1.weight")] == "float32"
    results = {row["accumulation"]: row["result"] for row in acc["rows"]}
    assert results["fp32"] == pytest.approx(10.0, abs=1e-3)
    assert abs(results["fp16"] - 10.0) > 0.01  # fp16 accumulation drifts
    assert abs(results["fp32 accumulator, fp16 addend"] - 10.0) < abs(results["fp16"] - 10.0)
    assert results["bf16"] == 4.0  # stalls once 0.01 is below half an ulp


def test_e2e_honours_a_yaml_attn_impl_and_the_command_line_overrides_it(lmsys, tmp_path):
    """A model YAML's attn_impl runs (it was validated but replaced by naive); --impl still wins."""
    yaml = tmp_path / "m.yaml"
    yaml.write_text("preset: tiny\nnum_layers: 1\nattn_impl: sdpa\n")
    r = lmsys("bench", "e2e", "--size", str(yaml), *FAST, "-f", "json")
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    assert doc["meta"]["lmsys path"].startswith("attention sdpa") and doc["rows"][0]["status"] == "ok"
    r = lmsys("bench", "e2e", "--size", str(yaml), "--impl", "naive", *FAST, "-f", "json")
    assert r.code == 0, r.err
    assert json.loads(r.out)["meta"]["lmsys path"].startswith("attention naive")
