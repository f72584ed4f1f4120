"""``batchfit.lightning.BatchFit``: a real Trainer, real DataLoaders, under batchfit's CPU live-tensor cap.

The model is an MLP classifier whose ``training_step`` logs and updates a torchmetrics metric, as
ordinary Lightning code does; the probe must neither break on that nor leave a trace in it. The
two-rank case runs this file as a script (``python tests/test_lightning.py OUT_DIR``), which starts
``Trainer(strategy="ddp_spawn", devices=2)``; each rank writes what it saw to ``OUT_DIR``, and the
script runs under a timeout so that a hang fails the test.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

pl = pytest.importorskip("lightning.pytorch")
import torch  # noqa: E402
import torchmetrics  # noqa: E402
from lightning.pytorch.utilities.exceptions import MisconfigurationException  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import batchfit  # noqa: E402
import batchfit.lightning  # noqa: E402
import batchfit.lightning_trainer  # noqa: E402
from batchfit.lightning import INSTALL_HINT, BatchFit  # noqa: E402

#: Live tensor bytes: the MLP below trains up to 220 samples under it (weights, gradients and AdamW
#: state take 5.4 MiB, a sample about 128 KiB): a search of 10 trials of small steps.
LIMIT = "32MiB"
FEATURES, HIDDEN, CLASSES, ROWS = 32, 8192, 10, 2048
SPAWN_TIMEOUT_S = 90


def dataset(rows: int = ROWS) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(rows, FEATURES, generator=generator), torch.randint(0, CLASSES, (rows,), generator=generator)
    )


class Classifier(pl.LightningModule):
    """An MLP classifier that reads its dataloader's batch size from ``self.batch_size``, and
    records what the real training loop fed it (``on_train_batch_start`` runs only there)."""

    def __init__(self, batch_size: int | None = 4) -> None:
        super().__init__()
        if batch_size is not None:  # None: the datamodule holds it
            self.batch_size = batch_size
        self.net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(HIDDEN, CLASSES)
        )
        self.mean_loss = torchmetrics.MeanMetric()
        self.trained_batches: list[int] = []
        self.at_first_step: dict[str, Any] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.mean_loss(loss.detach())
        self.log("train_loss", loss, prog_bar=True)
        self.log("mean_loss", self.mean_loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.05)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(dataset(), batch_size=self.batch_size, shuffle=True)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.trained_batches.append(len(batch[0]))
        if not self.at_first_step:
            self.at_first_step = {
                "params": {name: p.detach().clone() for name, p in self.named_parameters()},
                "metric_updates": self.mean_loss._update_count,
            }


class Data(pl.LightningDataModule):
    """A datamodule that holds the batch size in its hparams."""

    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(dataset(), batch_size=self.hparams.batch_size)


class RngAt(pl.Callback):
    """The CPU generator's state in ``on_fit_start`` (callbacks run in list order)."""

    def __init__(self) -> None:
        self.state: torch.Tensor | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.state = torch.get_rng_state()


def trainer(*callbacks: pl.Callback, **kwargs: Any) -> pl.Trainer:
    options: dict[str, Any] = {
        "max_steps": 2,
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        **kwargs,
    }
    return pl.Trainer(callbacks=list(callbacks), **options)


def reference(model: Classifier, batch_size: int) -> batchfit.Result:
    """``batchfit.find`` called by hand on a copy: the same training_step (its log calls only warn
    on a module without a trainer), the same AdamW, the same batch shape and limit."""
    batch = next(iter(DataLoader(dataset(), batch_size=batch_size)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return batchfit.find(
            model,
            batch,
            step_fn=lambda m, b: m.training_step(b, 0),
            optimizer=model.configure_optimizers(),
            memory_limit=LIMIT,
        )


@pytest.fixture
def infos(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What the callback logged with ``rank_zero_info``."""
    import lightning.pytorch.utilities.rank_zero as rank_zero

    messages: list[str] = []
    monkeypatch.setattr(rank_zero, "rank_zero_info", lambda message, *a, **k: messages.append(message))
    return messages


@pytest.mark.slow
def test_trains_at_the_safe_batch_that_find_reports(infos: list[str]) -> None:
    model = Classifier()
    twin = copy.deepcopy(model)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    callback, rng_before, rng_after = BatchFit(memory_limit=LIMIT), RngAt(), RngAt()
    fit = trainer(rng_before, callback, rng_after)
    fit.fit(model)

    expected = reference(twin, batch_size=4)
    assert callback.result is not None and callback.plan is None
    assert callback.result.safe_batch == expected.safe_batch
    assert callback.result.max_batch == expected.max_batch
    assert 20 <= expected.safe_batch < expected.max_batch <= 1000  # a real boundary, below the dataset
    assert model.batch_size == expected.safe_batch
    assert model.trained_batches == [expected.safe_batch] * 2  # the run really trained at that size
    assert fit.accumulate_grad_batches == 1
    # Nothing the probe did shows in the run: weights, the metric, the random stream.
    for name, value in before.items():
        assert torch.equal(model.at_first_step["params"][name], value), name
    assert model.at_first_step["metric_updates"] == 0
    assert torch.equal(rng_before.state, rng_after.state)
    assert "train_loss" in fit.callback_metrics  # the run's own logging works
    assert any(f"batch_size={expected.safe_batch}" in message for message in infos), infos


def test_target_batch_keeps_the_global_batch() -> None:
    model = Classifier()
    callback = BatchFit(memory_limit=LIMIT, target_batch=1000)
    fit = trainer(callback)
    fit.fit(model)

    plan = callback.plan
    assert plan is not None and plan.exact and plan.world_size == 1
    assert plan.micro_batch <= callback.result.safe_batch < 1000  # accumulation is really needed
    assert model.batch_size == plan.micro_batch
    assert fit.accumulate_grad_batches == plan.accumulation_steps > 1
    assert fit.accumulate_grad_batches * model.batch_size == 1000
    # max_steps counts optimizer steps: two of them, each over accumulation_steps micro-batches.
    assert model.trained_batches == [plan.micro_batch] * (2 * plan.accumulation_steps)


@pytest.mark.slow
def test_checkpointing_applies_the_policy_fit_recommends_and_trains_with_it(infos: list[str]) -> None:
    model = Classifier()
    callback = BatchFit(memory_limit=LIMIT, target_batch=1000, checkpointing=["net.0", "net.3"])
    fit = trainer(callback)
    fit.fit(model)

    assert callback.fit is not None and callback.result is None
    chosen = callback.fit.recommendation
    assert model.batch_size == chosen.batch_size and fit.accumulate_grad_batches == chosen.accumulation
    assert chosen.batch_size * chosen.accumulation == 1000
    assert all("forward" in model.get_submodule(name).__dict__ for name in callback.fit.policy.checkpointed)
    assert model.trained_batches == [chosen.batch_size] * (2 * chosen.accumulation)
    assert any(line.startswith("BatchFit: applied ") for line in infos)


def test_batch_size_held_in_datamodule_hparams_under_bf16_mixed_precision() -> None:
    model, data = Classifier(batch_size=None), Data()
    callback = BatchFit(memory_limit=LIMIT)
    trainer(callback, precision="bf16-mixed").fit(model, datamodule=data)

    assert callback.result.settings.amp == "bf16"  # the trainer's precision, as the probe's autocast
    assert not hasattr(model, "batch_size")
    assert data.hparams.batch_size == callback.result.safe_batch > 4
    assert model.trained_batches == [callback.result.safe_batch] * 2


def test_optimizer_and_loss_found_in_every_form_lightning_accepts() -> None:
    sgd, adam = (torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1) for _ in range(2))
    schedule = torch.optim.lr_scheduler.StepLR(sgd, 1)
    for config in (sgd, [sgd, adam], ([sgd, adam], [schedule]), {"optimizer": sgd, "lr_scheduler": schedule}):
        assert batchfit.lightning_trainer.optimizers_in(config)[0] is sgd
    assert batchfit.lightning_trainer.optimizers_in([{"optimizer": sgd}, {"optimizer": adam}]) == [sgd, adam]
    loss = torch.tensor(1.0)
    assert batchfit.lightning_trainer.loss_of(loss) is loss
    assert batchfit.lightning_trainer.loss_of({"loss": loss, "logits": torch.zeros(2)}) is loss
    with pytest.raises(ValueError, match="returned None"):
        batchfit.lightning_trainer.loss_of(None)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"headroom": 1.5}, ValueError, "headroom"),
        ({"memory_limit": "lots"}, ValueError, "lots"),
        ({"batch_arg_name": ""}, TypeError, "batch_arg_name"),
        ({"batch_arg_name": 3}, TypeError, "batch_arg_name"),
        ({"eval_batch_arg_name": "val size"}, TypeError, "eval_batch_arg_name"),
        ({"eval": "yes"}, TypeError, "eval"),
        ({"target_batch": 0}, ValueError, "target_batch"),
        ({"target_batch": 2.5}, TypeError, "target_batch"),
        ({"max_batch": 0}, ValueError, "max_batch"),
        ({"step_fn": lambda m, b: m(b)}, TypeError, "step_fn"),
        ({"sample": torch.zeros(2)}, TypeError, "sample"),
        ({"callback": 3}, TypeError, "callback"),
        ({"max_batchsize": 8}, TypeError, "max_batchsize"),
        ({"noise_scale": 1}, TypeError, "noise_scale"),
        ({"noise_passes": 2}, ValueError, "noise_passes"),
        ({"checkpointing": "auto"}, ValueError, "needs target_batch"),
    ],
)
def test_bad_arguments_raise_at_construction(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        BatchFit(**kwargs)


class ManualClassifier(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: (Classifier(), {"train_dataloaders": DataLoader(dataset(), batch_size=4)}), "passed directly"),
        (lambda: (Classifier(batch_size=None), {}), "no attribute 'batch_size'"),
        (lambda: (ManualClassifier(), {}), "automatic optimization"),
    ],
    ids=["dataloader-passed-to-fit", "no-batch-size-attribute", "manual-optimization"],
)
def test_what_it_cannot_do_is_refused_before_training(build: Any, match: str) -> None:
    model, fit_kwargs = build()
    with pytest.raises(MisconfigurationException, match=match):
        trainer(BatchFit(memory_limit=LIMIT)).fit(model, **fit_kwargs)
    assert model.trained_batches == []


def test_importable_without_lightning_and_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    # A parent set to None is not enough: `from lightning.pytorch import ...` finds the submodule
    # in sys.modules first.
    for name in [name for name in sys.modules if name == "lightning" or name.startswith("lightning.")]:
        monkeypatch.setitem(sys.modules, name, None)
    try:
        module = importlib.reload(batchfit.lightning)
        with pytest.raises(ImportError, match=INSTALL_HINT.replace("[", r"\[").replace("]", r"\]")):
            module.BatchFit()
    finally:
        monkeypatch.undo()
        importlib.reload(batchfit.lightning)
    assert issubclass(batchfit.lightning.BatchFit, pl.Callback)


# The noise scale ---------------------------------------------------------------------------------
class Memory(pl.loggers.Logger):
    """A logger that keeps what it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[tuple[dict[str, float], int | None]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.append((dict(metrics), step))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


class Counting(Classifier):
    """Counts every ``training_step`` call, the probe's and the noise scale's too. ``rows``: 4096 give
    the noise scale the 16 batches at the safe batch (about 200) it needs at the least."""

    def __init__(self, rows: int = 4096) -> None:
        super().__init__()
        self.rows = rows
        self.calls = 0
        self.calls_at_last_trial = 0  # set by the probe's trial callback
        self.calls_before_training: int | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.calls += 1
        return super().training_step(batch, batch_idx)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(dataset(self.rows), batch_size=self.batch_size, shuffle=True)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.calls_before_training is None:
            self.calls_before_training = self.calls
        super().on_train_batch_start(batch, batch_idx)


def _counted_fit(noise_scale: bool, rows: int = 4096, **kwargs: Any) -> tuple[Counting, BatchFit, Memory]:
    model, logger = Counting(rows), Memory()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}

    def trial_done(trial: Any) -> None:
        model.calls_at_last_trial = model.calls

    callback = BatchFit(memory_limit=LIMIT, noise_scale=noise_scale, callback=trial_done, **kwargs)
    rng_before, rng_after = RngAt(), RngAt()
    trainer(rng_before, callback, rng_after, logger=logger).fit(model)
    for name, value in before.items():  # nothing the probe or the measurement did shows in the run
        assert torch.equal(model.at_first_step["params"][name], value), name
    assert model.at_first_step["metric_updates"] == 0
    assert torch.equal(rng_before.state, rng_after.state)
    return model, callback, logger


def test_noise_scale_off_runs_no_extra_pass_and_logs_nothing(infos: list[str]) -> None:
    model, callback, logger = _counted_fit(noise_scale=False)
    assert callback.result is not None and callback.result.noise_scale is None
    assert model.calls_before_training == model.calls_at_last_trial > 0  # the probe's passes only
    assert not any(name.startswith("batchfit/") for metrics, _ in logger.metrics for name in metrics)
    assert not any("recommended" in message for message in infos)
    assert callback.recommendation == callback.result.recommendation  # still there, as advice


@pytest.mark.slow
def test_noise_scale_on_measures_from_the_train_dataloader_and_logs_it(infos: list[str]) -> None:
    model, callback, logger = _counted_fit(noise_scale=True, noise_passes=16)
    result, recommendation = callback.result, callback.recommendation
    assert result is not None and recommendation is not None
    noise = result.noise_scale
    assert noise is not None and 0 < noise.passes <= 16
    assert model.calls_before_training - model.calls_at_last_trial >= noise.passes  # through training_step
    assert recommendation == result.recommendation and recommendation.noise_low == noise.low
    logged = {name: value for metrics, _ in logger.metrics for name, value in metrics.items()}
    assert logged["batchfit/noise_scale_low"] == noise.low
    assert logged["batchfit/recommended_batch"] == recommendation.batch_size
    assert ("batchfit/noise_scale" in logged) == (noise.b_simple is not None)
    assert any(message.startswith("BatchFit: recommended ") and recommendation.reason in message for message in infos)
    assert model.batch_size == result.safe_batch  # the batch set is the probe's, as without it
    assert model.trained_batches == [result.safe_batch] * 2


def test_too_few_batches_for_the_noise_scale_warn_and_the_run_goes_on(infos: list[str]) -> None:
    with pytest.warns(UserWarning, match="BatchFit: no noise scale measured: .*window"):
        model, callback, logger = _counted_fit(noise_scale=True, rows=1024, noise_passes=16)
    assert callback.result is not None and callback.result.noise_scale is None
    assert not any(name.startswith("batchfit/") for metrics, _ in logger.metrics for name in metrics)
    assert model.trained_batches == [callback.result.safe_batch] * 2


# Evaluation --------------------------------------------------------------------------------------
class Validating(Classifier):
    """A classifier with a validation loop whose loader reads ``eval_batch_size`` (``own_eval_batch``)
    or the train ``batch_size``, as a module with one batch size does; records what the probe and the
    real validation loop fed ``validation_step``. ``batch_size=None``: a datamodule holds both."""

    def __init__(self, own_eval_batch: bool = True, batch_size: int | None = 4) -> None:
        super().__init__(batch_size)
        if own_eval_batch:
            self.eval_batch_size = 4
        self.validation_calls: list[int] = []
        self.validated: list[int] = []  # the real validation loop's batches only

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.validation_calls.append(len(x))
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("val_loss", loss)
        return loss

    def val_dataloader(self) -> DataLoader:
        return DataLoader(dataset(), batch_size=getattr(self, "eval_batch_size", self.batch_size))

    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.validated.append(len(batch[0]))


class ValidatingData(Data):
    """A datamodule that holds both sizes in its hparams, the validation one as ``val_batch_size``."""

    def __init__(self, batch_size: int = 4, val_batch_size: int = 4) -> None:
        super().__init__(batch_size)
        self.save_hyperparameters()

    def val_dataloader(self) -> DataLoader:
        return DataLoader(dataset(), batch_size=self.hparams.val_batch_size)


def _validating_fit(callback: BatchFit, model: Validating, **kwargs: Any) -> pl.Trainer:
    """Two steps, each followed by two validation batches (no sanity check, so every batch is the run's)."""
    fit = trainer(callback, limit_val_batches=2, val_check_interval=1, num_sanity_val_steps=0)
    fit.fit(model, **kwargs)
    return fit


@pytest.mark.slow
@pytest.mark.parametrize("where", ["module", "datamodule"])
def test_the_validation_loaders_batch_is_sized_and_set_where_it_reads_it(where: str, infos: list[str]) -> None:
    model = Validating(own_eval_batch=where == "module", batch_size=4 if where == "module" else None)
    data = ValidatingData() if where == "datamodule" else None
    callback = BatchFit(memory_limit=LIMIT)
    _validating_fit(callback, model, datamodule=data)

    result = callback.result
    assert result is not None and result.evaluation is not None and result.evaluation.safe_verified
    eval_batch = result.eval_safe_batch
    # No gradients, no activations kept for backward: evaluation fits more than the train batch.
    assert result.safe_batch < eval_batch < result.eval_max_batch < ROWS
    assert callback.eval_attribute == ("eval_batch_size" if where == "module" else "val_batch_size")
    if data is None:
        assert model.eval_batch_size == eval_batch and model.batch_size == result.safe_batch
    else:
        assert data.hparams.val_batch_size == eval_batch and data.hparams.batch_size == result.safe_batch
    # The probe's evaluation ran validation_step; the run validated and trained at the sizes set.
    assert result.eval_max_batch in model.validation_calls
    assert model.validated == [eval_batch] * 4 and model.trained_batches == [result.safe_batch] * 2
    assert model.at_first_step["metric_updates"] == 0
    assert any(f"set as {callback.eval_attribute}={eval_batch}" in message for message in infos), infos


@pytest.mark.slow
@pytest.mark.parametrize("evaluate", [None, True])
def test_without_an_eval_attribute_the_validation_loader_is_not_sized(
    evaluate: bool | None, infos: list[str]
) -> None:
    model = Validating(own_eval_batch=False)  # its validation loader reads batch_size, the train batch
    callback = BatchFit(memory_limit=LIMIT, **({} if evaluate is None else {"eval": evaluate}))
    if evaluate:  # sized when asked for, but there is nowhere to set it
        with pytest.warns(UserWarning, match="evaluation sized .* but not set"):
            _validating_fit(callback, model)
        assert callback.result.evaluation is not None and callback.result.eval_safe_batch > callback.result.safe_batch
    else:
        _validating_fit(callback, model)
        assert callback.result.evaluation is None and model.validation_calls == model.validated  # no eval probe
        assert any("validation loader's batch is not sized" in message for message in infos), infos
    assert callback.eval_attribute is None
    assert model.validated == [callback.result.safe_batch] * 4


def test_a_named_eval_attribute_must_exist_and_checkpointing_sizes_training_only() -> None:
    model = Validating()
    with pytest.raises(MisconfigurationException, match="no attribute 'valid_batch'.*eval_batch_arg_name"):
        _validating_fit(BatchFit(memory_limit=LIMIT, eval_batch_arg_name="valid_batch"), model)
    assert model.trained_batches == [] and model.validation_calls == []
    with pytest.raises(ValueError, match="sizes training only"):
        BatchFit(target_batch=1000, checkpointing="auto", eval=True)


# Two ranks -------------------------------------------------------------------------------------
class Report(pl.Callback):
    """Writes what this rank's run did to ``out/rank{r}.json`` (ddp_spawn runs each rank in its own
    process, so the callback and the module the test holds never see the ranks' attributes)."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        fitter = next(c for c in trainer.callbacks if isinstance(c, BatchFit))
        record = {
            "result": json.loads(fitter.result.to_json()),
            "plan": fitter.plan.to_dict() if fitter.plan else None,
            "batch_size": pl_module.batch_size,
            "accumulate": trainer.accumulate_grad_batches,
            "trained": pl_module.trained_batches,
            "world_size": trainer.world_size,
        }
        Path(self.out, f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def ddp_job(out: Path) -> None:
    """Run by the test below in a subprocess: two ranks probe together, then train."""
    callback = BatchFit(memory_limit=LIMIT, target_batch=1000, rank_timeout=20)
    # default_root_dir: ddp_spawn hands rank 0's weights back through a file written there.
    fit = trainer(callback, Report(str(out)), strategy="ddp_spawn", devices=2, default_root_dir=str(out))
    fit.fit(Classifier())


@pytest.mark.distributed
def test_ddp_spawn_ranks_probe_together_and_keep_the_global_batch(tmp_path: Path) -> None:
    job = subprocess.Popen(
        [sys.executable, __file__, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # so that a hang can be killed with the ranks it spawned
    )
    try:
        output, _ = job.communicate(timeout=SPAWN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        output, _ = job.communicate()
        pytest.fail(f"the ddp_spawn run did not finish within {SPAWN_TIMEOUT_S} s:\n{output[-3000:]}")
    assert job.returncode == 0, output[-3000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    # One answer on both ranks (the same trials, peaks and times; only the wall time of find() differs).
    answers = [{k: v for k, v in record["result"].items() if k != "elapsed_s"} for record in ranks]
    for answer in answers:  # the time a rank spent timing sizes warm is its own wall time too
        (answer["throughput"] or {}).pop("timing_s", None)
    assert answers[0] == answers[1]
    for record in ranks:
        result, plan = record["result"], record["plan"]
        assert record["world_size"] == result["world_size"] == plan["world_size"] == 2
        assert plan["batch_size"] <= result["safe_batch"] and plan["global_batch"] == 1000
        assert record["batch_size"] == plan["batch_size"] and record["accumulate"] == plan["accumulation"]
        assert record["batch_size"] * record["accumulate"] * 2 == 1000
        assert record["trained"] == [plan["batch_size"]] * (2 * plan["accumulation"])


if __name__ == "__main__":
    ddp_job(Path(sys.argv[1]))
