"""Test setup shared by every test module.

- Without a GPU, Triton kernels run in its interpreter; TRITON_INTERPRET is read when a kernel is
  decorated, so it is set here, before any lmsys.kernels module is imported.
- `gpu`-marked tests are skipped without CUDA (they run on the lent GPU machine).
- `lmsys` runs the CLI in-process through `lmsys.cli.main` (the real entry point, with its exit codes).
- Every test starts from a fixed seed of its own (from its node id) for torch and `random`; the seed is
  printed in the failure report ("seed: N"), and `seed` hands it to tests that build their own generators.
"""

from __future__ import annotations

import os
import random
import zlib
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
