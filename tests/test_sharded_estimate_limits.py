"""``estimate_sharded``'s limits (issue 48): the error names the function called, and a target that
hangs ends at ``timeout_s`` in batchfit's own error, with nothing it started left running."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from batchfit.errors import BatchfitError, EstimateTimeoutError
from batchfit.estimation.rank_estimate import ESTIMATE_TIMEOUT_S, estimate_sharded

ROOT = Path(__file__).resolve().parents[1]
GPT = f"{ROOT / 'benchmarks' / 'sharded_targets.py'}:gpt"
HANG = f"{ROOT / 'tests' / 'sharded_hang_target.py'}:build"


def test_no_memory_limit_names_estimate_sharded() -> None:
    with pytest.raises(TypeError, match=r"^estimate_sharded\(\) needs memory_limit="):
        estimate_sharded(GPT, 2, device="cpu")


@pytest.mark.parametrize("timeout_s", [0, -1.0, float("nan"), True, "60"])
def test_a_timeout_that_is_not_a_positive_number_is_refused_before_any_process(timeout_s: object) -> None:
    with pytest.raises(ValueError, match="timeout_s must be a positive number"):
        estimate_sharded(GPT, 2, memory_limit="32MiB", timeout_s=timeout_s)  # type: ignore[arg-type]


def test_the_default_limit_is_a_limit() -> None:
    import inspect

    assert inspect.signature(estimate_sharded).parameters["timeout_s"].default == ESTIMATE_TIMEOUT_S > 0


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed and not yet reaped by its parent, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_a_hanging_target_ends_at_the_limit_in_batchfits_error_with_nothing_left_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pids = tmp_path / "pids"
    monkeypatch.setenv("BATCHFIT_TEST_HANG_PIDS", str(pids))
    with pytest.raises(EstimateTimeoutError) as raised:
        estimate_sharded(HANG, 2, memory_limit="64MiB", timeout_s=30)
    error = raised.value
    assert isinstance(error, BatchfitError) and isinstance(error, TimeoutError)
    assert error.target == HANG and error.timeout_s == 30
    assert HANG in str(error) and "timeout_s=30 s" in str(error)
    assert pids.exists(), "the target never ran: the machine is too slow for this test's limit"
    started = [int(pid) for pid in pids.read_text().split()]
    for _ in range(50):  # the helper's parent died with it: init reaps it
        if not any(_alive(pid) for pid in started):
            break
        time.sleep(0.1)
    assert not [pid for pid in started if _alive(pid)], "a process the estimate started is still running"
    assert os.getpid() not in started
