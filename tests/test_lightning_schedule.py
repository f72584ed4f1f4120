"""``batchfit.lightning.BatchScheduler``: a real Trainer training the built-in GPT on real text, on CPU.

The runs are tiny (a 1-layer GPT of width 32, micro-batches of 4 windows of 32 bytes) but real: the
callback steers Lightning's own accumulation, and the tests count what the trainer really did (the
optimizer steps, the rows ``training_step`` saw) against the schedule's state.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytest

pl = pytest.importorskip("lightning.pytorch")
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import batchfit.examples  # noqa: E402
import batchfit.lightning_schedule  # noqa: E402
from batchfit.lightning import INSTALL_HINT, BatchScheduler  # noqa: E402

LR = 1e-3
#: ramp thresholds (samples): 8 is passed after step 1, where doubling 2 -> 4 would put the next
#: step's boundary (batch 2) off Lightning's, so it waits a step; 40 likewise waits from step 4 to 5.
RAMP = (8, 40)


class TinyOptimizer(torch.optim.Optimizer):
    """An optimizer batchfit has never heard of: plain gradient descent under another name."""

    def __init__(self, params: Any, lr: float = LR) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None if closure is None else closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])
        return loss


class Language(pl.LightningModule):
    """The built-in GPT on `text_loader` (or, ``noisy``, on random bytes one in twenty of them a zero:
    a weak signal in strong noise, a noise scale near 30 where the text's is near 1 at the start);
    counts the rows the training loop fed it."""

    def __init__(
        self, optimizer: str = "adamw", batch_size: int = 4, manual: bool = False, noisy: bool = False
    ) -> None:
        super().__init__()
        self.model, _ = batchfit.examples.gpt(vocab_size=256, seq_len=32, d_model=32, n_layers=1)
        self.optimizer, self.batch_size, self.noisy = optimizer, batch_size, noisy
        self.automatic_optimization = not manual
        self.rows = 0

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.rows += len(batch["input_ids"])
        return self.model(**batch)["loss"]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "tiny":
            return TinyOptimizer(self.parameters())
        return torch.optim.AdamW(self.parameters(), lr=LR)

    def train_dataloader(self) -> Any:
        if self.noisy:
            generator = torch.Generator().manual_seed(0)
            ids = torch.randint(0, 256, (512, 32), generator=generator)
            ids[torch.rand(512, 32, generator=generator) < 0.05] = 0  # the one thing to learn: zeros are common
            return DataLoader([{"input_ids": row, "labels": row} for row in ids], batch_size=self.batch_size)
        return batchfit.examples.text_loader(seq_len=32, batch_size=self.batch_size)


def trainer(callback: BatchScheduler, **kwargs: Any) -> pl.Trainer:
    settings = {"accumulate_grad_batches": 2, "max_steps": 8, **kwargs}
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        callbacks=[callback],
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **settings,
    )


def ramp() -> BatchScheduler:
    return BatchScheduler(policy="ramp", thresholds=RAMP, min_steps=1)


def fitted(callback: BatchScheduler, module: Language | None = None, ckpt: Path | None = None, **kwargs: Any) -> Any:
    module = module or Language()
    run = trainer(callback, **kwargs)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(num_workers|resuming from a checkpoint).*")
        run.fit(module, ckpt_path=ckpt)
    return run, module


# what a run does ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_ramp_changes_lightnings_accumulation_and_counts_what_the_trainer_trained() -> None:
    callback = ramp()
    run, module = fitted(callback)
    state = callback.schedule.state
    assert run.global_step == state.step == 8
    assert module.rows == state.samples == 2 * 8 + 3 * 16 + 3 * 32  # K = 2, 4, 8 over steps 1-2, 3-5, 6-8
    # Each change waited for a step boundary the doubled accumulation keeps.
    assert [(c.step, c.samples, c.accumulation) for c in callback.changes] == [(2, 16, 4), (5, 64, 8)]
    assert run.accumulate_grad_batches == state.accumulation == 8
    assert run.optimizers[0].param_groups[0]["lr"] == pytest.approx(LR * 2)  # sqrt(2) per doubling, AdamW
    assert callback.megatron() == "0:8 16:16 64:32"
    assert callback.megatron(seq_length=32) == "0:8 512:16 2048:32"  # thresholds in tokens
    assert callback.olmo_core() == {"batch_sizes": [8, 16, 32], "schedule": [0, 16, 64]}
    assert run.callback_metrics["batchfit/global_batch"] == 32


@pytest.mark.slow
def test_an_epochs_short_last_step_counts_its_rows_and_a_new_epoch_is_a_boundary() -> None:
    """Seven batches an epoch: Lightning steps at batches 2, 4 and, short, at 7 (then 4 and 7 at 4)."""
    callback = BatchScheduler(policy="ramp", thresholds=(8,), min_steps=1)
    run, module = fitted(callback, max_steps=-1, max_epochs=2, limit_train_batches=7)
    state = callback.schedule.state
    assert run.global_step == state.step == 5
    assert module.rows == state.samples == 14 * 4
    assert [(c.step, c.accumulation) for c in callback.changes] == [(2, 4)]


@pytest.mark.slow
def test_the_noise_scale_drives_a_change_measured_from_lightnings_micro_batches() -> None:
    callback = BatchScheduler(every=1, min_steps=2, settle=1, lr_rule="linear")
    run, module = fitted(callback, module=Language(batch_size=2, noisy=True), max_steps=10)
    state = callback.schedule.state
    assert run.global_step == state.step == 10
    assert module.rows == state.samples
    assert state.windows == 10 and state.b_simple is not None
    assert callback.changes, f"no change at B_simple {state.b_simple}"
    first = callback.changes[0]
    assert first.noise_scale is not None and first.noise_scale >= first.global_batch
    assert run.optimizers[0].param_groups[0]["lr"] == pytest.approx(LR * state.lr_factor)
    assert state.lr_factor == pytest.approx(2 ** len(callback.changes))
    assert run.accumulate_grad_batches == state.accumulation > 2
    assert run.callback_metrics["batchfit/noise_scale"] == pytest.approx(state.b_simple)


@pytest.mark.slow
def test_the_layernorm_meter_measures_without_accumulation() -> None:
    callback = BatchScheduler(meter="layernorm", every=1, min_steps=2, settle=1)
    run, module = fitted(callback, module=Language(batch_size=4, noisy=True), accumulate_grad_batches=1, max_steps=6)
    state = callback.schedule.state
    assert run.global_step == state.step == 6 and module.rows == state.samples
    assert state.windows >= 2 and state.recent[-1][2:] == (1, 4)  # an example against its micro-batch
    assert run.accumulate_grad_batches == state.accumulation


# resuming ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run stopped after step 3 (accumulation 4, the first change made), saved."""
    run, _ = fitted(ramp(), max_steps=3)
    path = tmp_path_factory.mktemp("schedule") / "step3.ckpt"
    run.save_checkpoint(path)
    return path


@pytest.mark.slow
def test_a_resumed_run_continues_the_schedule_as_an_unbroken_run_does(checkpoint: Path) -> None:
    whole, _ = fitted(unbroken := ramp())
    resumed = ramp()
    run, module = fitted(resumed, ckpt=checkpoint)  # the Trainer starts at accumulation 2 again
    assert run.global_step == resumed.schedule.state.step == 8
    assert resumed.changes == unbroken.changes
    assert resumed.schedule.state.samples == unbroken.schedule.state.samples
    assert module.rows == resumed.schedule.state.samples - 2 * 8 - 16  # this process trained steps 4-8
    assert run.accumulate_grad_batches == 8
    assert run.optimizers[0].param_groups[0]["lr"] == pytest.approx(whole.optimizers[0].param_groups[0]["lr"])


@pytest.mark.slow
def test_a_resume_on_another_world_size_is_refused_naming_it(checkpoint: Path, tmp_path: Path) -> None:
    saved = torch.load(checkpoint, weights_only=False)
    saved["callbacks"]["BatchScheduler"]["schedule"]["rule"]["world_size"] = 2
    torch.save(saved, moved := tmp_path / "two_ranks.ckpt")
    module = Language()
    with pytest.raises(ValueError, match="ran on 2 ranks and this run has 1"):
        fitted(ramp(), module=module, ckpt=moved)
    assert module.rows == 0


# refused -----------------------------------------------------------------------------------------
def test_accumulation_one_on_one_process_is_refused_naming_it() -> None:
    module = Language()
    with pytest.raises(ValueError, match="accumulation 1 on one process"):
        fitted(BatchScheduler(), module=module, accumulate_grad_batches=1)
    assert module.rows == 0


def test_an_optimizer_of_unknown_family_needs_an_lr_rule() -> None:
    module = Language(optimizer="tiny")
    with pytest.raises(ValueError, match="learning rate of TinyOptimizer"):
        fitted(BatchScheduler(), module=module)
    assert module.rows == 0


def test_manual_optimization_is_refused() -> None:
    with pytest.raises(ValueError, match="manual optimization"):
        fitted(BatchScheduler(accumulation=2), module=Language(manual=True), accumulate_grad_batches=1)


def test_a_micro_batch_other_than_the_loaders_is_refused() -> None:
    module = Language()
    with pytest.raises(ValueError, match=r"micro_batch=8\) but the train dataloader's batch_size is 4"):
        fitted(BatchScheduler(micro_batch=8), module=module)
    assert module.rows == 0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"policy": "cosine"}, ValueError, "policy must be one of"),
        ({"lr_rule": "cube"}, ValueError, "lr_rule must be one of"),
        ({"every": 0}, ValueError, "every"),
        ({"policy": "ramp"}, ValueError, "thresholds="),
        ({"policy": "ramp", "thresholds": (40, 8)}, ValueError, "increasing"),
        ({"thresholds": "8"}, TypeError, "thresholds must be a sequence"),
        ({"accumulation": 4, "max_accumulation": 2}, ValueError, r"max_accumulation \(2\) is below"),
        ({"decay": 1.0}, ValueError, "decay"),
    ],
)
def test_bad_settings_are_refused_at_construction(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        BatchScheduler(**kwargs)


def test_without_lightning_construction_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batchfit.lightning_schedule, "_MISSING", ImportError("no lightning"))
    with pytest.raises(ImportError, match=INSTALL_HINT.replace("[", r"\[").replace("]", r"\]")):
        BatchScheduler()


def test_before_fit_there_is_no_schedule_to_export() -> None:
    callback = BatchScheduler()
    assert callback.schedule is None and callback.changes == () and callback.state_dict() == {}
    with pytest.raises(RuntimeError, match=r"after trainer.fit\(\)"):
        callback.megatron()
    assert math.isfinite(callback.settings["decay"])
