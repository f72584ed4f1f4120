"""The command line's contract at its edges (issue 19): ``--rank-timeout``, ``--json`` targets
that cannot take the result, Ctrl-C at start-up, and ``COLUMNS`` for piped output.

Each probe is real and tiny (``batchfit.examples:mlp`` on CPU under a small limit); in-process
through ``main()`` where that shows the behaviour, in a subprocess where the process's own exit
(its code, its stderr, Python's start-up) is what is checked.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from batchfit import Result
from batchfit.cli import main

REPO = Path(__file__).resolve().parents[1]

#: A probe of a few seconds at most: the example MLP, a small limit, a few sizes, no verification.
FAST = ["--device", "cpu", "--memory-limit", "64MiB", "--max-batch", "8", "--verify-steps", "0"]


def run_cli(*args: str, pythonpath: Path | None = None, **popen: Any) -> subprocess.CompletedProcess[str]:
    """``python -m batchfit ARGS`` from the repository, installed or not, with one intra-op
    thread (tiny steps on a busy machine), SIGINT at its default as a terminal's shell leaves it."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "FORCE_COLOR", "NO_COLOR")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath or ""), str(REPO), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    env.update(popen.pop("env", {}))
    preexec = popen.pop("preexec_fn", None)

    def child() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if preexec is not None:
            preexec()

    return subprocess.run(
        [sys.executable, "-m", "batchfit", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
        preexec_fn=child,
        **popen,
    )


def error_line(err: str) -> str:
    """The one ``batchfit: error:`` line of stderr (argparse prints its usage before it)."""
    lines = [line for line in err.splitlines() if line.startswith("batchfit: error:")]
    assert len(lines) == 1, err
    return lines[0]


# a. --rank-timeout ------------------------------------------------------------------------------
def test_rank_timeout_reaches_the_probe(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import batchfit.probe

    seen: list[float] = []
    real = batchfit.probe.find_with

    def spy(model: Any, sample: Any, options: Any, **kwargs: Any) -> Any:
        seen.append(options.rank_timeout)
        return real(model, sample, options, **kwargs)

    monkeypatch.setattr(batchfit.probe, "find_with", spy)

    # --timed-steps 0: the flag is what is checked, not the timing after the search (seconds on a CPU).
    code = main(["probe", "batchfit.examples:mlp", *FAST, "--timed-steps", "0", "--rank-timeout", "12.5"])

    assert code == 0, capsys.readouterr().err
    assert seen == [12.5]


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_rank_timeout_must_be_a_positive_finite_number(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["probe", "batchfit.examples:mlp", *FAST, "--rank-timeout", value])

    assert exited.value.code == 2
    assert error_line(capsys.readouterr().err).startswith("batchfit: error: argument --rank-timeout: ")


# b. --json PATH ------------------------------------------------------------------------------------
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_json_to_a_full_device_saves_the_result_elsewhere(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["probe", "batchfit.examples:mlp", *FAST, "--json", "/dev/full"])

    line = error_line(capsys.readouterr().err)
    assert code == 2
    assert line.startswith("batchfit: error: cannot write --json '/dev/full': ")
    saved = re.search(r"the result was saved to (\S+\.json)$", line)
    assert saved, line
    path = Path(saved.group(1))
    try:
        result = Result.from_json(path.read_text())
        assert result.max_batch >= 1 and json.loads(path.read_text())
    finally:
        path.unlink()


def test_json_in_a_missing_folder_fails_before_probing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    loaded = tmp_path / "loaded"
    target = tmp_path / "marked.py"
    target.write_text(f"from pathlib import Path\nPath({str(loaded)!r}).touch()\nfrom batchfit.examples import mlp\n")
    out = str(tmp_path / "no-such-folder" / "x.json")

    code = main(["probe", f"{target}:mlp", *FAST, "--json", out])

    assert code == 2
    assert error_line(capsys.readouterr().err).startswith(f"batchfit: error: cannot write --json {out!r}: ")
    assert not loaded.exists()  # refused before the target was even imported


def test_json_file_is_written_whole_and_nothing_else(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    out.write_text("the previous result\n")

    assert main(["probe", "batchfit.examples:mlp", *FAST, "--json", str(out)]) == 0

    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]  # no temporary file left beside it
    assert Result.from_json(out.read_text()).max_batch >= 1


@pytest.mark.slow  # a real process, under a limit on the files it may write
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_FSIZE as Linux applies it")
def test_a_failed_json_write_leaves_the_previous_file_whole(tmp_path: Path) -> None:
    """A write that fails part-way (here: the process may not write files over 1 KiB, so the
    result's few KiB fail, as on a full disk) must not leave a truncated file where the last
    result was."""
    import resource

    out = tmp_path / "r.json"
    out.write_text("the previous result\n")

    def small_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG, the process lives
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))

    proc = run_cli("probe", "batchfit.examples:mlp", *FAST, "--json", str(out), preexec_fn=small_files)

    assert proc.returncode == 2, proc.stderr
    assert error_line(proc.stderr).startswith(f"batchfit: error: cannot write --json {str(out)!r}: ")
    assert out.read_text() == "the previous result\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


# c. Ctrl-C at start-up --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "source",
    ["raise KeyboardInterrupt\n", "def build():\n    raise KeyboardInterrupt\n"],
    ids=["at-import", "in-factory"],
)
def test_ctrl_c_while_the_target_loads_exits_130_without_a_traceback(
    tmp_path: Path, source: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # In this process: main() is what turns the KeyboardInterrupt into the line and the code (a
    # real SIGINT while a target loads: tests/test_cli.py, in a subprocess).
    (tmp_path / "interrupted_target.py").write_text(source + "\n\ndef build():\n    raise KeyboardInterrupt\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    try:
        code = main(["probe", "interrupted_target:build", *FAST])
    except KeyboardInterrupt:  # left to escape, it would stop the whole test run
        pytest.fail("the KeyboardInterrupt escaped main()")

    err = capsys.readouterr().err
    assert code == 130, err
    assert "Traceback" not in err
    assert err.strip() == "batchfit: error: interrupted"


@pytest.mark.slow  # a real `python -m batchfit`: Ctrl-C before main() runs
def test_ctrl_c_while_batchfit_itself_imports_exits_130_without_a_traceback(tmp_path: Path) -> None:
    """Ctrl-C before ``main()`` runs: while ``python -m batchfit`` imports the command line. A
    module the command line imports (argparse, first on the path here) stands for the one that
    was importing when the key was pressed."""
    (tmp_path / "argparse.py").write_text("raise KeyboardInterrupt\n")

    proc = run_cli("probe", "batchfit.examples:mlp", *FAST, pythonpath=tmp_path)

    assert proc.returncode == 130, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip() == "batchfit: error: interrupted"


def test_ctrl_c_before_the_command_runs_exits_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted() -> Any:
        raise KeyboardInterrupt

    # The module, not the function that batchfit.cli's surface names the same.
    monkeypatch.setattr(sys.modules["batchfit.cli.main"], "build_parser", interrupted)

    try:
        code = main(["probe", "batchfit.examples:mlp", *FAST])
    except KeyboardInterrupt:  # left to escape, it would stop the whole test run
        pytest.fail("the KeyboardInterrupt escaped main()")
    assert code == 130
    assert capsys.readouterr().err.strip() == "batchfit: error: interrupted"


# d. COLUMNS for piped output ----------------------------------------------------------------------
PLAN = ["--target-batch", "1000"]  # the plan line is the longest one


@pytest.mark.parametrize("columns", [60, 80])
def test_piped_output_keeps_within_columns(
    columns: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", str(columns))

    assert main(["probe", "batchfit.examples:mlp", *FAST, *PLAN]) == 0

    out = capsys.readouterr().out
    too_long = [line for line in out.splitlines() if len(line) > columns]
    assert not too_long, "\n".join(too_long)
    assert re.search(r"^max batch\s+8\b", out, re.MULTILINE)
    assert "[#" not in out  # the bar of the budget went; the share stays
    assert re.search(r"^plan\s+global batch 1000 ", out, re.MULTILINE)


def test_piped_output_without_columns_is_as_wide_as_its_cells(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)

    assert main(["probe", "batchfit.examples:mlp", *FAST, *PLAN]) == 0

    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if re.match(r"^\s+\d+\s+\d+\s+search\s+fits", line)]
    assert rows and all("[" in row and len(row) > 100 for row in rows)  # the bar is there, nothing wrapped
    assert len([line for line in lines if line.startswith("plan ")]) == 1
    assert max(map(len, lines)) > 200  # the plan line stays one line


# e. batchfit frontier: its options are batchfit.frontier's keywords ---------------------------------
FRONTIER_TARGET = """
import torch
from batchfit.examples import GPT


def build():
    torch.manual_seed(0)
    model = GPT(vocab_size=64, seq_len=128, d_model=32, n_layers=1, n_heads=2)

    def make_batch(batch_size, seq_len):
        ids = torch.randint(0, 64, (batch_size, seq_len), generator=torch.Generator().manual_seed(seq_len))
        return {"input_ids": ids, "labels": ids.clone()}

    return {"model": model, "make_batch": make_batch}
"""

#: ``batchfit frontier``'s options that say what to print or write, not how to probe.
FRONTIER_OUTPUT_OPTIONS = {"help", "target", "json", "plot", "quiet", "traceback"}


def test_every_frontier_option_is_a_keyword_of_frontier() -> None:
    import argparse

    import batchfit
    from batchfit.cli.parser import build_parser
    from batchfit.probe.options import parameters_of

    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    dests = {action.dest for action in commands.choices["frontier"]._actions} - FRONTIER_OUTPUT_OPTIONS
    keywords = set(parameters_of(batchfit.frontier))
    renamed = {"no_longest": "longest_at_batch_1"}
    assert {renamed.get(dest, dest) for dest in dests} <= keywords


def test_frontier_options_reach_frontier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    import batchfit.api

    (tmp_path / "lm.py").write_text(FRONTIER_TARGET)
    seen: dict[str, Any] = {}
    real = batchfit.api.frontier

    def spy(model: Any, make_batch: Any, **kwargs: Any) -> Any:
        seen.update(kwargs)
        return real(model, make_batch, **kwargs)

    monkeypatch.setattr(batchfit.api, "frontier", spy)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny steps on a busy machine
    try:
        code = main(
            ["frontier", f"{tmp_path / 'lm.py'}:build", "--seq-lens", "32,16", "--max-seq-len", "96"]
            + ["--device", "cpu", "--memory-limit", "4MiB", "--reserve", "1KiB", "--headroom", "0.2", "--mode", "train"]
            + ["--max-batch", "64", "--init-batch", "2", "--multiple-of", "2", "--steps-per-trial", "2"]
            + ["--verify-steps", "1", "--strategy", "binary", "--time-budget", "120", "--quiet"]
        )
    finally:
        torch.set_num_threads(threads)

    assert code == 0, capsys.readouterr().err
    callbacks = {"on_point", "callback", "on_trial_start", "on_start"}
    assert callbacks <= set(seen)
    assert seen.pop("amp", None) is None  # not given: left to Options' default, or passed as None
    assert {k: v for k, v in seen.items() if k not in callbacks} == {
        "seq_lens": (32, 16),
        "longest_at_batch_1": True,
        "max_seq_len": 96,
        "device": "cpu",
        "memory_limit": "4MiB",
        "reserve": "1KiB",
        "headroom": 0.2,
        "mode": "train",
        "max_batch": 64,
        "init_batch": 2,
        "multiple_of": 2,
        "steps_per_trial": 2,
        "verify_steps": 1,
        "strategy": "binary",
        "time_budget": 120.0,
    }
    line = capsys.readouterr().out.strip()
    assert line.startswith("seq_len:max/safe 16:") and "longest_at_batch_1=96" in line


def test_the_docs_give_finds_cpu_default_with_its_cap() -> None:
    # find()'s budget line on a CPU says 1.00 GiB where the docs said "half of the available memory":
    # the code takes half of what is available, at most 1 GiB; every page of ours that says the one says both.
    from batchfit.backends.cpu import DEFAULT_CPU_FRACTION, DEFAULT_CPU_LIMIT

    assert (DEFAULT_CPU_FRACTION, DEFAULT_CPU_LIMIT) == (0.5, 2**30)  # what the pages below say
    pages = ["README.md", "docs/reference/cli.md", "docs/reference/python-api.md", "docs/getting-started.md"]
    pages.append("batchfit/probe/keywords.py")  # memory_limit's one documentation, which the reference renders
    said = 0
    for page in pages:
        for paragraph in (REPO / page).read_text().split("\n\n"):
            flat = " ".join(paragraph.split())
            if re.search(r"half (of )?the (available|host)", flat):
                said += 1
                assert "at most 1 GiB" in flat, f"{page}: {flat}"
    assert said >= 2


def test_the_license_is_an_spdx_expression_the_build_backend_reads() -> None:
    # A TOML table (`license = {text = ...}`) makes setuptools warn on every install, and builds stop
    # taking it after 2027-02-18 (PEP 639); a string needs setuptools 77 or later to build.
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"
    requires = [r for r in project["build-system"]["requires"] if r.replace(" ", "").startswith("setuptools")]
    assert requires and re.fullmatch(r"setuptools>=(\d+)", requires[0].replace(" ", ""))
    assert int(requires[0].split(">=")[1]) >= 77
