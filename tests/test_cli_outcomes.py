"""Issue 44: every outcome said plainly. One test (or more) per row of its table: the exit code, the number of
lines and the message, and for the checks made before the work, that nothing ran."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from test_cli_safety import one_line

FIXTURE = str(Path(__file__).resolve().parent / "fixtures" / "outcomes" / "exits.py")
E2E = ("bench", "e2e", "--size", "tiny", "--device", "cpu", "--steps", "1", "--warmup", "0", "--context-length", "16",
       "--batch-size", "1")


def failed_run(result) -> str:
    """The one `error:` line of a failed run (exit 1), no traceback."""
    return one_line(result, code=1)


# ------------------------------------------------------------------------------------ user code's sys.exit


@pytest.mark.parametrize("fn,code", [("exit0", "0"), ("exit7", "7")])
def test_user_attention_calling_sys_exit_is_one_line_exit_1(lmsys, fn, code):
    r = lmsys(*E2E, "--impl", f"{FIXTURE}:{fn}")
    assert failed_run(r) == f"error: your code (--impl {FIXTURE}:{fn}) called sys.exit({code})"
    assert r.out == ""


def test_user_model_calling_sys_exit_in_its_forward_is_one_line_exit_1(lmsys):
    r = lmsys(*E2E, "--model", f"{FIXTURE}:ExitModel")
    assert failed_run(r) == f"error: your code (--model {FIXTURE}:ExitModel) called sys.exit(0)"


def test_profile_torch_engine_with_a_model_calling_sys_exit(lmsys, tmp_path):
    r = lmsys("profile", "nsys", "--engine", "torch", "--device", "cpu", "--size", "tiny", "--context-length", "16",
              "--batch-size", "1", "--warmup", "0", "--steps", "1", "--model", f"{FIXTURE}:ExitModel",
              "--out-dir", str(tmp_path / "prof"))
    assert failed_run(r) == f"error: your code (--model {FIXTURE}:ExitModel) called sys.exit(0)"


def test_a_rank_whose_user_code_calls_sys_exit_is_one_line_exit_1(lmsys):
    r = lmsys("ddp", "train", "--strategy", "naive", "--no-single-process", "--world-size", "2", "--size", "tiny",
              "--context-length", "16", "--batch-size", "1", "--steps", "1", "--warmup", "0",
              "--model", f"{FIXTURE}:ExitModel")
    lines = [ln for ln in r.err.splitlines() if ln.startswith("error:")]
    assert r.code == 1 and "Traceback" not in r.err, r.err
    assert len(lines) == 1, r.err  # and perhaps "(no report from rank 1: ...)", when torchrun stopped it first
    assert lines[0].startswith(f"error: your code (--model {FIXTURE}:ExitModel) called sys.exit(0)"), r.err
    assert len([ln for ln in r.err.splitlines() if ln.strip()]) == 1, r.err


def test_a_user_model_failing_inside_the_run_is_named_by_its_option(lmsys):
    r = lmsys(*E2E, "--model", f"{FIXTURE}:SmallVocab")
    line = failed_run(r)
    assert line.startswith(f"error: --model {FIXTURE}:SmallVocab: IndexError: Target ") and "out of bounds" in line


def test_a_command_after_user_code_forgets_it(lmsys):
    """Tests run many commands in one process: the next command's crash is not blamed on the last one's code."""
    from lmsys.core import imports

    lmsys(*E2E, "--impl", f"{FIXTURE}:exit0")
    lmsys("list", "models", "-f", "csv")
    assert imports._USER_CODE == {}


# ------------------------------------------------------------------------------------------ rows decide


def test_every_row_out_of_memory_is_exit_1_after_the_table(lmsys):
    r = lmsys("bench", "attention", "--batch-size", "100000", "--heads", "1000", "--seq-len", "100000",
              "--d-head", "128", "--impl", "naive", "--device", "cpu", "-f", "csv")
    assert failed_run(r) == "error: every row ran out of memory"
    rows = list(csv.DictReader(io.StringIO(r.out)))
    assert [row["status"] for row in rows] == ["OOM"]


def test_oom_rows_beside_rows_that_ran_are_results():
    from lmsys.core.results import Report, outcome

    assert outcome(Report("t", [{"status": "OOM"}, {"status": "ok"}])) is None
    assert outcome([Report("t", [{"status": "OOM"}]), Report("u", [{"status": "OOM (caught)"}])]) \
        == "every row ran out of memory"
    assert outcome(Report("t", [{"status": "unsupported"}, {"status": "OOM"}])) is None
    assert outcome(Report("t", [])) is None


def test_a_nan_loss_is_status_non_finite_loss_and_exit_1(lmsys):
    r = lmsys(*E2E, "--model", f"{FIXTURE}:NaNModel", "-f", "csv")
    assert failed_run(r) == "error: 1 of 1 rows failed; the status column says why"
    rows = list(csv.DictReader(io.StringIO(r.out)))
    assert [row["status"] for row in rows] == ["non-finite loss"] and rows[0]["loss"] == ""


# ----------------------------------------------------------------------------------------------- help


@pytest.mark.parametrize("command,text", [
    (("bench", "e2e"), "(your attention, [batch, seq, d])"),
    (("bench", "attention"), "(your attention on [batch, seq, d]: heads"),
    (("flash", "check"), "on [batch, seq, d])"),
])
def test_help_shows_the_text_in_square_brackets(lmsys, monkeypatch, command, text):
    monkeypatch.setenv("COLUMNS", "400")
    r = lmsys(*command, "--help")
    assert r.code == 0
    assert text in " ".join(r.out.replace("│", " ").split())


# ------------------------------------------------------------------------------------------------ CSV


def test_csv_is_plain_with_the_header_first_and_metadata_in_json(lmsys):
    r = lmsys(*E2E, "-f", "csv")
    assert r.code == 0, r.err
    assert r.out.splitlines()[0].startswith("size,mode,params,")
    rows = list(csv.reader(io.StringIO(r.out)))
    assert len(rows) == 2 and len(rows[0]) == len(rows[1])  # every line a row of the same width
    assert rows[1][rows[0].index("status")] == "ok"
    doc = json.loads(lmsys(*E2E, "-f", "json").out)
    assert doc["meta"]["device"].startswith("cpu") and doc["rows"][0]["status"] == "ok"


def test_several_reports_are_one_csv_table_with_a_table_column(lmsys):
    r = lmsys("precision", "--device", "cpu", "--steps", "10", "-f", "csv")
    assert r.code == 0, r.err
    rows = list(csv.DictReader(io.StringIO(r.out)))
    tables = list(dict.fromkeys(row["table"] for row in rows))
    assert len(tables) == 2 and tables[0].startswith("autocast") and tables[1].startswith("accumulating 0.01")
    assert all(row["accumulation"] for row in rows if row["table"] == tables[1])


@pytest.mark.parametrize("fmt,name", [("csv", "out.json"), ("json", "out.csv"), ("md", "out.json")])
def test_a_format_the_extension_contradicts_is_one_line_before_the_run(lmsys, monkeypatch, tmp_path, fmt, name):
    import lmsys.commands.precision as cmd

    monkeypatch.setattr(cmd, "check_counts", lambda **_: pytest.fail("ran past the format check"))
    line = one_line(lmsys("precision", "--device", "cpu", "-f", fmt, "-o", str(tmp_path / name)))
    assert line == f"error: -f {fmt} and -o {tmp_path / name} disagree: a .{name.split('.')[1]} file holds " \
                   f"{name.split('.')[1]}"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fmt,name", [("csv", "out.txt"), ("json", "out"), ("table", "out.json")])
def test_an_extension_that_names_no_format_takes_the_format_given(lmsys, tmp_path, fmt, name):
    r = lmsys("precision", "--device", "cpu", "--steps", "10", "-f", fmt, "-o", str(tmp_path / name))
    assert r.code == 0, r.err
    assert (tmp_path / name).read_text()[:1] == {"csv": "t", "json": "[", "table": "["}[fmt]


# ------------------------------------------------------------------------- files checked before the run


def _immutable(path: Path):
    """chattr +i (root on ext4 and most disk file systems): not even root can write there. Skips elsewhere."""
    import subprocess

    r = subprocess.run(["chattr", "+i", str(path)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"chattr +i is not available here: {r.stderr.decode().strip()}")
    return lambda: subprocess.run(["chattr", "-i", str(path)], check=True)


@pytest.fixture
def read_only_dir(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    release = _immutable(folder)
    yield folder
    release()


@pytest.fixture
def full_dir(tmp_path):
    """A 1 MiB tmpfs filled to the last block (root may mount one; skips elsewhere)."""
    import subprocess

    folder = tmp_path / "full"
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        with open(folder / "filler", "wb") as f:
            try:
                f.write(bytes(2 * 2**20))
                f.flush()
            except OSError:
                pass
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


PROFILE_TORCH = ("profile", "nsys", "--engine", "torch", "--device", "cpu", "--size", "tiny", "--context-length", "16",
                 "--batch-size", "1", "--warmup", "0", "--steps", "1")


def _no_profile(monkeypatch):
    from lmsys.profiling import memory, report

    monkeypatch.setattr(report, "profile_step", lambda *a, **k: pytest.fail("the profile ran"))
    monkeypatch.setattr(memory, "sweep_contexts", lambda *a, **k: pytest.fail("the profile ran"))


def test_profile_torch_out_dir_read_only_is_one_line_before_the_run(lmsys, monkeypatch, read_only_dir):
    _no_profile(monkeypatch)
    line = one_line(lmsys(*PROFILE_TORCH, "--out-dir", str(read_only_dir)))
    assert line == f"error: --out-dir: cannot write in {read_only_dir} (Operation not permitted)"
    assert list(read_only_dir.iterdir()) == []


def test_profile_torch_out_dir_on_a_full_disk_is_one_line_before_the_run(lmsys, monkeypatch, full_dir):
    _no_profile(monkeypatch)
    line = one_line(lmsys(*PROFILE_TORCH, "--out-dir", str(full_dir)))
    assert line == f"error: --out-dir: cannot write in {full_dir} (No space left on device)"
    assert [p.name for p in full_dir.iterdir()] == ["filler"]


def test_profile_memory_snapshot_out_dir_read_only_is_one_line_before_rendering(lmsys, monkeypatch, read_only_dir):
    from lmsys.profiling import memory

    monkeypatch.setattr(memory, "snapshot_reports", lambda *a, **k: pytest.fail("rendered"))
    snap = Path(__file__).resolve().parent / "fixtures" / "memory" / "snapshot_tiny_train.pickle"
    line = one_line(lmsys("profile", "memory", "--snapshot", str(snap), "--out-dir", str(read_only_dir)))
    assert line == f"error: --out-dir: cannot write in {read_only_dir} (Operation not permitted)"


def test_profile_memory_out_dir_on_a_full_disk_is_one_line(lmsys, monkeypatch, full_dir):
    from lmsys.profiling import memory

    monkeypatch.setattr(memory, "snapshot_reports", lambda *a, **k: pytest.fail("rendered"))
    snap = Path(__file__).resolve().parent / "fixtures" / "memory" / "snapshot_tiny_train.pickle"
    line = one_line(lmsys("profile", "memory", "--snapshot", str(snap), "--out-dir", str(full_dir)))
    assert line == f"error: --out-dir: cannot write in {full_dir} (No space left on device)"


def test_output_at_an_immutable_file_is_one_line_before_the_run(lmsys, monkeypatch, tmp_path):
    _no_profile(monkeypatch)
    out = tmp_path / "out.json"
    out.write_text("{}")
    release = _immutable(out)
    try:
        line = one_line(lmsys(*PROFILE_TORCH, "--out-dir", str(tmp_path / "prof"), "-o", str(out)))
    finally:
        release()
    assert line == f"error: -o: cannot write {out} (Operation not permitted)"  # the option as typed
    assert out.read_text() == "{}" and sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


# --------------------------------------------------------------------------------- checks before work


def test_parallel_train_interleaved_on_pp_1_is_refused_before_any_rank_starts(lmsys, monkeypatch):
    from lmsys.distributed import launch

    monkeypatch.setattr(launch, "run", lambda *a, **k: pytest.fail("a rank started"))
    line = one_line(lmsys("parallel", "train", "--mesh", "tp=2", "--pp-schedule", "interleaved-1f1b",
                          "--virtual-stages", "2"))
    assert line == ("error: --mesh dp=1,tp=2,pp=1: interleaved-1f1b with --virtual-stages 2 passes each micro-batch "
                    "round the pipeline ranks, and pp=1 has no pipeline")


@pytest.mark.parametrize("mesh,message", [
    ("dp=1,tp=1,pp=1,zero=7", "error: --mesh: zero=7 is not a ZeRO stage; one of 0 (none), 1 (optimizer state "
                              "sharded), 2 (and gradients), 3 (and weights)"),
    ("dp=1,tp=1,pp=1,zero=2", "error: --mesh dp=1,tp=1,pp=1,zero=2: zero=2 shards over the data-parallel ranks, "
                              "and dp=1 has one"),
    ("dp=1,schedule=zigzag", "error: --mesh: schedule=zigzag is not one of none, 1f1b, interleaved, gpipe"),
    ("dp=1,checkpoint=some", "error: --mesh: checkpoint=some is not one of none, selective, full, op"),
])
def test_plan_train_names_the_mesh_value_that_is_wrong(lmsys, mesh, message):
    assert one_line(lmsys("plan", "train", "--gpu", "H100", "--mesh", mesh)) == message


def test_plan_train_gpus_not_a_whole_number_of_nodes_is_refused(lmsys):
    r = lmsys("plan", "train", "--gpu", "H100", "--gpus", "8", "--gpus-per-node", "3")
    assert one_line(r) == "error: --gpus 8 is not a whole number of nodes of --gpus-per-node 3"
    assert "hint: --gpus 6 or 9, or a --gpus-per-node that divides 8" in r.err
    assert lmsys("plan", "train", "--gpu", "H100", "--gpus", "2", "--gpus-per-node", "3", "--top", "1").code == 0
    assert lmsys("plan", "train", "--gpu", "H100", "--gpus", "6", "--gpus-per-node", "3", "--top", "1").code == 0


def test_plan_train_help_says_what_is_required(lmsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    r = lmsys("plan", "train", "--help")
    text = " ".join(r.out.replace("│", " ").split())
    assert r.code == 0
    assert "Required: the GPU, by --gpu, --cluster or --profile (one of them)" in text
    assert "--gpu <str> Required, unless --cluster or --profile names the GPU." in text
    assert one_line(lmsys("plan", "train")) == \
        "error: give the GPU: --gpu NAME or --cluster FILE.yaml (or a --profile from plan calibrate)"


# ------------------------------------------------------------------------------------------- messages


def test_an_absurd_memory_estimate_says_far_more_than_any_gpu(lmsys):
    line = one_line(lmsys("bench", "e2e", "--size", "tiny", "--batch-size", "1000000000000", "--device", "cpu"))
    assert line.startswith("error: --size tiny: a training step (weights, gradients, AdamW state, activations) "
                           "needs far more than any GPU or host has (over 1 PiB), but ")
    assert line.endswith(" GiB of RAM is available")


def test_byte_estimates_read_as_amounts():
    from lmsys.core.parsing import about_bytes

    assert about_bytes(80.5 * 2**30) == "about 80.5 GiB"
    assert about_bytes(3 * 2**40) == "about 3.0 TiB"
    assert about_bytes(8651733398437499904 * 2**30) == "far more than any GPU or host has (over 1 PiB)"


def test_a_user_impl_that_is_not_callable_is_named_with_its_article(lmsys, tmp_path):
    (tmp_path / "notfn.py").write_text("attn = 3\nname = 'x'\n")
    line = one_line(lmsys(*E2E, "--impl", f"{tmp_path / 'notfn.py'}:attn"))
    assert line == (f"error: {tmp_path / 'notfn.py'}:attn is an int, not an autograd.Function or a callable "
                    "(q, k, v, is_causal) -> o")


def test_a_model_constructor_without_arguments_says_so(lmsys, tmp_path):
    (tmp_path / "m.py").write_text("def build():\n    raise TypeError('no model today')\n"
                                   "def number(**kw):\n    return 3\n")
    line = one_line(lmsys(*E2E, "--model", f"{tmp_path / 'm.py'}:build"))
    assert line == f"error: --model {tmp_path / 'm.py'}:build: building it with no arguments raised TypeError: " \
                   "no model today"
    line = one_line(lmsys(*E2E, "--model", f"{tmp_path / 'm.py'}:number"))
    assert line == f"error: --model {tmp_path / 'm.py'}:number returned an int, not a torch.nn.Module"


# ------------------------------------------------------------------------------------- progress in logs


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_plain_progress_lines_start_after_the_interval_then_one_per_row_and_per_interval(capsys, monkeypatch):
    from lmsys.core import progress

    monkeypatch.setenv(progress.EVERY_ENV, "10")
    clock = Clock()
    lines = progress.Lines("ddp train", None, clock=clock)
    lines.apply("rows", "3")
    lines.apply("row", "naive")
    clock.now += 4
    lines.apply("steps", "5 steps")
    lines.apply("step")
    lines.apply("row", "flat")  # row 1 done after 4 s: within the first 10 s, so silent
    assert capsys.readouterr().err == ""
    clock.now += 7
    lines.apply("step")  # 11 s in, 7 s into row 2: the first line
    clock.now += 3
    lines.apply("step")  # 3 s after the last line: nothing
    clock.now += 8
    lines.apply("step")  # 11 s after the last line
    lines.apply("row", "torch-ddp")
    clock.now += 2
    lines.close()
    assert capsys.readouterr().err.splitlines() == [
        "ddp train: row 2/3 (flat) running for 7 s",
        "ddp train: row 2/3 (flat) running for 18 s",
        "ddp train: row 2/3 done (flat) in 18.0 s, 22 s so far",
        "ddp train: row 3/3 done (torch-ddp) in 2.0 s, 24 s so far",
    ]


def test_a_job_still_starting_says_so(capsys, monkeypatch):
    from lmsys.core import progress

    monkeypatch.setenv(progress.EVERY_ENV, "10")
    clock = Clock()
    lines = progress.Lines("comm all-reduce, world size 2", None, clock=clock)
    clock.now += 12
    lines.tick()
    assert capsys.readouterr().err == "comm all-reduce, world size 2: starting, 12 s so far\n"


ATTENTION = ("bench", "attention", "--device", "cpu", "--impl", "naive", "--d-head", "16", "--seq-len", "16,32",
             "--warmup", "0", "--steps", "2", "-f", "csv")


def test_a_sweep_with_stderr_not_a_terminal_writes_one_line_per_finished_row():
    from test_cli_safety import cli

    r = cli(*ATTENTION, env={"LMSYS_PROGRESS_EVERY": "0"})
    assert r.returncode == 0, r.stderr
    done = [ln for ln in r.stderr.splitlines() if " done " in ln]
    assert [ln.split(" in ")[0] for ln in done] == ["bench attention: row 1/2 done", "bench attention: row 2/2 done"]
    assert all(ln.startswith("bench attention: row ") for ln in r.stderr.splitlines()), r.stderr
    assert "\x1b" not in r.stderr and r.stdout.startswith("impl,")  # plain text; stdout the CSV only
    quiet = cli(*ATTENTION, "--quiet", env={"LMSYS_PROGRESS_EVERY": "0"})
    assert quiet.returncode == 0 and quiet.stderr == ""
    short = cli(*ATTENTION, env={"LMSYS_PROGRESS_EVERY": "600"})  # a run shorter than the interval: silent
    assert short.returncode == 0 and short.stderr == ""


def test_a_job_on_ranks_logs_its_rows_through_the_relay():
    from test_cli_safety import cli

    r = cli("comm", "allreduce", "--sizes", "1MB,2MB", "--steps", "2", "--warmup", "1", "-f", "csv",
            env={"LMSYS_PROGRESS_EVERY": "0"}, timeout=300)
    assert r.returncode == 0, r.stderr
    done = [ln.split(" in ")[0] for ln in r.stderr.splitlines() if " done " in ln]
    assert done == ["comm all-reduce, world size 2: row 1/2 done (all-reduce 1MB)",
                    "comm all-reduce, world size 2: row 2/2 done (all-reduce 2MB)"], r.stderr


def test_flash_check_max_len_has_a_bound_said_before_any_case_runs(lmsys, monkeypatch):
    from lmsys.bench import flash_check

    monkeypatch.setattr(flash_check, "run_check", lambda *a, **k: pytest.fail("a case ran"))
    r = lmsys("flash", "check", "--device", "cpu", "--cases", "2", "--max-len", "100000")
    assert one_line(r) == ("error: --max-len 100000 is over the limit of 4096: the float64 reference runs on the CPU "
                           "and would hold 447.0 GiB of scores per tensor of its backward")
    assert "hint: --max-len 4096 or less" in r.err


def test_the_step_under_nsys_reports_the_user_models_sys_exit_as_a_failed_run(tmp_path, capsys):
    """profile nsys --engine nsys runs the step in a child process: its sys.exit comes back as one line, exit 1."""
    from lmsys.core import imports
    from lmsys.core.errors import RunFailed
    from lmsys.model.config import resolve_configs
    from lmsys.profiling import nsys_target

    imports.forget_user_code()
    _, cfg = resolve_configs(["tiny"], context_length=16, model=f"{FIXTURE}:ExitModel")[0]
    spec = {"config": cfg.as_dict(), "batch_size": 1, "dtype": "fp32", "mode": "fwd", "warmup": 0, "steps": 1,
            "device": "cpu", "result": str(tmp_path / "result.json")}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    assert nsys_target.main([str(tmp_path / "spec.json")]) == 1
    result = json.loads((tmp_path / "result.json").read_text())
    assert result == {"status": "error", "yours": True,
                      "error": f"your code (--model {FIXTURE}:ExitModel) called sys.exit(0)"}
    assert capsys.readouterr().err == f"error: your code (--model {FIXTURE}:ExitModel) called sys.exit(0)\n"
    imports.forget_user_code()


def test_a_run_failed_in_a_child_is_its_line_and_exit_1(lmsys, monkeypatch, tmp_path):
    from lmsys.core.errors import RunFailed
    from lmsys.profiling import report

    def failed(*a, **k):
        raise RunFailed("your code (--model m.py:Net) called sys.exit(3); full output in x.log")

    monkeypatch.setattr(report, "profile_step", failed)
    r = lmsys(*PROFILE_TORCH, "--out-dir", str(tmp_path))
    assert failed_run(r) == "error: your code (--model m.py:Net) called sys.exit(3); full output in x.log"


def test_only_the_users_own_frames_are_blamed_for_sys_exit(monkeypatch):
    from lmsys.core import imports

    monkeypatch.setattr(imports, "_USER_CODE", {})
    fn = imports.load_object(f"{FIXTURE}:exit7", what="--impl")
    try:
        fn(None, None, None, False)
    except SystemExit as exc:
        assert imports.describe_user_failure(exc) == f"your code (--impl {FIXTURE}:exit7) called sys.exit(7)"
    try:
        raise SystemExit(3)  # lmsys's own (none today): not the user's, whatever was loaded
    except SystemExit as exc:
        assert imports.describe_user_failure(exc) is None
    try:
        raise IndexError("Target 775 is out of bounds.")  # torch's, on the user's output: named by the option
    except IndexError as exc:
        assert imports.describe_user_failure(exc) == f"--impl {FIXTURE}:exit7: IndexError: Target 775 is out of bounds."
