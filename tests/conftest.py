"""Test setup shared by every test module.

- Without a GPU, Triton kernels run in its interpreter; TRITON_INTERPRET is read when a kernel is
  decorated, so it is set here, before any lmsys.kernels module is imported.
- Temporary files go into a folder of this session's, removed at the end; leftovers are listed in the summary.
- `gpu`-marked tests are skipped without CUDA (they run on the lent GPU machine).
- `lmsys` runs the CLI in-process through `lmsys.cli.main` (the real entry point, with its exit codes).
- Every test starts from a fixed seed of its own (from its node id) for torch and `random`; the seed is
  printed in the failure report ("seed: N"), and `seed` hands it to tests that build their own generators.
"""

from __future__ import annotations

import os
import random
import sys
import zlib
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Issue 44: where stderr is not a terminal, a run longer than LMSYS_PROGRESS_EVERY seconds (default 10) writes
# plain progress lines there. The tests' stderr is never a terminal and their run times vary with the machine's
# load, so a test's stderr would depend on it: here the lines come after an hour; the tests of those lines
# (test_cli_outcomes.py) set the interval themselves.
os.environ.setdefault("LMSYS_PROGRESS_EVERY", "3600")

# Issue 27 item 7, the tests leave nothing in the temp directory: this session's temporary files (torch's
# torchinductor_<user> cache and precompiled headers, torchrun's torchelastic_* folders, lmsys's run folders,
# in this process and in the subprocesses that inherit TMPDIR) go into a folder of its own, removed when the
# session ends; anything else found there then is listed in the summary. pytest's own tmp_path folders
# stay where pytest keeps them (PYTEST_DEBUG_TEMPROOT), so a failed test's files can still be looked at.
_SESSION_TMP = None
if "LMSYS_TESTS_TMP" not in os.environ:
    import tempfile

    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
    _SESSION_TMP = tempfile.mkdtemp(prefix="lmsys-tests-")
    os.environ["TMPDIR"] = os.environ["LMSYS_TESTS_TMP"] = tempfile.tempdir = _SESSION_TMP
_LEFT: list[str] = []


def pytest_sessionfinish(session, exitstatus):
    if _SESSION_TMP is None:
        return
    import shutil

    _LEFT.extend(sorted(name for name in os.listdir(_SESSION_TMP) if not name.startswith("torchinductor_")))
    shutil.rmtree(_SESSION_TMP, ignore_errors=True)


def pytest_terminal_summary(terminalreporter):
    if _LEFT:
        terminalreporter.write_line(f"left in the temp directory by the tests (now removed): {', '.join(_LEFT)}",
                                    yellow=True)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _seed_of(nodeid: str) -> int:
    return zlib.crc32(nodeid.encode()) % 2**31


@pytest.fixture(autouse=True)
def seed(request) -> int:
    """This test's seed: torch and `random` are seeded with it before the test runs."""
    value = _seed_of(request.node.nodeid)
    torch.manual_seed(value)
    random.seed(value)
    return value


@pytest.fixture(autouse=True)
def _no_flash_plans():
    """Every test starts without flash-triton's launch plans (lmsys.kernels.plans): a plan recorded by an
    earlier test would replay its kernels past what a later test patches (the tuner's memory, the kernels)."""
    module = sys.modules.get("lmsys.kernels.plans")  # not imported here: most tests never load Triton
    if module is not None:
        module.clear()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.sections.append(("seed", f"seed: {_seed_of(item.nodeid)} (torch.manual_seed and random.seed)"))


@dataclass
class CliResult:
    code: int
    out: str
    err: str


@pytest.fixture
def lmsys(capsys):
    """lmsys("bench", "e2e", "--size", "tiny") -> CliResult(code, out, err)."""
    from lmsys.cli import main

    def run(*args: str) -> CliResult:
        capsys.readouterr()
        try:
            main(list(args))
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run
