"""What-if tables, the estimate command line, plans printed by the CLI, torch.compile notes."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

import batchfit
from batchfit import cli, examples
from batchfit.estimation.whatif import checkpointing, parse_option


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


@pytest.mark.slow
def test_what_if_levers_move_the_answer_the_way_they_should_and_leave_the_model_alone() -> None:
    model, sample = examples.gpt()
    before, slots = _state(model), [id(p) for p in model.parameters()]
    table = batchfit.what_if(
        model, sample, memory_limit="256MiB", options=["amp=bf16", "checkpointing", "optimizer=sgd", "optimizer=adamw"]
    )
    base = table.row("baseline")
    assert base.max_batch == batchfit.estimate(model, sample, memory_limit="256MiB").max_batch
    # Half-precision activations and recomputed blocks both fit more; SGD has no state to drop
    # where activations dominate, but never fits less; AdamW is the default: the same answer.
    assert table.row("amp=bf16").max_batch > base.max_batch
    assert table.row("checkpointing").max_batch > base.max_batch
    assert table.row("checkpointing").per_sample_bytes < base.per_sample_bytes
    assert table.row("optimizer=sgd").max_batch >= base.max_batch
    assert table.row("optimizer=adamw").max_batch == base.max_batch
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert [id(p) for p in model.parameters()] == slots
    assert not any("forward" in vars(module) for module in model.modules())  # the wrapper is gone
    assert "checkpointing" in str(table) and "x" in str(table)


def test_sgd_drops_the_optimizer_state_where_the_weights_dominate() -> None:
    model, sample = examples.mlp()  # 2.5 MiB of weights, tiny activations
    table = batchfit.what_if(model, sample, memory_limit="16MiB", options=["optimizer=sgd"])
    assert table.row("optimizer=sgd").max_batch > table.row("baseline").max_batch


def test_checkpointing_without_repeated_blocks_says_why() -> None:
    model = torch.nn.Linear(64, 8)
    table = batchfit.what_if(model, torch.randn(2, 64), memory_limit="8MiB", options=["checkpointing"])
    row = table.row("checkpointing")
    assert row.max_batch is None and "no repeated blocks" in (row.note or "")


@pytest.mark.slow
def test_hugging_face_checkpointing_uses_the_blocks_own_flag_and_switches_it_back() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 1000, (2, 128))
    table = batchfit.what_if(model, {"input_ids": ids, "labels": ids}, memory_limit="128MiB", options=["checkpointing"])
    row = table.row("checkpointing")
    assert row.max_batch is not None and row.max_batch > table.row("baseline").max_batch
    assert row.note == "checkpointed the 2 blocks of transformer.h"
    assert not model.is_activation_checkpointing
    assert "gradient_checkpointing" not in model.transformer.h[0].__dict__


@pytest.mark.slow
def test_the_checkpointing_wrapper_recomputes_for_real() -> None:
    """Outside an estimate too: real steps under the wrapper need less memory at the same size."""
    model, sample = examples.gpt()
    plain = batchfit.find(copy.deepcopy(model), sample, memory_limit="64MiB").max_batch
    with checkpointing(model):
        wrapped = batchfit.find(model, sample, memory_limit="64MiB").max_batch
    assert wrapped > plain


@pytest.mark.parametrize("bad", ["amp=fp32", "checkpoint", "optimizer=lion", ""])
def test_unknown_options_are_named(bad: str) -> None:
    with pytest.raises(ValueError, match="unknown what-if option"):
        parse_option(bad)


def test_options_must_be_a_list() -> None:
    model, sample = examples.mlp()
    with pytest.raises(TypeError, match="list"):
        batchfit.what_if(model, sample, memory_limit="16MiB", options="amp=bf16")  # type: ignore[arg-type]


# The command line ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_estimate_command_prints_the_estimate_the_plan_and_the_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "est.json"
    code = cli.main(
        ["estimate", "batchfit.examples:gpt", "--memory-limit", "256MiB", "--device", "cpu", "--target-batch", "512",
         "--what-if", "amp=bf16", "--json", str(out)]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0
    result = batchfit.Result.from_json(out.read_text())
    model, sample = examples.gpt()
    assert result.estimated and result.max_batch == batchfit.find(model, sample, memory_limit="256MiB").max_batch
    assert "no device and no memory used" in printed and "assumes" in printed
    assert "plan" in printed and "accumulation steps" in printed and "amp=bf16" in printed


def test_estimate_command_refuses_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["estimate", "batchfit.examples:gpt", "--memory-limit", "2GiB", "--device", "tpu"]) == 2
    assert "--device" in capsys.readouterr().err
    assert cli.main(["estimate", "batchfit.examples:gpt", "--memory-limit", "2GiB", "--what-if", "turbo"]) == 2
    assert "turbo" in capsys.readouterr().err
    assert cli.main(["estimate", "batchfit.examples:gpt"]) == 2
    assert "--memory-limit is required" in capsys.readouterr().err
    assert cli.main(["estimate", "batchfit.examples:mlp", "--memory-limit", "1MiB", "--device", "cpu"]) == 3


def test_probe_prints_the_plan_for_a_target_batch(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "probe.json"
    code = cli.main(
        ["probe", "batchfit.examples:mlp", "--memory-limit", "16MiB", "--target-batch", "1000", "--json", str(out)]
    )
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert code == 0
    plan_line = next(line for line in printed.splitlines() if line.startswith("plan"))
    plan = batchfit.plan(batchfit.Result.from_json(out.read_text()), target_batch=1000)
    assert plan.summary() in plan_line and plan.micro_batch <= result["safe_batch"]
    assert plan.micro_batch * plan.accumulation_steps == 1000


# torch.compile ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_model_compiled_with_dynamic_false_gets_a_warning_and_the_same_answer() -> None:
    model, sample = examples.mlp()
    eager = batchfit.find(copy.deepcopy(model), sample, memory_limit="16MiB")
    result = batchfit.find(torch.compile(model, dynamic=False), sample, memory_limit="16MiB")
    assert result.max_batch == eager.max_batch  # probed as its eager module on the CPU, and said so
    assert any("probed eagerly" in note for note in result.notes)
    assert any("dynamic=False" in note and "recompile_limit" in note for note in result.notes)
    estimated = batchfit.estimate(torch.compile(model), sample, memory_limit="16MiB")
    assert any("traced as its eager module" in note for note in estimated.notes)


@pytest.mark.cuda
@pytest.mark.compile
def test_a_compiled_model_on_cuda_compiles_once_for_all_sizes() -> None:
    from torch._dynamo.utils import counters

    model, sample = examples.gpt()
    compiled = torch.compile(model.cuda())
    before = counters["stats"]["unique_graphs"]
    result = batchfit.find(compiled, sample, memory_limit="2GiB", device="cuda")
    graphs = counters["stats"]["unique_graphs"] - before
    assert result.boundary_reached
    assert graphs <= 4  # forward and backward, static then dynamic at most: not one per size
    assert any("torch.compile:" in note and "compilation" in note for note in result.notes)
