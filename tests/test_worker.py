"""The one process hop (`batchfit.probe.wire`, `batchfit.worker`): options cross as JSON both ways, an
error comes back as its own type, and the command line carries nothing for the library."""

from __future__ import annotations

import argparse
import ast
import json
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

import batchfit
from batchfit import errors
from batchfit.cli.parser import build_parser
from batchfit.errors import error_document, error_from
from batchfit.probe.job_search import WORKER_OPTIONS, worker_request
from batchfit.probe.keywords import EstimateOptions, keywords_of
from batchfit.probe.options import Options
from batchfit.probe.wire import WorkerRequest, from_wire, to_wire, worker_command

PACKAGE = Path(batchfit.__file__).resolve().parent

#: A value other than the default for every option that is not code, two groups `Options` takes together.
OTHER_VALUES: tuple[dict[str, Any], ...] = (
    {
        "amp": "bf16", "eval": True, "device": "cpu:0", "memory_limit": "16MiB", "reserve": "1MiB",
        "steps_per_trial": 3, "headroom": 0.2, "init_batch": 2, "max_batch": 64, "multiple_of": 2,
        "verify_steps": 3, "strategy": "binary", "time_budget": 30.0, "restore_rng": False, "distributed": False,
        "rank_timeout": 12.5, "seq_len": 16, "scan_batches": None, "noise_scale": True, "noise_passes": 64,
        "timed_steps": 2, "cache": "some/dir",
    },
    {"mode": "generate", "max_new_tokens": 4, "memory_limit": 0.5, "device": "cuda"},
)  # fmt: skip


def test_every_option_that_is_not_code_is_in_the_values_above() -> None:
    named = {name for values in OTHER_VALUES for name in values}
    assert named == {option.name for option in fields(Options) if option.metadata.get("how") != "code"}


@pytest.mark.parametrize("values", OTHER_VALUES)
def test_options_cross_as_json_and_come_back_the_same(values: dict[str, Any]) -> None:
    options = Options(**values)
    wire = json.loads(json.dumps(to_wire(options)))
    assert wire == values  # a default stays one: it does not cross
    assert from_wire(wire) == options
    assert to_wire(Options()) == {} and from_wire({}) == Options()


def test_a_rank_gets_the_options_its_trial_needs_resolved_and_nothing_else() -> None:
    options = Options(**OTHER_VALUES[0])
    request = worker_request("t.py:build", 2, options)
    assert set(request.options) == set(WORKER_OPTIONS) & set(OTHER_VALUES[0]) and request.world_size == 2
    crossed = from_wire(json.loads(json.dumps(request.options)))
    assert all(getattr(crossed, name) == getattr(options, name) for name in WORKER_OPTIONS)
    assert crossed.init_batch is None  # the search's options stay with the driver
    # On the CPU without a limit a rank takes the command line's, as `batchfit probe` does.
    plain = worker_request("t.py:build", 2, Options(device="cpu")).options
    assert plain == {"device": "cpu", "memory_limit": "256MiB"}


def test_code_comes_from_the_target_and_a_value_json_cannot_carry_is_named() -> None:
    def loss(output: Any, batch: Any) -> Any:
        return output

    assert from_wire({"amp": "bf16"}, loss_fn=loss) == Options(amp="bf16", loss_fn=loss)
    with pytest.raises(TypeError, match=r"loss_fn= is a function, which cannot cross"):
        to_wire(Options(loss_fn=loss))
    with pytest.raises(TypeError, match=r"optimizer= is a object, which cannot cross"):
        to_wire({"optimizer": object(), "memory_limit": "1GiB"})
    estimate = {name: value for name, value in OTHER_VALUES[0].items() if name in keywords_of(EstimateOptions)}
    assert to_wire(estimate) == estimate


def test_a_request_is_written_and_read_whole(tmp_path: Path) -> None:
    request = WorkerRequest(
        kind="trial", target="t.py:build", options={"device": "cpu"}, world_size=2, out=str(tmp_path),
        batch_size=8, steps=2, cap_bytes=1024, headroom=0.1,
    )  # fmt: skip
    request.write(tmp_path / "request.json")
    assert WorkerRequest.read(tmp_path / "request.json") == request
    assert request.answer_path.parent == tmp_path
    (tmp_path / "other.json").write_text('{"kind": "something"}')
    with pytest.raises(ValueError, match="not a batchfit worker request"):
        WorkerRequest.read(tmp_path / "other.json")


def test_the_worker_is_started_by_its_module_alone(tmp_path: Path) -> None:
    one = worker_command(tmp_path / "r.json")
    assert one[1:] == ["-m", "batchfit.worker", str(tmp_path / "r.json")]
    job = worker_command(tmp_path / "r.json", 4)
    assert job[1:3] == ["-m", "torch.distributed.run"] and "--nproc-per-node=4" in job
    assert job[-3:] == ["-m", "batchfit.worker", str(tmp_path / "r.json")]


def test_nothing_outside_the_command_line_starts_the_command_line() -> None:
    """No ``"-m", "batchfit"`` in a list of the library: a hop goes through `worker_command`."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        if "cli" in path.relative_to(PACKAGE).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.List):
                words = [item.value for item in node.elts if isinstance(item, ast.Constant)]
                if any(a == "-m" and b == "batchfit" for a, b in zip(words, words[1:])):
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not found, found


def _errors() -> list[BaseException]:
    return [
        errors.NothingFitsError(4, 100, 200, "the backward pass", "CUDA out of memory", "Lower it."),
        errors.RankFailedError(1, 8, "the trial", "KeyError: 'x'"),
        errors.RanksTimeoutError("rank 1 gave no answer"),
        errors.EstimateTimeoutError("t.py:build", 3.0, "the end of its output"),
        errors.LimitError("the process already holds more"),
        errors.DeviceFailedError("an illegal memory access"),
        errors.UncountableMemoryError("an MKL-DNN tensor"),
        errors.NoOptimizerStepError("the optimizer never stepped"),
    ]


@pytest.mark.parametrize("exc", _errors(), ids=lambda exc: type(exc).__name__)
def test_each_batchfit_error_comes_back_as_itself(exc: BaseException) -> None:
    exc.add_note("where it happened")
    back = error_from(json.loads(json.dumps(error_document(exc))))
    assert type(back) is type(exc) and str(back) == str(exc) and back.args == exc.args
    assert vars(back) == vars(exc)  # its fields and notes too


def test_other_errors_come_back_as_the_types_the_caller_can_catch() -> None:
    class Wrong(ValueError):
        pass

    for exc, kind in ((TypeError("bad"), TypeError), (Wrong("worse"), ValueError)):
        back = error_from(json.loads(json.dumps(error_document(exc))))
        assert type(back) is kind and str(back) == str(exc)
    back = error_from(error_document(KeyError("k")), "the sharded estimate")
    assert type(back) is RuntimeError and str(back) == "the sharded estimate raised KeyError: 'k'"


def test_no_hidden_flag_but_the_deprecated_memory() -> None:
    hidden = []
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in commands.choices.items():
        hidden += [f"{name} {a.option_strings[0]}" for a in command._actions if a.help == argparse.SUPPRESS]
    assert hidden == ["estimate --memory"]
