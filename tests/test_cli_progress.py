"""Issue 27 item 5: every command that runs more than a couple of seconds says where it is on stderr when
stderr is a terminal (rows done of rows planned, the steps of the running row), and nothing otherwise.
The library loops' events are checked through a recording display (rows planned = rows started, every
planned step reported); the drawing itself on a pseudo-terminal, and its absence on a pipe."""

from __future__ import annotations

import re

import pytest
import torch

from lmsys.core import progress
from test_cli_safety import cli, on_a_terminal


class Recorder:
    """Stands in for the Rich display: keeps every event the library emits."""

    def __init__(self):
        self.events: list[tuple[str, str]] = []

    def apply(self, kind: str, value: str = "") -> None:
        self.events.append((kind, value))

    def rows(self) -> tuple[int, list[str]]:
        planned = [int(v) for k, v in self.events if k == "rows"]
        return (planned[-1] if planned else None), [v for k, v in self.events if k == "row"]

    def loops(self) -> list[tuple[int, int]]:
        """(steps planned, steps reported) per loop."""
        out = []
        for kind, value in self.events:
            if kind == "steps":
                out.append([int(value.split()[0]), 0])
            elif kind == "step":
                out[-1][1] += int(value or 1)
        return [tuple(x) for x in out]


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(progress, "_display", rec)
    return rec


def test_precision_reports_each_case_and_its_additions(recorder):
    from lmsys.bench.precision import accumulation_experiment

    accumulation_experiment(1234)
    planned, started = recorder.rows()
    assert planned == len(started) == 4 and started[0] == "fp32"
    assert recorder.loops() == [(1234, 1234)] * 4
    assert sum(1 for k, _ in recorder.events if k == "step") <= 4 * 100  # at most a hundred per case, not 1234


def test_bench_attention_reports_the_steps_of_each_row(recorder):
    from lmsys.bench.attention import CPU_DEFAULT, run_attention

    from dataclasses import replace

    sweep = replace(CPU_DEFAULT, impls=("naive",), d_head=(16,), seq_len=(16, 32), warmup=2, steps=3)
    rows = list(run_attention(sweep, device=torch.device("cpu")))
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert recorder.loops() == [(5, 5), (5, 5)]


@pytest.mark.slow
def test_plan_calibrate_and_validate_plan_their_rows_and_start_each(recorder):
    from lmsys.plan.calibrate import HOST_BLOCKS, calibrate
    from lmsys.plan.validate import validate
    from lmsys.plan.shape import load_shape

    cpu = torch.device("cpu")
    prof, _ = calibrate(load_shape("tiny"), device=cpu, dtypes=["fp32"], batch_size=1, warmup=0, steps=1,
                        collectives=False)
    planned, started = recorder.rows()
    assert planned == len(started) and started[-1] == "host fp32", started
    assert all(done == total for total, done in recorder.loops()) and recorder.loops()

    recorder.events.clear()
    validate(sizes=["tiny"], dtypes=["fp32"], checkpoints=["none", "block"], batch_size=1, warmup=0, steps=2,
             device=cpu, profile=prof, host_rate="profile")
    assert recorder.rows() == (1, ["tiny fp32"])
    assert recorder.loops() == [(2, 2), (2, 2)]  # bench e2e's steps, one loop per checkpoint policy

    recorder.events.clear()  # --host-rate beside (the default): the host twins' loops before and after them
    validate(sizes=["tiny"], dtypes=["fp32"], checkpoints=["none", "block"], batch_size=1, warmup=0, steps=2,
             device=cpu, profile=prof)
    assert recorder.rows() == (1, ["tiny fp32"])
    loops = recorder.loops()
    twin = len(HOST_BLOCKS) * 2  # block counts × checkpoint policies
    assert loops[twin:twin + 2] == [(2, 2), (2, 2)] and len(loops) == 2 * twin + 2, loops
    assert all(done == total for total, done in loops)


def _plain(shown: str) -> str:
    return re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", shown)


PRECISION = ("precision", "--device", "cpu", "--steps", "20000", "--format", "csv")


def test_precision_draws_its_progress_on_a_terminal_only():
    code, shown, out = on_a_terminal(*PRECISION)
    assert code == 0, shown
    shown = _plain(shown)
    assert "precision: accumulation" in shown and "additions" in shown and "20000/20000" in shown, shown
    assert "/4" in shown  # rows done of the four cases
    assert "accumulation" in out and "\x1b" not in out and "additions" not in out  # stdout: the table only
    piped = cli(*PRECISION)
    assert piped.returncode == 0 and piped.stderr == "", piped.stderr
    code, shown, _ = on_a_terminal(*PRECISION, "--quiet")
    assert code == 0 and "additions" not in shown


def test_a_child_process_progress_is_relayed_into_the_display(recorder):
    """profile nsys runs the step in a process nsys starts: its lines reach this process's display."""
    import os
    import subprocess
    import sys

    from test_cli_safety import SRC

    code = "from lmsys.core import progress\nprogress.plan_steps(3, 'steps')\nfor _ in range(3): progress.step()\n"
    with progress.relayed() as env:
        assert set(env) == {progress.ENV}
        subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": SRC, **env}, check=True)
        folder = os.path.dirname(env[progress.ENV])
    assert recorder.loops() == [(3, 3)]
    assert not os.path.exists(folder)  # the relay's file and folder are gone


def test_without_a_display_nothing_is_relayed(monkeypatch):
    monkeypatch.setattr(progress, "_display", None)
    with progress.relayed() as env:
        assert env == {}


def test_the_step_under_nsys_reports_its_steps(recorder, tmp_path):
    from lmsys.model.config import get_config
    from lmsys.profiling import nsys_target

    spec = {"config": get_config("tiny").with_overrides(num_layers=1, context_length=16).as_dict(), "batch_size": 1,
            "dtype": "fp32", "mode": "fwd", "warmup": 1, "steps": 2, "device": "cpu",
            "result": str(tmp_path / "result.json")}
    nsys_target.run(spec)
    assert recorder.loops() == [(3, 3)]
