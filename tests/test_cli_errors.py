"""Every error a user can cause is one line (exit 2 for input, 1 for a failed run), never a traceback:
one test per row of issue 14's tables, and the option vocabulary (aliases, --device, lists)."""

from __future__ import annotations

import errno
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from lmsys.core.errors import LmsysError

SRC = str(Path(__file__).resolve().parents[1] / "src")


def one_line(result, code: int = 2) -> str:
    assert result.code == code, (result.out, result.err)
    assert "Traceback" not in result.err + result.out
    lines = [ln for ln in result.err.splitlines() if ln.strip() and not ln.startswith("hint:")]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.err
    return lines[0]


# ------------------------------------------------------------------------------------ the table's rows


def test_unsupported_sdpa_backends_on_a_cpu_are_rows_and_the_sweep_goes_on(lmsys):
    # torch's CPU build has a flash kernel of its own but no cuDNN: sdpa-cudnn has no viable backend
    r = lmsys("bench", "attention", "--impl", "sdpa-cudnn,naive", "--device", "cpu", "--seq-len", "32",
              "--d-head", "16", "--batch-size", "1", "--warmup", "0", "--steps", "1", "--format", "csv")
    assert r.code == 0, r.err
    lines = r.out.splitlines()
    cudnn = next(ln for ln in lines if ln.startswith("sdpa-cudnn")).split(",")
    assert cudnn[:5] == ["sdpa-cudnn", "1", "1", "16", "32"] and cudnn[-1] == "unsupported"  # status: the last column
    assert next(ln for ln in lines if ln.startswith("impl,")).split(",")[-1] == "status"
    naive = next(ln for ln in lines if ln.startswith("naive"))
    assert "unsupported" not in naive and "oom" not in naive


def test_an_output_path_that_cannot_be_written_is_refused_before_the_run(lmsys, monkeypatch):
    import lmsys.commands.precision as cmd

    monkeypatch.setattr(cmd, "check_counts", lambda **_: pytest.fail("ran past the output check"))
    assert "cannot write in /proc" in one_line(lmsys("precision", "--device", "cpu", "-o", "/proc/lmsys.md"))


def test_a_full_disk_is_one_line_and_leaves_no_temporary_file(lmsys, monkeypatch, tmp_path):
    import builtins

    real_open = builtins.open

    def full_disk_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        if "w" in mode and ".tmp-" in str(file):
            class Full:
                def __enter__(self):
                    return self

                def __exit__(self, *exc):
                    f.close()

                def write(self, text):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            return Full()
        return f

    monkeypatch.setattr(builtins, "open", full_disk_open)
    out = tmp_path / "p.md"
    line = one_line(lmsys("precision", "--device", "cpu", "--steps", "10", "-o", str(out)))
    assert "No space left on device" in line and str(out) in line
    assert list(tmp_path.iterdir()) == []


def test_a_yaml_preset_that_names_itself_is_one_line(lmsys, tmp_path):
    (tmp_path / "a.yaml").write_text("preset: b.yaml\n")
    (tmp_path / "b.yaml").write_text("preset: a.yaml\nd_model: 64\n")
    line = one_line(lmsys("bench", "e2e", "--size", str(tmp_path / "a.yaml"), "--device", "cpu"))
    assert "comes back to itself" in line and "a.yaml -> b.yaml -> a.yaml" in line


def test_a_yaml_with_a_non_string_key_is_one_line(lmsys, tmp_path):
    (tmp_path / "k.yaml").write_text("preset: tiny\n1: 2\n")
    assert "keys must be ModelConfig field names, got 1" in one_line(
        lmsys("bench", "e2e", "--size", str(tmp_path / "k.yaml"), "--device", "cpu"))


def test_a_yaml_preset_path_is_relative_to_the_yaml_file(tmp_path, monkeypatch):
    from lmsys.model.config import get_config

    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "base.yaml").write_text("preset: tiny\nnum_layers: 3\n")
    (tmp_path / "sub" / "top.yaml").write_text("preset: base.yaml\nd_ff: 256\n")
    monkeypatch.chdir(tmp_path)  # not the YAML's folder
    cfg = get_config("sub/top.yaml")
    assert (cfg.num_layers, cfg.d_ff, cfg.d_model) == (3, 256, 128)


@pytest.mark.parametrize("seed", ["99999999999999999999", "-1", str(2**63)])
def test_flash_check_seed_out_of_range_is_one_line(lmsys, seed):
    assert "--seed must be in 0 .. 2**63-1" in one_line(lmsys("flash", "check", "--seed", seed, "--device", "cpu"))


def test_a_malformed_snapshot_is_one_line_and_leaves_no_output_folder(lmsys, tmp_path):
    snap = tmp_path / "S.pickle"
    trace = [{"action": "alloc", "addr": 1, "size": "not-a-number", "frames": []}]
    snap.write_bytes(pickle.dumps({"device_traces": [trace], "segments": []}))
    out_dir = tmp_path / "out"
    line = one_line(lmsys("profile", "memory", "--snapshot", str(snap), "--out-dir", str(out_dir)))
    assert "not a valid memory snapshot" in line
    assert not out_dir.exists()


def test_a_bad_dist_timeout_is_one_line_before_torchrun_starts(lmsys, monkeypatch):
    import subprocess as sp

    monkeypatch.setenv("LMSYS_DIST_TIMEOUT_S", "abc")
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sp, "Popen", lambda *a, **k: pytest.fail("torchrun was started"))
    assert "LMSYS_DIST_TIMEOUT_S='abc' is not a number" in one_line(
        lmsys("comm", "allreduce", "--backend", "gloo", "--sizes", "4KB"))


def oom_job(ctx):
    """A rank that runs out of memory (as the fsdp lane reports it: an exception inside the job)."""
    if ctx.rank == 1:
        raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB")
    import torch.distributed as dist

    dist.barrier()
    return {}


@pytest.mark.slow
def test_a_failing_rank_is_one_line_without_torchruns_dump(tmp_path):
    """Subprocess: the whole output of the parent is one line (torchrun's ChildFailedError and the rank's
    traceback stay in the log), exit 1; LMSYS_DEBUG=1 streams them."""
    code = ("import sys, typer; from lmsys.commands._common import run_on_ranks\n"
            "try:\n    run_on_ranks('test_cli_errors:oom_job', {}, world_size=2, backend='gloo')\n"
            "except typer.Exit as e:\n    sys.exit(e.exit_code)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, str(Path(__file__).parent)]), TMPDIR=str(tmp_path),
               LMSYS_DIST_TIMEOUT_S="60")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LMSYS_DEBUG"):
        env.pop(name, None)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("error: rank 1 failed: RuntimeError: CUDA out of memory. Tried to allocate 20.00 GiB")
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith("torchinductor_")] == []
    r = subprocess.run([sys.executable, "-c", code], env={**env, "LMSYS_DEBUG": "1"}, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" in r.stderr


# ------------------------------------------------------------------------------------ wrong or rough


def test_an_output_under_a_file_says_the_parent_is_a_file(lmsys):
    assert "/etc/hostname is a file, not a directory" in one_line(
        lmsys("precision", "-o", "/etc/hostname/out.md"))


def test_a_snapshot_directory_is_called_a_directory(lmsys, tmp_path):
    assert "is a directory" in one_line(lmsys("profile", "memory", "--snapshot", str(tmp_path)))


@pytest.mark.parametrize("args", [
    ["bench", "e2e", "--format", "bogus"], ["bench", "attention", "--device", "tpu"],
    ["comm", "allreduce", "--dtype", "fp8"], ["ddp", "train", "--format", "xml"], ["precision", "--format", "x"],
    ["flash", "check", "--seed", "-5"], ["profile", "memory", "--format", "bogus"],
    ["bench", "e2e", "--attn", "bogus"], ["profile", "nsys", "--size", "tiny,small"],
    ["profile", "memory", "--size", "tiny,small"], ["ddp", "train", "--size", "tiny,small"],
    ["parallel", "train", "--dp-strategy", "bogus"], ["parallel", "train", "--checkpoint", "some"],
    ["plan", "validate", "--profile", "p.yaml", "--dp-strategy", "bogus"],
])
def test_option_errors_answer_before_torch_is_imported(args):
    code = ("import sys; from lmsys.cli import main\n"
            f"try:\n    main({args!r})\nexcept SystemExit as e:\n    assert e.code == 2, e.code\n"
            "assert 'torch' not in sys.modules, 'imported torch first'\n")
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=SRC), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stderr.startswith("error: ") and "Traceback" not in r.stderr


def test_precision_steps_are_bounded(lmsys):
    assert "over the limit" in one_line(lmsys("precision", "--steps", "100000000"))


def test_a_leaderboard_preset_on_a_cpu_says_it_falls_back(monkeypatch, lmsys):
    import lmsys.bench.attention as lib

    monkeypatch.setattr(lib, "run_attention", lambda sweep, device: iter(()))
    r = lmsys("bench", "attention", "--preset", "leaderboard", "--device", "cpu", "--format", "csv")
    assert r.code == 0, r.err
    assert "CPU: implementations naive" in r.err.splitlines()[0]


def test_a_model_larger_than_ram_is_refused_before_it_is_built(lmsys, monkeypatch):
    import lmsys.model.memory as mem

    monkeypatch.setattr(mem, "available_ram", lambda: 8 * 2**30)
    line = one_line(lmsys("bench", "e2e", "--size", "10b", "--device", "cpu"))
    assert "--size 10b: a training step (weights, gradients, AdamW state, activations) needs about" in line
    assert line.endswith(" GiB, but 8.0 GiB of RAM is available")


def test_train_memory_estimate_is_the_planners_memory_model():
    # one memory model: the up-front check's estimate is lmsys.plan.memory's peak for the config's shape (naive
    # attention: the S x S scores count too; one process, no recomputation, fp32 weights under autocast), on
    # the device it runs on; that model is held against torch's profiler in tests/test_plan_phases.py
    from lmsys.model.config import PRESETS, parameter_count_formula
    from lmsys.model.memory import train_memory_estimate
    from lmsys.plan import memory as mem
    from lmsys.plan.shape import from_model_config

    cfg = PRESETS["tiny"]
    shape = from_model_config(cfg, name="tiny")
    assert shape.attention == "naive"
    for device in ("cuda", "cpu"):
        for dtype in ("fp32", "bf16"):
            planned = mem.memory(shape, mem.Layout(micro_batch=2), mem.precision(dtype, master_weights=False),
                                 capacity=float("inf"), device=device)
            assert train_memory_estimate(cfg, batch_size=2, dtype=dtype, device=device) == int(planned.total)
    est = train_memory_estimate(cfg, batch_size=2, dtype="fp32")
    assert est > 16 * parameter_count_formula(cfg)  # fp32 weights, gradients, AdamW's two moments, and more
    assert train_memory_estimate(cfg, batch_size=4) > est  # more batch, more activations
    # autocast over fp32 weights: 16-bit activations, plus the weights' 16-bit copies (and on CUDA an fp32
    # softmax): less memory where activations dominate, as they do from a few sequences of 512 tokens
    assert train_memory_estimate(cfg, batch_size=8, dtype="bf16") < train_memory_estimate(cfg, batch_size=8)
    longer = train_memory_estimate(cfg, batch_size=2, context_length=2 * cfg.context_length)
    assert longer == train_memory_estimate(cfg.with_overrides(context_length=2 * cfg.context_length), batch_size=2)
    assert longer > est


def test_oversubscribed_gloo_warns(monkeypatch):
    from lmsys.distributed import launch

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert "runs 16 processes on 2 CPU core(s)" in launch.warn_oversubscription([2, 16], "gloo")
    assert launch.warn_oversubscription([2], "gloo") is None
    assert launch.warn_oversubscription([16], "nccl") is None


def test_a_message_size_that_is_not_whole_elements_is_refused(lmsys):
    assert "--sizes 3: 3 bytes is not a whole number of fp32 elements" in one_line(
        lmsys("comm", "allreduce", "--sizes", "3"))


# ------------------------------------------------------------------------------------ vocabulary and help


def test_device_maps_to_the_backend_and_conflicts_are_one_line(lmsys):
    from lmsys.distributed.launch import backend_for_device

    assert backend_for_device("cpu", None) == "gloo"
    assert backend_for_device("cuda", "nccl") == "nccl"
    assert backend_for_device("auto", "gloo") == "gloo"
    for cmd in (["comm", "allreduce"], ["ddp", "train"]):
        assert "--device cpu runs gloo, but --backend nccl" in one_line(
            lmsys(*cmd, "--device", "cpu", "--backend", "nccl"))


def test_old_spellings_are_aliases(lmsys, monkeypatch):
    import lmsys.bench.attention as lib

    seen = {}
    real = lib.resolve_sweep

    def spy(**kw):
        sweep, notes = real(**kw)
        seen["sweep"] = sweep
        raise LmsysError("stop here")

    monkeypatch.setattr(lib, "resolve_sweep", spy)
    lmsys("bench", "attention", "--device", "cpu", "--batch", "3", "--seq-len", "40", "--iters", "2")
    assert (seen["sweep"].batch, seen["sweep"].seq_len, seen["sweep"].steps) == ((3,), (40,), 2)
    lmsys("bench", "attention", "--device", "cpu", "--batch-size", "5", "--context-length", "48", "--steps", "3")
    assert (seen["sweep"].batch, seen["sweep"].seq_len, seen["sweep"].steps) == ((5,), (48,), 3)


def test_ddp_world_size_takes_a_list(lmsys, monkeypatch):
    import lmsys.commands.ddp as cmd

    calls = []

    def fake(target, kwargs, *, world_size, backend, description):
        calls.append(world_size)
        return {"meta": {}, "rows": [{"strategy": "naive", "ms/step": 1.0}]}

    monkeypatch.setattr(cmd, "run_on_ranks", fake)
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    r = lmsys("ddp", "train", "--backend", "gloo", "--world-size", "2,4", "--strategy", "naive", "--format", "md")
    assert r.code == 0, r.err
    assert calls == [2, 4]
    assert "ddp train: world size 2" in r.out and "ddp train: world size 4" in r.out


def test_help_lists_every_attention_impl_and_flags_have_no_bool_metavar(lmsys):
    from lmsys.profiling import nvtx  # noqa: F401 - registers `annotated`
    from lmsys.kernels.attention import IMPLS
    from lmsys.kernels.registry import NAMES as ATTENTION_IMPLS, USER

    assert set(IMPLS) - USER == set(ATTENTION_IMPLS)  # lmsys's own: every name listed has a function
    r = lmsys("bench", "e2e", "--help")
    text = " ".join(r.out.split())
    for name in ATTENTION_IMPLS:
        assert name in text
    for line in r.out.splitlines():
        if "--help" not in line:  # typer 0.29 renders its own --help so; pyproject keeps typer < 0.29
            assert "<bool>" not in line, line


@pytest.mark.parametrize("cmd", [["profile", "nsys", "--engine", "torch"], ["profile", "memory"], ["ddp", "train"]])
def test_a_size_list_where_one_model_is_run_is_one_line(lmsys, cmd):
    line = one_line(lmsys(*cmd, "--size", "tiny,small", "--device", "cpu"))
    assert line.startswith(f"error: --size tiny,small: {' '.join(cmd[:2])} takes one preset or .yaml config, not a list")
    assert line.endswith("run it once per size")


def test_every_help_states_its_warmup_default_and_whether_size_is_a_list(lmsys, monkeypatch):
    """Warm-up defaults differ by command (the docs show them): each help says its own."""
    monkeypatch.setenv("COLUMNS", "400")  # one line per option

    def option_line(args: list[str], option: str) -> str:
        r = lmsys(*args, "--help")
        assert r.code == 0, r.err
        lines = [ln for ln in r.out.splitlines() if ln.lstrip("│ ").startswith(option + " ")
                 or ln.lstrip("│ ").startswith(option + ",")]
        assert len(lines) == 1, (args, option, r.out)
        return " ".join(lines[0].split())

    for args, default in [(["bench", "e2e"], 5), (["profile", "nsys"], 3), (["comm", "allreduce"], 5),
                          (["ddp", "train"], 3)]:
        assert f"[default: {default}]" in option_line(args, "--warmup"), args
    attention = option_line(["bench", "attention"], "--warmup")
    assert "seed: 10" in attention and "CPU: 1" in attention  # its default depends on the device
    assert "comma-separated" in option_line(["bench", "e2e"], "--size")
    for args in (["profile", "nsys"], ["profile", "memory"], ["ddp", "train"]):
        assert "not a comma list" in option_line(args, "--size"), args
