"""Many nodes: ``torchrun --nnodes 2`` with two node processes on this machine, over loopback.

Each "node" is one ``python -m torch.distributed.run --nnodes 2 --nproc-per-node 1 --rdzv-backend
c10d --rdzv-endpoint 127.0.0.1:PORT`` started together with the other, each in a folder of its own
(so a file written by the wrong node shows). The c10d rendezvous, not ``--node-rank`` (which it
ignores, with a warning), decides which node gets node rank 0 and with it global rank 0: on one
machine the order of the two launchers' process ids. So the tests find the leader by what it wrote,
and check that the other node's rank wrote and printed nothing. What a rank prints is read from the
files torchrun tees it into (``--log-dir``, ``--tee 3``), not from the launcher's stderr: the launcher
itself may warn at teardown when the other node's launcher, which hosts the rendezvous store, ends
first (a TCPStore "recvVector failed" and "failed to shutdown the rendezvous"), a race between two
torchrun agents that batchfit neither causes nor sees. Every job runs under a timeout and in a
session of its own, killed whole on a timeout: a hang fails the test and leaves no process behind.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import batchfit
from batchfit.examples import gpt

ROOT = Path(__file__).resolve().parent.parent
JOB_TIMEOUT_S = 120
LIMIT, LIMIT_BYTES = "64MiB", 64 * 2**20
RANK_LOGS = ".torchrun"  # each node's folder: torchrun's --log-dir
PROBE = ["-m", "batchfit", "probe", "batchfit.examples:gpt", "--memory-limit", LIMIT, "--json", "out.json"]

#: ``find()`` from a user's script: the group is the script's own; every rank writes what it got.
SCRIPT = f"""
import json, os, sys
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
import batchfit
from batchfit.examples import gpt

dist.init_process_group("gloo")
model, sample = gpt()
result = batchfit.find(DistributedDataParallel(model), sample, memory_limit={LIMIT!r}, progress=True)
answer = {{"rank": dist.get_rank(), "group_rank": int(os.environ["GROUP_RANK"]), "world_size": result.world_size,
          "max_batch": result.max_batch, "safe_batch": result.safe_batch}}
with open(f"rank{{dist.get_rank()}}.json", "w") as f:
    json.dump(answer, f)
dist.destroy_process_group()
"""

#: A target whose model raises a non-OOM error on node 1 only (torchrun's ``GROUP_RANK``).
FAILING = """
import os
import torch
from torch import nn

class FailsOnNode1(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x):
        if os.environ["GROUP_RANK"] == "1" and x.shape[0] >= 4:
            raise ValueError("node 1 cannot take this batch")
        return self.linear(x)

def build():
    return FailsOnNode1(), torch.randn(1, 16)
"""


@dataclass
class Node:
    """One torchrun launcher: its folder, exit code and output."""

    folder: Path
    returncode: int
    stdout: str
    stderr: str

    def json(self, name: str = "out.json") -> dict[str, Any]:
        return json.loads((self.folder / name).read_text())

    def rank_output(self) -> tuple[str, str]:
        """What this node's one rank printed (stdout, stderr), from the files torchrun teed it into."""
        [rank] = (self.folder / RANK_LOGS).glob("*/attempt_0/0")
        return (rank / "stdout.log").read_text(), (rank / "stderr.log").read_text()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def torchrun(folder: Path, launcher: list[str], program: list[str]) -> subprocess.Popen[str]:
    folder.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *launcher, *program],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=folder, env=env, start_new_session=True,
    )  # fmt: skip


def finish(folders: list[Path], launchers: list[subprocess.Popen[str]]) -> list[Node]:
    """Wait for every launcher (all within one timeout); on a timeout kill each one's session
    (torchrun and its workers) and fail."""
    nodes: list[Node] = []
    try:
        for folder, launcher in zip(folders, launchers):
            stdout, stderr = launcher.communicate(timeout=JOB_TIMEOUT_S)
            nodes.append(Node(folder, launcher.returncode, stdout, stderr))
    except subprocess.TimeoutExpired:
        pytest.fail(f"a torchrun job did not end within {JOB_TIMEOUT_S} s (a hang)")
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.communicate()
    return nodes


def two_nodes(tmp: Path, program: list[str]) -> list[Node]:
    """Two node launchers started together against one c10d rendezvous on 127.0.0.1."""
    launcher = [
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", f"batchfit-{uuid.uuid4().hex[:12]}",
        "--tee", "3",
    ]  # fmt: skip
    folders = [tmp / "node0", tmp / "node1"]
    launchers = [torchrun(folder, [*launcher, "--log-dir", str(folder / RANK_LOGS)], program) for folder in folders]
    return finish(folders, launchers)


def leader_and_follower(nodes: list[Node], marker: str) -> tuple[Node, Node]:
    """The node whose rank 0 left ``marker`` in its folder, and the other one."""
    having = [node for node in nodes if (node.folder / marker).exists()]
    assert len(having) == 1, [(n.folder.name, sorted(p.name for p in n.folder.iterdir())) for n in nodes]
    return having[0], next(node for node in nodes if node is not having[0])


@pytest.fixture(scope="module")
def alone() -> batchfit.Result:
    """One process's answer under LIMIT: what a job of one rank (no DDP) finds."""
    model, sample = gpt()
    return batchfit.find(model, sample, memory_limit=LIMIT)


@pytest.fixture(scope="module")
def beside_buckets() -> batchfit.Result:
    """One process's answer under LIMIT less DDP's gradient buckets (the gradients' bytes once more):
    what each of two DDP ranks finds under LIMIT."""
    model, sample = gpt()
    buckets = sum(p.numel() * p.element_size() for p in model.parameters())
    return batchfit.find(model, sample, memory_limit=LIMIT_BYTES - buckets)


@pytest.fixture(scope="module")
def probe_nodes(tmp_path_factory: pytest.TempPathFactory) -> list[Node]:
    return two_nodes(tmp_path_factory.mktemp("probe"), PROBE)


@pytest.mark.distributed
def test_two_nodes_end_and_only_global_rank_0_writes_and_prints(probe_nodes: list[Node]) -> None:
    assert [node.returncode for node in probe_nodes] == [0, 0], [node.stderr[-3000:] for node in probe_nodes]
    leader, follower = leader_and_follower(probe_nodes, "out.json")
    assert leader.json()["world_size"] == 2
    assert leader.stdout.count("probing batchfit.examples:gpt") == 1
    assert "torchrun: rank 0 of 2 (gloo)" in leader.stdout
    assert "global max batch" in leader.stdout
    assert follower.rank_output() == ("", "") and follower.stdout == ""  # no output, no file, no warning


@pytest.mark.distributed
def test_two_nodes_answer_as_one_node_with_two_processes_and_as_one_process(
    probe_nodes: list[Node], beside_buckets: batchfit.Result, tmp_path: Path
) -> None:
    leader, _ = leader_and_follower(probe_nodes, "out.json")
    launcher = ["--standalone", "--nproc-per-node", "2"]
    [one_node] = finish([tmp_path], [torchrun(tmp_path, launcher, PROBE)])
    assert one_node.returncode == 0, one_node.stderr[-3000:]
    answers = [(doc["world_size"], doc["max_batch"], doc["safe_batch"]) for doc in (leader.json(), one_node.json())]
    assert answers == [(2, beside_buckets.max_batch, beside_buckets.safe_batch)] * 2


@pytest.mark.distributed
def test_find_from_a_script_gives_every_rank_the_same_answer_and_only_rank_0_shows_progress(
    tmp_path: Path, beside_buckets: batchfit.Result
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    nodes = two_nodes(tmp_path, [str(script)])
    assert [node.returncode for node in nodes] == [0, 0], [node.stderr[-3000:] for node in nodes]
    answers = sorted((json.loads(path.read_text()) for node in nodes for path in node.folder.glob("rank*.json")),
                     key=lambda answer: answer["rank"])  # fmt: skip
    assert [(a["rank"], a["group_rank"]) for a in answers] == [(0, 0), (1, 1)]  # one rank per node
    assert {(a["world_size"], a["max_batch"], a["safe_batch"]) for a in answers} == {
        (2, beside_buckets.max_batch, beside_buckets.safe_batch)
    }
    leader, follower = leader_and_follower(nodes, "rank0.json")
    assert leader.stderr.count("batchfit: probing DistributedDataParallel") == 1  # find(progress=True): rank 0 only
    assert "global max batch" in leader.stderr
    assert follower.rank_output() == ("", "") and follower.stdout == ""


@pytest.mark.distributed
def test_an_error_on_node_1_ends_both_nodes_and_node_0_names_the_rank_and_the_error(tmp_path: Path) -> None:
    (tmp_path / "failing.py").write_text(FAILING)
    target = str(tmp_path / "failing.py") + ":build"
    nodes = two_nodes(tmp_path, ["-m", "batchfit", "probe", target, "--memory-limit", LIMIT, "--json", "out.json"])
    assert all(node.returncode != 0 for node in nodes), [node.returncode for node in nodes]
    assert not any((node.folder / "out.json").exists() for node in nodes)
    [leader] = [node for node in nodes if "torchrun: rank 0 of 2" in node.stdout]
    [failing] = [node for node in nodes if node is not leader]
    assert "batchfit: error: RankFailedError: rank 1 failed at batch size" in leader.stderr, leader.stderr[-3000:]
    assert "during forward: ValueError: node 1 cannot take this batch" in leader.stderr
    assert "batchfit: error: ValueError: node 1 cannot take this batch (raised during forward" in failing.stderr
    assert failing.stdout == ""


@pytest.mark.distributed
def test_elastic_nnodes_1_to_2_with_one_node_probes_alone(tmp_path: Path, alone: batchfit.Result) -> None:
    """``--nnodes 1:2``: once one node joined, the rendezvous waits ``last_call_timeout`` for more,
    then runs with what it has; a job of one rank probes as one process does."""
    launcher = [
        "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", f"batchfit-{uuid.uuid4().hex[:12]}",
        "--rdzv-conf", "last_call_timeout=1,join_timeout=60", "--max-restarts", "0",
    ]  # fmt: skip
    [node] = finish([tmp_path], [torchrun(tmp_path, launcher, PROBE)])
    assert node.returncode == 0, node.stderr[-3000:]
    document = node.json()
    assert (document["world_size"], document["max_batch"], document["safe_batch"]) == (
        1, alone.max_batch, alone.safe_batch
    )  # fmt: skip
    assert "torchrun: rank" not in node.stdout  # a job of one is no group


def test_a_process_without_a_group_leads() -> None:
    from batchfit.distributed import leads

    assert leads(None) and leads(False) and leads(True)  # alone (True fails later, in find(), naming the group)


@pytest.mark.distributed
@pytest.mark.parametrize("gone", [0, 1])
def test_env_launch_with_a_rank_that_never_joins_ends_within_the_rank_timeout(tmp_path: Path, gone: int) -> None:
    """Launched as ``srun`` or a plain pod does it (``MASTER_ADDR``/``MASTER_PORT``, ``RANK``,
    ``WORLD_SIZE``, no torchrun agent), a rank that dies before the process group forms (here: a
    command-line error) leaves the other in ``init_process_group``: it must end there after
    ``--rank-timeout`` seconds with an error saying so, not after gloo's 30 minutes (the subprocess
    timeout turns such a hang into a failure)."""
    survivor = 1 - gone
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": "2", "LOCAL_RANK": "0"}  # fmt: skip
    probe = [sys.executable, *PROBE, "--rank-timeout", "4"]
    dead = subprocess.run([*probe, "--memory-limit", "lots"], env={**env, "RANK": str(gone)}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=JOB_TIMEOUT_S)  # fmt: skip
    assert dead.returncode != 0 and "lots" in dead.stderr  # it never reached the group
    try:
        alive = subprocess.run(probe, env={**env, "RANK": str(survivor)}, cwd=tmp_path, capture_output=True,
                               text=True, timeout=60)  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail("the surviving rank was still waiting for the process group after 60 s (--rank-timeout 4)")
    assert alive.returncode == 1, alive.stderr[-3000:]
    assert f"rank {survivor} of 2 could not join the process group at 127.0.0.1:{env['MASTER_PORT']}" in alive.stderr
    assert "within 4 s (--rank-timeout)" in alive.stderr
    assert "a rank failed or died before joining" in alive.stderr
    assert not (tmp_path / "out.json").exists()
