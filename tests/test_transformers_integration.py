"""``batchfit.transformers.autosize``: a real Hugging Face ``Trainer``, sized by a probe, then trained.

A tiny BERT built from its config (no download) on a fixed-length in-memory dataset, on the CPU
under a live-tensor limit that puts the boundary in the tens. The probe is compared with a
``batchfit.find`` call made by hand from the same pieces (the trainer's first batch, its
``compute_loss``, its optimizer), and ``trainer.train()`` is checked to run at the size set, on
parameters untouched by the probe.
"""

from __future__ import annotations

import importlib
import logging
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import (  # noqa: E402
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import batchfit  # noqa: E402
import batchfit.transformers as bft  # noqa: E402

LIMIT = "32MiB"  # tiny BERT at length 64: max batch 34, safe batch 30 (live tensors)
LENGTH = 64


class FixedLength(torch.utils.data.Dataset):
    """``n`` token sequences of length 64, as a tokenizer with ``padding="max_length"`` gives them."""

    def __init__(self, n: int = 256) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 1000, (n, LENGTH), generator=generator)
        self.labels = torch.randint(0, 2, (n,), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.ids[index],
            "attention_mask": torch.ones(LENGTH, dtype=torch.long),
            "labels": self.labels[index],
        }


class Recording(Trainer):
    """A Trainer that records the batch size of every training step (not the probe's steps)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[int] = []

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        if self.is_in_train:
            self.seen.append(int(inputs["input_ids"].shape[0]))
        return super().compute_loss(model, inputs, *args, **kwargs)


class FirstStepParameters(TrainerCallback):
    """The model's parameters as the first optimizer step begins."""

    def __init__(self) -> None:
        self.parameters: dict[str, torch.Tensor] | None = None

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self.parameters is None:
            self.parameters = {name: p.detach().clone() for name, p in model.named_parameters()}


def tiny_bert() -> BertForSequenceClassification:
    torch.manual_seed(0)
    config = BertConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=1000,
        max_position_embeddings=64,
    )
    return BertForSequenceClassification(config)


def make_trainer(tmp_path: Path, **overrides: Any) -> Recording:
    settings: dict[str, Any] = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        max_steps=2,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        per_device_train_batch_size=2,
        disable_tqdm=True,
    )
    optimizers = overrides.pop("optimizers", (None, None))
    callbacks = overrides.pop("callbacks", None)
    samples = overrides.pop("samples", 256)
    settings.update(overrides)
    return Recording(
        model=tiny_bert(),
        args=TrainingArguments(**settings),
        train_dataset=FixedLength(samples),
        optimizers=optimizers,
        callbacks=callbacks,
    )


def by_hand(tmp_path: Path) -> batchfit.Result:
    """``batchfit.find`` on an identical trainer's own batch, loss and optimizer, written out."""
    trainer = make_trainer(tmp_path / "by_hand")
    batch = dict(next(iter(trainer.get_train_dataloader())))
    optimizer = trainer.create_optimizer()
    return batchfit.find(
        trainer.model,
        batch,
        step_fn=lambda model, b: trainer.compute_loss(model, dict(b)),
        optimizer=optimizer,
        memory_limit=LIMIT,
    )


@pytest.mark.slow
def test_autosize_sets_the_safe_batch_and_train_runs_at_it(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    expected = by_hand(tmp_path)
    assert 10 <= expected.safe_batch < 100, expected  # the boundary is in the tens

    first_step = FirstStepParameters()
    trainer = make_trainer(tmp_path / "run", callbacks=[first_step])
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    rng = torch.get_rng_state()
    registered = len(trainer.accelerator._dataloaders)
    callbacks = list(trainer.callback_handler.callbacks)

    caplog.set_level(logging.INFO, logger="batchfit.transformers")
    sized = bft.autosize(trainer, memory_limit=LIMIT)

    assert sized.result.safe_batch == expected.safe_batch
    assert sized.result.max_batch == expected.max_batch
    assert sized.batch_size == expected.safe_batch == trainer.args.per_device_train_batch_size
    assert trainer._train_batch_size == expected.safe_batch  # what the Trainer's dataloader reads
    assert sized.accumulation_steps == trainer.args.gradient_accumulation_steps == 1
    assert sized.plan is None and sized.previous_batch_size == 2
    assert any(f"-> {sized.batch_size}" in record.getMessage() for record in caplog.records)

    # Nothing else changed: no optimizer left behind, no training state, RNG and registry as before.
    assert trainer.optimizer is None and trainer.lr_scheduler is None
    assert trainer.state.global_step == 0 and trainer.seen == []
    assert torch.equal(torch.get_rng_state(), rng)
    assert len(trainer.accelerator._dataloaders) == registered
    assert trainer.callback_handler.callbacks == callbacks

    trainer.train()
    assert trainer.state.global_step == 2
    assert trainer.seen == [expected.safe_batch] * 2
    assert first_step.parameters is not None
    for name, value in before.items():
        assert torch.equal(first_step.parameters[name], value), name
    # train() built its own optimizer, with the Trainer's weight-decay split.
    assert trainer.optimizer is not None and len(trainer.optimizer.param_groups) == 2


@pytest.mark.slow
def test_target_batch_keeps_the_global_batch(tmp_path: Path) -> None:
    # 200 samples: two optimizer steps of 100 in one epoch, so every micro-batch is a full one.
    trainer = make_trainer(tmp_path, samples=200)
    sized = bft.autosize(trainer, memory_limit=LIMIT, target_batch=100)

    plan = sized.plan
    assert plan is not None and plan.exact and plan.target_batch == 100
    assert plan.micro_batch <= sized.result.safe_batch < 100
    assert plan.micro_batch * plan.accumulation_steps == 100 == sized.global_batch
    assert trainer.args.per_device_train_batch_size == plan.micro_batch == sized.batch_size
    assert trainer.args.gradient_accumulation_steps == plan.accumulation_steps > 1

    trainer.train()
    assert trainer.state.global_step == 2
    assert trainer.seen == [plan.micro_batch] * (2 * plan.accumulation_steps)


class Stop(Exception):
    """Raised by the spy in place of a probe."""


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """``find`` (as ``batchfit.transformers`` imports it) replaced by one that records its arguments and stops."""
    seen: dict[str, Any] = {}

    def fake_find(model: torch.nn.Module, sample: Any = None, **kwargs: Any) -> batchfit.Result:
        seen.update(kwargs, model=model, sample=sample, state=kwargs["optimizer"].state_dict()["state"])
        raise Stop

    monkeypatch.setattr("batchfit.transformers.find", fake_find)  # imported at module level there
    return seen


def test_probe_gets_the_trainers_batch_loss_optimizer_and_precision(tmp_path: Path, spy: dict[str, Any]) -> None:
    trainer = make_trainer(tmp_path, bf16=True, weight_decay=0.01, learning_rate=3e-4)
    with pytest.raises(Stop):
        bft.autosize(trainer, memory_limit="1GiB", headroom=0.2, max_batch=512)
    assert spy["model"] is trainer.model
    assert set(spy["sample"]) == {"input_ids", "attention_mask", "labels"}
    assert spy["sample"]["input_ids"].shape == (2, LENGTH)
    assert spy["amp"] == "bf16" and spy["memory_limit"] == "1GiB" and spy["headroom"] == 0.2
    assert spy["max_batch"] == 512
    groups = spy["optimizer"].param_groups
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0] and groups[0]["lr"] == 3e-4
    # The optimizer created for the probe is dropped again, even when the probe raises.
    assert trainer.optimizer is None
    assert trainer.args.per_device_train_batch_size == 2


def test_an_optimizer_given_to_the_trainer_is_used_and_kept(tmp_path: Path, spy: dict[str, Any]) -> None:
    trainer = make_trainer(tmp_path)
    mine = torch.optim.SGD(trainer.model.parameters(), lr=0.1, momentum=0.9)
    trainer.optimizer = mine
    with pytest.raises(Stop):
        bft.autosize(trainer)
    assert spy["optimizer"] is mine and spy["state"] == {}
    assert trainer.optimizer is mine


def test_trainer_amp() -> None:
    assert bft.trainer_amp(SimpleNamespace(bf16=True, fp16=False)) == "bf16"
    assert bft.trainer_amp(SimpleNamespace(bf16=False, fp16=True)) == "fp16"
    assert bft.trainer_amp(SimpleNamespace(bf16=False, fp16=False)) is None


def test_refuses_what_is_not_a_trainer() -> None:
    with pytest.raises(TypeError, match="transformers.Trainer"):
        bft.autosize(object())  # type: ignore[arg-type]


def test_import_safe_without_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        with monkeypatch.context() as patch:
            patch.setitem(sys.modules, "transformers", None)
            module = importlib.reload(bft)  # the import itself must not need transformers
            with pytest.raises(ImportError, match=r"pip install 'batchfit\[transformers\]'"):
                module.autosize(object())  # type: ignore[arg-type]
    finally:
        importlib.reload(bft)
    assert "transformers" in sys.modules and sys.modules["transformers"] is not None


def test_warns_when_train_would_turn_on_checkpointing_after_the_probe(
    tmp_path: Path, spy: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    trainer = make_trainer(tmp_path, activation_checkpointing=True)
    with pytest.raises(Stop):
        bft.autosize(trainer)
    assert any("activation checkpointing" in record.getMessage() for record in caplog.records)
    caplog.clear()
    trainer.model.activation_checkpointing_enable()  # probed as train() will run it: nothing to say
    with pytest.raises(Stop):
        bft.autosize(trainer)
    assert not any("activation checkpointing" in record.getMessage() for record in caplog.records)


# The noise scale ---------------------------------------------------------------------------------
class Counted(Recording):
    """Counts every ``compute_loss`` call: the probe's, the noise scale's and the run's."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls = 0

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return super().compute_loss(model, inputs, *args, **kwargs)


class Logs(TrainerCallback):
    """What ``trainer.log`` handed to the callbacks."""

    def __init__(self) -> None:
        self.logs: list[dict[str, float]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        self.logs.append(dict(logs or {}))


def _counted_autosize(
    tmp_path: Path, noise_scale: bool, samples: int = 600, **kwargs: Any
) -> tuple[Counted, bft.Autosized, Logs, int]:
    """``autosize`` on a counting trainer; also the calls made after the probe's last trial. 600
    samples give the noise scale the 16 batches at the safe batch (30) it needs at the least."""
    logs = Logs()
    trainer = Counted(
        model=tiny_bert(),
        args=TrainingArguments(
            output_dir=str(tmp_path), use_cpu=True, max_steps=2, report_to=[], save_strategy="no",
            logging_strategy="no", per_device_train_batch_size=2, disable_tqdm=True,
        ),
        train_dataset=FixedLength(samples),
        callbacks=[logs],
    )  # fmt: skip
    at_last_trial = [0]
    rng, registered = torch.get_rng_state(), len(trainer.accelerator._dataloaders)
    sized = bft.autosize(
        trainer,
        memory_limit=LIMIT,
        noise_scale=noise_scale,
        callback=lambda trial: at_last_trial.__setitem__(0, trainer.calls),
        **kwargs,
    )
    assert torch.equal(torch.get_rng_state(), rng) and len(trainer.accelerator._dataloaders) == registered
    assert trainer.optimizer is None and trainer.state.global_step == 0
    return trainer, sized, logs, trainer.calls - at_last_trial[0]


@pytest.mark.slow
def test_noise_scale_off_runs_no_extra_pass_and_logs_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="batchfit.transformers")
    trainer, sized, logs, extra = _counted_autosize(tmp_path, noise_scale=False)
    assert extra == 0 and sized.result.noise_scale is None and logs.logs == []
    assert not any("recommended" in record.getMessage() for record in caplog.records)
    assert sized.recommendation == sized.result.recommendation  # still there, as advice
    with pytest.raises(TypeError, match="noise_scale must be True or False"):
        bft.autosize(trainer, noise_scale="yes")  # type: ignore[arg-type]


@pytest.mark.slow
def test_noise_scale_on_measures_from_the_train_dataloader_and_logs_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="batchfit.transformers")
    trainer, sized, logs, extra = _counted_autosize(tmp_path, noise_scale=True, noise_passes=16)
    noise, recommendation = sized.result.noise_scale, sized.recommendation
    assert noise is not None and 0 < noise.passes <= 16 and extra >= noise.passes
    assert recommendation is not None and recommendation == sized.result.recommendation
    assert recommendation.noise_low == noise.low
    (logged,) = logs.logs
    assert logged["batchfit/noise_scale_low"] == noise.low
    assert logged["batchfit/recommended_batch"] == recommendation.batch_size
    assert any(recommendation.reason in record.getMessage() for record in caplog.records)
    assert sized.batch_size == sized.result.safe_batch  # the batch set is the probe's, as without it
    trainer.train()
    assert trainer.seen == [sized.batch_size] * 2


@pytest.mark.slow
def test_too_few_batches_for_the_noise_scale_warn_and_autosize_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trainer, sized, logs, _ = _counted_autosize(tmp_path, noise_scale=True, samples=256, noise_passes=16)
    assert sized.result.noise_scale is None and logs.logs == []
    assert any("no noise scale measured" in record.getMessage() for record in caplog.records)
    assert sized.batch_size == sized.result.safe_batch == trainer.args.per_device_train_batch_size


@pytest.mark.slow
def test_checkpointing_applies_the_policy_fit_recommends_and_train_runs_with_it(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, samples=200)
    sized = bft.autosize(trainer, memory_limit=LIMIT, target_batch=100, checkpointing="auto")
    assert sized.fit is not None and sized.result is None and sized.applied is not None
    recommended = sized.fit.recommendation
    assert (sized.batch_size, sized.accumulation_steps) == (recommended.batch_size, recommended.accumulation)
    assert trainer.args.per_device_train_batch_size * trainer.args.gradient_accumulation_steps == 100
    policy = sized.fit.policy
    flagged = [n for n, m in trainer.model.named_modules() if getattr(m, "gradient_checkpointing", False) is True]
    wrapped = [n for n, m in trainer.model.named_modules() if "forward" in m.__dict__]
    assert set(policy.checkpointed) <= set(flagged) | set(wrapped)  # applied for train(), as the log says
    trainer.train()
    assert trainer.state.global_step == 2


def test_checkpointing_needs_a_target_batch(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"autosize\(checkpointing=...\) needs target_batch"):
        bft.autosize(make_trainer(tmp_path), memory_limit=LIMIT, checkpointing="auto")


# Evaluation --------------------------------------------------------------------------------------
GPT2_LIMIT = "24MiB"  # a 2-layer GPT-2 at length 32: trains up to 28, evaluates up to 136 (live tensors)
GPT2_LENGTH = 32


class Texts(torch.utils.data.Dataset):
    """``n`` token sequences of length 32 for a causal LM (the labels are the inputs)."""

    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, 512, (n, GPT2_LENGTH), generator=torch.Generator().manual_seed(n))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ones = torch.ones(GPT2_LENGTH, dtype=torch.long)
        return {"input_ids": self.ids[index], "attention_mask": ones, "labels": self.ids[index]}


class Evaluating(Trainer):
    """Records the batch of every ``prediction_step`` call: the probe's evaluation steps and the run's."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.predicted: list[int] = []

    def prediction_step(self, model: torch.nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        self.predicted.append(int(inputs["input_ids"].shape[0]))
        return super().prediction_step(model, inputs, *args, **kwargs)


def gpt2_trainer(tmp_path: Path, eval_samples: int | None = 160) -> Evaluating:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=GPT2_LENGTH, bos_token_id=0, eos_token_id=0
    )
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, max_steps=1, report_to=[], save_strategy="no", logging_strategy="no",
        per_device_train_batch_size=2, per_device_eval_batch_size=2, disable_tqdm=True,
    )  # fmt: skip
    return Evaluating(
        model=GPT2LMHeadModel(config),
        args=args,
        train_dataset=Texts(64),
        eval_dataset=Texts(eval_samples) if eval_samples else None,
    )


@pytest.mark.slow
def test_autosize_sizes_evaluation_with_the_trainers_prediction_step_and_sets_the_eval_batch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trainer = gpt2_trainer(tmp_path)
    caplog.set_level(logging.INFO, logger="batchfit.transformers")
    sized = bft.autosize(trainer, memory_limit=GPT2_LIMIT)

    result = sized.result
    assert result.evaluation is not None and result.evaluation.safe_verified
    eval_batch = result.eval_safe_batch
    # No gradients, no activations kept for backward: evaluation fits several times the train batch.
    assert result.safe_batch < 2 * result.safe_batch < eval_batch < result.eval_max_batch < 160
    assert trainer.args.per_device_eval_batch_size == sized.eval_batch_size == eval_batch
    assert sized.previous_eval_batch_size == 2 and sized.batch_size == result.safe_batch
    assert f"per_device_eval_batch_size 2 -> {eval_batch}" in str(sized)
    assert any("eval_accumulation_steps" in record.getMessage() for record in caplog.records)
    # The probe's evaluation steps went through the trainer's own prediction_step.
    assert eval_batch in trainer.predicted and result.eval_max_batch in trainer.predicted
    assert trainer.optimizer is None and trainer.state.global_step == 0

    trainer.predicted.clear()
    trainer.train()
    metrics = trainer.evaluate()
    assert trainer.predicted == [eval_batch, 160 - eval_batch]  # the run evaluates at the size set
    assert metrics["eval_loss"] > 0


def test_evaluation_is_sized_when_the_trainer_has_an_eval_set_unless_told_otherwise(
    tmp_path: Path, spy: dict[str, Any]
) -> None:
    trainer = make_trainer(tmp_path)
    with pytest.raises(Stop):
        bft.autosize(trainer)  # no eval_dataset: training only
    assert "eval" not in spy and "eval_step" not in spy

    trainer.eval_dataset = FixedLength(8)
    spy.clear()
    with pytest.raises(Stop):
        bft.autosize(trainer)
    assert spy["eval"] is True
    loss, logits, labels = spy["eval_step"](trainer.model, spy["sample"])  # the trainer's prediction_step
    assert loss.ndim == 0 and logits.shape == (2, 2) and torch.equal(labels, spy["sample"]["labels"])

    spy.clear()
    with pytest.raises(Stop):
        bft.autosize(trainer, eval=False)
    assert spy["eval"] is False and "eval_step" not in spy

    mine = lambda model, batch: model(**batch)  # noqa: E731
    spy.clear()
    with pytest.raises(Stop):
        bft.autosize(make_trainer(tmp_path), eval=True, eval_step=mine)  # asked for, without an eval set
    assert spy["eval"] is True and spy["eval_step"] is mine
    assert trainer.args.per_device_eval_batch_size == 8  # nothing set when the probe did not finish


def test_checkpointing_sizes_training_only(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="sizes training only"):
        bft.autosize(make_trainer(tmp_path), memory_limit=LIMIT, target_batch=100, checkpointing="auto", eval=True)
