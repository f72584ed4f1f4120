"""``batchfit fit TARGET --target-batch N`` (issue 48): `batchfit.fit` from the command line, with the
probe's flags for the same things, the table the Python API prints, ``--json`` and the probe's exit codes.

In-process through ``main()`` on a tiny GPT (two blocks) under a small CPU limit and a small
``--max-batch``: what is checked is the command, `batchfit.fit` itself is ``tests/test_checkpointing.py``'s.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchfit.cli import main
from batchfit.cli.parser import FIT_REFUSES, build_parser
from batchfit.probe.keywords import FindOptions, keywords_of

TARGET = """
from batchfit import examples

def build():
    return examples.gpt(vocab_size=64, seq_len=8, d_model=16, n_layers=2, n_heads=2)
"""

#: Small and quick: the tiny GPT under 24 MiB, sizes up to 8, no verification, the fewest timed steps.
FAST = ["--device", "cpu", "--memory-limit", "24MiB", "--max-batch", "8", "--verify-steps", "0", "--timed-steps", "0"]


@pytest.fixture
def target(tmp_path: Path) -> str:
    path = tmp_path / "tiny_gpt.py"
    path.write_text(TARGET)
    return f"{path}:build"


@pytest.mark.slow  # a few seconds: a search and the timed candidate
def test_fit_prints_the_policy_table_and_writes_its_json(
    target: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "fit.json"

    code = main(["fit", target, "--target-batch", "4", *FAST, "--json", str(out)])

    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "fitting" in printed.out and "which blocks to checkpoint" in printed.out  # the header
    assert "batchfit fit: target batch 4 per optimizer step" in printed.out  # str(fit), the Python API's table
    assert "max batch by blocks checkpointed" in printed.out and "recommended: none" in printed.out
    document = json.loads(out.read_text())
    assert document["schema"] == "batchfit.fit/1" and document["target_batch"] == 4
    assert document["policy"]["checkpointed"] == []  # batch 4 fits as the model is


@pytest.mark.slow  # about a second: a search and the timed candidate
def test_fit_quiet_prints_one_line(target: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fit", target, "--target-batch", "2", *FAST, "--max-batch", "2", "-q"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.splitlines() == [out]
    assert out.startswith("checkpointed=0/2 micro_batch=2 accumulation=1 target_batch=2 samples_per_s=")


def test_a_block_name_that_is_no_module_is_a_usage_error(target: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["fit", target, "--target-batch", "4", *FAST, "--checkpointing", "blocks.0,nope"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("batchfit: error: ValueError: checkpointing names 'nope', which is no module")


@pytest.mark.slow  # a few seconds: every policy's search
def test_no_policy_fitting_in_one_step_does_not_fit(target: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["fit", target, "--target-batch", "100000", *FAST, "--no-accumulate"])
    err = capsys.readouterr().err
    assert code == 3, err
    assert "batchfit: error: no policy fits target_batch 100000 in one step" in err


def test_fit_refuses_torchrun_before_loading(
    target: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    assert main(["fit", target, "--target-batch", "4", *FAST]) == 2
    assert "batchfit fit sizes one process" in capsys.readouterr().err


def test_fit_takes_the_probes_flags_for_what_fit_takes_and_no_others(capsys: pytest.CaptureFixture[str]) -> None:
    """One contract: a flag of `fit` is the probe's flag of the same option (same dest, same spelling), and
    every option of `find` has one on `fit` unless `fit` refuses it or the probe has none either."""
    commands = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    flags = {a.dest: a.option_strings for a in commands["fit"]._actions}
    probe = {a.dest: a.option_strings for a in commands["probe"]._actions}
    for name in keywords_of(FindOptions):
        if name in FIT_REFUSES:
            assert name not in flags, name
        elif name in probe:
            assert flags.get(name) == probe[name], name
    assert flags["target_batch"] == probe["target_batch"] and flags["json"] == probe["json"]
    with pytest.raises(SystemExit) as exited:
        main(["fit", "x.py:build", "--target-batch", "4", "--mode", "eval"])
    assert exited.value.code == 2
    assert "unrecognized arguments: --mode" in capsys.readouterr().err
