"""``batchfit.soak`` of a target string (issue 50, item 6): the epoch replayed in a fresh process.

A target file (a small HF GPT-2 from its config, with a ``make_batch``) is soaked through
`batchfit.worker`'s ``"soak"`` request: real steps in another process, the `Soak` read back from its
JSON, an error raised again as its own type. A model and a ``make_batch`` still soak in this process.
Each fresh process imports torch and transformers (seconds on 2 cores): marked slow.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import batchfit
from batchfit.cli import main
from batchfit.probe.wire import WorkerRequest
from batchfit.report.varlen import Soak

TARGET = """
import os

import torch
import transformers


def make_batch(batch_size, seq_len):
    ids = torch.randint(0, 128, (batch_size, seq_len), generator=torch.Generator().manual_seed(seq_len))
    return {"input_ids": ids, "labels": ids}


def model():
    config = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, n_positions=256, vocab_size=128, attn_pdrop=0.0,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def build():
    with open(os.environ["SOAK_PID_FILE"], "w") as file:  # which process loaded the target
        file.write(str(os.getpid()))
    return {"model": model(), "make_batch": make_batch}


def without_batches():
    return model(), make_batch(2, 8)
"""

LIMIT = "24MiB"


@pytest.fixture
def target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "soak_gpt.py"
    path.write_text(TARGET)
    monkeypatch.setenv("SOAK_PID_FILE", str(tmp_path / "pid"))
    return path


@pytest.mark.slow  # a fresh process per soak, each importing torch and transformers
def test_a_target_soaks_in_a_fresh_process_and_counts_its_ooms(target: Path) -> None:
    soak = batchfit.soak(f"{target}:build", None, [(4, 16), (2, 32)], name="two steps", memory_limit=LIMIT)
    assert isinstance(soak, Soak) and soak.process == "fresh" and soak.fresh
    assert (soak.sampler, soak.steps, soak.oom) == ("two steps", 2, 0)
    assert 0 < soak.peak_bytes <= (soak.budget_bytes or 0) and soak.peak_shape in ((4, 16), (2, 32))
    loaded_in = int((target.parent / "pid").read_text())
    assert loaded_in != os.getpid()  # the target was loaded in another process, not this one
    assert Soak.from_json(soak.to_json()) == soak
    oversized = batchfit.soak(f"{target}:build", None, [(2, 16), (4096, 256)], memory_limit=LIMIT, max_steps=2)
    assert (oversized.steps, oversized.oom, oversized.process) == (2, 1, "fresh")


@pytest.mark.slow  # one fresh process
def test_a_target_without_make_batch_is_named(target: Path) -> None:
    with pytest.raises(ValueError, match=r"without_batches gave no make_batch\(batch_size, seq_len\)"):
        batchfit.soak(f"{target}:without_batches", None, [(2, 8)], memory_limit=LIMIT)


def test_what_cannot_cross_is_refused_before_the_process(target: Path) -> None:
    spec = f"{target}:build"
    with pytest.raises(TypeError, match="make_batch must be None"):
        batchfit.soak(spec, lambda b, s: None, [(2, 8)], memory_limit=LIMIT)
    with pytest.raises(TypeError, match="optimizer= is a type, which cannot cross into the soak's fresh process"):
        batchfit.soak(spec, None, [(2, 8)], memory_limit=LIMIT, optimizer=torch.optim.SGD)
    with pytest.raises(TypeError, match="callback= cannot cross"):
        batchfit.soak(spec, None, [(2, 8)], memory_limit=LIMIT, callback=print)
    with pytest.raises(ValueError, match="step 2's rows"):
        batchfit.soak(spec, None, [(2, 8), (0, 8)], memory_limit=LIMIT)
    with pytest.raises(TypeError, match="'module:factory'"):
        batchfit.soak("no_colon", None, [(2, 8)], memory_limit=LIMIT)
    assert not (target.parent / "pid").exists()  # no process loaded the target


def test_a_soak_request_crosses_as_json(tmp_path: Path) -> None:
    request = WorkerRequest("soak", "t.py:build", {"memory_limit": LIMIT}, 1, str(tmp_path), shapes=[[4, 16]], name="b")
    request.write(tmp_path / "request.json")
    assert WorkerRequest.read(tmp_path / "request.json") == request
    document = json.loads((tmp_path / "request.json").read_text())
    (tmp_path / "other.json").write_text(json.dumps({**document, "kind": "x"}))
    with pytest.raises(ValueError, match="not a batchfit worker request"):
        WorkerRequest.read(tmp_path / "other.json")


@pytest.mark.slow  # a real model's steps in this process
def test_a_model_and_make_batch_still_soak_in_this_process(target: Path) -> None:
    namespace: dict[str, Any] = {}
    exec(compile(TARGET, str(target), "exec"), namespace)  # the same model, built here
    model, make_batch = namespace["model"](), namespace["make_batch"]
    soak = batchfit.soak(model, make_batch, [(4, 16), (2, 32)], memory_limit=LIMIT)
    assert (soak.process, soak.steps, soak.oom) == ("this", 2, 0)
    with pytest.raises(TypeError, match="soak\\(\\) needs make_batch"):
        batchfit.soak(model, None, [(4, 16)], memory_limit=LIMIT)


@pytest.mark.slow  # ~20 s: the plan's frontier here, then a fresh process per sampler's soak
def test_the_command_line_soaks_each_sampler_in_a_fresh_process(
    target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lengths, out = tmp_path / "lengths.txt", tmp_path / "plan.json"
    lengths.write_text("\n".join(map(str, [8, 8, 8, 12, 16, 16, 24, 48])) + "\n")
    flags = ["--device", "cpu", "--memory-limit", "4MiB", "--max-batch", "16", "--verify-steps", "0"]

    code = main(["probe", f"{target}:build", "--buckets", str(lengths), *flags, "--soak", "--json", str(out)])

    printed = capsys.readouterr()
    assert code == 0, printed.err
    plan = batchfit.LengthPlan.from_json(out.read_text())
    assert [soak.sampler for soak in plan.soaks] == ["buckets", "token budget"]
    assert all(soak.process == "fresh" and soak.oom == 0 for soak in plan.soaks)
    assert printed.out.count("in a fresh process") == 2
    assert int((target.parent / "pid").read_text()) != os.getpid()  # the last soak's process loaded it
