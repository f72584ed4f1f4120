"""The sharded estimate (issue 35): rank 0 of an FSDP2 job on fake tensors in a fake process group.

Bad input is refused by name before any trace or job; the estimate equals the real job-per-trial
answer of ``batchfit probe TARGET --nproc-per-trial 2`` on the CPU (the benchmark,
``benchmarks/sharded_estimate.py``, holds GPT and Llama to it at 2 and 4 ranks).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from batchfit import examples
from batchfit.estimation.fake_ranks import check_sharded, check_world_size
from batchfit.estimation.rank_estimate import estimate_sharded

ROOT = Path(__file__).resolve().parents[1]
GPT = f"{ROOT / 'benchmarks' / 'sharded_targets.py'}:gpt"
BAD = ROOT / "tests" / "sharded_bad_targets.py"


@pytest.mark.parametrize("world_size", [0, -2, 2.0, True, "2", None])
def test_a_world_size_that_is_not_a_positive_int_is_refused_before_any_process(world_size: object) -> None:
    with pytest.raises((TypeError, ValueError), match="world_size must be a positive int"):
        estimate_sharded(GPT, world_size, memory_limit="32MiB", device="cpu")  # type: ignore[arg-type]


def test_keywords_are_checked_before_any_process() -> None:
    with pytest.raises(TypeError, match="memory_limit"):
        estimate_sharded(GPT, 2, device="cpu")
    with pytest.raises(TypeError, match="optimizer= is a AdamW"):
        model, _ = examples.mlp(in_features=4, hidden=4, depth=1, classes=2)
        estimate_sharded(GPT, 2, memory_limit="32MiB", device="cpu", optimizer=torch.optim.AdamW(model.parameters()))
    with pytest.raises(TypeError, match="'module:factory'"):
        estimate_sharded("no_colon", 2, memory_limit="32MiB")


def test_a_model_not_wrapped_with_fully_shard_is_refused_by_name_where_ranks_would_share_it() -> None:
    model, _ = examples.gpt(vocab_size=64, seq_len=8, d_model=16, n_layers=1, n_heads=2)
    with pytest.raises(ValueError, match=r"mine:build's model \(GPT\) is not wrapped with fully_shard"):
        check_sharded(model, 2, "mine:build")
    check_sharded(model, 1, "mine:build")  # one rank holds it all anyway
    assert check_world_size(4) == 4


def _estimate_cli(target: str, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "batchfit", "estimate", target, "--memory-limit", "32MiB", "--device", "cpu"]
    return subprocess.run([*command, *extra], capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("factory", "said"),
    [
        ("not_sharded", "is not wrapped with fully_shard, so at world size 2"),
        ("mesh_too_big", "builds a device mesh that the fake process group of 2 rank(s) cannot build"),
        pytest.param(
            "on_cuda",
            "puts its model on CUDA, which this machine does not have",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA"),
        ),
    ],
)
def test_the_cli_refuses_a_target_the_fake_group_cannot_run_before_any_trace(factory: str, said: str) -> None:
    done = _estimate_cli(f"{BAD}:{factory}", "--world-size", "2")
    assert done.returncode == 2, done.stderr[-2000:]
    assert said in done.stderr
    assert "Traceback" not in done.stderr and "#" not in done.stdout  # refused before any trial ran


@pytest.mark.distributed
def test_the_estimate_equals_the_job_per_trial_answer_at_two_ranks(tmp_path: Path) -> None:
    """GPT sharded per block and at the root, 2 ranks of 32 MiB each: the same max and safe batch as
    the real jobs (5 torchrun jobs of 2 gloo ranks), with world_size and the global batch."""
    estimated = estimate_sharded(GPT, 2, memory_limit="32MiB", device="cpu")
    out = tmp_path / "jobs.json"
    command = [
        sys.executable, "-m", "batchfit", "probe", GPT, "--nproc-per-trial", "2", "--memory-limit", "32MiB",
        "--no-estimate", "--json", str(out), "-q",  # the jobs' own search: the truth leans on no estimate
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    jobs = json.loads(out.read_text())
    assert (estimated.max_batch, estimated.safe_batch) == (jobs["max_batch"], jobs["safe_batch"])
    assert estimated.estimated and estimated.world_size == jobs["world_size"] == 2
    assert estimated.global_max_batch == 2 * jobs["max_batch"]
    assert any("fake process group" in line for line in estimated.assumptions)
    assert any("not modelled" in line for line in estimated.assumptions)
    assert not torch.distributed.is_initialized()  # the group lived and died in the estimate's process


#: In a fake group of 2: estimate() on a model sharded in this process is refused before any swap,
#: and the model still trains (a find() after it runs), as the lead's first try could not.
REFUSED_IN_PLACE = """
import sys, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
sys.path.insert(0, sys.argv[1])
import sharded_targets, batchfit
model, sample = sharded_targets.gpt()
try:
    batchfit.estimate(model, sample, memory_limit="32MiB", device="cpu")
except ValueError as exc:
    print("refused:", exc)
print("find:", batchfit.find(model, sample, memory_limit="32MiB", distributed=False, timed_steps=0).max_batch)
"""


@pytest.mark.distributed
def test_estimate_refuses_a_model_sharded_in_its_own_process_and_leaves_it_whole() -> None:
    done = subprocess.run(
        [sys.executable, "-c", REFUSED_IN_PLACE, str(ROOT / "benchmarks")],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused: the model (FSDPGPT) is sharded" in done.stdout and "estimate_sharded" in done.stdout
    assert "find: 9" in done.stdout  # the jobs' answer at 2 x 32 MiB: the model was left as it was


@pytest.mark.distributed
def test_a_model_fake_tensors_cannot_trace_runs_rank_0s_real_steps_and_says_so() -> None:
    """``gpt_item`` reads a value in forward: real CPU steps of rank 0 in the fake group answer, a
    fresh build per trial; the gate adds a few scalars, so the answer is the traced ``gpt``'s."""
    real = estimate_sharded(GPT.replace(":gpt", ":gpt_item"), 2, memory_limit="32MiB", device="cpu")
    assert real.assumptions[0].startswith("ran real CPU steps of rank 0 in the fake process group")
    assert "DataDependentOutputException" in real.assumptions[0]
    traced = estimate_sharded(GPT, 2, memory_limit="32MiB", device="cpu")
    assert (real.max_batch, real.safe_batch, real.world_size) == (traced.max_batch, traced.safe_batch, 2)
    with pytest.raises(ValueError, match="real CPU steps answer only for the CPU"):
        estimate_sharded(GPT.replace(":gpt", ":gpt_item"), 2, memory_limit="2GiB", device="cpu")
