"""The GPU proof's judging and scheduling (``benchmarks/gpu.py``), on CPU: what it reads a GPU run by.

A GPU is lent for minutes; a proof that misreads a healthy run wastes them. So how it counts the
CUDA tests' skips (only tests marked ``cuda``, only for a reason it lists), how wide it lets the
estimate be (one batch either side of ``find()``'s max at least), the rule that judges a fresh
process (on what the H200 recorded), which files pytest collects, and how the children share the
GPU (lanes: never more than was free; the sections that run alone with nothing beside them) are
checked here, from a real pytest run's JUnit XML where one can be made on CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu  # noqa: E402
import proof_checks as pc  # noqa: E402  (benchmarks/ is no package)
import proof_children as children  # noqa: E402

from batchfit.testing.pytest_plugin import CUDA_PROPERTY  # noqa: E402


def test_the_proof_reads_the_property_the_plugin_writes() -> None:
    assert pc.CUDA_PROPERTY == CUDA_PROPERTY


@pytest.mark.slow  # a real pytest process: 2-4 s
def test_a_real_junit_report_counts_skips_of_cuda_tests_only(tmp_path: Path) -> None:
    """A module that skips itself at collection (ray missing) is no CUDA test; a CUDA test that
    skips for a reason not listed is (here: no CUDA device, as on this machine)."""
    (tmp_path / "test_needs_ray.py").write_text(
        "import pytest\npytest.importorskip('batchfit_no_such_module')\n\ndef test_x():\n    pass\n"
    )
    (tmp_path / "test_gpu.py").write_text(
        textwrap.dedent(
            """
            import pytest

            @pytest.mark.cuda
            def test_on_the_gpu():
                pass

            def test_plain():
                pass

            def test_broken():
                assert False
            """
        )
    )
    xml = tmp_path / "report.xml"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "batchfit.testing.pytest_plugin", "-p", "no:cacheprovider"]
        + ["-q", f"--junitxml={xml}", "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=tmp_path,
        env={**env, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert xml.exists(), done.stdout + done.stderr
    cases = pc.read_junit(xml)
    assert list(cases.skipped) == ["test_gpu::test_on_the_gpu"]  # no CUDA here, and that is no listed reason
    assert cases.skipped["test_gpu::test_on_the_gpu"].startswith("no CUDA device")
    assert len(cases.other_skips) == 1 and "batchfit_no_such_module" in next(iter(cases.other_skips.values()))
    assert cases.failed == ["test_gpu::test_broken"]
    assert cases.ran == [] and cases.allowed_skips == {}  # test_plain ran, but it is no CUDA test


def test_a_cuda_test_skipped_for_a_listed_reason_is_allowed(tmp_path: Path) -> None:
    """As pytest writes a CUDA test that skipped itself on a one-GPU box (tests/test_cuda.py)."""
    xml = tmp_path / "report.xml"
    xml.write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="2" skipped="1">'
        '<testcase classname="tests.test_cuda" name="test_a_probe_on_cuda_1"><properties>'
        '<property name="batchfit-marker" value="cuda" /></properties>'
        '<skipped type="pytest.skip" message="needs two visible CUDA devices (cuda:1)">skip</skipped></testcase>'
        '<testcase classname="tests.test_cuda" name="test_ran"><properties>'
        '<property name="batchfit-marker" value="cuda" /></properties></testcase>'
        "</testsuite></testsuites>"
    )
    cases = pc.read_junit(xml)
    assert list(cases.allowed_skips) == ["tests.test_cuda::test_a_probe_on_cuda_1"]
    assert cases.skipped == {} and cases.failed == [] and cases.ran == ["tests.test_cuda::test_ran"]


@pytest.mark.parametrize(
    ("estimated", "found", "passes"),
    [
        (19, 18, True),  # one batch above: the band alone (x1.056) failed it
        (17, 18, True),
        (20, 18, False),
        (15, 18, False),
        (2, 1, True),
        (3, 1, False),
        (105, 100, True),
        (106, 100, False),
        (85, 100, True),
        (84, 100, False),
    ],
)
def test_the_estimate_passes_within_the_band_or_one_batch(estimated: int, found: int, passes: bool) -> None:
    assert pc.estimate_within_band(estimated, found) is passes


@pytest.mark.parametrize(
    ("tail", "finished"),
    [
        # the third H200 run: every test passed, then the slice's end came before pytest exited
        ("....s....\n31 passed, 3 skipped, 1617 deselected in 147.01s (0:02:27)\n\n[timed out", True),
        # the same run's part 2: stopped mid-run, pytest still prints the count of what ran
        ("!!!! KeyboardInterrupt !!!!\n2 failed, 2 skipped, 1643 deselected, 15 warnings in 149.96s\n", False),
        ("........\n[timed out after 150 s]", False),
    ],
)
def test_a_pytest_run_that_printed_its_closing_count_is_not_read_as_stopped(tail: str, finished: bool) -> None:
    assert pc.pytest_finished(tail) is finished


# The rule of "fits" on what the H200 recorded (benchmarks/results/2026-11-26-nvidia-h200-run2, -run3) --------
GiB = 2**30


def _steps(retries: list[int], allocated: int = 20 * GiB, reserved: int = 23 * GiB) -> list[dict[str, Any]]:
    return [
        {"step": i, "retries": r, "max_allocated_bytes": allocated, "max_reserved_bytes": reserved}
        for i, r in enumerate(retries, 1)
    ]


def test_a_native_step_that_flushed_the_cache_at_the_cap_does_not_fit() -> None:
    """Run 2's gate: 62 trained from scratch, but only after 4 allocator retries (its reserved peak
    exactly the 8 GiB cap): under the native allocator that is no fit; under expandable segments
    the retries are reported and it fits."""
    facts = {"allocator": "native", "steps_wanted": 10, "steps": 10, "retries_before": 0}
    facts["per_step"] = _steps([4] * 10, 7688397824, 8 * GiB)
    verdict = children.judge_fresh(facts)
    assert verdict["fits"] is False and verdict["retries"] == 4 and "flushing the cache" in verdict["why"]
    assert "step 1" in verdict["why"]
    expandable = children.judge_fresh({**facts, "allocator": "expandable"})
    assert expandable["fits"] is True and "4 allocator retries (not judged)" in expandable["why"]


def test_retries_before_the_first_step_are_not_the_steps() -> None:
    facts = {"allocator": "native", "steps_wanted": 10, "steps": 10, "retries_before": 2}
    facts["per_step"] = _steps([2] * 10)
    assert children.judge_fresh(facts)["fits"] is True
    facts["per_step"] = _steps([2] * 6 + [3] * 4)
    verdict = children.judge_fresh(facts)
    assert verdict["fits"] is False and verdict["retries"] == 1 and "(step 7)" in verdict["why"]


def test_an_out_of_memory_does_not_fit_and_says_where() -> None:
    """Run 2's fresh 22 on GPT-2 (native): "Tried to allocate 4.21 GiB" with 5.46 GiB reserved but
    unallocated, 118 GiB free on the device: the cap, not the device."""
    message = "OutOfMemoryError: CUDA out of memory. Tried to allocate 4.21 GiB. GPU 0 has a total capacity of ..."
    facts = {"allocator": "native", "steps_wanted": 10, "steps": 1, "retries_before": 0, "per_step": _steps([0])}
    facts.update(oom={"step": 2, "phase": "backward", "message": message}, device_free_bytes=118 * GiB)
    verdict = children.judge_fresh(facts)
    assert verdict["fits"] is False and not verdict["void"]
    assert verdict["why"].startswith("OOM in the backward of step 2: OutOfMemoryError")
    assert (
        pc.fresh_text({"ok": True, **facts, **verdict}) == "OOM in the backward of step 2 (Tried to allocate 4.21 GiB)"
    )
    full = children.judge_fresh({**facts, "device_free_bytes": GiB // 2})  # the lanes let the device run full
    assert full["fits"] is False and full["void"] and "VOID" in full["why"]
    assert "VOID" in pc.fresh_text({"ok": True, **facts, **full})


def test_cuda_malloc_async_fits_without_an_out_of_memory_and_reports_its_pool() -> None:
    """Run 3's async 27: trained, its pool reserving 24.22 GiB for 23.30 GiB allocated under 24 GiB."""
    facts = {"allocator": "async", "steps_wanted": 10, "steps": 10, "retries_before": 0}
    facts.update(per_step=_steps([0] * 10), max_allocated_bytes=25015336344, max_reserved_bytes=26004684800)
    verdict = children.judge_fresh(facts)
    assert verdict["fits"] is True and verdict["pool_overhead_bytes"] == 26004684800 - 25015336344
    assert "pool overhead 0.92 GiB" in verdict["why"]


def test_fewer_steps_than_asked_is_no_fit_and_the_cpu_trial_is_judged_by_its_oom() -> None:
    assert (
        children.judge_fresh({"allocator": "native", "steps_wanted": 10, "steps": 3, "per_step": []})["fits"] is False
    )
    cpu = {"allocator": "cpu", "steps_wanted": 10, "steps": 10, "oom": None}
    assert children.judge_fresh(cpu)["fits"] is True
    oom = children.judge_fresh({**cpu, "steps": 0, "oom": {"step": None, "phase": "forward", "message": "over"}})
    assert oom["fits"] is False and oom["why"] == "OOM in the forward: over" and oom["rule"] == children.RULES["cpu"]


@pytest.mark.parametrize(
    ("backend", "conf", "kind"),
    [
        ("native", None, "native"),
        ("native", "expandable_segments:True", "expandable"),
        ("native", "garbage_collection_threshold:0.8, expandable_segments:true", "expandable"),
        ("native", "expandable_segments:False", "native"),
        ("cudaMallocAsync", "backend:cudaMallocAsync", "async"),
    ],
)
def test_the_allocator_is_read_from_the_backend_and_the_configuration(
    backend: str, conf: str | None, kind: str
) -> None:
    assert children.allocator_kind(backend, conf) == kind


# The lanes ----------------------------------------------------------------------------------------------
def _plan(free: int, total: int) -> pc.Plan:
    return gpu.plan_for({"cuda": True, "gpu_total_bytes": total, "gpu_free_bytes": free, "cpu_count": 16})


@pytest.mark.parametrize(("free", "total", "gpt2_at_once"), [(139 * GiB, 140 * GiB, 4), (78 * GiB, 79 * GiB, 2)])
def test_the_lanes_hold_what_was_free(free: int, total: int, gpt2_at_once: int) -> None:
    """An H200 runs four 24 GiB GPT-2 children at once beside the compile tests and a gate child; an H100 two."""
    plan = _plan(free, total)
    assert plan.capacity == free - pc.POOL_MARGIN_BYTES
    assert plan.cost(24 * GiB) == 26 * GiB and plan.cost(24 * GiB, "cudaMallocAsync") == 27 * GiB + GiB // 2
    beside = plan.compile_cost + plan.cost(plan.gate.limit_bytes)
    assert pc.at_once(plan.capacity, plan.cost(plan.main.limit_bytes), beside) == gpt2_at_once
    assert f"{gpt2_at_once} of gpt2_small at once" in gpu.lanes_line(plan, {"gpu_free_bytes": free})


def test_a_request_starts_when_it_fits_beside_those_running() -> None:
    lanes = pc.Lanes(100)
    lanes.queue = {1: 60, 2: 50, 3: 30}
    assert lanes.next_admitted() == 1  # nothing runs: the earliest
    lanes.held, lanes.queue = {1: 60}, {2: 50, 3: 30}
    assert lanes.next_admitted() == 3  # 50 does not fit beside 60; 30 does
    lanes.held, lanes.queue = {1: 60, 3: 30}, {2: 50}
    assert lanes.next_admitted() is None
    lanes.held, lanes.queue = {}, {4: 500}
    assert lanes.next_admitted() == 4  # larger than all: it runs when nothing else does
    lanes.alone_owner, lanes.queue = 7, {5: 1}
    assert lanes.next_admitted() is None
    lanes.alone_owner, lanes.held, lanes.queue, lanes.first = None, {1: 60}, {2: 30, 3: 30}, {3}
    assert lanes.next_admitted() == 3  # the compile tests, the longest process, before the rest


def test_children_never_hold_more_than_the_capacity_and_alone_sections_run_with_nothing_beside() -> None:
    """Three checks' threads as gpu.py runs them: children of several sizes in lanes, two sections
    that wait to run alone (the gate's --reserve auto, the CUDA tests) after all the shared work."""
    lanes, lock = pc.Lanes(100, workers=3), threading.Lock()
    running: list[int] = []
    seen: dict[str, Any] = {"most": 0, "alone": [], "shared_done": 0}
    until = time.monotonic() + 20

    def child(cost: int) -> None:
        with lanes.lane(cost, until):
            with lock:
                running.append(cost)
                seen["most"] = max(seen["most"], sum(running))
            time.sleep(0.02)
            with lock:
                running.remove(cost)

    def alone(label: str, order: int) -> None:
        with lanes.alone(order, until):
            child(10)  # its own children run inside, with nothing beside them
            with lock:
                seen["alone"].append((label, list(running), seen["shared_done"]))

    def check(costs: list[int], section: tuple[str, int] | None) -> None:
        try:
            pc.parallel({i: (lambda c=c: child(c)) for i, c in enumerate(costs)})
            with lock:
                seen["shared_done"] += 1
            if section:
                alone(*section)
        finally:
            lanes.done()

    jobs = [([60, 50, 30, 30], ("gate", 1)), ([26, 26, 26, 26, 26], None), ([], ("cuda tests", 2))]
    threads = [threading.Thread(target=check, args=job) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert seen["most"] <= 100
    assert seen["alone"] == [("gate", [], 3), ("cuda tests", [], 3)]  # in order, after all shared work
    assert lanes.workers == 0 and not lanes.held and lanes.alone_owner is None


def test_no_lane_before_the_hard_end_is_a_cut_not_a_failure() -> None:
    lanes = pc.Lanes(10)
    lanes.held = {0: 10}
    with pytest.raises(pc.Cut), lanes.lane(5, time.monotonic() + 0.05):
        pass
    assert lanes.queue == {}


# What pytest runs ---------------------------------------------------------------------------------------
def test_pytest_collects_the_files_that_hold_cuda_tests_only() -> None:
    files = pc.cuda_test_files()
    assert {"tests/test_cuda.py", "tests/test_cuda_allocator.py", "tests/test_checkpointing.py"} <= set(files)
    assert "tests/test_gpu_proof.py" not in files  # it writes a cuda test in a string: no CUDA test of its own
    assert "tests/test_search.py" not in files
    assert pc.marks_cuda("import pytest\npytestmark = [pytest.mark.cuda, pytest.mark.slow]\n")
    assert pc.marks_cuda("import pytest\nclass TestX:\n    @pytest.mark.cuda\n    def test_y(self): pass\n")
    assert not pc.marks_cuda('CODE = """\n@pytest.mark.cuda\ndef test_z(): pass\n"""\n')


def test_the_deselected_tests_exist() -> None:
    """A renamed test would silently stop being deselected and run twice the cap checks' work."""
    for node in pc.DESELECTED:
        path, name = node.split("::")
        assert f"def {name}(" in (ROOT / path).read_text(), node


def test_two_junit_reports_are_sent_back_as_one(tmp_path: Path) -> None:
    case = (
        '<testcase classname="tests.test_cuda" name="{}"><properties><property name="batchfit-marker" value="cuda" />'
    )
    for name in ("a", "b"):
        (tmp_path / f"{name}.xml").write_text(
            f'<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="1">'
            f"{case.format(name)}</properties></testcase></testsuite></testsuites>"
        )
    pc.merge_junit([tmp_path / "a.xml", tmp_path / "b.xml"], tmp_path / "both.xml")
    assert pc.read_junit(tmp_path / "both.xml").ran == ["tests.test_cuda::a", "tests.test_cuda::b"]


def test_the_parts_of_the_old_proof_still_choose_their_checks() -> None:
    """``gpu_bisect.sh`` runs ``--part 1 --only "cap native"``; the whole proof runs every check once."""
    plan = _plan(139 * GiB, 140 * GiB)
    every = [name for name, _ in gpu.checks_of(plan, "all")]
    one, two = ([name for name, _ in gpu.checks_of(plan, part)] for part in "12")
    assert "cap native" in one and "throughput" in one and "cap async" in two and "compile tests" in two
    assert sorted(set(one) | set(two)) == sorted(every) and len(every) == len(set(every)) == 11
