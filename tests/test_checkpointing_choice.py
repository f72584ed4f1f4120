"""Which blocks `fit` may checkpoint, and what its answer says (issue 48, items 11 and 12): blocks
checkpointed already are known by what checkpoints them, a container that is never called is
refused by name, blocks of several groups are ordered by the bytes they save, and the reason
says what was measured."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn

import batchfit
from batchfit import examples
from batchfit.probe.checkpointing_blocks import applied, apply_policy, find_blocks, policy_for
from batchfit.report import Policy, PolicyRow


def small_gpt() -> tuple[nn.Module, Any]:
    return examples.gpt(vocab_size=256, seq_len=32, d_model=64, n_layers=4, n_heads=4)


class Basic(nn.Module):
    """A ResNet basic block (torchvision may not import beside this torch, so built here)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = None if stride == 1 else nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                                           nn.BatchNorm2d(cout))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return torch.relu(out + (x if self.down is None else self.down(x)))


class ResNetLike(nn.Module):
    """resnet18's shape, small: four stages of two basic blocks, channels doubling as maps halve,
    so the last stage holds the most parameters and the fewest activations."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.layer1 = nn.Sequential(Basic(width, width, 1), Basic(width, width, 1))
        self.layer2 = nn.Sequential(Basic(width, 2 * width, 2), Basic(2 * width, 2 * width, 1))
        self.layer3 = nn.Sequential(Basic(2 * width, 4 * width, 2), Basic(4 * width, 4 * width, 1))
        self.layer4 = nn.Sequential(Basic(4 * width, 8 * width, 2), Basic(8 * width, 8 * width, 1))
        self.fc = nn.Linear(8 * width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer4(self.layer3(self.layer2(self.layer1(self.stem(x)))))
        return self.fc(x.mean((2, 3)))


def test_blocks_behind_an_accelerate_hook_are_not_checkpointed_already_and_keep_their_hook() -> None:
    """Before the fix every block with an instance ``forward`` (Accelerate's, from
    ``add_hook_to_module`` as ``dispatch_model`` sets it) read as checkpointed already."""
    hooks = pytest.importorskip("accelerate.hooks")
    calls = []

    class Counting(hooks.ModelHook):  # type: ignore[misc,name-defined]
        def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            calls.append(module)
            return args, kwargs

    model, sample = small_gpt()
    for block in model.blocks:
        hooks.add_hook_to_module(block, Counting())
    theirs = [block.__dict__["forward"] for block in model.blocks]
    assert find_blocks(model).already == ()
    with applied(model, policy_for(find_blocks(model).names, 4)):
        assert find_blocks(model).already == ("blocks.0", "blocks.1", "blocks.2", "blocks.3")
        model(**sample)["loss"].backward()
    assert len(calls) >= 4  # the hook still ran under checkpointing
    assert [block.__dict__["forward"] for block in model.blocks] == theirs


def test_blocks_checkpointed_by_you_are_known_by_what_checkpoints_them() -> None:
    from torch.utils.checkpoint import checkpoint

    model, _ = small_gpt()
    model.blocks[0].forward = functools.partial(checkpoint, model.blocks[0].forward, use_reentrant=False)
    own = model.blocks[1].forward
    model.blocks[1].forward = lambda *args, **kwargs: checkpoint(own, *args, use_reentrant=False, **kwargs)
    model.blocks[3].forward = functools.partial(model.blocks[3].forward)  # a forward of its own, no checkpoint
    assert find_blocks(model).already == ("blocks.0", "blocks.1")
    apply_policy(model, policy_for(("blocks.2",), 1))
    assert find_blocks(model).already == ("blocks.0", "blocks.1", "blocks.2")


def test_a_container_that_is_never_called_is_refused_by_name_before_any_trial() -> None:
    """Before the fix ``checkpointing=["blocks"]`` (a ModuleList: no forward) was accepted, and
    every policy measured the model as it is."""
    model, sample = small_gpt()
    ran: list[Any] = []
    with pytest.raises(ValueError, match=r"'blocks', a ModuleList that is never called .* \(blocks.0, blocks.1, "):
        batchfit.fit(model, sample, target_batch=8, checkpointing=["blocks"], callback=ran.append)
    assert ran == []
    assert find_blocks(model, ["blocks.0", "blocks.1"]).names == ("blocks.0", "blocks.1")


def test_every_group_of_blocks_is_found_and_ordered_by_the_bytes_it_saves() -> None:
    """Before the fix the group with the most parameters was the only one: a ResNet's last stage
    (the fewest activations), T5's decoder alone."""
    from batchfit.probe.checkpointing_blocks import by_saving, saving

    torch.manual_seed(0)
    model, sample = ResNetLike(width=4), torch.randn(1, 3, 16, 16)
    blocks = find_blocks(model)
    assert blocks.groups == ("layer1", "layer2", "layer3", "layer4") and len(blocks.names) == 8
    with batchfit.Prober(model, sample, memory_limit="64MiB") as prober, saving(model, blocks.free) as saved:
        assert prober.trial(1, steps=1).fits
    ordered, note = by_saving(blocks, saved)
    assert ordered.names[:2] == ("layer1.0", "layer1.1") and ordered.names[-2:] == ("layer4.0", "layer4.1")
    assert saved["layer1.0"] > saved["layer4.1"] > 0
    assert note.startswith("blocks of 4 groups, the most saved first") and "layer1 " in note


def test_t5s_encoder_and_decoder_stacks_are_both_found() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(num_layers=2, num_decoder_layers=2, d_model=32, d_ff=64, num_heads=2, d_kv=16,
                                   vocab_size=64)  # fmt: skip
    t5 = find_blocks(transformers.T5ForConditionalGeneration(config))
    assert t5.groups == ("encoder.block", "decoder.block") and len(t5.names) == 4


class SpareStack(nn.Module):
    """Two stacks of blocks, one never called (kept for another task)."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2))
        self.spare = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.used:
            x = block(x)
        return x


def test_blocks_never_called_in_a_step_are_passed_over_and_named() -> None:
    from batchfit.probe.checkpointing_blocks import by_saving, saving

    torch.manual_seed(0)
    model, sample = SpareStack(), torch.randn(2, 16)
    blocks = find_blocks(model)
    assert blocks.groups == ("used", "spare")
    with batchfit.Prober(model, sample, memory_limit="16MiB") as prober, saving(model, blocks.free) as saved:
        assert prober.trial(1, steps=1).fits
    ordered, note = by_saving(blocks, saved)
    assert ordered.names == ("used.0", "used.1") and ordered.found_in == "used"
    assert "passed over 3 that saved nothing, never called in a step (spare.0, spare.1, spare.2)" in note


def row(k: int, max_batch: int, safe: int, micro: int | None, steps: int | None, rate: float | None) -> PolicyRow:
    names = ("b0", "b1", "b2", "b3")
    boundary = {"max_batch": max_batch, "safe_batch": safe, "safe_verified": True, "boundary_reached": True}
    return PolicyRow(policy_for(names, k), 1000, 10.0, 3, micro, steps, rate, **boundary)


def test_the_reason_says_what_was_measured() -> None:
    """Before the fix: 'target 52 fits without checkpointing (safe batch 26)' for a plan of 26 x 2,
    and '(+50% for this one)' beside the slower policy."""
    from batchfit.report.checkpointing import fit_recommendation

    none = row(0, 41, 26, 26, 2, 30.0)
    fits = fit_recommendation(row(0, 60, 52, 52, 1, 30.0), [row(0, 60, 52, 52, 1, 30.0)], [], 52, 4)
    assert fits.reason.startswith("target 52 fits in one step as the model is (safe batch 52): nothing to recompute")
    split = fit_recommendation(none, [none], [none, row(4, 48, 41, None, None, None)], 52, 4)
    assert split.reason == (
        "target 52 does not fit in one step as the model is (max 41, safe batch 26), and no policy measured holds "
        "it in one step (all 4 blocks: safe batch 41): trains it as 26 x 2 accumulation steps at 30.0 samples/s"
    )
    yours = fit_recommendation(none, [none], [none], 52, 0, already=4)
    assert "as the model is, with the 4 blocks you checkpointed (max 41, safe batch 26), and no block" in yours.reason
    assert "no block is left to checkpoint" in yours.reason and "fits" not in yours.reason
    slower = row(2, 90, 80, 52, 1, 20.0)
    chosen = fit_recommendation(none, [none, slower], [none, slower], 52, 4)
    assert "2 of 4 blocks (the first) at 52: 20.0 samples/s, the chosen 50% faster" in chosen.reason
    assert "for this one" not in chosen.reason
    assert isinstance(none.policy, Policy)


@pytest.mark.slow
def test_fit_of_a_model_whose_blocks_you_checkpointed_does_not_claim_the_target_fits() -> None:
    """Before the fix: 'target 120 fits without checkpointing (safe batch 100): nothing to
    recompute' while the plan was 60 x 2."""
    model, sample = small_gpt()
    apply_policy(model, policy_for(find_blocks(model).names, 4))
    fit = batchfit.fit(model, sample, target_batch=120, memory_limit="24MiB")
    assert fit.recommendation.accumulation > 1
    assert "does not fit in one step" in fit.recommendation.reason and "no block is left" in fit.recommendation.reason
    assert "no block is left to checkpoint" in fit.notes[0]


@pytest.mark.slow
def test_fit_of_a_resnet_checkpoints_the_stages_that_hold_the_activations() -> None:
    """Before the fix the fit chose ``layer4``'s two blocks only: all of them raised the max batch
    from 79 to 80 (the reason then said the target of 200 fitted)."""
    torch.manual_seed(0)
    model, sample = ResNetLike(), torch.randn(1, 3, 32, 32)
    fit = batchfit.fit(model, sample, target_batch=200, memory_limit="48MiB")
    assert fit.blocks[:2] == ("layer1.0", "layer1.1") and len(fit.blocks) == 8
    assert any("the most saved first" in note for note in fit.notes)
    none, most = fit.rows[0], fit.rows[-1]
    assert most.policy.k > 0 and most.max_batch > 1.3 * none.max_batch
