"""`batchfit probe` and `batchfit devices`, run for real in a subprocess on CPU under small limits.

Each run is a real probe: the built-in examples and a target file written here, under caps that
keep boundaries at a few dozen samples so a run takes seconds. Nothing asserts times.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from batchfit import Result
from batchfit.cli import main
from batchfit.testing import GateReport

REPO = Path(__file__).resolve().parents[1]
NO_GPU = not torch.cuda.is_available()

# One plain row per finished trial: "<index>  <batch>  <kind>  fits|OOM ...".
ROW = re.compile(r"^\s*\d+\s+\d+\s+(search|verify|gate)\s+(fits|OOM)", re.MULTILINE)

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
    '''
)


def run_cli(*args: str, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m batchfit ARGS`` from the repository, installed or not.

    One intra-op thread: on a 2-core machine that runs other work, OpenMP threads waiting on
    each other make tiny steps orders of magnitude slower; the results do not depend on it.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "NO_COLOR")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra_env or {})
    return subprocess.run(
        [sys.executable, "-m", "batchfit", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("targets") / "targets.py"
    path.write_text(TARGETS)
    return path


def test_probe_builtin_example_writes_json_that_round_trips(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    proc = run_cli(
        "probe", "batchfit.examples:gpt", "--device", "cpu", "--memory-limit", "24MiB", "--verify-steps", "2",
        "--json", str(out),
    )  # fmt: skip

    assert proc.returncode == 0, proc.stderr
    assert "\x1b" not in proc.stdout and "\x1b" not in proc.stderr
    result = Result.from_json(out.read_text())
    assert Result.from_json(result.to_json()) == result
    assert result.device.type == "cpu" and result.budget_bytes == 24 * 2**20
    assert result.boundary_reached and result.trial(result.max_batch).fits
    # One plain line per trial, as each finished, then the summary with the same answers.
    assert len(ROW.findall(proc.stdout)) == len(result.trials)
    assert re.search(rf"^max batch\s+{result.max_batch}\b", proc.stdout, re.MULTILINE)
    assert re.search(rf"^safe batch\s+{result.safe_batch}\b", proc.stdout, re.MULTILINE)
    assert "weights" in proc.stdout and "optimizer state" in proc.stdout and "/sample" in proc.stdout
    assert "running on CPU under a limit of 24.00 MiB" in proc.stdout
    assert result.settings.strategy == "interpolate"


def test_probe_strategy_option_reaches_find(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    proc = run_cli(
        "probe", "batchfit.examples:gpt", "--device", "cpu", "--memory-limit", "24MiB", "--verify-steps", "0",
        "--strategy", "binary", "--json", str(out),
    )  # fmt: skip

    assert proc.returncode == 0, proc.stderr
    result = Result.from_json(out.read_text())
    assert result.settings.strategy == "binary"
    sizes = [t.batch_size for t in result.search_trials]
    assert sizes[:3] == [2, 4, 8]  # plain doubling
    assert run_cli("probe", "batchfit.examples:gpt", "--strategy", "guess").returncode == 2


@pytest.mark.skipif(not NO_GPU, reason="the CPU default applies only where there is no GPU")
def test_probe_without_gpu_says_it_runs_on_cpu_under_the_cli_default(targets: Path) -> None:
    proc = run_cli("probe", f"{targets}:wide", "--max-batch", "16", "--verify-steps", "0")

    assert proc.returncode == 0, proc.stderr
    assert "no GPU: running on CPU under a limit of 256.00 MiB" in proc.stdout


def test_json_to_stdout_with_quiet_keeps_stdout_pure_json(targets: Path) -> None:
    proc = run_cli(
        "probe", f"{targets}:wide_dict", "--device", "cpu", "--memory-limit", "4MiB", "--json", "-", "--quiet"
    )

    assert proc.returncode == 0, proc.stderr
    result = Result.from_json(proc.stdout)
    assert 8 < result.max_batch < 64 and result.boundary_reached
    # The human output moved to stderr, and --quiet made it one line with the answer.
    assert proc.stderr.splitlines() == [
        f"max_batch={result.max_batch} safe_batch={result.safe_batch} "
        f"best_throughput_batch={result.best_throughput_batch} budget=4.00 MiB"
    ]


def test_gate_passes_and_fails_with_exit_codes_0_and_3(targets: Path, tmp_path: Path) -> None:
    out = tmp_path / "gate.json"
    failed = run_cli(
        "probe", f"{targets}:wide", "--device", "cpu", "--memory-limit", "4MiB", "--require-batch", "512",
        "--json", str(out),
    )  # fmt: skip

    assert failed.returncode == 3, failed.stderr
    report = GateReport.from_json(out.read_text())
    assert GateReport.from_json(report.to_json()) == report
    assert not report.fits and report.trial.batch_size == 512 and report.trial.kind == "gate"
    assert report.search is not None and report.largest_fit == report.search.max_batch
    assert 8 < report.largest_fit < 512
    assert all(t.batch_size < 512 for t in report.search.trials)
    assert "FAIL: batch 512 does not fit" in failed.stdout
    assert re.search(rf"^largest fit\s+{report.largest_fit}$", failed.stdout, re.MULTILINE)

    # The largest batch the failed gate reported passes the same gate, in one trial.
    passed = run_cli(
        "probe", f"{targets}:wide", "--device", "cpu", "--memory-limit", "4MiB",
        "--require-batch", str(report.largest_fit), "--json", "-",
    )  # fmt: skip
    assert passed.returncode == 0, passed.stderr
    ok = GateReport.from_json(passed.stdout)
    assert ok.fits and ok.search is None and ok.largest_fit is None
    assert ok.trial.peak_bytes is not None and ok.trial.peak_bytes <= ok.budget_bytes
    assert f"PASS: batch {report.largest_fit} fits" in passed.stderr
    assert len(ROW.findall(passed.stderr)) == 1


def test_nothing_fits_exits_3_with_one_line(targets: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe", f"{targets}:wide", "--device", "cpu", "--memory-limit", "64KiB"]) == 3
    err = capsys.readouterr().err

    assert err.strip().count("\n") == 0
    assert re.search(r"batch size \d+ does not fit", err) and "64.00 KiB" in err


# (target, exit code, message); the first five run in a subprocess, the rest through main() in
# this process (same code path, without paying for a Python start each).
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
]


def _check_one_line(stderr: str, message: str) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("batchfit: error: ") and message in lines[0]
    assert "Traceback" not in stderr


@pytest.mark.parametrize(("target", "code", "message"), BAD_TARGETS[:5])
def test_bad_target_gives_one_clear_line(targets: Path, target: str, code: int, message: str) -> None:
    proc = run_cli("probe", target.format(targets=targets), "--device", "cpu", "--memory-limit", "8MiB")

    assert proc.returncode == code, proc.stderr
    _check_one_line(proc.stderr, message)


@pytest.mark.parametrize(("target", "code", "message"), BAD_TARGETS[5:])
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
    assert "argument --memory-limit: memory_limit 'lots' is not a size" in proc.stderr


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
    ],
)
def test_usage_errors_in_process(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(args)
    except SystemExit as exit_:  # argparse's own usage errors
        code = exit_.code
    assert code == 2
    assert "error:" in capsys.readouterr().err


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


@pytest.mark.cuda
def test_probe_on_cuda_with_a_limit(tmp_path: Path) -> None:
    out = tmp_path / "cuda.json"
    proc = run_cli("probe", "batchfit.examples:gpt", "--memory-limit", "1GiB", "--json", str(out))

    assert proc.returncode == 0, proc.stderr
    result = Result.from_json(out.read_text())
    assert result.device.type == "cuda" and result.boundary_reached
    assert result.budget_bytes == 2**30
