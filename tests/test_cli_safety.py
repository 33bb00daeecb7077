"""Issue 27: --output never destroys what it does not own, exit codes mean one thing, nothing silently
ignored, nothing left running, progress on long runs. One test per row of the issue's table: the exit
code, a one-line message, and nothing changed at the path or in the temp directory that should not be."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")
PRECISION = ("precision", "--device", "cpu", "--steps", "10")


def one_line(result, code: int = 2) -> str:
    assert result.code == code, (result.code, result.out, result.err)
    assert "Traceback" not in result.err + result.out
    lines = [ln for ln in result.err.splitlines() if ln.strip() and not ln.startswith("hint:")]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.err
    return lines[0]


def cli(*args: str, env: dict | None = None, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    """`python -m lmsys ARGS` in a subprocess (for what only a real process shows: pipes, signals)."""
    full = dict(os.environ, PYTHONPATH=SRC)
    full.pop("LMSYS_DEBUG", None)
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "lmsys", *args], env=full, capture_output=True, text=True,
                          timeout=timeout, **kw)


# ------------------------------------------------------------------------ 1. --output owns only its file


def test_output_dev_full_is_one_line_exit_2_and_never_wrote(lmsys):
    r = lmsys(*PRECISION, "-o", "/dev/full")
    assert "cannot write /dev/full: No space left on device" in one_line(r)
    assert "wrote" not in r.err
    assert Path("/dev/full").is_char_device()


def test_output_dev_null_is_written_directly_and_stays_a_device(lmsys):
    r = lmsys(*PRECISION, "-o", "/dev/null")
    assert r.code == 0, r.err
    assert Path("/dev/null").is_char_device()


def test_output_symlink_is_written_through_to_its_target(lmsys, tmp_path):
    target = tmp_path / "real.md"
    target.write_text("old")
    link = tmp_path / "link.md"
    link.symlink_to(target)
    r = lmsys(*PRECISION, "-o", str(link))
    assert r.code == 0, r.err
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text().startswith("### autocast")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.md", "real.md"]


def test_output_dangling_symlink_creates_its_target(lmsys, tmp_path):
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "made.json")
    assert lmsys(*PRECISION, "-o", str(link)).code == 0
    assert link.is_symlink() and (tmp_path / "made.json").read_text().startswith("[")


def test_output_fifo_is_written_to_and_stays_a_fifo(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    proc = subprocess.Popen([sys.executable, "-m", "lmsys", *PRECISION, "-o", str(fifo), "-f", "csv"],
                            env=dict(os.environ, PYTHONPATH=SRC), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    with open(fifo) as reader:
        text = reader.read()
    assert proc.wait(timeout=120) == 0, proc.stderr.read()
    assert text.startswith("table,autocast,tensor,dtype") and fifo.is_fifo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


def test_output_directory_is_one_line_and_untouched(lmsys, tmp_path):
    (tmp_path / "keep").write_text("x")
    assert "is a directory" in one_line(lmsys(*PRECISION, "-o", str(tmp_path)))
    assert [p.name for p in tmp_path.iterdir()] == ["keep"]


def test_output_socket_is_refused(lmsys, tmp_path):
    import socket

    path = tmp_path / "s"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))
    try:
        assert "not a regular file, a device or a pipe" in one_line(lmsys(*PRECISION, "-o", str(path)))
    finally:
        sock.close()


def test_output_name_too_long_is_one_line_exit_2(lmsys, tmp_path):
    line = one_line(lmsys(*PRECISION, "-o", str(tmp_path / ("x" * 300 + ".md"))))
    assert "File name too long" in line
    assert list(tmp_path.iterdir()) == []


def test_a_regular_file_is_replaced_whole_and_keeps_its_mode(lmsys, tmp_path):
    out = tmp_path / "t.md"
    out.write_text("old")
    out.chmod(0o640)
    assert lmsys(*PRECISION, "-o", str(out)).code == 0
    assert out.read_text().startswith("### autocast") and out.stat().st_mode & 0o777 == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["t.md"]


def test_a_writer_that_fails_midway_leaves_neither_partial_nor_temporary_file(tmp_path):
    from lmsys.core.errors import LmsysError
    from lmsys.core.files import atomic_output

    out = tmp_path / "plot.png"
    out.write_bytes(b"previous")
    with pytest.raises(KeyboardInterrupt):
        with atomic_output(out, what="--plot") as tmp:
            assert tmp.suffix == ".png" and tmp.parent == tmp_path
            tmp.write_bytes(b"half")
            raise KeyboardInterrupt
    assert out.read_bytes() == b"previous" and [p.name for p in tmp_path.iterdir()] == ["plot.png"]
    with pytest.raises(LmsysError, match="--plot: cannot write .*Input/output error"):
        with atomic_output(out, what="--plot") as tmp:
            raise OSError(5, os.strerror(5))
    assert [p.name for p in tmp_path.iterdir()] == ["plot.png"]


# ------------------------------------------------------------------------ 2. exit codes mean one thing


def test_flash_triton_on_a_cpu_is_refused_before_bench_e2e_runs(tmp_path):
    env = {"TMPDIR": str(tmp_path)}
    full = dict(os.environ, PYTHONPATH=SRC)
    full.pop("TRITON_INTERPRET", None)  # conftest turns the interpreter on for this process, not for users
    full.pop("LMSYS_DEBUG", None)
    r = subprocess.run([sys.executable, "-m", "lmsys", "bench", "e2e", "--attn", "flash-triton", "--device", "cpu"],
                       env={**full, **env}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if not ln.startswith("hint:")]
    assert lines == ["error: flash-triton needs CUDA tensors (got cpu); use flash-torch on a CPU"], r.stderr
    assert r.stdout == ""


@pytest.mark.parametrize("value", ["inf", "nan", "-inf", "1e400", "0"])
def test_a_dist_timeout_that_is_not_finite_is_refused_before_torchrun(lmsys, monkeypatch, value):
    import subprocess as sp

    monkeypatch.setenv("LMSYS_DIST_TIMEOUT_S", value)
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sp, "Popen", lambda *a, **k: pytest.fail("torchrun was started"))
    line = one_line(lmsys("comm", "allreduce", "--backend", "gloo", "--sizes", "4KB"))
    assert line == f"error: LMSYS_DIST_TIMEOUT_S must be a number of seconds in (0, 604800], got {value}"


def test_lmsys_debug_adds_the_traceback_and_keeps_exit_2():
    r = cli("bench", "e2e", "--format", "bogus", env={"LMSYS_DEBUG": "1"})
    assert r.returncode == 2
    assert "Traceback" in r.stderr and r.stderr.rstrip().endswith("error: --format must be one of table, md, csv, json, not 'bogus'")


def test_a_closed_stdout_ends_quietly_by_sigpipe():
    import signal

    env = dict(os.environ, PYTHONPATH=SRC)
    env.pop("LMSYS_DEBUG", None)
    proc = subprocess.Popen([sys.executable, "-m", "lmsys", *PRECISION], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the first line, as `| head -0` would be
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == -signal.SIGPIPE, err
    assert err == ""


def test_a_closed_stdout_in_process_is_141_and_silent(lmsys, monkeypatch):
    class Closed:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass

        def isatty(self):
            return False

        def fileno(self):
            raise ValueError

    monkeypatch.setattr(sys, "stdout", Closed())
    from lmsys.cli import main

    with pytest.raises(SystemExit) as exc:
        main(list(PRECISION))
    assert exc.value.code == 141


def test_a_row_in_error_fails_the_run_after_the_table(lmsys, monkeypatch):
    import lmsys.bench.e2e as lib

    monkeypatch.setattr(lib, "run_e2e", lambda *a, **k: iter([
        {"size": "tiny", "mode": "train", "status": "ok"}, {"size": "tiny", "mode": "fwd", "status": "error: boom"}]))
    r = lmsys("bench", "e2e", "--device", "cpu", "--size", "tiny", "--format", "csv")
    assert "tiny,fwd,error: boom" in r.out  # the table first
    assert one_line(r, code=1) == "error: 1 of 2 rows failed; the status column says why"


def test_an_oom_row_is_a_result_not_a_failure(lmsys, monkeypatch):
    import lmsys.bench.e2e as lib

    # issue 44: an OOM row beside rows that ran is a result (exit 0); every row OOM is a failed run
    # (test_cli_outcomes.py::test_every_row_out_of_memory_is_exit_1_after_the_table)
    monkeypatch.setattr(lib, "run_e2e", lambda *a, **k: iter([{"size": "tiny", "mode": "train", "status": "OOM"},
                                                               {"size": "tiny", "mode": "fwd", "status": "ok"}]))
    r = lmsys("bench", "e2e", "--device", "cpu", "--size", "tiny", "--format", "csv")
    assert r.code == 0 and r.err == "", r.err


def test_ddp_world_size_bound_is_stated_once(lmsys):
    assert one_line(lmsys("ddp", "train", "--world-size", "-2")) == "error: --world-size must be >= 1, got -2"


def test_comm_device_cuda_without_a_gpu_names_device_not_backend(lmsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert one_line(lmsys("comm", "allreduce", "--device", "cuda")) == \
        "error: --device cuda needs CUDA GPUs, and PyTorch sees none"


@pytest.mark.parametrize("args,message", [
    (["bench", "e2e", "--steps", "abc"], "error: Invalid value for '--steps': 'abc' is not a valid int"),
    (["bench", "e2e", "--iters", "abc"], "error: Invalid value for '--iters': 'abc' is not a valid int"),
    (["precision", "--bogus"], "error: No such option: --bogus"),
    (["precision", "extra"], "error: Got unexpected extra argument(s) (extra)"),
    (["bench", "e2e", "--size", "tiny", "--size", "small"], "error: --size was given twice (--size tiny, then --size small)"),
    (["bench", "e2e", "--steps=3", "--iters", "4"], "error: --iters was given twice (--steps=3, then --iters 4)"),
])
def test_usage_errors_are_one_line_and_a_hint(lmsys, args, message):
    r = lmsys(*args)
    assert one_line(r) == message
    assert r.err.splitlines()[1].startswith("hint: ") and len(r.err.splitlines()) == 2


# ------------------------------------------------------------------------ 7. nothing left after kill -9


@pytest.mark.slow
def test_kill_9_of_lmsys_leaves_no_process_and_no_run_folder(tmp_path):
    import signal
    import time

    from test_cli_signals import _alive, _descendants

    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    env = dict(os.environ, PYTHONPATH=SRC, TMPDIR=str(tmpdir), LMSYS_DIST_TIMEOUT_S="120")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LMSYS_DEBUG"):
        env.pop(name, None)
    proc = subprocess.Popen([sys.executable, "-m", "lmsys", "comm", "allreduce", "--backend", "gloo",
                             "--world-size", "2", "--sizes", "1MB", "--iters", "100000000"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen: set[int] = set()
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and len(seen) < 3:  # torchrun and its two ranks
        seen |= _descendants(proc.pid)
        assert proc.poll() is None
        time.sleep(0.2)
    assert len(seen) >= 3, "torchrun and its ranks never started"
    time.sleep(3)  # the ranks at work
    seen |= _descendants(proc.pid)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and ({p for p in seen if _alive(p)} or
                                           [p for p in tmpdir.iterdir() if not p.name.startswith("torchinductor_")]):
        time.sleep(0.2)
    assert not {p for p in seen if _alive(p)}, "processes of the run outlived lmsys by 10 s"
    assert [p.name for p in tmpdir.iterdir() if not p.name.startswith("torchinductor_")] == []


# ------------------------------------------------------------------------ 8. triton is an extra

NO_TRITON = """import sys
class NoTriton:  # as on a CPU install without the [triton] extra
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoTriton())
from lmsys.cli import main
main(sys.argv[1:])
"""


def without_triton(*args: str, interpret: bool = False) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=SRC)
    for name in ("LMSYS_DEBUG", "TRITON_INTERPRET"):
        env.pop(name, None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, "-c", NO_TRITON, *args], env=env, capture_output=True, text=True,
                          timeout=300)


def test_triton_is_an_extra_that_test_includes():
    import tomllib

    project = tomllib.loads((Path(SRC).parent / "pyproject.toml").read_text())["project"]
    assert not any(dep.startswith("triton") for dep in project["dependencies"])
    assert [d.split(";")[0] for d in project["optional-dependencies"]["triton"]] == ["triton>=3.0"]
    assert "lmsys[triton]" in project["optional-dependencies"]["test"]


@pytest.mark.parametrize("args", [["bench", "attention", "--impl", "flash-triton", "--device", "cpu"],
                                  ["flash", "check", "--impl", "flash-triton", "--device", "cpu"],
                                  ["bench", "e2e", "--attn", "flash-triton", "--device", "cpu"]])
def test_flash_triton_without_triton_is_one_line_naming_the_extra(args):
    r = without_triton(*args, interpret=True)
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert r.stderr.splitlines() == ["error: flash-triton needs Triton, which is not installed",
                                     "hint: pip install 'lmsys[triton]' (torch's CUDA build brings it on a GPU machine)"]


def test_the_main_job_and_flash_check_run_without_triton():
    r = without_triton("bench", "e2e", "--device", "cpu", "--size", "tiny", "--steps", "1", "--warmup", "0",
                       "--context-length", "16", "--format", "csv")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("size,") and r.stdout.rstrip().endswith(",ok")
    r = without_triton("bench", "e2e", "--device", "cpu", "--size", "tiny", "--steps", "1", "--warmup", "0",
                       "--context-length", "16", "--format", "json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["meta"]["triton"] == "not installed"
    r = without_triton("flash", "check", "--device", "cpu", "--cases", "2", "--format", "json", interpret=True)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert "impl flash-torch" in doc["meta"]["run"] and [row["result"] for row in doc["rows"]] == ["pass"] * 4  # 2 cases in each of the 2 tiers


# ------------------------------------------------------------------------ 6. numbers with their caveats


@pytest.fixture
def no_torchrun(monkeypatch):
    import subprocess as sp

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sp, "Popen", lambda *a, **k: pytest.fail("torchrun was started"))


def test_comm_world_size_1_is_refused(lmsys, no_torchrun):
    assert one_line(lmsys("comm", "allreduce", "--backend", "gloo", "--world-size", "1", "--sizes", "4KB")) == \
        "error: --world-size 1: a collective over one rank moves no data (busbw 0), so there is no bandwidth to measure"


def test_comm_sizes_are_checked_against_memory_up_front(lmsys, no_torchrun, monkeypatch):
    import lmsys.model.memory as mem

    monkeypatch.setattr(mem, "available_ram", lambda: 8 * 2**30)
    line = one_line(lmsys("comm", "allreduce", "--backend", "gloo", "--world-size", "2", "--sizes", "1MB,100GB"))
    assert line == ("error: --sizes 100GB needs about 372.5 GiB (186.3 GiB per rank); "
                    "8.0 GiB of RAM is available for 2 rank(s)")


def test_ddp_scaling_is_left_empty_when_ranks_outnumber_cores(lmsys, monkeypatch):
    import lmsys.commands.ddp as cmd

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr(cmd, "run_on_ranks", lambda *a, **k: {
        "meta": {}, "rows": [{"strategy": "naive", "ms/step": 1.0, "scaling eff %": 115.0, "status": "ok"}]})
    r = lmsys("ddp", "train", "--backend", "gloo", "--world-size", "2", "--strategy", "naive", "--format", "json")
    assert r.code == 0, r.err
    import json

    doc = json.loads(r.out)
    assert doc["rows"][0]["scaling eff %"] is None
    assert any("scaling eff % is left empty: 2 processes on 1 CPU core(s)" in n for n in doc["notes"])


# ------------------------------------------------------------------------ 3. nothing silently ignored


@pytest.mark.parametrize("args,message", [
    (["bench", "e2e", "--size", "", "--device", "cpu"], "error: --size: expected a value or a comma-separated list, got ''"),
    (["bench", "e2e", "--size", "tiny,,tiny", "--device", "cpu"], "error: --size: empty item in 'tiny,,tiny'"),
    (["bench", "e2e", "--size", "tiny,tiny", "--device", "cpu"],
     "error: --size: tiny given twice; each value runs once, so give it once"),
    (["comm", "allreduce", "--sizes", "1MB,,2MB"], "error: --sizes: empty item in '1MB,,2MB'"),
    (["profile", "nsys", "--engine", "torch", "--nsys-args", "--foo", "--device", "cpu"],
     "error: --nsys-args applies to --engine nsys; --engine torch runs torch.profiler"),
    (["ddp", "train", "--strategy", "fsdp", "--shard-optimizer"],
     "error: --shard-optimizer applies to the DDP strategies (naive, flat, overlap, bucketed, torch-ddp, yours, "
     "yours-bucketed, or your DDP-style pkg.module:Class), not to --strategy fsdp, which shards its own way or "
     "brings its own optimizer"),
])
def test_what_would_be_ignored_is_one_line(lmsys, no_torchrun, args, message):
    assert one_line(lmsys(*args)) == message


@pytest.mark.parametrize("line,message", [
    ("attn_impl: bogus", "attn_impl must be one of naive, compiled,"),
    ("attn_impl: yours-torch", "attn_impl yours-torch is your adapters' attention"),
    ("model: hf:nope", "model must be lmsys,"),
    ("d_model: x", "d_model must be a positive integer, got 'x'"),
])
@pytest.mark.parametrize("command", [["bench", "e2e", "--device", "cpu"], ["ddp", "train", "--backend", "gloo"],
                                     ["profile", "nsys", "--engine", "torch", "--device", "cpu"]])
def test_a_bad_value_in_a_model_yaml_is_refused_naming_file_and_key(lmsys, no_torchrun, tmp_path, monkeypatch,
                                                                     command, line, message):
    """Unknown values in YAML are refused like on the command line: one line naming the file and the key,
    before any work (no torchrun, no output folder)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.yaml").write_text(f"preset: tiny\n{line}\n")
    got = one_line(lmsys(*command, "--size", "m.yaml"))
    assert got.startswith(f"error: m.yaml: {message}"), got
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.yaml"]


# ------------------------------------------------------------------------ 5. progress on long work


def on_a_terminal(*args: str, timeout: float = 300) -> tuple[int, str, str]:
    """Run `python -m lmsys ARGS` with stderr on a pseudo-terminal and stdout on a pipe: (exit code,
    what the terminal showed, stdout)."""
    import pty
    import select

    master, slave = pty.openpty()
    env = dict(os.environ, PYTHONPATH=SRC, TERM="xterm", COLUMNS="120")
    env.pop("LMSYS_DEBUG", None)
    proc = subprocess.Popen([sys.executable, "-m", "lmsys", *args], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    shown = b""
    try:
        while True:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: every writer has closed the terminal
                    break
                if not data:
                    break
                shown += data
            elif proc.poll() is not None:
                break
        out = proc.stdout.read().decode()
        code = proc.wait(timeout=timeout)
    finally:
        proc.kill()
        os.close(master)
    return code, shown.decode(errors="replace"), out


E2E = ("bench", "e2e", "--device", "cpu", "--size", "tiny", "--context-length", "32", "--batch-size", "2",
       "--warmup", "2", "--steps", "40", "--mode", "fwd-bwd", "--checkpoint", "none,block")


def test_progress_is_drawn_on_a_terminal_and_nothing_reaches_stdout():
    code, shown, out = on_a_terminal(*E2E)
    assert code == 0, shown
    assert "bench e2e: rows" in shown and "fwd-bwd steps" in shown and "/42" in shown  # 2 warm-up + 40 timed
    assert "0/2" in shown  # rows done of rows planned (one per checkpoint policy)
    assert "bench e2e" in out and "\x1b" not in out  # the table, and no control codes on stdout


def test_no_progress_when_piped_or_quiet():
    r = cli(*E2E)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    code, shown, out = on_a_terminal(*E2E, "--quiet")
    assert code == 0 and "steps" not in shown and "rows" not in shown, shown
    assert "ms/step" in out


def test_a_multi_process_run_relays_rank_0s_progress_to_the_terminal(tmp_path):
    code, shown, out = on_a_terminal("comm", "allreduce", "--backend", "gloo", "--world-size", "2",
                                     "--sizes", "4KB,8KB", "--iters", "400", "--format", "csv")
    assert code == 0, shown
    assert "comm all-reduce, world size 2" in shown and "rounds" in shown and "/405" in shown, shown
    assert out.count("4KB") == 1 and "\x1b" not in out


# ------------------------------------------------------------------------ 4. one vocabulary


def _commands():
    from typer.main import get_command

    from lmsys.cli import app

    def walk(cmd, path):
        if hasattr(cmd, "commands"):
            for name, sub in cmd.commands.items():
                yield from walk(sub, (*path, name))
        else:
            yield path, cmd

    yield from walk(get_command(app), ())


def test_the_same_aliases_work_everywhere_they_apply():
    """--seq-len, --batch and --iters wherever --context-length, --batch-size and --steps count steps."""
    aliases = {"--context-length": "--seq-len", "--batch-size": "--batch", "--steps": "--iters"}
    checked = 0
    for path, cmd in _commands():
        for param in cmd.params:
            for name, alias in aliases.items():
                if name in param.opts and path != ("precision",):  # precision's --steps counts additions
                    assert alias in param.opts, (path, name)
                    checked += 1
    assert checked >= 20


def test_impl_names_the_attention_everywhere_and_attn_stays_an_alias(lmsys):
    for path, cmd in _commands():
        assert not any("--attn" in p.opts and "--impl" not in p.opts for p in cmd.params), path
    for spelling in ("--impl", "--attn"):
        assert f"error: {spelling} must be one of" in one_line(lmsys("bench", "e2e", spelling, "bogus"))


@pytest.mark.parametrize("alias,name", [("allgather", "all-gather"), ("reducescatter", "reduce-scatter"),
                                        ("all-reduce", "allreduce"), ("sendrecv", "send-recv")])
def test_comm_accepts_both_spellings(lmsys, no_torchrun, alias, name):
    for spelling in (alias, name):
        assert "--world-size" in one_line(  # the command ran its own checks: the spelling was accepted
            lmsys("comm", spelling, "--backend", "gloo", "--world-size", "1", "--sizes", "4KB"))


def test_bare_loop_and_single_process_say_what_they_are_and_the_old_names_stay(lmsys, monkeypatch):
    import lmsys.commands.comm as comm_cmd
    import lmsys.commands.ddp as ddp_cmd

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    seen = []
    monkeypatch.setattr(comm_cmd, "run_on_ranks", lambda target, kwargs, **kw: seen.append(kwargs["baseline"]) or
                        {"rows": [], "meta": {}})
    monkeypatch.setattr(ddp_cmd, "run_on_ranks", lambda target, kwargs, **kw: seen.append(kwargs["baseline"]) or
                        {"rows": [], "meta": {}})
    comm = ("comm", "allreduce", "--backend", "gloo", "--world-size", "2", "--sizes", "4KB")
    ddp = ("ddp", "train", "--backend", "gloo", "--world-size", "2", "--strategy", "naive")
    for args in ((*comm,), (*comm, "--bare-loop"), (*comm, "--baseline"), (*ddp,), (*ddp, "--no-single-process"),
                 (*ddp, "--no-baseline"), (*ddp, "--single-process")):
        assert lmsys(*args).code == 0
    assert seen == [False, True, True, True, False, False, True]
    from typer.main import get_command

    from lmsys.cli import app

    helps = {opt: param.hidden for path, cmd in _commands() if path[:1] in (("comm",), ("ddp",))
             for param in cmd.params for opt in param.opts if opt in ("--baseline", "--bare-loop", "--single-process")}
    assert helps == {"--baseline": True, "--bare-loop": False, "--single-process": False}
    assert get_command(app)  # the app builds with the hidden options


@pytest.mark.parametrize("suffix,start", [(".json", "[\n  {\n    \"title\": \"autocast"), (".csv", "table,autocast,"), (".md", "### autocast")])
def test_format_is_inferred_from_the_output_extension(lmsys, tmp_path, suffix, start):
    out = tmp_path / f"r{suffix}"
    r = lmsys(*PRECISION, "-o", str(out))
    assert r.code == 0, r.err
    assert out.read_text().startswith(start) and "accumulating 0.01" in r.out  # a table on stdout
