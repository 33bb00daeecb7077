"""The device scripts (scripts/gpu/*.sh) run dry: every command they would send to the GPU machine is
printed (DRY_RUN=1, scripts/gpu/lib.sh), and each `lmsys` command among them must parse against the real
CLI (its command path and every option and value, without running it); test files and scripts they name
must exist. Also: they share lib.sh, and none flips a kernel module switch that Policy fields replaced."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (ROOT / "scripts" / "gpu").glob("*.sh") if p.name != "lib.sh")
# module switches that became flash_triton.Policy fields (gluon_bwd_min_keys, ..., wide_configs)
OLD_SWITCHES = re.compile(r"GLUON_\w*MIN_KEYS|TMA_REDUCE_DQ|WARP_SPEC_WITH_TMA|\.WIDE_CONFIGS\s*=")


def dry_run(script: Path, tmp_path: Path, **env) -> list[list[str]]:
    """The commands `script` would run, each as its argv."""
    environ = {**os.environ, "DRY_RUN": "1", "PARTS": "all", "OUT": str(tmp_path / "out"), **env}
    proc = subprocess.run(["bash", str(script)], cwd=ROOT, env=environ, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [shlex.split(line[len("DRY: "):]) for line in proc.stderr.splitlines() if line.startswith("DRY: ")]


def lmsys_args(argv: list[str]) -> list[str] | None:
    """The lmsys arguments of `python3 -m lmsys ...`, else None."""
    for i in range(len(argv) - 1):
        if argv[i:i + 2] == ["-m", "lmsys"]:
            return argv[i + 2:]
    return None


def parse_lmsys(args: list[str]) -> None:
    """Resolve the command path and parse its options as the CLI would, without running anything."""
    from typer.main import get_command

    from lmsys.cli import app

    cmd, path, rest = get_command(app), ["lmsys"], list(args)
    while hasattr(cmd, "commands"):  # a group: the next word names a command
        assert rest, f"{shlex.join(args)}: no command under {' '.join(path)}"
        name = rest.pop(0)
        assert name in cmd.commands, f"{shlex.join(args)}: {' '.join(path)} has no command {name!r}"
        cmd, path = cmd.commands[name], path + [name]
    try:
        ctx = cmd.make_context(" ".join(path), rest)
    except Exception as exc:  # noqa: BLE001 - a usage error (unknown option, bad value) is the finding
        pytest.fail(f"{shlex.join(args)}: {type(exc).__name__}: {getattr(exc, 'message', exc)}")
    inner = next((v for v in ctx.params.values() if isinstance(v, (list, tuple)) and lmsys_args(list(v))), None)
    if inner:  # e.g. `profile nsys ... -- python3 -m lmsys ddp train ...`
        parse_lmsys(lmsys_args(list(inner)))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_dry_run_names_real_commands(script, tmp_path):
    text = script.read_text()
    assert "source scripts/gpu/lib.sh" in text  # one shell library
    assert not OLD_SWITCHES.search(text)
    commands = dry_run(script, tmp_path)
    lmsys_commands = [args for argv in commands if (args := lmsys_args(argv)) is not None]
    assert lmsys_commands, "no lmsys command in the dry run"
    for args in lmsys_commands:
        parse_lmsys(args)
    for argv in commands:
        named = [p for a in argv for p in a.split(",") if p.startswith(("tests/", "scripts/")) and not p.endswith("/")]
        for path in named:
            assert (ROOT / path.split("::")[0]).exists(), f"{shlex.join(argv)}: {path} does not exist"


def test_parse_check_catches_a_wrong_option():
    with pytest.raises(pytest.fail.Exception, match="--no-such-option"):
        parse_lmsys(["bench", "attention", "--no-such-option", "1"])
    with pytest.raises(pytest.fail.Exception, match="'1x'"):
        parse_lmsys(["comm", "allreduce", "--steps", "1x"])
    with pytest.raises(AssertionError, match="no command 'nope'"):
        parse_lmsys(["bench", "nope"])
    with pytest.raises(pytest.fail.Exception, match="--bogus"):  # the command after `--` is checked too
        parse_lmsys(["profile", "nsys", "--", "python3", "-m", "lmsys", "ddp", "train", "--bogus"])


def test_budget_and_parts_in_lib(tmp_path):
    """L skips a command (and says so) when less than 25 s of BUDGET is left; part() reads PARTS."""
    script = tmp_path / "t.sh"
    script.write_text("source scripts/gpu/lib.sh\nPARTS=${PARTS:-a b}\npart a && echo A\npart c && echo C\n"
                      "L --version\n")
    proc = subprocess.run(["bash", str(script)], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "BUDGET": "10", "OUT": str(tmp_path / "out")})
    assert proc.stdout.split() == ["A"] and "skipped (time): python3 -m lmsys --version" in proc.stderr


def test_no_probes_left_in_scripts():
    """The one-off Python probes are gone (their answers and last commits are in docs/benchmarks/); what
    stays in scripts/ is the device-call wrappers and the sm_90 compiler, none flipping old switches."""
    assert not list((ROOT / "scripts" / "gpu").glob("*.py"))
    for path in (ROOT / "scripts").rglob("*"):
        if path.is_file():
            assert not OLD_SWITCHES.search(path.read_text()), path


def test_scripts_stay_within_900_lines():
    """issue 40: scripts/ is wrappers of lmsys commands and the sm_90 compiler, 900 lines at most
    (`wc -l scripts/*.py scripts/gpu/*`); a diagnostic that grows becomes a command (plan breakdown did)."""
    files = [*(ROOT / "scripts").glob("*.py"), *(p for p in (ROOT / "scripts" / "gpu").iterdir() if p.is_file())]
    assert sum(len(p.read_text().splitlines()) for p in files) <= 900
    assert not (ROOT / "scripts" / "plan_breakdown.py").exists()


def test_parallel_breakdown_part_runs_the_command(tmp_path):
    """scripts/gpu/parallel.sh's breakdown part is `lmsys plan breakdown` (with the plan part's profile when
    that ran first), its table under its command in $OUT/breakdown.md."""
    commands = dry_run(ROOT / "scripts" / "gpu" / "parallel.sh", tmp_path, PARTS="breakdown")
    (args,) = [a for argv in commands if (a := lmsys_args(argv)) is not None]
    assert args[:2] == ["plan", "breakdown"] and "--profile" not in args
    (tmp_path / "out").mkdir(exist_ok=True)
    (tmp_path / "out" / "gpu.yaml").write_text("device: x\n")
    commands = dry_run(ROOT / "scripts" / "gpu" / "parallel.sh", tmp_path, PARTS="breakdown")
    (args,) = [a for argv in commands if (a := lmsys_args(argv)) is not None]
    assert args[args.index("--profile") + 1] == str(tmp_path / "out" / "gpu.yaml")
    parse_lmsys(args)


@pytest.mark.slow
def test_compile_sm90_parses_its_options():
    proc = subprocess.run([sys.executable, "scripts/compile_sm90.py", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "--element-atomics" in proc.stdout and "--dump" in proc.stdout


@pytest.mark.slow
def test_first_call_probe_runs_on_the_cpu(tmp_path):
    """scripts/gpu/first_call.sh's probe under Triton's interpreter at a tiny shape: a cold and a warm-disk
    process per impl, each row the import and the first fwd+bwd at each length, in seconds."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "DEVICE": "cpu", "DTYPE": "float32", "DS": "16", "HEADS": "2",
           "SEQS": "40 45", "IMPLS": "sdpa flash-triton flash-triton-tl-serial", "PARTS": "probe", "OUT": str(tmp_path)}
    proc = subprocess.run(["bash", "scripts/gpu/first_call.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = (tmp_path / "first_call.md").read_text().splitlines()
    assert lines[0] == ("| impl | d | process | import s | first fwd+bwd s, seq 40 | first fwd+bwd s, seq 45 |")
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert [row[:3] for row in rows] == [["sdpa", "16", "cold"], ["sdpa", "16", "warm disk"],
                                         ["flash-triton", "16", "cold"], ["flash-triton", "16", "warm disk"],
                                         ["flash-triton-tl-serial", "16", "cold"], ["flash-triton-tl-serial", "16", "warm disk"]]
    assert all(float(c) >= 0 for row in rows for c in row[3:]) and all(len(row) == 6 for row in rows)
    assert "!! " not in proc.stdout + proc.stderr  # no command failed or was skipped
