"""`BatchSchedulerCallback`: a real GPT-2 trained by a real ``Trainer`` on CPU, its batch grown by the schedule.

Each optimizer step's micro-batches are counted by a forward hook and an ``on_step_end`` callback of
the test's own, so what is checked is what the Trainer's loop did, not what the schedule says it did.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from batchfit.examples import text_ids  # noqa: E402
from batchfit.transformers_schedule import BatchSchedulerCallback, _Accumulation, _accumulation_at  # noqa: E402

MICRO = 2
WINDOW = 16


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny steps on a busy machine: more threads only fight over its cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Windows(torch.utils.data.Dataset):
    """``count`` windows of real text of ``length`` tokens, labels = inputs (the model shifts them)."""

    def __init__(self, count: int, length: int = WINDOW) -> None:
        ids = text_ids()[: count * length].view(count, length)
        self.rows = [{"input_ids": row, "labels": row.clone()} for row in ids]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.rows[index]


class Counted(TrainerCallback):
    """Micro-batches (training forwards) per optimizer step, and the learning rate after each."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.forwards = 0
        self.per_step: list[int] = []
        self.lrs: list[float] = []
        model.register_forward_pre_hook(self._forward)

    def _forward(self, module: torch.nn.Module, inputs: Any) -> None:
        if module.training:
            self.forwards += 1

    def on_step_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        self.per_step.append(self.forwards)
        self.forwards = 0
        self.lrs.append(float(optimizer.param_groups[0]["lr"]))


def model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=256, n_positions=32, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def trainer(
    tmp_path: Path,
    callback: BatchSchedulerCallback,
    *,
    windows: int = 40,
    length: int = WINDOW,
    accumulation: int = 2,
    **arguments: Any,
) -> tuple[Trainer, Counted]:
    net = model()
    counted = Counted(net)
    settings: dict[str, Any] = {
        "per_device_train_batch_size": MICRO,
        "gradient_accumulation_steps": accumulation,
        "learning_rate": 1e-3,
        "lr_scheduler_type": "constant",
        "num_train_epochs": 1,
        "report_to": [],
        "save_strategy": "no",
        "use_cpu": True,
        "logging_strategy": "no",
        "disable_tqdm": True,
        "seed": 0,
        "dataloader_num_workers": 0,
    }
    settings.update(arguments)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), **settings)
    made = Trainer(model=net, args=args, train_dataset=Windows(windows, length), callbacks=[callback, counted])
    return made, counted


def expected_steps(callback: BatchSchedulerCallback) -> list[int]:
    """The accumulation the schedule set for each step it counted (1-based), from its changes."""
    state = callback.schedule_state
    accumulation, at = [], state.rule.accumulation
    changes = list(state.changes)
    for step in range(1, state.step + 1):
        accumulation.append(at)
        while changes and changes[0].step == step:
            at = changes.pop(0).accumulation
    return accumulation


def check_followed(callback: BatchSchedulerCallback, counted: Counted, epoch_micro_batches: int) -> None:
    """Every step took the schedule's accumulation; only an epoch's last step may be its remainder."""
    expected = expected_steps(callback)
    assert len(counted.per_step) == len(expected)
    done = 0
    for took, wanted in zip(counted.per_step, expected):
        done += took
        if done % epoch_micro_batches == 0 and took < wanted:  # the epoch's short last step
            continue
        assert took == wanted, (counted.per_step, expected)


# Deterministic changes ---------------------------------------------------------------------------
@pytest.mark.slow
def test_a_ramp_grows_the_trainers_batch_step_by_step(tmp_path: Path) -> None:
    # 20 micro-batches an epoch. Steps of 4 samples: 12 samples after step 3 -> accumulation 4 where
    # the epoch has run 6 micro-batches (not a multiple of 4); 36 after step 6 -> 8 at 18 (nor of 8).
    callback = BatchSchedulerCallback(policy="ramp", thresholds=(12, 36), min_steps=1, max_accumulation=8)
    run, counted = trainer(tmp_path, callback, windows=40, num_train_epochs=2)
    run.train()

    state = callback.schedule_state
    assert [(c.step, c.accumulation) for c in state.changes] == [(3, 4), (6, 8)]
    assert "ramp: 12 samples passed the threshold 12" in state.changes[0].reason
    # epoch 1: 2, 2, 2, 4, 4, 4, 2 (its last 2 micro-batches); epoch 2: 8, 8, 4 (its remainder)
    assert counted.per_step == [2, 2, 2, 4, 4, 4, 2, 8, 8, 4]
    check_followed(callback, counted, 20)
    assert run.state.global_step == state.step == 10
    assert sum(counted.per_step) == 2 * 20  # every micro-batch of both epochs, none twice
    # The learning rate followed the batch by the square root (AdamW) from the step after a change.
    assert counted.lrs == pytest.approx([1e-3] * 2 + [1e-3 * math.sqrt(2)] * 3 + [2e-3] * 5)
    assert state.lr_factor == pytest.approx(2.0)
    assert run.lr_scheduler.base_lrs == pytest.approx([2e-3, 2e-3])  # both parameter groups
    # Logged with the reason, in the Trainer's own history; the user's setting put back after.
    logged = [r for r in run.state.log_history if "batchfit/global_batch" in r]
    assert [(r["step"], r["batchfit/global_batch"]) for r in logged] == [(3, 8), (6, 16)]
    assert run.args.gradient_accumulation_steps == 2 and type(run.args.gradient_accumulation_steps) is int
    # Exports: the realised schedule in samples (4 until 12 samples, 8 until 36, then 16).
    assert callback.megatron() == "0:4 12:8 36:16"
    assert callback.olmo_core(seq_length=WINDOW) == {"batch_sizes": [64, 128, 256], "schedule": [0, 192, 576]}


@pytest.mark.slow
def test_the_noise_scale_drives_the_trainers_batch(tmp_path: Path) -> None:
    # Rows of 4 tokens: the tiny GPT's noise scale at the start is some 20-30 rows, far above a batch of 4.
    callback = BatchSchedulerCallback(
        policy="noise", every=1, min_steps=2, settle=1, max_accumulation=8, fraction=1.0
    )  # fraction=1: doubles once B_simple itself reaches the doubled batch
    run, counted = trainer(tmp_path, callback, windows=64, length=4)
    run.train()

    state = callback.schedule_state
    assert state.windows > 0 and state.noise[0].b_simple is not None
    assert [(c.step, c.accumulation) for c in state.changes] == [(2, 4), (4, 8)]
    assert all(c.noise_scale is not None and "B_simple" in c.reason for c in state.changes)
    check_followed(callback, counted, 32)
    assert state.step == run.state.global_step == len(counted.per_step)
    assert state.samples == MICRO * sum(counted.per_step)  # the micro-batches the Trainer really took
    assert counted.lrs[-1] == pytest.approx(1e-3 * state.lr_factor)


@pytest.mark.slow
def test_a_step_the_loop_did_not_take_as_set_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A plain int at the misaligned change (after 6 micro-batches, accumulation 4): the Trainer would
    # end the next step after 2 micro-batches of the 4 it fetched. The callback's count says so.
    monkeypatch.setattr("batchfit.transformers_schedule._accumulation_at", lambda accumulation, done: accumulation)
    callback = BatchSchedulerCallback(policy="ramp", thresholds=(12,), min_steps=1, max_accumulation=8)
    run, _ = trainer(tmp_path, callback, windows=40)
    with pytest.raises(RuntimeError, match="optimizer step 4 took 2 micro-batches .* gradient_accumulation_steps=4"):
        run.train()


# Resuming ----------------------------------------------------------------------------------------
def _ramp() -> BatchSchedulerCallback:
    return BatchSchedulerCallback(policy="ramp", thresholds=(12, 36), min_steps=1, max_accumulation=8)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("at", "restore", "steps"),
    [
        (4, False, [4, 4, 8, 8]),  # the callback reads its state from the checkpoint's TrainerState itself
        # Step 3: the Trainer resumes 6 micro-batches into the epoch, at accumulation 4 (not a multiple),
        # and transformers restores the callback itself, as a new instance.
        (3, True, [4, 4, 4, 8, 8]),
    ],
)
def test_a_checkpoint_resumes_the_schedule(tmp_path: Path, at: int, restore: bool, steps: list[int]) -> None:
    whole = _ramp()
    run, _ = trainer(tmp_path, whole, windows=80, max_steps=8, save_strategy="steps", save_steps=at)
    run.train()
    checkpoint = tmp_path / "out" / f"checkpoint-{at}"
    saved = json.loads((checkpoint / "trainer_state.json").read_text())["stateful_callbacks"]["BatchSchedulerCallback"]
    assert saved["attributes"]["saved"]["step"] == at and saved["attributes"]["saved"]["accumulation"] == 4

    given = _ramp()
    again, counted = trainer(tmp_path, given, windows=80, max_steps=8, restore_callback_states_from_checkpoint=restore)
    again.train(resume_from_checkpoint=str(checkpoint))
    resumed = BatchSchedulerCallback.of(again)
    assert (resumed is given) is not restore
    # The same schedule as the run that was not interrupted: steps, samples, changes, learning rate.
    assert resumed.schedule_state.to_dict() == whole.schedule_state.to_dict()
    assert counted.per_step == steps  # from step at + 1: accumulation 4, then 8 from step 6's change on
    assert counted.lrs[-1] == pytest.approx(2e-3)


@pytest.mark.slow
def test_a_schedule_saved_on_another_world_size_is_refused(tmp_path: Path) -> None:
    run, _ = trainer(tmp_path, _ramp(), windows=40, max_steps=2, save_strategy="steps", save_steps=2)
    run.train()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    path = checkpoint / "trainer_state.json"
    data = json.loads(path.read_text())
    data["stateful_callbacks"]["BatchSchedulerCallback"]["attributes"]["saved"]["rule"]["world_size"] = 2
    path.write_text(json.dumps(data))

    again, _ = trainer(tmp_path, _ramp(), windows=40, max_steps=4)
    with pytest.raises(ValueError, match="ran on 2 ranks and this run has 1"):
        again.train(resume_from_checkpoint=str(checkpoint))
    assert again.args.gradient_accumulation_steps == 2


# Bad input ---------------------------------------------------------------------------------------
def test_accumulation_one_on_one_process_is_refused_when_the_trainer_is_built(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="accumulation 1 on one process"):
        trainer(tmp_path, BatchSchedulerCallback(), accumulation=1)


@pytest.mark.parametrize(
    ("settings", "error", "match"),
    [
        ({"policy": "sometimes"}, ValueError, "policy must be one of"),
        ({"policy": "ramp"}, ValueError, "thresholds="),
        ({"lr_rule": "cube"}, ValueError, "lr_rule must be one of"),
        ({"every": 0}, ValueError, "every"),
        ({"decay": 1.0}, ValueError, "decay"),
        ({"accumulation": 4, "max_accumulation": 2}, ValueError, "max_accumulation"),
        ({"thresholds": "12"}, TypeError, "thresholds"),
    ],
)
def test_bad_settings_are_refused_at_once(settings: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        BatchSchedulerCallback(**settings)


def test_settings_the_trainer_contradicts_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="micro_batch=4, but the Trainer trains micro-batches of 2"):
        trainer(tmp_path, BatchSchedulerCallback(micro_batch=4))
    with pytest.raises(ValueError, match="accumulation=2 is below the Trainer's gradient_accumulation_steps=4"):
        trainer(tmp_path, BatchSchedulerCallback(accumulation=2), accumulation=4)


def test_no_schedule_before_training() -> None:
    callback = BatchSchedulerCallback(policy="ramp", thresholds=(8,))
    with pytest.raises(RuntimeError, match="starts with trainer.train"):
        callback.megatron()
    assert callback.state() == {"args": callback.settings, "attributes": {"saved": None}}
    json.dumps(callback.state())  # a checkpoint's trainer_state.json holds it


# The mechanism -----------------------------------------------------------------------------------
def test_the_accumulation_counts_its_steps_from_where_it_took_effect() -> None:
    # The Trainer ends a step where (step + 1) % gradient_accumulation_steps == 0, step counting the
    # epoch's micro-batches from 0: from micro-batch 6 on, steps of 4 end after 9, 13, 17, ...
    accumulation = _accumulation_at(4, 6)
    assert accumulation == 4 and isinstance(accumulation, _Accumulation)
    assert [step for step in range(6, 20) if (step + 1) % accumulation == 0] == [9, 13, 17]
    assert [step for step in range(6, 20) if step % accumulation == 0] == [6, 10, 14, 18]
    assert list(range(accumulation)) == [0, 1, 2, 3] and accumulation * 2 == 8
    assert type(_accumulation_at(4, 8)) is int
    import pickle

    assert type(pickle.loads(pickle.dumps(accumulation))) is int


def test_importing_the_front_end_imports_neither_transformers_nor_torch() -> None:
    code = "import sys, batchfit.transformers; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    import batchfit.transformers

    assert batchfit.transformers.BatchSchedulerCallback is BatchSchedulerCallback
