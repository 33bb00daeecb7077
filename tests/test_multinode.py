"""Multi-node through torchrun: two agents (`--nnodes 2`, one process each, 127.0.0.1, gloo) stand for
two nodes. `ddp train` and `comm allreduce` end with one report (node 0's rank 0 prints, node 1 prints
no table) and parity; a dead agent ends the other within the collective timeout, with an error."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import lmsys

SRC = str(Path(lmsys.__file__).resolve().parent.parent)
TIMEOUT_S = 8  # LMSYS_DIST_TIMEOUT_S in the agents' workers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def torchelastic_files_in_tmp_path(tmp_path, monkeypatch):
    """torchrun's agents make torchelastic_* folders in TMPDIR: keep them out of the system's temp directory."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))


def agents(args: list[str], *, port: int) -> list[subprocess.Popen]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(PYTHONPATH=os.pathsep.join(p for p in (SRC, env.get("PYTHONPATH")) if p), OMP_NUM_THREADS="1",
               LMSYS_DIST_TIMEOUT_S=str(TIMEOUT_S))
    return [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
                              str(node), "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port",
                              str(port), "--monitor-interval", "0.1", "-m", "lmsys", *args],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                             start_new_session=True)
            for node in (0, 1)]


def workers(agent: subprocess.Popen) -> list[int]:
    """The agent's children (its workers: torchrun starts them, each in a session of its own, only once
    both agents have met)."""
    pids = []
    for task in Path(f"/proc/{agent.pid}/task").glob("*"):
        try:
            pids += [int(pid) for pid in (task / "children").read_text().split()]
        except OSError:
            continue
    return pids


def kill_node(agent: subprocess.Popen) -> None:
    """SIGKILL an agent and its workers, as a node that loses power."""
    for pid in [*workers(agent), agent.pid]:
        try:
            os.killpg(pid, signal.SIGKILL)  # each is the leader of its own group
        except ProcessLookupError:
            pass
    agent.wait()


def finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            out.append((p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                kill_node(p)
    return out


@pytest.mark.slow
def test_ddp_train_on_two_nodes_one_report_and_parity():
    procs = agents(["ddp", "train", "--backend", "gloo", "--strategy", "bucketed", "--context-length", "32",
                    "--warmup", "1", "--steps", "2", "--format", "json"], port=free_port())
    (code0, out0, err0), (code1, out1, err1) = finish(procs, timeout=55)
    assert code0 == 0 and code1 == 0, err0 + err1
    doc = json.loads(out0)  # one document from node 0
    assert out1.strip() == ""  # node 1 prints no table
    one, bucketed = doc["rows"]
    assert one["strategy"].startswith("1 process") and bucketed["strategy"] == "bucketed 25 MiB"
    assert bucketed["parity max|Δθ|"] < 1e-5  # world 2 across the two agents = one process on both batches
    assert "world size 2" in doc["meta"]["run"]


@pytest.mark.slow
def test_comm_allreduce_on_two_nodes_one_report():
    procs = agents(["comm", "allreduce", "--backend", "gloo", "--sizes", "4KB", "--warmup", "0", "--iters", "2",
                    "--format", "json"], port=free_port())
    (code0, out0, err0), (code1, out1, err1) = finish(procs, timeout=55)
    assert code0 == 0 and code1 == 0, err0 + err1
    (row,) = json.loads(out0)["rows"]
    assert row["world size"] == 2 and row["correct"] is True and row["bytes"] == 4000
    assert out1.strip() == ""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs /proc to see the agents' workers")
def test_a_dead_node_ends_the_other_within_the_timeout():
    procs = agents(["comm", "allreduce", "--backend", "gloo", "--sizes", "10MB", "--warmup", "0",
                    "--iters", "100000", "--format", "json"], port=free_port())
    node0, node1 = procs
    try:
        deadline = time.monotonic() + 90  # generous: two torchrun agents on two busy cores
        while not (workers(node0) and workers(node1)):
            assert time.monotonic() < deadline, "the agents never started their workers"
            assert node0.poll() is None and node1.poll() is None, "an agent ended before the kill"
            time.sleep(0.2)
        time.sleep(3)  # the group is up and all-reducing
        assert node0.poll() is None
        kill_node(node1)  # node 1 dies: its agent and its worker
        killed = time.monotonic()
        (code0, out0, err0), = finish([node0], timeout=TIMEOUT_S + 60)
        elapsed = time.monotonic() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                kill_node(p)
    assert code0 != 0, err0
    assert elapsed < TIMEOUT_S + 45, elapsed  # not a hang: the collective's timeout at most, plus teardown
    # (on a loaded 2-core machine the teardown of torch and torchrun alone took up to ~25 s)
    assert out0.strip() == ""  # no report from a job that did not finish
