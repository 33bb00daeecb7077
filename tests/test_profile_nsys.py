"""nsys: the lookup, the command lines, the CSV parsers (on the captured fixtures and on exact inline
tables) and every error path, with a stand-in nsys (tests/helpers/fake_nsys.py) where a run is needed."""

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from lmsys.core.errors import LmsysError
from lmsys.profiling import nsys
from lmsys.profiling.summary import short_kernel_name, split_rows

FIXTURES = Path(__file__).parent / "fixtures" / "nsys"
FAKE = Path(__file__).parent / "helpers" / "fake_nsys.py"


def fixture_rows(report: str):
    path = FIXTURES / f"{report}.csv"
    if not path.is_file():
        pytest.skip(f"fixture {path.name} not captured")
    return nsys.read_csv(path)


@pytest.fixture
def fake_nsys(tmp_path, monkeypatch):
    """$NSYS -> a script running the fake; returns the file its argv are logged to."""
    script = tmp_path / "bin" / "nsys"
    script.parent.mkdir()
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "argv.jsonl"
    monkeypatch.setenv("NSYS", str(script))
    monkeypatch.setenv("FAKE_NSYS_LOG", str(log))
    monkeypatch.setenv("FAKE_NSYS_FIXTURES", str(FIXTURES))
    return log


@pytest.fixture
def no_nsys(monkeypatch, tmp_path):
    monkeypatch.delenv("NSYS", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(nsys, "SEARCH_GLOBS", (str(tmp_path / "nowhere" / "**" / "nsys"),))


# ------------------------------------------------------------------------------------ finding nsys


def test_find_nsys_order_explicit_then_path_then_globs(tmp_path):
    def exe(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\n")
        path.chmod(0o755)
        return str(path)

    explicit = exe(tmp_path / "explicit" / "nsys")
    on_path = exe(tmp_path / "bin" / "nsys")
    old = exe(tmp_path / "opt" / "nsight-systems" / "2024.1" / "target-linux-x64" / "nsys")
    new = exe(tmp_path / "opt" / "nsight-systems" / "2025.3" / "target-linux-x64" / "nsys")
    exe(tmp_path / "opt" / "nsight-systems" / "2025.3" / "target" / "qnx-arm" / "nsys")  # not this host's CLI
    globs = (str(tmp_path / "opt" / "nsight-*" / "**" / "nsys"),)
    assert nsys.find_nsys({"NSYS": explicit, "PATH": str(Path(on_path).parent)}, globs) == explicit
    assert nsys.find_nsys({"PATH": str(Path(on_path).parent)}, globs) == on_path
    assert nsys.find_nsys({"PATH": ""}, globs) == new != old
    with pytest.raises(LmsysError, match="--engine torch"):
        nsys.find_nsys({"PATH": ""}, (str(tmp_path / "none" / "nsys"),))
    with pytest.raises(LmsysError, match="not an executable"):
        nsys.find_nsys({"NSYS": str(tmp_path / "missing")}, globs)


def test_nsys_missing_is_one_line_exit_2_suggesting_the_torch_engine(lmsys, no_nsys):
    r = lmsys("profile", "nsys", "--size", "tiny")
    assert r.code == 2
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and "nsys" in lines[0] and "--engine torch" in lines[0]
    r = lmsys("profile", "nsys", "--", sys.executable, "-c", "pass")
    assert r.code == 2 and "--engine torch" in r.err


def test_bad_nsys_env_is_exit_2(lmsys, monkeypatch, tmp_path):
    monkeypatch.setenv("NSYS", str(tmp_path / "no-such-nsys"))
    r = lmsys("profile", "nsys", "--", "true")
    assert r.code == 2 and "NSYS=" in r.err


def test_nsys_engine_without_a_gpu_is_exit_2(lmsys, fake_nsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the CPU behaviour")
    r = lmsys("profile", "nsys", "--size", "tiny", "--device", "cpu")
    assert r.code == 2 and "--engine torch" in r.err


def test_option_errors_are_exit_2(lmsys):
    assert lmsys("profile", "nsys", "--engine", "perf").code == 2
    assert lmsys("profile", "nsys", "--engine", "torch", "--mode", "bwd").code == 2
    assert lmsys("profile", "nsys", "--engine", "torch", "--steps", "0").code == 2
    assert lmsys("profile", "nsys", "--engine", "torch", "--size", "tiny,small").code == 2
    r = lmsys("profile", "nsys", "--engine", "torch", "--", "true")
    assert r.code == 2 and "--engine nsys" in r.err
    r = lmsys("profile", "nsys", "--engine", "torch", "--nsys-args", '--foo="bar')
    assert r.code == 2 and r.err.startswith("error: --nsys-args: cannot split") and "Traceback" not in r.err


def test_help_of_top_and_out_dir_names_each_commands_own_outputs():
    """profile nsys and profile memory share option names, not outputs: each help says what that command writes."""
    import typer

    from lmsys.commands.profile import app

    group = typer.main.get_command(app)
    helps = {name: {p.name: " ".join((p.help or "").split()) for p in group.commands[name].params}
             for name in ("nsys", "memory")}
    assert ".nsys-rep" in helps["nsys"]["out_dir"] and "Chrome trace" in helps["nsys"]["out_dir"]
    assert "top-kernels" in helps["nsys"]["top"] and "allocation" not in helps["nsys"]["top"]
    for word in ("snapshot", "PNG"):
        assert word not in helps["nsys"]["out_dir"] and word in helps["memory"]["out_dir"]
    assert "largest-allocations" in helps["memory"]["top"] and "kernel" not in helps["memory"]["top"]
    assert ".nsys-rep" not in helps["memory"]["out_dir"]
    flag = next(p for p in group.commands["nsys"].params if p.name == "annotate_attention")
    assert flag.metavar == ""  # no <bool> metavar for a flag that takes no value


def test_an_out_dir_that_cannot_be_made_is_exit_2(lmsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    r = lmsys("profile", "nsys", "--engine", "torch", "--size", "tiny", "--out-dir", str(blocker / "sub"))
    assert r.code == 2 and r.err.startswith(f"error: --out-dir: cannot create {blocker / 'sub'}")
    assert len(r.err.strip().splitlines()) == 1


# ----------------------------------------------------------------------------------- command lines


def test_profile_command_captures_only_the_measured_steps():
    cmd = nsys.profile_command("nsys", ["python", "-m", "x"], output=Path("/o/r"), capture_profiler_api=True,
                               extra=["--cuda-memory-usage=true"])
    assert cmd[:2] == ["nsys", "profile"]
    assert "--trace=cuda,nvtx,osrt,cublas" in cmd and "--output=/o/r" in cmd
    assert "--capture-range=cudaProfilerApi" in cmd and "--capture-range-end=stop" in cmd
    assert cmd[-4:] == ["--cuda-memory-usage=true", "python", "-m", "x"]
    whole = nsys.profile_command("nsys", ["a"], output=Path("r"), trace="cuda,nvtx")
    assert "--trace=cuda,nvtx" in whole and not any(c.startswith("--capture-range") for c in whole)
    stats = nsys.stats_command("nsys", Path("r.nsys-rep"), base=Path("/o/r_stats"))
    assert [c for c in stats if c.startswith("--report=")] == [f"--report={r}" for r in nsys.STATS_REPORTS]
    assert "--format=csv" in stats and "--output=/o/r_stats" in stats and stats[-1] == "r.nsys-rep"


def test_optional_flags_this_nsys_lacks_are_left_out():
    cmd = nsys.profile_command("nsys", ["app", "--sample=x"], output=Path("r"), capture_profiler_api=True)
    kept = nsys.drop_unsupported(cmd[:-2], {"--trace", "--output", "--sample"}) + cmd[-2:]
    assert "--cpuctxsw=none" not in kept and "--stats=false" not in kept and "--sample=none" in kept
    assert "--capture-range=cudaProfilerApi" in kept and kept[-2:] == ["app", "--sample=x"]  # the app's own args
    assert nsys.drop_unsupported(cmd, None) == cmd


# ---------------------------------------------------------------------------- parsers: exact tables


NVTX_SUM = """\
Processing [/tmp/r.sqlite] with [/opt/nvidia/nsys/reports/nvtx_sum.py]...
Time (%),Total Time (ns),Instances,Avg (ns),Med (ns),Min (ns),Max (ns),StdDev (ns),Style,Range
60.0,3000000,2,1500000.0,1500000.0,1400000,1600000,141421.4,PushPop,:BWD_STEP
30.0,1500000,2,750000.0,750000.0,700000,800000,70710.7,PushPop,:FWD_STEP
10.0,500000,1,500000.0,500000.0,500000,500000,0.0,StartEnd,:FWD_STEP

"""
KERN_SUM = """\
Time (%),Total Time (us),Instances,Avg (us),Med (us),Min (us),Max (us),StdDev (us),Name
75.0,300.0,3,100.0,100.0,90.0,110.0,10.0,"void gemm<float, 4>(int, T1)"
25.0,100.0,4,25.0,25.0,25.0,25.0,0.0,softmax_kernel
"""
NVTX_KERN = """\
NVTX Range,Style,PID,TID,NVTX Inst,Kern Inst,Total Time (ns),Avg (ns),Med (ns),Min (ns),Max (ns),StdDev (ns),Kernel Name
:ATTN_SOFTMAX,PushPop,1,1,2,2,4000,2000.0,2000.0,2000,2000,0.0,softmax_kernel
:ATTN_QK_MATMUL,PushPop,1,1,2,2,6000,3000.0,3000.0,3000,3000,0.0,gemm
:ATTN_QK_MATMUL,PushPop,1,7,1,1,2000,2000.0,2000.0,2000,2000,0.0,gemm
:ATTN_AV_MATMUL,PushPop,1,1,3,3,9000,3000.0,3000.0,3000,3000,0.0,gemm
"""


def test_parse_csv_skips_notices_and_stops_at_the_blank_line():
    rows = nsys.parse_csv(NVTX_SUM + "Time (%),Name\n1,other report\n")
    assert len(rows) == 3 and rows[0]["Range"] == ":BWD_STEP" and rows[2]["Style"] == "StartEnd"
    assert nsys.parse_csv("SKIPPED: no data\n") == []


def test_ranges_merge_styles_and_strip_the_domain_colon():
    ranges = {r.name: r for r in nsys.ranges_from_nvtx_sum(nsys.parse_csv(NVTX_SUM))}
    assert set(ranges) == {"FWD_STEP", "BWD_STEP"}
    assert ranges["FWD_STEP"].instances == 3 and ranges["FWD_STEP"].total_ns == 2_000_000
    assert ranges["BWD_STEP"].total_ns == 3_000_000


def test_kernel_summary_reads_the_unit_from_the_header_and_keeps_quoted_names():
    top = nsys.timed_from_summary(nsys.parse_csv(KERN_SUM))
    assert [t.name for t in top] == ["void gemm<float, 4>(int, T1)", "softmax_kernel"]
    assert top[0].total_ns == 300_000 and top[0].count == 3
    assert short_kernel_name(top[0].name) == "gemm<float, 4>"
    softmax = ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::"
               "(anonymous namespace)::SoftMaxForwardEpilogue>(T4 *, const T2 *, int)")
    assert short_kernel_name(softmax, width=200) == ("at::native::cunn_SoftMaxForward<4, float, float, float, "
                                                     "at::native::SoftMaxForwardEpilogue>")
    assert short_kernel_name("x" * 100, width=10) == "x" * 9 + "…"


def test_attention_split_from_nvtx_kern_sum_with_flops():
    stats = {"nvtx_sum": nsys.parse_csv(
        "Time (%),Total Time (ns),Instances,Style,Range\n"
        "1,90000,3,PushPop,:ATTN_QK_MATMUL\n1,90000,2,PushPop,:ATTN_SOFTMAX\n1,90000,3,PushPop,:ATTN_AV_MATMUL\n"),
        "nvtx_kern_sum": nsys.parse_csv(NVTX_KERN)}
    prof = nsys.summarize(stats)
    qk = prof.range("ATTN_QK_MATMUL")
    assert qk.device_ns == 8000 and qk.kernels == 3  # merged over threads
    rows = {r["part"]: r for r in split_rows(prof, shape=(1, 2, 4, 8))}
    assert rows["mask + softmax"]["time ms"] == pytest.approx(0.004)
    assert rows["matmuls (QKᵀ + P·V)"]["time ms"] == pytest.approx(0.017)
    assert rows["matmuls (QKᵀ + P·V)"]["% of attention"] == pytest.approx(100 * 17 / 21)
    # QKᵀ: 2·B·H·S²·d per call = 2·1·2·16·8 = 512 FLOPs, 3 calls
    assert rows["QKᵀ matmul (+ scale)"]["GFLOP"] == pytest.approx(3 * 512 / 1e9)
    assert rows["mask + softmax"]["GFLOP"] == pytest.approx(2 * 5 * 32 / 1e9)


def test_kernels_in_windows_assigns_by_execution_time_and_skips_memcpy():
    ranges = nsys.parse_csv("Start (ns),End (ns),NameTid,Name\n100,200,BWD_STEP (7),BWD_STEP\n"
                            "300,400,BWD_STEP (7),:BWD_STEP\n150,160,FWD_STEP (7),FWD_STEP\n")
    kernels = nsys.parse_csv(
        "Start (ns),Duration (ns),Name\n110,20,a\n190,20,b\n310,50,a\n320,5,[CUDA memcpy Device-to-Host]\n")
    got = nsys.kernels_in_windows(ranges, kernels, ("BWD_STEP", "FWD_STEP", "OPTIM_STEP"))
    assert [(k.name, k.count, k.total_ns) for k in got["BWD_STEP"]] == [("a", 2, 70)]  # b ends after 200
    assert got["FWD_STEP"] == [] and "OPTIM_STEP" not in got


def test_missing_libraries_from_loader_errors_and_ldd():
    text = ("QdstrmImporter: error while loading shared libraries: libdw.so.1: cannot open shared object file: "
            "No such file or directory\n")
    assert nsys.missing_libraries(text) == ["libdw.so.1"]
    ldd = "\tlinux-vdso.so.1 (0x7ff)\n\tlibdw.so.1 => not found\n\tlibelf.so.1 => not found\n\tlibc.so.6 => /lib/libc.so.6\n"
    assert nsys.missing_libraries(ldd) == ["libdw.so.1", "libelf.so.1"]


# -------------------------------------------------------------------- parsers: the captured fixtures


def test_fixture_nvtx_sum_has_the_three_phases_with_positive_times():
    ranges = {r.name: r for r in nsys.ranges_from_nvtx_sum(fixture_rows("nvtx_sum"))}
    for phase in ("FWD_STEP", "BWD_STEP", "OPTIM_STEP"):
        assert ranges[phase].instances >= 1 and ranges[phase].total_ns > 0
    assert "WARMUP" not in ranges  # the warm-up lies outside the capture range


def test_fixture_kernel_summaries_parse_sorted_and_positive():
    for report in ("cuda_gpu_kern_sum", "cuda_api_sum"):
        items = nsys.timed_from_summary(fixture_rows(report))
        assert items and all(t.total_ns > 0 and t.count >= 1 for t in items)
        assert [t.total_ns for t in items] == sorted((t.total_ns for t in items), reverse=True)
    by_range = nsys.kernels_by_range(fixture_rows("nvtx_kern_sum"))
    assert by_range.get("FWD_STEP"), sorted(by_range)


def test_fixture_full_summary_attributes_kernels_to_every_phase():
    stats = {name: fixture_rows(name) for name in (*nsys.STATS_REPORTS, *nsys.TRACE_REPORTS)}
    prof = nsys.summarize(stats, windowed=("FWD_STEP", "BWD_STEP", "OPTIM_STEP"))
    # The windows come from the two trace reports: compare with the kernels of that same capture.
    # Kernels only: the trace also lists memory copies and sets (a 'Bytes (MB)' value, a '[CUDA ...' name).
    kernel_rows = [r for r in stats["cuda_gpu_trace"] if not r["Name"].startswith("[")]
    assert len(kernel_rows) < len(stats["cuda_gpu_trace"])  # the capture has copies: they are left out
    total_kernel_ns = sum(float(r["Duration (ns)"]) for r in kernel_rows)
    in_phases = 0.0
    for phase in ("FWD_STEP", "BWD_STEP", "OPTIM_STEP"):
        r = prof.range(phase)
        assert r.device_ns > 0 and r.kernels > 0, phase
        assert r.device_ns <= r.total_ns  # kernels of a synchronised phase run inside its window
        in_phases += r.device_ns
    # every kernel of the capture ran in some phase
    assert in_phases == pytest.approx(total_kernel_ns, rel=0.01)
    split = split_rows(prof, shape=(4, 4, 128, 32))
    assert {r["part"] for r in split} >= {"mask + softmax", "matmuls (QKᵀ + P·V)"}
    assert all(r["% of attention"] > 0 for r in split[:3])


# ---------------------------------------------------------------------- runs with the stand-in nsys


def test_a_command_after_dashdash_is_profiled_whole_and_rendered(lmsys, fake_nsys, tmp_path):
    out = tmp_path / "out"
    r = lmsys("profile", "nsys", "--out-dir", str(out), "--format", "json", "--",
              sys.executable, "-c", "print('hello from the app')")
    assert r.code == 0, r.err
    docs = json.loads(r.out[r.out.index("["):])
    titles = [d["title"] for d in docs]
    assert titles[0] == "profile nsys: time per range" and any("top 10 kernels" in t for t in titles)
    assert {row["range"] for row in docs[0]["rows"]} >= {"FWD_STEP", "BWD_STEP", "OPTIM_STEP"}
    assert "nsys report:" in r.err and (out / f"nsys_{Path(sys.executable).name}.nsys-rep").is_file()
    argv = [json.loads(line) for line in fake_nsys.read_text().splitlines()]
    profile = next(a for a in argv if a[0] == "profile" and a[1] != "--help")
    assert profile[-3:] == [sys.executable, "-c", "print('hello from the app')"]
    assert "--cpuctxsw=none" not in profile and "--sample=none" in profile  # as this nsys's --help lists
    assert not any(a.startswith("--capture-range") for a in profile)


def test_profile_e2e_runs_the_target_under_a_capture_range(fake_nsys, tmp_path):
    from lmsys.model.config import PRESETS

    prof = nsys.profile_e2e(os.environ["NSYS"], config=PRESETS["tiny"], batch_size=2, dtype="fp32", mode="train",
                            warmup=1, steps=2, device="cuda", out_dir=tmp_path, name="run")
    spec = json.loads((tmp_path / "run.spec.json").read_text())
    assert spec["config"]["d_model"] == 128 and spec["steps"] == 2 and spec["warmup"] == 1
    argv = [json.loads(line) for line in fake_nsys.read_text().splitlines()]
    profile = next(a for a in argv if a[0] == "profile" and a[1] != "--help")
    assert "--capture-range=cudaProfilerApi" in profile and "lmsys.profiling.nsys_target" in profile
    stats = [a for a in argv if a[0] == "stats"]
    assert len(stats) == 2 and "--report=cuda_gpu_trace" in stats[1]  # the phase windows
    assert prof.range("BWD_STEP").device_ns > 0  # from the windows, not launch matching
    assert Path(prof.files["report"]).is_file() and prof.commands[0].startswith(os.environ["NSYS"])


def test_only_a_qdstrm_names_the_missing_library(lmsys, fake_nsys, monkeypatch, tmp_path):
    monkeypatch.setenv("FAKE_NSYS_MODE", "qdstrm")
    r = lmsys("profile", "nsys", "--out-dir", str(tmp_path), "--", sys.executable, "-c", "pass")
    assert r.code == 2
    assert "only nsys_" in r.err and ".qdstrm" in r.err and "libdw.so.1" in r.err
    assert r.err.startswith("error:") and "hint:" in r.err


def test_only_a_qdstrm_with_a_loader_error_names_that_library(lmsys, fake_nsys, monkeypatch, tmp_path):
    text = tmp_path / "importer.txt"
    text.write_text("Importer error status: libfoo.so.3: cannot open shared object file: No such file\n")
    monkeypatch.setenv("FAKE_NSYS_MODE", "qdstrm")
    monkeypatch.setenv("FAKE_NSYS_QDSTRM_TEXT", str(text))
    r = lmsys("profile", "nsys", "--out-dir", str(tmp_path), "--", sys.executable, "-c", "pass")
    assert r.code == 2 and "cannot load libfoo.so.3" in r.err


def test_an_importer_missing_a_library_fails_before_profiling(lmsys, fake_nsys, monkeypatch, tmp_path):
    """Checked up front with ldd: without it nsys runs the whole workload and fails at the end."""
    bin_dir = Path(os.environ["NSYS"]).parent
    for name, body in (("QdstrmImporter", "exit 0"),
                       ("ldd", "echo '\tlibdw.so.1 => not found'; echo '\tlibc.so.6 => /lib/libc.so.6'")):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    r = lmsys("profile", "nsys", "--out-dir", str(tmp_path / "out"), "--", sys.executable, "-c", "pass")
    assert r.code == 2 and "would leave only a .qdstrm" in r.err and "libdw.so.1" in r.err
    assert "libc" not in r.err and "hint:" in r.err
    calls = [json.loads(line)[0] for line in fake_nsys.read_text().splitlines()] if fake_nsys.exists() else []
    assert "profile" not in calls


def test_the_captured_importer_failure_names_libdw(lmsys, fake_nsys, monkeypatch, tmp_path):
    """The real output of nsys without libdw (captured on the GPU machine by scripts/gpu/profile.sh)."""
    captured = FIXTURES / "qdstrm_failure.txt"
    if not captured.is_file():
        pytest.skip("qdstrm_failure.txt not captured")
    monkeypatch.setenv("FAKE_NSYS_MODE", "qdstrm")
    monkeypatch.setenv("FAKE_NSYS_QDSTRM_TEXT", str(captured))
    r = lmsys("profile", "nsys", "--out-dir", str(tmp_path), "--", sys.executable, "-c", "pass")
    assert r.code == 2 and "libdw.so.1" in r.err


def test_a_failing_nsys_without_report_is_exit_2(lmsys, monkeypatch, tmp_path):
    script = tmp_path / "nsys"
    script.write_text("#!/bin/sh\necho 'nsys: fatal: cannot open the target' >&2\nexit 3\n")
    script.chmod(0o755)
    monkeypatch.setenv("NSYS", str(script))
    r = lmsys("profile", "nsys", "--out-dir", str(tmp_path), "--", "true")
    assert r.code == 2 and "exit 3" in r.err and "cannot open the target" in r.err


def test_the_target_process_runs_a_spec_and_reports_its_status(tmp_path):
    """What nsys runs: on a CPU the same steps without a capture window; errors land in the result."""
    import subprocess

    from lmsys.model.config import PRESETS

    cfg = PRESETS["tiny"].with_overrides(context_length=16, num_layers=1).as_dict()
    spec = {"config": cfg, "batch_size": 1, "dtype": "fp32", "mode": "train", "warmup": 1, "steps": 1,
            "device": "cpu", "result": str(tmp_path / "ok.json")}
    (tmp_path / "ok.spec.json").write_text(json.dumps(spec))
    env = nsys._child_env()
    run = subprocess.run([sys.executable, "-m", "lmsys.profiling.nsys_target", str(tmp_path / "ok.spec.json")],
                         capture_output=True, text=True, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert json.loads((tmp_path / "ok.json").read_text()) == {"status": "ok"}
    bad = dict(spec, config=dict(cfg, num_heads=3), result=str(tmp_path / "bad.json"))  # 128 % 3 != 0
    (tmp_path / "bad.spec.json").write_text(json.dumps(bad))
    run = subprocess.run([sys.executable, "-m", "lmsys.profiling.nsys_target", str(tmp_path / "bad.spec.json")],
                         capture_output=True, text=True, env=env, cwd=tmp_path)
    result = json.loads((tmp_path / "bad.json").read_text())
    assert run.returncode == 2 and result["status"] == "error" and "num_heads" in result["error"]
    assert run.stderr.startswith("error:")


def test_shares_against_a_hand_built_trace():
    from lmsys.profiling.summary import RangeTime, TimeProfile, range_rows

    ms = 1e6  # ns
    prof = TimeProfile("nsys", "kernel", ranges=[
        RangeTime("OPTIM_STEP", 2, 10 * ms, device_ns=9 * ms, kernels=4),
        RangeTime("FWD_STEP", 2, 30 * ms, device_ns=28 * ms, kernels=10),
        RangeTime("BWD_STEP", 2, 60 * ms, device_ns=55 * ms, kernels=20),
        RangeTime("WARMUP", 1, 500 * ms),
        RangeTime("ATTN_QK_MATMUL", 4, 4 * ms, device_ns=2 * ms, kernels=4),
        RangeTime("ATTN_SOFTMAX", 4, 6 * ms, device_ns=5 * ms, kernels=8),
        RangeTime("ATTN_AV_MATMUL", 4, 4 * ms, device_ns=3 * ms, kernels=4),
    ])
    rows = {r["range"]: r for r in range_rows(prof)}
    # the step is FWD + BWD + OPTIM = 100 ms of host time; WARMUP is not part of it
    assert rows["FWD_STEP"]["% of step"] == pytest.approx(30)
    assert rows["BWD_STEP"]["% of step"] == pytest.approx(60)
    assert rows["WARMUP"]["% of step"] is None and rows["ATTN_SOFTMAX"]["% of step"] is None
    assert [r["range"] for r in range_rows(prof)][:3] == ["FWD_STEP", "BWD_STEP", "OPTIM_STEP"]
    # attention split uses the GPU time: 2 + 5 + 3 = 10 ms; softmax 5 of them
    split = {r["part"]: r for r in split_rows(prof, shape=(1, 2, 8, 4))}
    assert split["mask + softmax"]["% of attention"] == pytest.approx(50)
    assert split["matmuls (QKᵀ + P·V)"]["% of attention"] == pytest.approx(50)
    assert split["mask + softmax"]["time ms"] == pytest.approx(5)
    # 4 calls of the QKᵀ matmul, 2·B·H·S²·d FLOPs each = 2·1·2·64·4 = 1024
    assert split["QKᵀ matmul (+ scale)"]["GFLOP"] == pytest.approx(4 * 1024 / 1e9)


# ---------------------------------------------------------------- interrupted: nothing at the final path


def test_an_interrupted_nsys_run_leaves_nothing_at_the_final_path(fake_nsys, monkeypatch, tmp_path):
    """nsys writes under a hidden temporary name; SIGINT while it runs: exit 130, no report (partial or
    not) at the final name, no temporary file left, and an older complete report untouched."""
    import signal
    import subprocess
    import time

    out = tmp_path / "out"
    out.mkdir()
    old = out / "nsys_true.nsys-rep"
    old.write_bytes(b"an older complete report")
    monkeypatch.setenv("FAKE_NSYS_MODE", "hang")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    proc = subprocess.Popen([sys.executable, "-m", "lmsys", "profile", "nsys", "--out-dir", str(out), "--", "true"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not list(out.glob(".nsys_true.tmp-*.nsys-rep")):  # nsys is writing its report
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "interrupted" in err, err
    assert old.read_bytes() == b"an older complete report"
    assert sorted(p.name for p in out.iterdir()) == ["nsys_true.log", "nsys_true.nsys-rep"]


def test_an_interrupted_torch_engine_run_leaves_no_partial_trace(lmsys, monkeypatch, tmp_path):
    """The issue's row: an interrupted `profile nsys --engine torch` left a valid-looking partial trace at
    the normal path. The interrupt lands while the trace is being written: exit 130, nothing at the path."""
    from torch.profiler import profile

    from lmsys.core.errors import Interrupted

    def export(self, path):
        Path(path).write_text('{"traceEvents": [')  # half a trace, then the signal
        raise Interrupted(2)

    monkeypatch.setattr(profile, "export_chrome_trace", export)
    out = tmp_path / "out"
    r = lmsys("profile", "nsys", "--engine", "torch", "--device", "cpu", "--size", "tiny", "--context-length", "16",
              "--batch-size", "1", "--warmup", "0", "--steps", "1", "--out-dir", str(out))
    assert r.code == 130 and "interrupted" in r.err, r.err
    assert list(out.iterdir()) == []
