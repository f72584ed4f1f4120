"""The experiment that decides "fits" on a GPU (``benchmarks/gpu_experiment.py``), on CPU.

A GPU is lent for minutes and the experiment has one call: a verdict that misreads its records, a
scheduler that overfills the card, or a script that breaks before the end would waste the call. So
the judging is checked here on records shaped as a GPU run writes them (the H200's GPT-2 story:
22 trains only by flushing the cache, 23 runs out of memory), the plan and the scheduler's rules
without starting anything, and the whole script once on CPU, as CI and the GPU box run it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_experiment as ge  # noqa: E402  (benchmarks/ is no package)

GiB = 2**30
RETRY = "CUDA allocator retry: the step ran only after the allocator flushed its cache at the cap 2 time(s)"


def fresh(allocator: str, *, oom: bool = False, retries: tuple[int, int] = (0, 0), **extra: Any) -> dict[str, Any]:
    """A fresh child's answer as ``train_loop`` writes it."""
    failure = {"step": 1, "phase": "backward", "message": "OutOfMemoryError: CUDA out of memory."} if oom else None
    answer = {
        "ok": True,
        "allocator": allocator,
        "steps_asked": 10,
        "completed": 0 if oom else 10,
        "oom": failure,
        "ooms": [failure] if failure else [],
        "retries_before": retries[0],
        "retries_after": retries[1],
        "records": [],
        "final": {"allocated_peak": 20 * GiB, "reserved_peak": 23 * GiB},
    }
    return {**answer, **extra}


def trial(fits: bool, message: str | None = None, retries: int | None = None) -> dict[str, Any]:
    """A replay trial as ``trial_facts`` writes it."""
    phase = None if fits else "backward"
    facts = None if retries is None else {"retries": retries, "inactive_split_peak_bytes": GiB}
    return {"fits": fits, "steps": 3 if fits else 1, "phase": phase, "message": message, "allocator": facts}


def gpu_answers() -> dict[str, dict[str, Any]]:
    """What the H200's runs say a GPU run records: find()'s max 22 trains only by flushing in a
    fresh process; the replay reproduces the flush; async: max 26, and 27 fits in one process only."""
    oom = "OutOfMemoryError: CUDA out of memory. Tried to allocate 4.21 GiB"
    return {
        "find native": {"ok": True, "max_batch": 22, "safe_batch": 20, "trials": [], "elapsed_s": 9.0},
        "find async": {"ok": True, "max_batch": 26, "safe_batch": 24, "trials": [], "elapsed_s": 9.0},
        "replay": {
            "ok": True,
            "from_scratch_available": True,
            "sizes": {
                "21": {"warm": trial(True), "fresh_optimizer": trial(True), "from_scratch": trial(True, retries=0)},
                "22": {"warm": trial(True), "fresh_optimizer": trial(True), "from_scratch": trial(False, RETRY, 2)},
                "23": {
                    "warm": trial(False, oom),
                    "fresh_optimizer": trial(False, oom),
                    "from_scratch": trial(False, oom, 1),
                },
            },
        },
        "fresh M-1": fresh("native"),
        "fresh M": fresh("native", retries=(0, 2)),
        "fresh M+1": fresh("native", oom=True),
        "fresh M-1 warm-up": fresh("native"),
        "fresh M warm-up": fresh("native"),
        "fresh M+1 warm-up": fresh("native", oom=True),
        "async M-1 #1": fresh("cudaMallocAsync"),
        "async M-1 #2": fresh("cudaMallocAsync"),
        "async M #1": fresh("cudaMallocAsync"),
        "async M #2": fresh("cudaMallocAsync"),
        "async M+1 #1": fresh("cudaMallocAsync"),
        "async M+1 #2": fresh("cudaMallocAsync", oom=True),
        "long native": fresh("native", retries=(0, 3), steps_asked=200, completed=200),
    }


# The rule of a fresh process ---------------------------------------------------------------------
def test_a_native_step_that_needed_a_retry_does_not_fit_but_an_expandable_or_async_one_does() -> None:
    assert ge.fresh_fits(fresh("native")) is True
    assert ge.fresh_fits(fresh("native", retries=(1, 3))) is False
    assert ge.fresh_fits(fresh("expandable", retries=(0, 5))) is True
    assert ge.fresh_fits(fresh("cudaMallocAsync", retries=(0, 1))) is True
    assert ge.fresh_fits(fresh("cpu", retries=(None, None))) is True  # type: ignore[arg-type]


def test_an_out_of_memory_fails_and_a_child_that_did_not_run_through_says_nothing() -> None:
    assert ge.fresh_fits(fresh("expandable", oom=True)) is False
    assert ge.fresh_fits(fresh("native", interrupted=True)) is None
    assert ge.fresh_fits(fresh("native", completed=7)) is None  # stopped at the deadline's grace
    assert ge.fresh_fits({"ok": False, "error": "exit 1"}) is None
    assert ge.fresh_fits(None) is None
    assert ge.fresh_reason(fresh("native", retries=(0, 2))) == "no 10 st +2 retries 23.00 GiB rsv"
    assert ge.fresh_reason(fresh("native", oom=True)) == "OOM backward step 1"


def test_a_trial_failed_by_the_retry_rule_did_not_run_out_of_memory() -> None:
    assert ge.ran_out(trial(False, RETRY, 2)) is False
    assert ge.ran_out(trial(False, "OutOfMemoryError: CUDA out of memory.")) is True
    assert ge.ran_out(trial(True)) is False
    assert ge.ran_out(None) is None


# The verdict ------------------------------------------------------------------------------------
def test_the_rule_that_judges_retries_is_the_one_that_agrees_with_fresh_processes() -> None:
    verdict = ge.judge(gpu_answers())
    rules = verdict["rules"]
    assert verdict["fresh"]["native"] == {-1: True, 0: False, 1: False}
    assert verdict["fresh"]["warm-up"] == {-1: True, 0: True, 1: False}  # the warm-up hides the flush
    assert rules["a"]["says"] == {-1: True, 0: True, 1: False} and rules["a"]["agrees"] is False
    assert rules["b"]["says"] == {-1: True, 0: True, 1: False} and rules["b"]["agrees"] is False
    assert rules["c"]["says"] == {-1: True, 0: False, 1: False} and rules["c"]["agrees"] is True
    # Async: 27 fitted in one process only, so it does not fit; the probe's max 26 agrees.
    assert verdict["fresh"]["async"] == {-1: True, 0: True, 1: False}
    assert rules["d"]["agrees"] is True
    assert verdict["agreeing"] == ["c", "d"] and verdict["differing"] == ["a", "b"]


def test_a_rule_with_a_size_unknown_is_not_called_agreeing() -> None:
    answers = gpu_answers()
    del answers["fresh M+1"]
    for name in ("async M-1 #1", "async M-1 #2"):
        answers.pop(name)
    verdict = ge.judge(answers)
    assert verdict["rules"]["c"]["agrees"] is None  # agrees where known, M+1 unknown
    assert verdict["rules"]["a"]["agrees"] is False  # a disagreement at M is known already
    assert verdict["rules"]["d"]["agrees"] is None
    assert ge.compare({-1: True, 0: None, 1: False}, {-1: True, 0: True, 1: False}) is None


def test_without_the_replay_keyword_b_and_c_are_unknown() -> None:
    answers = gpu_answers()
    answers["replay"] = {**answers["replay"], "from_scratch_available": False}
    answers["replay"]["sizes"] = {k: {**row, "from_scratch": None} for k, row in answers["replay"]["sizes"].items()}
    rules = ge.rule_answers(answers)
    assert rules["b"] == {-1: None, 0: None, 1: None} and rules["c"] == {-1: None, 0: None, 1: None}
    assert rules["a"] == {-1: True, 0: True, 1: False}


def test_a_replay_trial_that_raised_leaves_its_size_unknown() -> None:
    answers = gpu_answers()
    answers["replay"]["sizes"]["22"]["from_scratch"] = {"batch": 22, "fits": None, "error": "AttributeError: x"}
    rules = ge.rule_answers(answers)
    assert rules["b"][0] is None and rules["c"][0] is None and rules["c"][1] is False
    assert ge.replay_cells(answers["replay"]["sizes"]["22"]) == "yes / yes / error"


def test_async_truth_says_when_the_two_processes_disagree() -> None:
    answers = gpu_answers()
    assert ge.async_truth(answers, "M+1") == (False, False)
    assert ge.async_truth(answers, "M") == (True, True)
    assert ge.async_truth({"async M #1": fresh("cudaMallocAsync")}, "M") == (True, None)


def test_the_screen_fits_one_screen_and_names_the_verdict() -> None:
    answers = gpu_answers()
    answers["long native"]["ooms"] = [{"step": 3, "phase": "forward", "device_free": 10 * 2**20}]
    document = {
        "date": "2026-11-28 12:00",
        "elapsed_s": 250.0,
        "deadline_s": 520.0,
        "machine": {"cuda": True, "gpu": "NVIDIA H200", "total_bytes": 140 * GiB, "free_bytes": 139 * GiB},
        "plan": {
            "case": {"key": "gpt2_small", "amp": "bf16", "limit_bytes": 24 * GiB},
            "parallel": 8,
            "long_steps": 200,
            "seq_lens": [1024, 960, 1024, 896],
        },
        "answers": answers,
        "not_run": [("long expandable", "deadline: it would start at 530 s, after --deadline 520 s")],
        "verdict": ge.judge(answers),
    }
    text = ge.render(document)
    lines = text.splitlines()
    assert len(lines) <= 30 and max(map(len, lines)) <= 160
    assert lines[-1].startswith("verdict: agrees with fresh processes at M-1..M+1: c (replay, OOM + no retry), d")
    assert "disagrees: a, b" in lines[-1]
    assert any(line.startswith("   M  22  no 10 st +2 retries 23.00 GiB rsv") for line in lines)
    assert "not run: long expandable: deadline" in text
    assert "WARNING: the card itself was nearly full in long native" in text


# The children's loop, on CPU ----------------------------------------------------------------------
def loop_args(steps: int, window: int) -> dict[str, Any]:
    gpt = {"vocab_size": 64, "seq_len": 16, "d_model": 16, "n_layers": 1, "n_heads": 2}
    case = {"key": "gpt", "factory": "gpt", "kwargs": gpt, "amp": None, "limit_bytes": 2**26}
    return {"device": "cpu", "case": case, "size": 3, "steps": steps, "window": window, "seq_lens": [16, 12]}


def test_the_long_run_records_each_window_and_goes_on_after_an_oom_a_fresh_child_stops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    real, calls = ge.one_step, []

    def failing(model: Any, optimizer: Any, batch: Any, amp: Any, where: list[str]) -> None:
        calls.append(batch["input_ids"].shape[1])
        if len(calls) in (3, 5):
            where[0] = "backward"
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.21 GiB")
        real(model, optimizer, batch, amp, where)

    monkeypatch.setattr(ge, "one_step", failing)
    answer: dict[str, Any] = {}
    ge.train_loop(loop_args(steps=8, window=4), answer)
    assert calls == [16, 12, 16, 12, 16, 12, 16, 12]  # the lengths cycle
    assert answer["completed"] == 6 and [oom["step"] for oom in answer["ooms"]] == [3, 5]
    assert answer["oom"]["phase"] == "backward" and "4.21 GiB" in answer["oom"]["message"]
    assert [r["step"] for r in answer["records"]] == [4, 8]
    calls.clear()
    fresh_answer: dict[str, Any] = {}
    ge.train_loop(loop_args(steps=10, window=1), fresh_answer)
    assert fresh_answer["completed"] == 2 and len(fresh_answer["ooms"]) == 1 and len(calls) == 3
    assert ge.fresh_fits({"ok": True, **fresh_answer}) is False


def test_a_snapshot_is_summed_to_a_few_numbers_per_segment(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    def block(size: int, state: str) -> dict[str, Any]:
        return {"size": size, "state": state}

    segments = [
        {
            "total_size": 6 * GiB,
            "allocated_size": 4 * GiB,
            "blocks": [block(4 * GiB, "active_allocated"), block(GiB, "inactive"), block(GiB, "inactive")],
        },
        {"total_size": 2 * GiB, "allocated_size": 0, "blocks": [block(2 * GiB, "inactive")]},
    ] + [{"total_size": 2**21, "allocated_size": 2**20, "blocks": [block(2**20, "inactive")]}] * 30
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)
    summary = ge.snapshot_summary()
    assert summary["segments"] == 32 and summary["largest"][:2] == [[6 * GiB, 4 * GiB, GiB], [2 * GiB, 0, 2 * GiB]]
    assert summary["largest_free_block"] == 2 * GiB
    assert summary["split_free"] == 2 * GiB + 30 * 2**20  # the wholly free segment is no split-free memory
    assert len(summary["largest"]) == ge.SNAPSHOT_ROWS and summary["rest"]["segments"] == 32 - ge.SNAPSHOT_ROWS


# The plan and the scheduler -----------------------------------------------------------------------
def test_the_gpu_plan_is_the_proofs_case_and_every_part() -> None:
    plan = ge.plan_for({"cuda": True, "total_bytes": 79 * GiB, "free_bytes": 78 * GiB, "cpu_count": 16})
    assert plan.case["factory"] == "gpt2_small" and plan.case["limit_bytes"] == 24 * GiB and plan.case["amp"] == "bf16"
    jobs, skipped = ge.jobs_for(plan)
    names = [job.name for job in jobs]
    assert skipped == [] and len(names) == 17 and names[:3] == ["find native", "find async", "replay"]
    assert {job.alloc_conf for job in jobs if job.name.startswith("async")} == {ge.ASYNC}
    assert next(job for job in jobs if job.name == "long expandable").alloc_conf == ge.EXPANDABLE
    assert all(job.need_bytes >= 24 * GiB + ge.CONTEXT_BYTES for job in jobs)
    fresh_m = next(job for job in jobs if job.name == "fresh M+1 warm-up")
    args = fresh_m.args({"find native": {"ok": True, "max_batch": 22}})
    assert isinstance(args, dict) and args["size"] == 23 and args["warm_up"] is True and args["steps"] >= 10
    assert fresh_m.args({"find native": {"ok": False, "error": "boom"}}) == "find native gave no max_batch (boom)"


def test_the_cpu_plan_says_which_parts_need_cuda() -> None:
    plan = ge.plan_for({"cuda": False, "cpu_count": 2})
    jobs, skipped = ge.jobs_for(plan)
    assert [job.name for job in jobs] == ["find native", "replay", "fresh M-1", "fresh M", "fresh M+1", "long native"]
    assert {name for name, _ in skipped} >= {"find async", "fresh warm-up", "long expandable", "memory snapshots"}
    assert all(why == "no CUDA here" for _, why in skipped)


def test_children_start_only_where_the_cards_memory_holds_them_and_before_the_deadline(tmp_path: Path) -> None:
    plan = ge.plan_for({"cuda": True, "total_bytes": 79 * GiB, "free_bytes": 78 * GiB, "cpu_count": 16})
    jobs, _ = ge.jobs_for(plan)
    by_name = {job.name: job for job in jobs}
    scheduler = ge.Scheduler(plan, tmp_path, deadline_s=520.0)
    scheduler.answers["find native"] = {"ok": True, "max_batch": 22, "safe_batch": 20}
    running = [ge.Running(by_name[n], None, tmp_path, 0.0, 0.0, {}) for n in ("replay", "fresh M-1")]  # type: ignore[arg-type]
    pending = list(jobs)
    assert scheduler._ready(by_name["fresh M"], pending, running) is not None  # a third 24 GiB child fits in 78 GiB
    running.append(ge.Running(by_name["find async"], None, tmp_path, 0.0, 0.0, {}))  # type: ignore[arg-type]
    assert scheduler._ready(by_name["fresh M"], pending, running) is None  # not beside an async one: it waits
    assert scheduler._ready(by_name["async M #1"], pending, []) is None  # find async still runs
    scheduler.not_run.append(("find async", "deadline"))
    assert scheduler._ready(by_name["async M #1"], pending, []) is None
    assert ("async M #1", "find async did not run") in scheduler.not_run and by_name["async M #1"] not in pending
    scheduler.started = time.monotonic() - 600  # past the deadline: nothing starts, each says why
    assert scheduler._ready(by_name["fresh M"], pending, []) is None
    assert scheduler.not_run[-1][0] == "fresh M" and scheduler.not_run[-1][1].startswith("deadline")


# The whole script, on CPU, as the GPU box runs it ------------------------------------------------------
@pytest.mark.slow
def test_the_script_runs_end_to_end_on_cpu_into_at_most_eight_files(tmp_path: Path) -> None:
    out = tmp_path / "OUT"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_experiment.py"), "--device", "cpu", "--out", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    files = sorted(p.name for p in out.rglob("*") if p.is_file())
    assert files == ["experiment-logs.tar.gz", "experiment.json", "experiment.txt"]
    document = json.loads((out / "experiment.json").read_text())
    assert document["schema"] == "batchfit.gpu-experiment/1" and document["machine"]["cuda"] is False
    answers = document["answers"]
    assert set(answers) == {"find native", "replay", "fresh M-1", "fresh M", "fresh M+1", "long native"}
    assert all(answer["ok"] for answer in answers.values()), answers
    top = answers["find native"]["max_batch"]
    assert sorted(int(size) for size in answers["replay"]["sizes"]) == [top - 1, top, top + 1]
    assert answers["long native"]["completed"] + len(answers["long native"]["ooms"]) == 200
    assert set(document["verdict"]["rules"]) == {"a", "b", "c", "d"}
    assert {name for name, _ in document["not_run"]} >= {"find async", "long expandable"}
    # The rule a fresh CPU child keeps is batchfit's own: its max fits, max + 1 does not.
    assert document["verdict"]["fresh"]["native"] == {"-1": True, "0": True, "1": False}
    text = (out / "experiment.txt").read_text()
    assert "verdict (CPU: the script ran end to end" in text and text.strip() in done.stdout
