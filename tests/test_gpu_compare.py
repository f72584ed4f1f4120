"""``benchmarks/gpu_compare.py``: the verdict of fresh processes, the profile's buckets, the table, the
alias that lets ``compare.py`` drive the ``pytorch-lightning`` distribution, and (slow) one CPU run.

Nothing here looks at a timing: the script is a benchmark, and its GPU numbers come from a GPU box.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_compare.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_compare as gc  # noqa: E402  (benchmarks/ is not a package)


# The verdict -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("answer", "at", "above", "expected"),
    [
        (22, True, False, "exact"),
        (20, True, True, "below"),
        (23, False, False, "over"),
        (23, False, None, "over"),
        (22, True, None, "unknown"),
        (22, None, False, "unknown"),
        (None, None, None, "no answer"),
    ],
)
def test_verdict(answer: int | None, at: bool | None, above: bool | None, expected: str) -> None:
    assert gc.verdict(answer, at, above) == expected


def test_rows_are_judged_by_the_children_at_the_answer_and_one_above() -> None:
    whole = gc.Row("batchfit", "find() defaults: whole answer", answer=22, extra={"safe_batch": 20})
    lightning = gc.Row("Lightning", "binsearch", answer=20)
    skipped = gc.Row("Accelerate", "decorator", skipped="skipped: deadline")
    failed = gc.Row("Accelerate", "decorator", note="raised RuntimeError: boom")
    rows = [whole, lightning, skipped, failed]
    assert gc.sizes_to_judge(rows) == [20, 21, 22, 23]
    answers = {size: {"ok": True, "fits": size <= 22} for size in (20, 21, 22)}
    answers[23] = {"ok": False, "error": "exit 1, no answer"}  # a child that died says nothing
    gc.apply_verdicts(rows, answers)
    assert (whole.fresh_at, whole.fresh_above, whole.verdict) == (True, None, "unknown")
    assert whole.extra["safe_fresh_fits"] is True
    assert (lightning.fresh_at, lightning.fresh_above, lightning.verdict) == (True, True, "below")
    assert skipped.verdict is None and failed.verdict == "no answer"
    answers[23] = {"ok": True, "fits": False}
    gc.apply_verdicts(rows, answers)
    assert whole.verdict == "exact"


def test_a_childs_answer_is_its_last_marked_line() -> None:
    output = 'noise\nBATCHFIT-PROOF {"ok": true, "fits": false}\nBATCHFIT-PROOF {"ok": true, "fits": true}\n'
    assert gc.answer_of(output) == {"ok": True, "fits": True}
    assert gc.answer_of("Traceback ...") is None and gc.answer_of("BATCHFIT-PROOF {broken") is None
    assert gc.fits_of({"ok": True, "fits": False}) is False
    assert gc.fits_of({"ok": False, "fits": True}) is None and gc.fits_of(None) is None


def test_ratios_are_taken_against_lightning() -> None:
    rows = [
        gc.Row("batchfit", "whole", answer=22, trials=9, wall_s=4.0),
        gc.Row("Lightning", "binsearch", answer=20, trials=12, wall_s=10.0),
        gc.Row("Accelerate", "decorator", skipped="skipped"),
    ]
    gc.add_ratios(rows)
    assert rows[0].x_lightning_wall == pytest.approx(0.4) and rows[0].x_lightning_trials == pytest.approx(0.75)
    assert rows[1].x_lightning_wall == pytest.approx(1.0)
    assert rows[2].x_lightning_wall is None


# The profile -------------------------------------------------------------------------------------------
def _key(name: str, path: str = "/x/batchfit/api.py", line: int = 1) -> tuple[str, int, str]:
    return (path, line, name)


FIND = _key("find")
RUN_TRIAL = _key("run_trial", "/x/batchfit/probe/trial.py", 10)
STEPS = _key("_run_steps", "/x/batchfit/probe/trial.py", 20)
SYNC = _key("synchronize", "/x/torch/cuda/__init__.py")
WARM = _key("warm_up", "/x/batchfit/backends/cuda.py")
GC = ("~", 0, "<built-in method gc.collect>")
RELEASE = _key("release", "/x/batchfit/backends/accelerator.py")
CALL = _key("_call_impl", "/x/torch/nn/modules/module.py")
FORWARD = _key("forward", "/x/batchfit/examples.py")


def _edge(seconds: float) -> tuple[int, int, float, float]:
    return (1, 1, 0.0, seconds)


#: A synthetic ``pstats.Stats.stats``: find (10 s) runs trials whose steps take 5 s (with 1 s of
#: syncs and a forward that recurses through Module._call_impl), a warm-up (0.5 s, 0.2 of it a
#: sync), a sync of its own (0.3 s) and a release per trial (1 s, 0.8 of it gc.collect).
STATS = {
    FIND: (1, 1, 0.1, 10.0, {}),
    RUN_TRIAL: (9, 9, 0.2, 6.0, {FIND: _edge(6.0)}),
    STEPS: (9, 9, 0.5, 5.0, {RUN_TRIAL: _edge(5.0)}),
    SYNC: (20, 20, 1.5, 1.5, {STEPS: _edge(1.0), WARM: _edge(0.2), FIND: _edge(0.3)}),
    WARM: (1, 1, 0.3, 0.5, {FIND: _edge(0.5)}),
    GC: (5, 5, 0.8, 0.8, {RELEASE: _edge(0.8)}),
    RELEASE: (9, 9, 0.2, 1.0, {RUN_TRIAL: _edge(1.0)}),
    CALL: (30, 30, 0.1, 3.0, {STEPS: _edge(3.0), FORWARD: _edge(2.0)}),
    FORWARD: (30, 30, 0.5, 2.9, {CALL: _edge(2.9)}),
}


def test_each_moment_goes_to_the_first_bucket_on_the_stack() -> None:
    profile = gc.bucket_profile(STATS, wall_s=10.0)
    seconds = {b["bucket"]: b["seconds"] for b in profile["buckets"]}
    assert list(seconds) == [name for name, _ in gc.BUCKETS] + ["rest"]
    assert seconds["steps (trial._run_steps)"] == pytest.approx(5.0)
    assert seconds["warm-ups (CudaBackend.warm_up, cuBLAS workspaces)"] == pytest.approx(0.5)  # its sync inside
    assert seconds["gc.collect"] == pytest.approx(0.8)  # inside the release: gc's
    assert seconds["torch.cuda.empty_cache"] == 0.0
    assert seconds["torch.cuda.synchronize"] == pytest.approx(0.3)  # only find()'s own sync
    assert seconds["trial release, OOM recovery"] == pytest.approx(0.2)  # the release less its gc.collect
    assert seconds["rest"] == pytest.approx(3.2)
    assert sum(seconds.values()) == pytest.approx(10.0)
    cumulative = {b["bucket"]: b["cumulative_s"] for b in profile["buckets"]}
    assert cumulative["torch.cuda.synchronize"] == pytest.approx(1.5)  # pstats' figure, nested calls and all
    assert profile["steps_s"] == pytest.approx(5.0) and profile["outside_steps_s"] == pytest.approx(5.0)


def test_the_costs_outside_the_steps_leave_the_steps_out() -> None:
    profile = gc.bucket_profile(STATS, wall_s=10.0)
    outside = {e["function"]: e["seconds"] for e in profile["top_batchfit_outside_steps"]}
    # find's 10 s less the 5 s of steps below it; the release's 1 s. run_trial's 6 s less the same
    # 5 s is the release's 1 s: it passes its time through, and the release stands for it.
    assert outside["batchfit/api.py:1(find)"] == pytest.approx(5.0)
    assert outside["batchfit/backends/accelerator.py:1(release)"] == pytest.approx(1.0)
    assert "batchfit/probe/trial.py:10(run_trial)" not in outside
    # The forward recursing through Module._call_impl under the steps is no cost outside them.
    assert not any("forward" in name for name in outside)
    own = {e["function"]: e["seconds"] for e in profile["top_self_outside_steps"]}
    assert own["<built-in method gc.collect>"] == pytest.approx(0.8)
    assert own["torch/cuda/__init__.py:1(synchronize)"] == pytest.approx(1.5 * 0.5 / 1.5)


def test_a_recursion_inherits_the_share_of_its_entries() -> None:
    share = gc.under_share(STATS, {STEPS})
    assert share[CALL] == pytest.approx(1.0) and share[FORWARD] == pytest.approx(1.0)
    assert share[SYNC] == pytest.approx(1.0 / 1.5) and share[FIND] == 0.0
    component, order = gc.components(STATS)
    assert component[CALL] == component[FORWARD] != component[STEPS]
    assert order.index(next(m for m in order if FIND in m)) < order.index(next(m for m in order if STEPS in m))


def test_a_real_profile_is_read() -> None:
    import cProfile
    import gc as garbage
    import pstats

    def work() -> None:
        garbage.collect()

    profiler = cProfile.Profile()
    profiler.runcall(work)
    profile = gc.bucket_profile(pstats.Stats(profiler).stats, wall_s=1.0)  # type: ignore[attr-defined]
    buckets = {b["bucket"]: b for b in profile["buckets"]}
    assert buckets["gc.collect"]["calls"] == 1 and buckets["gc.collect"]["seconds"] > 0


# The table ---------------------------------------------------------------------------------------------
def _document() -> dict:
    whole = gc.Row("batchfit", "find() defaults: whole answer", answer=22, trials=9, ooms=2, wall_s=4.0)
    whole.extra = {"safe_batch": 20, "safe_fresh_fits": True}
    whole.note = "safe 20 verified"
    memory = gc.Row("batchfit", "find(timed_steps=0): memory answer", answer=22, trials=7, ooms=2, wall_s=3.0)
    lightning = gc.Row("Lightning", "binsearch, defaults (margin 0.05)", answer=20, trials=12, ooms=3, wall_s=10.0)
    accelerate = gc.Row("Accelerate", "decorator, starting_batch_size=128", skipped="skipped: deadline")
    rows = [whole, memory, lightning, accelerate]
    gc.add_ratios(rows)
    gc.apply_verdicts(rows, {20: {"ok": True, "fits": True}, 21: {"ok": True, "fits": True},
                             22: {"ok": True, "fits": True}, 23: {"ok": True, "fits": False}})  # fmt: skip
    case = {
        "model": "gpt2_small",
        "case": "gpt2_small(seq_len=1024) bf16 @ 24 GiB",
        "rows": [asdict(r) for r in rows],
        "profile": gc.bucket_profile(STATS, wall_s=10.0),
        "profile_skipped": None,
        "fresh_skipped": None,
        "others_cpu_share": 0.02,
    }
    return {"device": "cuda:0", "date": "2026-11-28", "machine": {"gpu": "NVIDIA H200"}, "cases": [case],
            "total_wall_s": 99.0}  # fmt: skip


def test_the_table_shows_answers_ratios_verdicts_and_the_profile() -> None:
    text = gc.render(_document())
    lines = text.splitlines()
    whole = next(line for line in lines if "whole answer" in line and line.startswith("batchfit"))
    assert " 22 " in whole and "0.40" in whole and "0.75" in whole and "fits / OOM" in whole and "exact" in whole
    assert "safe 20 fresh: fits" in whole
    light = next(line for line in lines if line.startswith("Lightning"))
    assert "fits / fits" in light and "below" in light and "1.00" in light
    assert any(line.startswith("Accelerate") and "skipped: deadline" in line for line in lines)
    assert "find() under cProfile: 10.00 s wall" in text and "gc.collect" in text and "rest" in text
    goal = next(line for line in lines if line.strip().startswith("gpt2_small:"))
    assert "0.40x Lightning's wall" in goal and "batchfit exact, Lightning below" in goal and "MET" in goal


def test_the_goal_is_not_met_when_batchfit_is_slow_or_not_exact() -> None:
    document = _document()
    rows = document["cases"][0]["rows"]
    rows[0]["x_lightning_wall"] = 0.6
    assert gc.goal_lines(document["cases"])[1].endswith("not met")
    rows[0]["x_lightning_wall"], rows[0]["verdict"], rows[2]["verdict"] = 0.4, "below", "exact"
    assert gc.goal_lines(document["cases"])[1].endswith("not met")


def test_short_names() -> None:
    assert gc._short("batchfit/probe/prober.py:300(_undo)") == "prober._undo"
    assert gc._short("<built-in method gc.collect>") == "<built-in method gc.collect>"


# The pytorch-lightning distribution --------------------------------------------------------------------
ALIAS = r"""
import importlib.util, sys
sys.path.insert(0, sys.argv[1])
real_find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, package=None: None if name == "lightning" else real_find_spec(name, package)

class Blocked:  # a lightning.* module the alias did not register would be loaded from `lightning`: refuse
    def find_spec(self, name, path=None, target=None):
        if name == "lightning" or name.startswith("lightning."):
            raise ModuleNotFoundError(name)

sys.meta_path.insert(0, Blocked())
import gpu_compare
assert gpu_compare.lightning_alias() == "pytorch_lightning"
importlib.util.find_spec = real_find_spec
import compare, pytorch_lightning, pytorch_lightning.tuner
import lightning.pytorch as pl
from lightning.pytorch.tuner import Tuner
from lightning.pytorch.utilities.memory import is_oom_error
assert pl is pytorch_lightning and Tuner is pytorch_lightning.tuner.Tuner
assert compare.lightning_available() and compare.versions()["lightning"] == pytorch_lightning.__version__
print("ok")
"""


@pytest.mark.slow
@pytest.mark.skipif(
    __import__("importlib.util").util.find_spec("pytorch_lightning") is None, reason="pytorch_lightning not installed"
)
def test_lightning_alias_serves_compare_from_pytorch_lightning() -> None:
    """The GPU box has the ``pytorch-lightning`` distribution (``import pytorch_lightning``), not
    ``lightning``: the alias makes ``compare.py``'s ``lightning.pytorch`` the same modules."""
    done = subprocess.run(
        [sys.executable, "-c", ALIAS, str(ROOT / "benchmarks")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-2000:] + done.stderr[-3000:]


# One run on CPU ----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_cpu_run_writes_its_table_and_json(tmp_path: Path) -> None:
    """The script as ``.ci/run`` runs it, from a tree where batchfit is not installed: one model and a
    deadline that cuts the run short; every row, the children and the profile ran or say why not."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CUDA_VISIBLE_DEVICES")}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--models", "cnn", "--deadline", "20", "--out", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    files = list(tmp_path.iterdir())
    assert 1 <= len(files) <= 8
    (written,) = tmp_path.glob("gpu-compare-cpu-*.json")
    document = json.loads(written.read_text())
    assert document["schema"] == "batchfit.gpu-compare/1" and document["device"] == "cpu"
    assert {"machine", "versions", "deadline_s", "cases", "skipped_models", "goal", "total_wall_s"} <= document.keys()
    assert document["deadline_s"] == 20
    (case,) = document["cases"]
    assert case["model"] == "cnn" and case["cap_bytes"] == 13_200_000
    finders = [(r["finder"], r["setting"].split(",")[0]) for r in case["rows"]]
    assert [f for f, _ in finders] == ["batchfit", "batchfit", "Lightning", "Accelerate"]
    for row in case["rows"]:
        assert {"answer", "trials", "wall_s", "verdict", "fresh_at", "fresh_above", "x_lightning_wall"} <= row.keys()
        assert row["skipped"] or row["answer"] is not None or row["note"], row
    whole = case["rows"][0]
    assert whole["skipped"] is None and whole["answer"] >= 1  # the first step always starts
    assert {"safe_batch", "best_throughput_batch", "trial_kinds", "elapsed_s"} <= whole["extra"].keys()
    assert case["fresh"] or case["fresh_skipped"]
    assert case["profile"] or case["profile_skipped"]
    if case["fresh"]:
        assert whole["verdict"] in ("exact", "below", "over", "unknown")
    text = (tmp_path / written.name.replace(".json", ".txt")).read_text()
    assert "goal (issue 47 item 7)" in text and "cnn" in text
    assert text.strip() in done.stdout
