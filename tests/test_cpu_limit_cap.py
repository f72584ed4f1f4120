"""A CPU memory limit takes at most `SAFE_CPU_FRACTION` of the host memory available (issue 48): the
README promises it, the probe caps a larger one, and the command line says so in its header, before
the first trial, instead of "running on CPU under a limit of 24.00 GiB" on a host that cannot give it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from batchfit.backends.cpu import SAFE_CPU_FRACTION
from batchfit.backends.host import available_host_bytes
from batchfit.cli import main
from batchfit.cli.arguments import cpu_budget

REPO = Path(__file__).resolve().parents[1]


def test_a_cpu_limit_over_the_cap_is_said_capped_before_the_probe(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    available = available_host_bytes()
    assert available is not None
    out = tmp_path / "r.json"
    asked = 2 * available  # "24GiB" on a 23.5 GiB host, whatever this host has

    code = main(
        ["probe", "batchfit.examples:mlp", "--device", "cpu", "--memory-limit", str(asked), "--max-batch", "2",
         "--verify-steps", "0", "--timed-steps", "0", "--json", str(out)]
    )  # fmt: skip

    printed = capsys.readouterr()
    assert code == 0, printed.err
    header = printed.out.splitlines()[1]
    assert header.startswith("running on CPU under a limit of ") and "is capped: on the CPU" in header
    assert f"takes at most {SAFE_CPU_FRACTION:.0%} of the host memory available" in header
    budget = json.loads(out.read_text())["budget_bytes"]
    assert budget <= SAFE_CPU_FRACTION * 1.05 * available  # what the probe held: the cap, not the limit


def test_the_cap_applies_to_sizes_and_fractions_over_it_only() -> None:
    available = available_host_bytes()
    assert available is not None
    assert cpu_budget("64MiB") == (64 * 2**20, None)
    half, said = cpu_budget(0.5)
    assert said is None and half == pytest.approx(0.5 * available, rel=0.05)
    capped, said = cpu_budget(0.9)
    assert said is not None and f"at most {SAFE_CPU_FRACTION:.0%}" in said
    assert capped == pytest.approx(SAFE_CPU_FRACTION * available, rel=0.05)


def test_the_cli_reference_says_a_cpu_limit_is_capped() -> None:
    # The reference told users to "pass --memory-limit 24GiB to check a model against a GPU of that
    # size" with no word of the cap: every paragraph that says so now says the cap too.
    said = 0
    for paragraph in (REPO / "docs/reference/cli.md").read_text().split("\n\n"):
        flat = " ".join(paragraph.split())
        if re.search(r"--memory-limit 24GiB` to check a model against a GPU", flat):
            said += 1
            assert f"at most {SAFE_CPU_FRACTION:.0%} of the host memory available" in flat, flat
    assert said == 1
