"""The evaluation step beside training (issue 36): `find(eval=True)` and `mode="eval"`.

The truth is a plain evaluation loop run outside any probe under the same live-tensor meter: the
training state live (a real AdamW step taken, its gradients freed), the model in `eval()`, forward
and loss under `torch.no_grad()`, the output kept for the metrics.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import batchfit
from batchfit.backends.cpu import LiveTensorMeter
from batchfit.report import Evaluation
from batchfit.report.boundary import Boundary
from tests.helpers import assert_same_state, state_of


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return _Net()


SAMPLE = torch.randn(1, 64, generator=torch.Generator().manual_seed(0))
LIMIT = "2MiB"


def _plain_eval_peak(model: nn.Module, rows: int) -> int:
    """The peak of one evaluation step at ``rows`` after a real training step, outside any probe."""
    optimizer = torch.optim.AdamW(model.parameters())
    model.train()
    model(SAMPLE).float().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.eval()
    batch = SAMPLE.repeat(rows, 1)
    # AdamW's `step` counters (a 0-d tensor a parameter, made by `torch.tensor(0.0)`) are not seen by the
    # live-tensor meter in a probe either: 4 bytes a parameter, left out of both sides.
    state = [
        t for entries in optimizer.state.values() for t in entries.values() if isinstance(t, torch.Tensor) and t.dim()
    ]
    meter = LiveTensorMeter(None, None, tensors=[*model.parameters(), *state, SAMPLE, batch])
    with meter.tracking(), torch.no_grad():
        meter.begin_trial()
        with meter.phase("forward"):
            output = model(batch)
            loss = output.float().mean()
            del output, loss
    return max(meter.phase_peaks().values())


def test_eval_is_sized_beside_training_with_the_training_state_live() -> None:
    model = _net()
    before = state_of(model)
    result = batchfit.find(model, SAMPLE, eval=True, memory_limit=LIMIT, timed_steps=0)
    assert_same_state(before, state_of(model))  # weights, train flags, RNG, no grads: nothing lost
    evaluation = result.evaluation
    assert evaluation is not None and evaluation.boundary_reached and evaluation.safe_verified
    assert result.eval_max_batch == evaluation.max_batch > result.max_batch  # no graph kept: far more rows
    assert result.eval_safe_batch == evaluation.safe_batch <= evaluation.max_batch
    # The boundary's trial is a plain evaluation step with AdamW's state live, byte for byte.
    at_max = next(t for t in evaluation.trials if t.batch_size == evaluation.max_batch and t.kind == "search")
    assert at_max.fits and at_max.peak_bytes == _plain_eval_peak(_net(), evaluation.max_batch)
    above = [t for t in evaluation.trials if t.batch_size == evaluation.max_batch + 1]
    assert above and not above[-1].fits
    # The optimizer's state is live in every evaluation trial: two moments and a step per parameter.
    assert evaluation.memory is not None and evaluation.memory.optimizer_state_bytes > 0
    assert "eval safe batch" in str(result)
    again = batchfit.Result.from_json(result.to_json())
    assert again.evaluation == evaluation


def test_mode_eval_alone_gives_the_evaluation_answer_of_eval_true() -> None:
    both = batchfit.find(_net(), SAMPLE, eval=True, memory_limit=LIMIT, timed_steps=0)
    alone = batchfit.find(_net(), SAMPLE, mode="eval", memory_limit=LIMIT, timed_steps=0)
    assert both.evaluation is not None
    assert (alone.max_batch, alone.safe_batch) == (both.evaluation.max_batch, both.evaluation.safe_batch)
    # The eval answer is the eval probe's, its boundary the same record: read from the probe alone, it agrees.
    assert Boundary.of(Evaluation.of(alone)) == Boundary.of(both.evaluation) == Boundary.of(alone)
    assert Evaluation.of(alone).best_throughput_batch == alone.best_throughput_batch
    assert batchfit.estimate(_net(), SAMPLE, mode="eval", memory_limit=LIMIT).max_batch == alone.max_batch


def test_an_eval_step_replaces_forward_and_loss() -> None:
    seen: list[int] = []

    def eval_step(model: nn.Module, batch: torch.Tensor) -> Any:
        seen.append(batch.shape[0])
        assert not torch.is_grad_enabled() and not model.training
        logits = model(batch)
        return logits.softmax(-1).argmax(-1)  # a metric's forward: the predictions

    result = batchfit.find(_net(), SAMPLE, eval=True, eval_step=eval_step, memory_limit=LIMIT, timed_steps=0)
    assert result.evaluation is not None
    assert result.evaluation.max_batch in seen


@pytest.mark.parametrize(
    ("keywords", "error", "words"),
    [
        ({"eval": 1}, TypeError, "eval must be True or False"),
        ({"eval": True, "mode": "inference"}, ValueError, "eval=True sizes evaluation beside a training probe"),
        ({"eval_step": lambda m, b: m(b)}, ValueError, "eval_step applies with eval=True"),
        ({"eval": True, "eval_step": 3}, TypeError, "eval_step must be callable"),
    ],
)
def test_bad_eval_input_is_named_before_any_trial(keywords: dict[str, Any], error: type, words: str) -> None:
    model = _net()
    before = state_of(model)
    calls: list[int] = []
    with pytest.raises(error, match=words):
        batchfit.find(model, SAMPLE, memory_limit=LIMIT, callback=lambda t: calls.append(t.batch_size), **keywords)
    assert calls == []
    assert_same_state(before, state_of(model))


def test_an_eval_probe_needs_something_to_train() -> None:
    model = _net().requires_grad_(False)
    with pytest.raises(ValueError, match="mode='eval'"):
        batchfit.find(model, SAMPLE, mode="eval", memory_limit=LIMIT)


def test_the_command_line_sizes_eval_beside_training(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from batchfit.cli import main

    out = tmp_path / "result.json"
    code = main(
        ["probe", "batchfit.examples:gpt", "--device", "cpu", "--memory-limit", "24MiB", "--eval",
         "--timed-steps", "0", "--json", str(out)]
    )  # fmt: skip
    printed = capsys.readouterr()
    assert code == 0, printed.err
    result = batchfit.Result.from_json(out.read_text())
    assert result.evaluation is not None and result.eval_safe_batch is not None
    assert f"eval safe batch  {result.eval_safe_batch}" in printed.out + printed.err
