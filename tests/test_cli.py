"""`batchfit probe` and `batchfit devices`, run for real on CPU under small limits.

Each run is a real probe: the built-in examples and a target file written here, under caps that
keep boundaries at a few dozen samples so a run takes seconds. Nothing asserts times. What a
command prints, writes and returns is checked through `main()` in this process (the code path of
the console script, without a Python start per test); what only a process shows (its exit on a
signal, a terminal, a closed pipe, `python -m batchfit` itself) runs in a subprocess, marked
`slow`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from batchfit import Result
from batchfit.cli import main
from batchfit.testing import GateReport

REPO = Path(__file__).resolve().parents[1]
NO_GPU = not torch.cuda.is_available()

# One plain row per finished trial: "<index>  <batch>  <kind>  fits|OOM ...".
ROW = re.compile(r"^\s*\d+\s+\d+\s+(search|verify|gate|time)\s+(fits|OOM)", re.MULTILINE)

TARGETS = textwrap.dedent(
    '''
    import torch
    from torch import nn


    class Wide(nn.Module):
        """Much activation memory per sample, almost no compute: boundaries in a few ms."""

        def __init__(self, width=4096):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(width))
            self.head = nn.Linear(width, 1)

        def forward(self, x):
            for _ in range(4):
                x = torch.tanh(x * self.scale)
            return self.head(x)


    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(8, 8)

        def forward(self, x):
            raise RuntimeError("broken forward")


    def wide():
        torch.manual_seed(0)
        return Wide(), torch.randn(2, 4096)


    def wide_dict():
        model, sample = wide()
        return {"model": model, "sample": sample, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}


    def raises():
        raise ValueError("factory exploded")


    def wrong_shape():
        model, sample = wide()
        return model, sample, "extra"


    def not_a_model():
        return "model", torch.randn(2, 4)


    def needs_args(width):
        return wide()


    def no_tensor():
        return Wide(), "text"


    def unknown_key():
        model, sample = wide()
        return {"model": model, "sample": sample, "lr": 0.1}


    def broken_model():
        return Broken(), torch.randn(2, 8)


    class Pipe(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(8, 8)

        def forward(self, x):
            raise BrokenPipeError(32, "the model's data pipe broke")


    def pipe_model():
        return Pipe(), torch.randn(2, 8)


    def meta_model():
        return nn.Linear(8, 8, device="meta"), torch.randn(2, 8)


    def meta_sample():
        return nn.Linear(8, 8), torch.empty(2, 8, device="meta")


    class Tokens(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(64, 256)
            self.head = nn.Linear(256, 1)

        def forward(self, ids):
            return self.head(torch.tanh(self.embed(ids)))


    class Chatty(nn.Module):
        """Says what a Hugging Face model says in its forward: a Python warning and a library logger's."""

        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(64, 64)

        def forward(self, x):
            import logging
            import warnings

            warnings.warn("chatty: `past_key_values` as a tuple is deprecated", FutureWarning)
            logging.getLogger("transformers.models.chatty").warning("chatty: the attention mask was not given")
            return self.layer(x)


    def chatty():
        import logging
        import sys

        # As a library sets up its logger at import: its own handler on stderr, not propagated.
        logger = logging.getLogger("transformers.models.chatty")
        logger.handlers[:] = [logging.StreamHandler(sys.stderr)]
        logger.propagate = False
        return Chatty(), torch.randn(2, 64)


    def sample_and_make_batch():
        """One file for `batchfit probe` (the sample) and `batchfit frontier` (make_batch(b, s))."""
        torch.manual_seed(0)
        return {
            "model": Tokens(),
            "sample": torch.randint(0, 64, (2, 32)),
            "make_batch": lambda batch_size, seq_len: torch.randint(0, 64, (batch_size, seq_len)),
        }
    '''
)

# Targets that hold a probe where a test wants it, told where by environment variables:
# $BATCHFIT_TEST_STARTED is created when the target gets there (so the test waits for a file, not
# for a time); $BATCHFIT_TEST_RELEASE, once it exists, lets a held forward go on. Every hold ends
# by itself after two minutes, so a lost signal fails an assertion instead of hanging the suite.
HOLDING_TARGETS = textwrap.dedent(
    """
    import os
    import sys
    import time
    from pathlib import Path

    import torch
    from torch import nn


    def _hold(x=None):
        Path(os.environ["BATCHFIT_TEST_STARTED"]).touch()
        release = os.environ.get("BATCHFIT_TEST_RELEASE", "")
        deadline = time.monotonic() + 120
        while not (release and os.path.exists(release)) and time.monotonic() < deadline:
            if x is not None:
                x = x + 0  # a tensor operation: where the probe raises a deferred Ctrl-C
            time.sleep(0.01)
        return x


    class Held(nn.Module):
        def __init__(self, operations=True):
            super().__init__()
            self.layer = nn.Linear(8, 8)
            self.operations = operations

        def forward(self, x):
            if self.operations:
                x = _hold(x)
            else:
                _hold()  # stuck in Python: no tensor operation, so no safe point, until released
            return self.layer(x)


    class Exits(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(8, 8)

        def forward(self, x):
            sys.exit(4)


    def held():
        return Held(), torch.randn(2, 8)


    def stuck():
        return Held(operations=False), torch.randn(2, 8)


    def exits_in_forward():
        return Exits(), torch.randn(2, 8)


    def exits_in_factory():
        sys.exit()
    """
)


def cli_env(extra_env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a CLI child: the repository importable, one intra-op thread (on a
    2-core machine that runs other work, OpenMP threads waiting on each other make tiny steps
    orders of magnitude slower; the results do not depend on it), colours left to the test."""
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "NO_COLOR")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra_env or {})
    return env


def run_cli(*args: str, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m batchfit ARGS`` from the repository, installed or not."""
    return subprocess.run(
        [sys.executable, "-m", "batchfit", *args],
        capture_output=True,
        text=True,
        env=cli_env(extra_env),
        timeout=300,
        check=False,
    )


def start_cli(*args: str, extra_env: dict[str, str] | None = None, **popen: Any) -> subprocess.Popen[str]:
    """``python -m batchfit ARGS`` started, not waited for: stdout and stderr piped unless given.

    SIGINT is reset to its default in the child before Python starts, as a terminal's shell
    leaves it: a test runner started as a background job ignores SIGINT, children inherit that,
    and Python then installs no Ctrl-C handler.
    """
    options: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **popen}
    return subprocess.Popen(
        [sys.executable, "-m", "batchfit", *args],
        env=cli_env(extra_env),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        **options,
    )


def wait_for(path: Path, proc: subprocess.Popen[str]) -> None:
    """Until the target has created ``path`` (bounded, so a broken run fails rather than hangs)."""
    deadline = time.monotonic() + 120
    while not path.exists():
        assert proc.poll() is None, f"the CLI exited {proc.returncode} before {path.name} appeared"
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.02)


def finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    """Wait for the CLI (bounded); its exit code, stdout and stderr."""
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the CLI did not exit; stderr: {err}")
    return proc.returncode, out or "", err or ""


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("targets") / "targets.py"
    path.write_text(TARGETS)
    return path


@pytest.fixture(scope="module")
def holding(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("holding") / "holding.py"
    path.write_text(HOLDING_TARGETS)
    return path


@pytest.fixture
def in_process(monkeypatch: pytest.MonkeyPatch) -> Any:
    """For a command run through `main()` here, what `cli_env` gives a child: one intra-op thread
    (tiny steps on a busy machine; the results do not depend on it), colours left to the test."""
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.delenv("NO_COLOR", raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run_main(args: list[str]) -> int:
    """`main(args)`'s exit code, argparse's own usage errors (a `SystemExit`) included."""
    try:
        return main(args)
    except SystemExit as exit_:
        assert isinstance(exit_.code, int)
        return exit_.code


@pytest.fixture
def markers(tmp_path: Path) -> tuple[Path, Path, dict[str, str]]:
    """(started, release) marker paths, and the environment that tells a holding target of them."""
    started, release = tmp_path / "started", tmp_path / "release"
    return started, release, {"BATCHFIT_TEST_STARTED": str(started), "BATCHFIT_TEST_RELEASE": str(release)}


@pytest.mark.usefixtures("in_process")
def test_probe_builtin_example_writes_json_that_round_trips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "result.json"
    code = main(
        ["probe", "batchfit.examples:gpt", "--device", "cpu", "--memory-limit", "24MiB", "--verify-steps", "2",
         "--json", str(out)]
    )  # fmt: skip
    stdout, stderr = capsys.readouterr()

    assert code == 0, stderr
    assert "\x1b" not in stdout and "\x1b" not in stderr
    result = Result.from_json(out.read_text())
    assert Result.from_json(result.to_json()) == result
    assert result.device.type == "cpu" and result.budget_bytes == 24 * 2**20
    assert result.boundary_reached and result.trial(result.max_batch).fits
    # One plain line per trial, as each finished, then the summary with the same answers.
    assert len(ROW.findall(stdout)) == len(result.trials)
    assert re.search(rf"^max batch\s+{result.max_batch}\b", stdout, re.MULTILINE)
    assert re.search(rf"^safe batch\s+{result.safe_batch}\b", stdout, re.MULTILINE)
    assert "weights" in stdout and "optimizer state" in stdout and "/sample" in stdout
    assert "running on CPU under a limit of 24.00 MiB" in stdout
    assert result.settings.strategy == "interpolate"


@pytest.mark.usefixtures("in_process")
def test_probe_strategy_option_reaches_find(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "result.json"
    code = main(
        ["probe", "batchfit.examples:gpt", "--device", "cpu", "--memory-limit", "24MiB", "--verify-steps", "0",
         "--strategy", "binary", "--json", str(out)]
    )  # fmt: skip

    assert code == 0, capsys.readouterr().err
    result = Result.from_json(out.read_text())
    assert result.settings.strategy == "binary"
    sizes = [t.batch_size for t in result.search_trials]
    assert sizes[:3] == [2, 4, 8]  # plain doubling
    assert run_main(["probe", "batchfit.examples:gpt", "--strategy", "guess"]) == 2


@pytest.mark.usefixtures("in_process")
@pytest.mark.parametrize("timed_steps", [0, 3])
def test_probe_timed_steps_option_reaches_find(
    tmp_path: Path, timed_steps: int, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "result.json"
    code = main(
        ["probe", "batchfit.examples:gpt", "--device", "cpu", "--memory-limit", "24MiB",
         "--timed-steps", str(timed_steps), "--json", str(out)]
    )  # fmt: skip
    assert code == 0, capsys.readouterr().err
    timed = [t for t in Result.from_json(out.read_text()).trials if t.kind == "time"]
    assert [t.steps for t in timed] == [1 + timed_steps] * len(timed)
    assert bool(timed) == bool(timed_steps)
    assert run_main(["probe", "batchfit.examples:gpt", "--timed-steps", "-1"]) == 2


@pytest.mark.skipif(not NO_GPU, reason="the CPU default applies only where there is no GPU")
@pytest.mark.usefixtures("in_process")
def test_probe_without_gpu_says_it_runs_on_cpu_under_the_cli_default(
    targets: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["probe", f"{targets}:wide", "--max-batch", "16", "--verify-steps", "0"])
    stdout, stderr = capsys.readouterr()

    assert code == 0, stderr
    assert "no GPU: running on CPU under a limit of 256.00 MiB" in stdout


@pytest.mark.usefixtures("in_process")
def test_json_to_stdout_with_quiet_keeps_stdout_pure_json(targets: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["probe", f"{targets}:wide_dict", "--device", "cpu", "--memory-limit", "4MiB", "--json", "-", "--quiet"]
    )
    stdout, stderr = capsys.readouterr()

    assert code == 0, stderr
    result = Result.from_json(stdout)
    assert 8 < result.max_batch < 64 and result.boundary_reached
    # The human output moved to stderr, and --quiet made it one line with the answer.
    assert stderr.splitlines() == [
        f"max_batch={result.max_batch} safe_batch={result.safe_batch} "
        f"best_throughput_batch={result.best_throughput_batch} budget=4.00 MiB"
    ]


@pytest.mark.usefixtures("in_process")
def test_gate_passes_and_fails_with_exit_codes_0_and_3(
    targets: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "gate.json"
    failed = main(
        ["probe", f"{targets}:wide", "--device", "cpu", "--memory-limit", "4MiB", "--require-batch", "512",
         "--json", str(out)]
    )  # fmt: skip
    failed_out, failed_err = capsys.readouterr()

    assert failed == 3, failed_err
    report = GateReport.from_json(out.read_text())
    assert GateReport.from_json(report.to_json()) == report
    assert not report.fits and report.trial.batch_size == 512 and report.trial.kind == "gate"
    assert report.search is not None and report.largest_fit == report.search.max_batch
    assert 8 < report.largest_fit < 512
    assert all(t.batch_size < 512 for t in report.search.trials)
    assert "FAIL: batch 512 does not fit" in failed_out
    assert re.search(rf"^largest fit\s+{report.largest_fit}$", failed_out, re.MULTILINE)

    # The largest batch the failed gate reported passes the same gate, in one trial.
    passed = main(
        ["probe", f"{targets}:wide", "--device", "cpu", "--memory-limit", "4MiB",
         "--require-batch", str(report.largest_fit), "--json", "-"]
    )  # fmt: skip
    passed_out, passed_err = capsys.readouterr()
    assert passed == 0, passed_err
    ok = GateReport.from_json(passed_out)
    assert ok.fits and ok.search is None and ok.largest_fit is None
    assert ok.trial.peak_bytes is not None and ok.trial.peak_bytes <= ok.budget_bytes
    assert f"PASS: batch {report.largest_fit} fits" in passed_err
    assert len(ROW.findall(passed_err)) == 1


def test_nothing_fits_exits_3_with_one_line(targets: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe", f"{targets}:wide", "--device", "cpu", "--memory-limit", "64KiB"]) == 3
    err = capsys.readouterr().err

    assert err.strip().count("\n") == 0
    assert re.search(r"batch size \d+ does not fit", err) and "64.00 KiB" in err


# (target, exit code, message), each through main() in this process (the console script's code
# path, without paying for a Python start each).
BAD_TARGETS = [
    ("nope:thing", 2, "cannot import 'nope': no module named 'nope'"),
    ("batchfit.examples:gtp", 2, "has no attribute 'gtp' (did you mean 'gpt'?)"),
    ("{targets}:wrong_shape", 2, "gave a tuple of length 3; expected (model, sample)"),
    ("{targets}:raises", 1, "raised ValueError: factory exploded"),
    ("{targets}:broken_model", 1, "RuntimeError: broken forward"),
    ("batchfit.examples", 2, "must look like 'package.module:factory'"),
    ("{targets}:not_a_model", 2, "expected a torch.nn.Module"),
    ("{targets}:needs_args", 2, "needs arguments (width)"),
    ("{targets}:unknown_key", 2, "unknown key(s) 'lr'"),
    ("{targets}:no_tensor", 2, "holds no tensor"),
    ("{missing}:wide", 2, "no such file"),
    # Rejected by find() before the first trial: the target's input, a usage error.
    ("{targets}:meta_model", 2, "on the meta device"),
    ("{targets}:meta_sample", 2, "on the meta device"),
    # The user's own BrokenPipeError is an error in the model, not a reader of stdout gone.
    ("{targets}:pipe_model", 1, "BrokenPipeError: [Errno 32] the model's data pipe broke"),
]


def _check_one_line(stderr: str, message: str) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("batchfit: error: ") and message in lines[0]
    assert "Traceback" not in stderr


@pytest.mark.usefixtures("in_process")
@pytest.mark.parametrize(("target", "code", "message"), BAD_TARGETS)
def test_bad_target_in_process(
    targets: Path, target: str, code: int, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = target.format(targets=targets, missing=targets.parent / "missing.py")

    assert main(["probe", spec, "--device", "cpu", "--memory-limit", "8MiB"]) == code
    captured = capsys.readouterr()
    _check_one_line(captured.err, message)


def test_traceback_flag_shows_the_users_frames(targets: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe", f"{targets}:raises", "--traceback"]) == 1
    err = capsys.readouterr().err

    assert "Traceback" in err and 'raise ValueError("factory exploded")' in err
    assert err.strip().splitlines()[-1] == f"batchfit: error: {targets}:raises raised ValueError: factory exploded"


def test_usage_error_exits_2() -> None:
    proc = run_cli("probe", "batchfit.examples:mlp", "--memory-limit", "lots")

    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    # argparse's usage, then the error with the prefix every batchfit error has (README).
    assert lines[0].startswith("usage: batchfit probe ")
    assert lines[-1].startswith("batchfit: error: argument --memory-limit: memory_limit 'lots' is not a size")


@pytest.mark.parametrize(
    "args",
    [
        ["probe"],
        ["probe", "batchfit.examples:mlp", "--headroom", "1.5"],
        ["probe", "batchfit.examples:mlp", "--max-batch", "0"],
        ["probe", "batchfit.examples:mlp", "--amp", "fp8"],
        ["probe", "batchfit.examples:mlp", "--require-batch", "8", "--max-batch", "16"],
        ["probe", "batchfit.examples:mlp", "--device", "nope", "--memory-limit", "8MiB"],
        ["probe", "batchfit.examples:mlp", "--json", "/no/such/folder/out.json"],
        ["devices", "--json", "/no/such/folder/out.json"],
    ],
)
def test_usage_errors_in_process(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(args)
    except SystemExit as exit_:  # argparse's own usage errors
        code = exit_.code
    assert code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.slow  # a real process: its signals, its terminal, its pipes
@pytest.mark.skipif(sys.platform == "win32", reason="needs a POSIX pseudo-terminal")
@pytest.mark.parametrize("no_color", [False, True])
def test_terminal_gets_the_live_view_and_no_color_drops_colours(targets: Path, no_color: bool) -> None:
    import pty

    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "NO_COLOR")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TERM="xterm-256color", COLUMNS="140")
    if no_color:
        env["NO_COLOR"] = "1"
    leader, follower = pty.openpty()
    args = [sys.executable, "-m", "batchfit", "probe", f"{targets}:wide", "--device", "cpu", "--memory-limit", "1MiB",
            "--max-batch", "4", "--verify-steps", "1"]  # fmt: skip
    proc = subprocess.Popen(args, stdin=follower, stdout=follower, stderr=follower, env=env)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 1 << 16)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert proc.wait(timeout=300) == 0
    screen = b"".join(chunks).decode("utf-8", "replace")

    assert "\x1b[" in screen  # a live view, redrawn in place
    assert "max batch" in screen and "█" in screen
    colour = re.compile(r"\x1b\[[0-9;]*(?<![0-9])(3[0-9]|9[0-7])(;[0-9;]*)?m")
    assert bool(colour.search(screen)) is not no_color


JSON_PATHS = {
    "a folder": ("", "it is a folder"),
    "a missing folder": ("missing/out.json", "does not exist"),
    "a path under a file": ("file.txt/out.json", "is not a folder"),
    "a read-only folder": ("locked/out.json", "is not writable"),
}


@pytest.mark.parametrize("case", JSON_PATHS)
def test_unwritable_json_path_fails_before_the_target_is_loaded(
    tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    relative, message = JSON_PATHS[case]
    (tmp_path / "file.txt").write_text("")
    if case == "a read-only folder":
        if os.geteuid() == 0:
            pytest.skip("root may write into a read-only folder")
        (tmp_path / "locked").mkdir(mode=0o500)
    loaded = tmp_path / "loaded"
    target = tmp_path / "marked.py"
    target.write_text(f"from pathlib import Path\nPath({str(loaded)!r}).touch()\nfrom batchfit.examples import mlp\n")
    out = str(tmp_path / relative) if relative else str(tmp_path)

    code = main(["probe", f"{target}:mlp", "--device", "cpu", "--max-batch", "4", "--verify-steps", "0", "--json", out])

    assert code == 2
    err = capsys.readouterr().err
    _check_one_line(err, f"cannot write --json {out!r}: ")
    assert message in err
    assert not loaded.exists()  # refused before the target ran, not after a whole probe


@pytest.mark.slow  # a real process: its signals, its terminal, its pipes
@pytest.mark.skipif(sys.platform == "win32", reason="POSIX pipes and signals")
def test_stdout_closed_by_its_reader_ends_quietly(holding: Path, markers: tuple[Path, Path, dict[str, str]]) -> None:
    """`batchfit probe ... | head -1`: the reader takes one line and leaves; the probe stops at its
    next line, with no traceback, exit 141 (128 + SIGPIPE)."""
    started, release, env = markers
    proc = start_cli(
        "probe", f"{holding}:held", "--device", "cpu", "--max-batch", "8", "--verify-steps", "0", extra_env=env
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()
    proc.stdout.close()  # what head does after its line
    release.touch()  # only now may the first trial finish and the CLI write its next line
    code, _, err = finish(proc)

    assert first.startswith("batchfit ") and "probing" in first
    assert code == 141, err
    assert err == ""  # nothing: no "Traceback", no "BrokenPipeError", no "Exception ignored"


@pytest.mark.slow  # a real process: its signals, its terminal, its pipes
@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_ctrl_c_while_the_target_loads_says_only_interrupted(
    tmp_path: Path, markers: tuple[Path, Path, dict[str, str]]
) -> None:
    started, _, env = markers
    target = tmp_path / "slow_import.py"
    target.write_text(
        "import os, time\nfrom pathlib import Path\n\nPath(os.environ['BATCHFIT_TEST_STARTED']).touch()\n"
        "time.sleep(120)\n\ndef build():\n    raise AssertionError('never reached')\n"
    )
    proc = start_cli("probe", f"{target}:build", "--device", "cpu", extra_env=env)
    wait_for(started, proc)  # inside the target's import
    proc.send_signal(signal.SIGINT)
    code, _, err = finish(proc)

    assert code == 130
    assert err.strip() == "batchfit: error: interrupted"  # no probe ran: nothing was restored


@pytest.mark.slow  # a real process: its signals, its terminal, its pipes
@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize(
    ("signum", "code", "message"),
    [
        (signal.SIGINT, 130, "interrupted (the model and optimizer were restored)"),
        (signal.SIGTERM, 143, "terminated by SIGTERM (the model and optimizer were restored)"),
    ],
    ids=["SIGINT", "SIGTERM"],
)
def test_signal_during_a_probe_unwinds_and_restores(
    holding: Path, markers: tuple[Path, Path, dict[str, str]], signum: int, code: int, message: str
) -> None:
    """Ctrl-C and SIGTERM in the middle of a trial end the same way: the probe unwinds (the
    model restored, the view stopped: see the terminal test for the cursor), one line, 128 + N."""
    started, _, env = markers
    proc = start_cli(
        "probe", f"{holding}:held", "--device", "cpu", "--max-batch", "8", "--verify-steps", "0", extra_env=env
    )
    wait_for(started, proc)  # inside the first trial's forward
    proc.send_signal(signum)
    returned, out, err = finish(proc)

    assert returned == code, err
    _check_one_line(err, message)
    assert "max batch" not in out  # stopped, not finished


@pytest.mark.slow  # a real process: its signals, its terminal, its pipes
@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_second_sigterm_stops_a_probe_stuck_in_the_users_code(
    holding: Path, markers: tuple[Path, Path, dict[str, str]]
) -> None:
    """A forward stuck in Python with no tensor operation never reaches the probe's safe point,
    where a SIGTERM (like a Ctrl-C) is raised; a second SIGTERM stops it at once, and says that
    the restore may have been cut short."""
    started, _, env = markers
    proc = start_cli(
        "probe", f"{holding}:stuck", "--device", "cpu", "--max-batch", "8", "--verify-steps", "0", extra_env=env
    )
    wait_for(started, proc)
    for _ in range(120):  # again until it ends: two signals sent at once may arrive as one
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=0.5)
            break
        except subprocess.TimeoutExpired:
            pass
    code, _, err = finish(proc)

    assert code == 143, err
    _check_one_line(err, "terminated by a second SIGTERM, at once: the model and optimizer may not have been restored")


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("{holding}:exits_in_forward", "the target called sys.exit(4) during a search trial at batch size 2"),
        ("{holding}:exits_in_factory", "the target called sys.exit() in {holding}:exits_in_factory"),
        ("{exits_file}:build", "the target called sys.exit(3) while running {exits_file_repr}"),
        ("exits_at_import:build", "the target called sys.exit('no arguments given') while importing 'exits_at_import'"),
    ],
    ids=["forward", "factory", "file", "module"],
)
@pytest.mark.usefixtures("in_process")
def test_sys_exit_in_the_target_is_an_error_in_the_target(
    holding: Path,
    tmp_path: Path,
    target: str,
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A target's sys.exit(n) (a forgotten ``if __name__ == "__main__"``, argparse at import) is
    not batchfit's answer: exit 1 and one line naming where, never exit n in silence."""
    exits_file = tmp_path / "exits_file.py"
    exits_file.write_text("import sys\nsys.exit(3)\n")
    (tmp_path / "exits_at_import.py").write_text("import sys\nsys.exit('no arguments given')\n")
    names = {"holding": holding, "exits_file": exits_file, "exits_file_repr": repr(str(exits_file))}
    monkeypatch.syspath_prepend(str(tmp_path))

    code = main(["probe", target.format(**names), "--device", "cpu", "--max-batch", "8", "--verify-steps", "0"])

    err = capsys.readouterr().err
    assert code == 1, err
    _check_one_line(err, message.format(**names))


@pytest.mark.slow  # a real process: its signals, its terminal, its pipes
@pytest.mark.skipif(sys.platform == "win32", reason="needs a POSIX pseudo-terminal")
def test_sigterm_in_a_terminal_gives_the_cursor_back(holding: Path, markers: tuple[Path, Path, dict[str, str]]) -> None:
    """The live view hides the cursor while it runs; SIGTERM unwinds through the same
    ``view.stop()`` as Ctrl-C, which shows it again."""
    import pty

    started, _, env = markers
    env.update(TERM="xterm-256color", COLUMNS="140")
    leader, follower = pty.openpty()
    proc = start_cli(
        "probe", f"{holding}:held", "--device", "cpu", "--max-batch", "8", "--verify-steps", "0",
        extra_env=env, stdin=follower, stdout=follower, stderr=follower,
    )  # fmt: skip
    os.close(follower)
    chunks: list[bytes] = []

    def read() -> None:  # drained all along, so the child never blocks on a full terminal
        while True:
            try:
                chunk = os.read(leader, 1 << 16)
            except OSError:  # the child closed the terminal
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        wait_for(started, proc)
        proc.send_signal(signal.SIGTERM)
        code, _, _ = finish(proc)
        reader.join(timeout=60)
    finally:
        os.close(leader)
    screen = b"".join(chunks).decode("utf-8", "replace")

    assert code == 143, screen
    hidden, shown = screen.rfind("\x1b[?25l"), screen.rfind("\x1b[?25h")
    assert hidden != -1  # the live view ran, with the cursor hidden
    assert shown > hidden  # and gave it back
    assert "batchfit: error: terminated by SIGTERM" in screen


def test_devices_exits_0() -> None:
    proc = run_cli("devices", "--json", "-")

    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    if report["unavailable"]:
        assert report["gpus"] == []
        assert proc.stderr.strip() == report["unavailable"]  # one line
    else:
        assert report["gpus"] and "GPU 0:" in proc.stderr
    if NO_GPU and not report["gpus"]:
        assert "no NVIDIA GPU" in report["unavailable"] or "cannot list GPUs" in report["unavailable"]


@pytest.mark.slow  # a real `python -m batchfit` process
@pytest.mark.cuda
def test_probe_on_cuda_with_a_limit(tmp_path: Path) -> None:
    out = tmp_path / "cuda.json"
    proc = run_cli("probe", "batchfit.examples:gpt", "--memory-limit", "1GiB", "--json", str(out))

    assert proc.returncode == 0, proc.stderr
    result = Result.from_json(out.read_text())
    assert result.device.type == "cuda" and result.boundary_reached
    assert result.budget_bytes == 2**30


@pytest.mark.slow
def test_one_target_file_serves_probe_estimate_and_frontier(
    targets: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A mapping with both a sample and make_batch: the probe and the estimate size on the sample (and
    # say make_batch is not used), the frontier and an estimated frontier build with make_batch.
    spec, out = f"{targets}:sample_and_make_batch", tmp_path / "result.json"
    small = ["--device", "cpu", "--memory-limit", "1MiB", "--max-batch", "16"]
    assert main(["probe", spec, *small, "--verify-steps", "0", "--timed-steps", "0", "--json", str(out)]) == 0
    said = capsys.readouterr().out
    assert "make_batch is not used: batchfit probe sizes on its sample" in said
    result = Result.from_json(out.read_text())
    assert result.trials[0].batch_size == 2 and result.max_batch >= 2
    assert main(["estimate", spec, "--memory-limit", "1MiB", "--device", "cpu", "--max-batch", "16"]) == 0
    assert "make_batch is not used" in capsys.readouterr().out
    lengths = ["--seq-lens", "16,32", "--no-longest"]
    assert main(["frontier", spec, *small, *lengths, "--verify-steps", "0", "-q"]) == 0
    assert main(["estimate", spec, "--memory-limit", "1MiB", "--device", "cpu", *lengths]) == 0
    assert "not used" not in capsys.readouterr().out  # the lengths' commands use make_batch, as asked


def test_what_libraries_say_during_the_trials_comes_once_after_the_table(
    targets: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # With --json - the table and the summary go to stderr too: what the model's libraries said must
    # not split the table's rows (once per trial), but come once, after everything else.
    import logging

    args = ["--device", "cpu", "--memory-limit", "1MiB", "--max-batch", "16", "--timed-steps", "0", "--json", "-"]
    try:
        code = main(["probe", f"{targets}:chatty", *args])
    finally:
        logging.getLogger("transformers.models.chatty").handlers.clear()
    out, err = capsys.readouterr()
    assert code == 0, err
    assert Result.from_json(out).max_batch >= 2
    lines = err.splitlines()
    said = [i for i, line in enumerate(lines) if "chatty: " in line]
    assert len(said) == 2, err  # each once
    assert any("FutureWarning" in lines[i] and "`past_key_values` as a tuple" in lines[i] for i in said)
    assert any("transformers.models.chatty" in lines[i] and "attention mask" in lines[i] for i in said)
    last_row = max(i for i, line in enumerate(lines) if ROW.match(line))
    summary = next(i for i, line in enumerate(lines) if line.startswith("max batch "))
    assert min(said) > summary > last_row  # after the table and the summary


def test_an_estimates_budget_line_names_the_limit_as_the_probes_does(capsys: pytest.CaptureFixture[str]) -> None:
    """``--memory-limit`` is the budget's source in an estimate too, not a bare "(memory)" (issue 32)."""
    args = ["estimate", "batchfit.examples:mlp", "--memory-limit", "16MiB", "--device", "cpu", "--max-batch", "64"]
    assert main(args) == 0
    assert re.search(r"^budget\s+16\.00 MiB \(memory_limit\)", capsys.readouterr().out, re.M)
