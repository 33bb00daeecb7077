"""SIGINT / SIGTERM to the `lmsys` process alone (as a scheduler or `kill PID` sends it) end the job:
exit 130 / 143, one line `interrupted`, no traceback, no process left, nothing left in TMPDIR."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _descendants(pid: int) -> set[int]:
    """Every live process below `pid`, from /proc (psutil may be missing)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _interrupt_mid_run(tmp_path, args: list[str], sig: int, *, ranks: int = 2) -> tuple[int, str, set[int]]:
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    env = dict(os.environ, PYTHONPATH=SRC, TMPDIR=str(tmpdir), LMSYS_DIST_TIMEOUT_S="120")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LMSYS_DEBUG"):
        env.pop(name, None)
    # SIGINT as an interactive shell leaves it: a test run started in the background by a non-interactive
    # shell has it ignored, and `lmsys` keeps an inherited SIG_IGN (as nohup'd jobs expect)
    proc = subprocess.Popen([sys.executable, "-m", "lmsys", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen: set[int] = set()
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # torchrun and its ranks up, and working for a moment
        seen |= _descendants(proc.pid)
        if len(seen) >= 1 + ranks:
            break
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    assert len(seen) >= 1 + ranks, "torchrun and its ranks never started"
    time.sleep(4)
    seen |= _descendants(proc.pid)
    sent = time.monotonic()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
    assert time.monotonic() - sent < 15
    time.sleep(0.5)
    left = {pid for pid in seen if _alive(pid)}
    # torchinductor_USER is torch's persistent compile cache (importing torch._dynamo creates it, and it
    # is meant to outlive the run); anything else (torchelastic_*, lmsys-run-*) is a leak.
    leftover = [p.name for p in tmpdir.iterdir() if not p.name.startswith("torchinductor_")]
    assert not leftover, f"left in TMPDIR: {leftover}"
    return proc.returncode, out + err, left


COMM = ["comm", "allreduce", "--backend", "gloo", "--world-size", "2", "--sizes", "1MB", "--iters", "100000000"]
DDP = ["ddp", "train", "--backend", "gloo", "--world-size", "2", "--strategy", "naive", "--steps", "1000000"]


@pytest.mark.slow
@pytest.mark.parametrize("args", [COMM, DDP], ids=["comm-allreduce", "ddp-train"])
@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_parent_alone_stops_torchrun_and_every_rank(tmp_path, args, sig, code):
    returncode, output, left = _interrupt_mid_run(tmp_path, args, sig)
    assert returncode == code, output
    assert "Traceback" not in output and "death signal" not in output, output
    assert output.strip().splitlines()[-1] == "interrupted", output
    assert not left, f"processes left running: {left}"


def test_sigterm_ends_a_single_process_command(tmp_path):
    env = dict(os.environ, PYTHONPATH=SRC, TMPDIR=str(tmp_path))
    env.pop("LMSYS_DEBUG", None)
    proc = subprocess.Popen([sys.executable, "-m", "lmsys", "precision", "--device", "cpu", "--steps", "1000000"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(6)
    assert proc.poll() is None, proc.communicate()
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert time.monotonic() - sent < 5
    assert proc.returncode == 143
    assert err.strip() == "interrupted" and "Traceback" not in out + err
