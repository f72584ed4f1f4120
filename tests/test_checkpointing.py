"""`batchfit.fit` and its policies: blocks found, applied and undone exactly, and the search over real steps."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import batchfit
from batchfit import examples
from batchfit.probe.checkpointing_blocks import NO_BLOCKS, applied, apply_policy, budget_policy, find_blocks, policy_for
from tests.helpers import assert_same_state, state_of, tiny_llama


def small_gpt() -> tuple[nn.Module, Any]:
    return examples.gpt(vocab_size=256, seq_len=32, d_model=64, n_layers=4, n_heads=4)


def attributes(model: nn.Module) -> list[dict[str, Any]]:
    """Every module's instance attributes that are not modules, parameters or buffers: what a policy sets."""
    return [{k: v for k, v in m.__dict__.items() if not k.startswith("_") or k == "_gradient_checkpointing_func"}
            for m in model.modules()]


def grads_with(model: nn.Module, sample: Any) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        output = model(**sample)
        (output["loss"] if isinstance(output, dict) else output.loss).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def test_blocks_are_found_by_structure_and_by_name() -> None:
    model, _ = small_gpt()
    found = find_blocks(model)
    assert found.names == ("blocks.0", "blocks.1", "blocks.2", "blocks.3") and found.found_in == "blocks"
    assert find_blocks(model, ["blocks.1", "blocks.3"]).names == ("blocks.1", "blocks.3")
    with pytest.raises(ValueError, match="'blocks.9', which is no module of the model; did you mean 'blocks.3'"):
        find_blocks(model, ["blocks.9"])
    with pytest.raises(ValueError, match=NO_BLOCKS[:30]):
        find_blocks(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(TypeError, match="'auto' or a list of module names"):
        find_blocks(model, "blocks.0")  # type: ignore[arg-type]


def test_policies_choose_the_first_or_spread_evenly() -> None:
    names = tuple(f"b{i}" for i in range(12))
    assert policy_for(names, 3).checkpointed == ("b0", "b1", "b2")
    assert policy_for(names, 3, "evenly").checkpointed == ("b0", "b4", "b8")
    assert policy_for(names, 12).label == "all 12 blocks" and policy_for(names, 0).label == "none"
    assert policy_for(names, 2, "evenly").label == "2 of 12 blocks (evenly)"
    with pytest.raises(ValueError, match="between 0 and 12"):
        policy_for(names, 13)


@pytest.mark.parametrize("build", [small_gpt, tiny_llama], ids=["plain", "hugging_face"])
def test_a_policy_recomputes_the_same_gradients_and_is_undone_bit_for_bit(build: Any) -> None:
    model, sample = build()
    model.train()
    if isinstance(model, examples.GPT):
        sample = {"input_ids": sample["input_ids"], "labels": sample["labels"]}
    before, kept = state_of(model), attributes(model)
    expected = grads_with(model, sample)
    blocks = find_blocks(model)
    policy = policy_for(blocks.names, len(blocks.names) - 1)
    with applied(model, policy):
        assert find_blocks(model).already == policy.checkpointed  # it shows as checkpointed while applied
        got = grads_with(model, sample)
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6)
    assert attributes(model) == kept
    assert_same_state(before, state_of(model))


def test_a_policy_is_undone_when_the_block_inside_raises() -> None:
    model, _ = small_gpt()
    kept = attributes(model)
    undo = apply_policy(model, policy_for(find_blocks(model).names, 4))
    assert "forward" in model.blocks[0].__dict__
    undo()
    assert attributes(model) == kept
    with pytest.raises(KeyboardInterrupt), applied(model, policy_for(find_blocks(model).names, 2)):
        raise KeyboardInterrupt
    assert attributes(model) == kept


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["first", "evenly"])
def test_fit_measures_each_policy_exactly_and_recommends_the_fastest(placement: str) -> None:
    model, sample = small_gpt()
    before, kept = state_of(model), attributes(model)
    fit = batchfit.fit(model, sample, target_batch=62, memory_limit="24MiB", placement=placement)
    assert_same_state(before, state_of(model))
    assert attributes(model) == kept
    assert fit.rows[0].policy.k == 0 and fit.rows[0].safe_batch < 62  # twice what fits as the model is
    assert len(fit.rows) >= 2 and [r.policy.k for r in fit.rows] == sorted(r.policy.k for r in fit.rows)
    assert all(r.policy == policy_for(fit.blocks, r.policy.k, placement) for r in fit.rows)  # type: ignore[arg-type]
    for row in fit.rows:  # each measured max is the exact boundary under its policy
        with applied(model, row.policy), batchfit.Prober(model, sample, memory_limit="24MiB") as prober:
            assert prober.trial(row.max_batch).fits and not prober.trial(row.max_batch + 1).fits
    holding = [r for r in fit.rows if r.policy.k and r.safe_batch >= fit.target_batch]
    if holding:  # the fewest blocks that hold the target, and one fewer does not
        fewest = min(holding, key=lambda r: r.policy.k)
        assert fewest.micro_batch == fit.target_batch
    recommendation = fit.recommendation
    assert recommendation.global_batch == fit.target_batch and recommendation.decided_by == "target"
    assert recommendation.samples_per_s == max(r.samples_per_s or 0 for r in fit.rows)
    assert recommendation.batch_size <= fit.rows[fit.chosen].safe_batch
    assert [k for k, _ in fit.predicted] == list(range(len(fit.blocks) + 1))
    text = str(fit)
    assert "recommended:" in text and "max batch by blocks checkpointed" in text
    assert fit.to_dict()["schema"] == "batchfit.fit/1"
    assert batchfit.Fit.from_json(fit.to_json()) == fit


def test_a_target_that_fits_as_is_needs_no_checkpointing() -> None:
    model, sample = small_gpt()
    fit = batchfit.fit(model, sample, target_batch=4, memory_limit="24MiB")
    assert [r.policy.k for r in fit.rows] == [0] and fit.policy.k == 0
    assert fit.recommendation.split() == "global batch 4 = micro-batch 4, no accumulation"
    assert "nothing to recompute" in fit.recommendation.reason


@pytest.mark.slow
def test_a_target_no_policy_fits_in_one_step_names_the_closest() -> None:
    model, sample = small_gpt()
    with pytest.raises(ValueError, match=r"no policy fits target_batch 100000 in one step: the closest, with all"):
        batchfit.fit(model, sample, target_batch=100_000, accumulate=False, memory_limit="24MiB")


def test_blocks_checkpointed_already_are_measured_from_there() -> None:
    model, sample = small_gpt()
    with applied(model, policy_for(find_blocks(model).names, 1)):
        fit = batchfit.fit(model, sample, target_batch=4, memory_limit="24MiB")
        assert "forward" in model.blocks[0].__dict__  # yours, left as it was
    assert fit.blocks == ("blocks.1", "blocks.2", "blocks.3")
    assert "1 of the 4 blocks were checkpointed already (blocks.0)" in fit.notes[0]


@pytest.mark.parametrize(
    ("keywords", "error", "match"),
    [
        ({"target_batch": 0}, ValueError, "target_batch must be >= 1, got 0"),
        ({"target_batch": 8, "mode": "inference"}, ValueError, "fit\\(\\) sizes training"),
        ({"target_batch": 8, "checkpointing": "all"}, ValueError, "'auto' or a list of module names"),
        ({"target_batch": 8, "checkpointing": ["nope"]}, ValueError, "'nope', which is no module"),
        ({"target_batch": 8, "placement": "last"}, ValueError, "placement must be 'first' or 'evenly'"),
        ({"target_batch": 8, "accumulate": 1}, TypeError, "accumulate must be True or False"),
        ({"target_batch": 8, "cache": "/tmp/x"}, ValueError, "neither cache, noise_scale nor eval"),
        ({"target_batch": 8, "eval": True}, ValueError, "neither cache, noise_scale nor eval"),
        ({"target_batch": 8, "mode": "eval"}, ValueError, "fit\\(\\) sizes training"),
        ({"target_batch": 8, "headroom": 2}, ValueError, "headroom"),
        ({"target_batch": 8, "distributed": True}, ValueError, "fit\\(\\) sizes one process"),
        ({"target_batch": 8, "memory_limt": "1GiB"}, TypeError, "did you mean 'memory_limit'"),
    ],
)
def test_bad_input_is_named_before_any_trial(keywords: dict[str, Any], error: type, match: str) -> None:
    model, sample = small_gpt()
    before, kept = state_of(model), attributes(model)
    ran: list[Any] = []
    with pytest.raises(error, match=match):
        batchfit.fit(model, sample, callback=ran.append, **keywords)
    assert ran == []
    assert_same_state(before, state_of(model))
    assert attributes(model) == kept


def test_ctrl_c_mid_fit_leaves_the_model_as_it_was() -> None:
    model, sample = small_gpt()
    before, kept = state_of(model), attributes(model)
    seen: list[str] = []

    def interrupt_once_checkpointed(size: int, kind: str) -> None:
        seen.append(kind)
        if any("forward" in m.__dict__ for m in model.modules()):
            raise KeyboardInterrupt  # a Ctrl-C while a policy is applied

    with pytest.raises(KeyboardInterrupt):
        batchfit.fit(model, sample, target_batch=400, memory_limit="24MiB", on_trial_start=interrupt_once_checkpointed)
    assert seen
    assert_same_state(before, state_of(model))
    assert attributes(model) == kept


def drawn_fit() -> batchfit.Fit:
    """A fit as `fit()` returns one for a 4-block model whose target needs 3 blocks checkpointed."""
    from batchfit.report import DeviceInfo, Policy, PolicyRow, Recommendation

    names = ("blocks.0", "blocks.1", "blocks.2", "blocks.3")
    none = PolicyRow(Policy((), 4), 44_000_000, 2_900_000.0, 6, 81, 2, 210.5,
                     max_batch=91, safe_batch=81, safe_verified=True, boundary_reached=True)  # fmt: skip
    three = PolicyRow(Policy(names[:3], 4), 44_000_000, 1_450_000.0, 3, 162, 1, 171.8,
                      max_batch=185, safe_batch=164, safe_verified=True, boundary_reached=True)  # fmt: skip
    chosen = Recommendation(81, 2, 1, 162, "target", "the fastest measured", 91, 81, 81, samples_per_s=210.5,
                            target=162, target_changed_by=0)  # fmt: skip
    return batchfit.Fit(162, names, "blocks", (none, three), 0, chosen, ((0, 91), (1, 110), (2, 138), (3, 185),
                        (4, 279)), 300 * 2**20, "allocated", DeviceInfo(type="cpu"), 9, 12.5)  # fmt: skip


def test_a_fit_prints_its_table_and_chart_and_draws_its_picture(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    fit = drawn_fit()
    text = str(fit)
    assert "none" in text and "3 of 4 blocks (the first)" in text and "<- recommended" in text
    chart = [line for line in text.splitlines() if line.startswith("    ")]
    assert len(chart) == 5 and chart[3].count("#") > chart[2].count("=") > 0  # measured 185 drawn longer than 138
    assert "81 x 2" in text and "global batch 162 = micro-batch 81 x 2 accumulation steps" in text
    path = tmp_path / "fit.png"
    assert fit.plot(path) == str(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(fit.to_json())["policy"]["checkpointed"] == []


def test_a_fit_without_matplotlib_says_how_to_install_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"plotting a fit needs matplotlib: install the plot extra"):
        drawn_fit().plot(tmp_path / "f.png")
    assert not (tmp_path / "f.png").exists()


def saved_bytes(model: nn.Module, sample: Any) -> int:
    """Bytes of the tensors autograd saves for backward in one step of ``model``."""
    total = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        total[0] += tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(**sample)["loss"]
    loss.backward()
    model.zero_grad(set_to_none=True)
    return total[0]


@pytest.mark.slow
def test_a_compile_budget_recompiles_the_module_alone_under_its_budget() -> None:
    import torch._functorch.config as functorch_config

    model, sample = small_gpt()
    sample = {k: v.repeat(4, 1) for k, v in sample.items()}
    yours = torch.compile(model, backend="aot_eager")
    as_compiled = saved_bytes(yours, sample)
    with applied(yours, budget_policy(10)) as runnable:  # budget 0.0: recompute all the partitioner can
        assert runnable is not yours and functorch_config.activation_memory_budget == 0.0
        assert saved_bytes(runnable, sample) < as_compiled / 4
    assert functorch_config.activation_memory_budget == 1.0
    assert saved_bytes(yours, sample) == as_compiled  # your compiled code, untouched
    assert budget_policy(3).label == "compile budget 0.7" and budget_policy(3).k == 3
    with pytest.raises(ValueError, match="use applied"):
        apply_policy(yours, budget_policy(3))


@pytest.mark.slow
def test_a_compiled_model_on_the_cpu_is_fitted_by_its_blocks_and_says_why() -> None:
    model, sample = small_gpt()
    fit = batchfit.fit(torch.compile(model), sample, target_batch=4, memory_limit="24MiB")
    assert fit.blocks[0] == "_orig_mod.blocks.0"
    assert any("runs it eagerly" in note and "activation memory budget" in note for note in fit.notes)


@pytest.mark.cuda
@pytest.mark.compile  # it compiles on the GPU: the proof's compile slice (part 2), not part 1's, whose deadline it cut
def test_a_compiled_model_on_a_gpu_is_fitted_by_its_compile_budget() -> None:
    model, sample = examples.gpt(vocab_size=2048, seq_len=128, d_model=256, n_layers=4, n_heads=4)
    compiled = torch.compile(model.cuda())
    plain = batchfit.find(compiled, sample, memory_limit="1GiB", timed_steps=0)
    fit = batchfit.fit(compiled, sample, target_batch=2 * plain.safe_batch, memory_limit="1GiB")
    assert fit.blocks_from == "torch.compile's activation memory budget"
    assert any(row.policy.budget is not None for row in fit.rows)
    for row in fit.rows:  # each measured max is the exact boundary under its budget, compiled, from scratch
        # (on CUDA the optimizer kept between trials carries its layout: the fit's max is the one a
        # fresh optimizer meets, as find()'s confirmation runs it, so the check runs it so too)
        with applied(compiled, row.policy) as runnable, batchfit.Prober(runnable, sample, memory_limit="1GiB") as p:
            fits = p.trial(row.max_batch, fresh_optimizer=True).fits
            assert fits and not p.trial(row.max_batch + 1, fresh_optimizer=True).fits


def test_a_model_without_repeated_blocks_is_named_before_any_trial() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    ran: list[Any] = []
    with pytest.raises(ValueError, match="no repeated blocks to checkpoint"):
        batchfit.fit(model, torch.randn(2, 8), target_batch=8, callback=ran.append)
    assert ran == []
