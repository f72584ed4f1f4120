"""``batchfit.ray``: a real Ray Train ``TorchTrainer`` (2 CPU workers, gloo), probed and then trained.

One local Ray cluster (2 CPUs) serves the module. Each ``trainer.fit()`` runs a real Hugging Face
GPT-2 built from a config (no download) through ``ray.train.torch.prepare_model`` (DDP), probes it
with :func:`batchfit.ray.worker_batch` under a live-tensor limit, and trains a few real steps at the
split it returned. Each worker writes what it saw to a file in a tmp dir (Ray Train keeps only
rank 0's reports), and the tests read those. Every ``fit()`` runs under a deadline, so a hang fails
the test instead of hanging CI; the cluster is shut down when the module ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
ray = pytest.importorskip("ray")
pytest.importorskip("ray.train.torch")

from ray import cloudpickle  # noqa: E402
from ray.train import FailureConfig, RunConfig, ScalingConfig, TrainingFailedError  # noqa: E402
from ray.train.torch import TorchTrainer  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

import batchfit  # noqa: E402
import batchfit.ray as bfr  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LIMIT = "24MiB"  # tiny GPT-2 at length 64: max batch 15, safe batch 13 (live tensors)
LENGTH = 64
WORKERS = 2
FIT_DEADLINE_S = 180  # a fit() takes ~20-30 s here; past this it is a hang

# The train functions below travel to the workers by value: pytest imports this file under a
# name the workers could not import.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=LENGTH)
    return GPT2LMHeadModel(config)


def token_sample(rows: int = 1) -> dict[str, torch.Tensor]:
    """Fixed-length token ids, as a tokenizer with ``padding="max_length"`` gives them."""
    ids = torch.randint(0, 256, (rows, LENGTH), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    """One local Ray cluster for the module, stopped (every process of it) when the module ends."""
    ray.init(num_cpus=WORKERS, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()


@contextlib.contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Fail with ``TimeoutError`` instead of hanging (SIGALRM: the test runs in the main thread)."""

    def expired(signum: int, frame: Any) -> None:
        raise TimeoutError(f"trainer.fit() did not end within {seconds} s: a hang")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def fit(train_func: Any, config: dict[str, Any], storage: Path) -> None:
    trainer = TorchTrainer(
        train_func,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=WORKERS, use_gpu=False),
        run_config=RunConfig(storage_path=str(storage), name="run", failure_config=FailureConfig(max_failures=0)),
    )
    with deadline(FIT_DEADLINE_S):
        trainer.fit()


def _records(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(WORKERS)]


# what each worker runs ---------------------------------------------------------------------------
def probe_then_train(config: dict[str, Any]) -> None:
    """Probe with worker_batch, train two optimizer steps at its split, write what this worker saw."""
    import ray.train
    import ray.train.torch
    import torch.distributed as dist

    model = ray.train.torch.prepare_model(tiny_gpt2())
    rank = ray.train.get_context().get_world_rank()
    record: dict[str, Any] = {"rank": rank, "batchfit_file": batchfit.__file__, "model": type(model).__name__}
    record["backend"] = dist.get_backend()
    fit = bfr.worker_batch(model, token_sample(), global_batch=config["global_batch"], memory_limit=LIMIT)
    record["fit"] = {
        "summary": fit.summary(),
        "metrics": fit.metrics(),
        "reason": fit.reason,
        "world_size": fit.world_size,
        "result_world_size": fit.result.world_size,
        "max_batch": fit.result.max_batch,
        "safe_batch": fit.result.safe_batch,
        "trials": [(t.batch_size, t.fits) for t in fit.result.trials],
    }
    prime = bfr.worker_batch(model, token_sample(), global_batch=config["prime_batch"], memory_limit=LIMIT)
    record["prime"] = {
        "micro_batch": prime.micro_batch,
        "accumulation_steps": prime.accumulation_steps,
        "global_batch": prime.global_batch,
        "exact": prime.exact,
        "reason": prime.reason,
    }
    plain = bfr.worker_batch(model, token_sample(), memory_limit=LIMIT)
    record["plain"] = {"summary": plain.summary(), "metrics": plain.metrics(), "target_batch": plain.target_batch}
    try:
        bfr.worker_batch(model, token_sample(), global_batch=config["indivisible_batch"], memory_limit=LIMIT)
    except ValueError as exc:
        record["indivisible"] = str(exc)
    record["training"] = _train(model, fit.micro_batch, fit.accumulation_steps)
    Path(config["out"], f"rank{rank}.json").write_text(json.dumps(record))
    ray.train.report(fit.metrics())


def _train(model: torch.nn.Module, micro_batch: int, accumulation_steps: int) -> dict[str, Any]:
    """Two optimizer steps of a plain DDP loop with gradient accumulation, on Ray's sharded loader."""
    import ray.train.torch

    optimizer_steps = 2
    rows = micro_batch * accumulation_steps * optimizer_steps * WORKERS
    ids = torch.randint(0, 256, (rows, LENGTH), generator=torch.Generator().manual_seed(2))
    data = [{"input_ids": row, "labels": row} for row in ids]
    loader = ray.train.torch.prepare_data_loader(torch.utils.data.DataLoader(data, batch_size=micro_batch))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
    seen, stepped = [], 0
    for index, batch in enumerate(loader):
        last = (index + 1) % accumulation_steps == 0
        with contextlib.nullcontext() if last else model.no_sync():
            loss = model(**batch).loss / accumulation_steps
            loss.backward()
        seen.append(int(batch["input_ids"].shape[0]))
        if last:
            optimizer.step()
            optimizer.zero_grad()
            stepped += 1
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {
        "micro_batches": seen,
        "optimizer_steps": stepped,
        "changed": bool((after != before).any()),
        "checksum": float(after.double().sum()),
    }


class FailsOnRank1(torch.nn.Module):
    """A model whose forward raises a ValueError on rank 1 from batch 8 on (not an out-of-memory)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if dist.get_rank() == 1 and x.shape[0] >= 8:
            raise ValueError(f"boom at batch {x.shape[0]}")
        return self.linear(x)


def probe_failing_model(config: dict[str, Any]) -> None:
    import ray.train
    import ray.train.torch

    model = ray.train.torch.prepare_model(FailsOnRank1())
    rank = ray.train.get_context().get_world_rank()
    try:
        bfr.worker_batch(model, torch.randn(1, 16), global_batch=64, memory_limit="1MiB", rank_timeout=60)
    except Exception as exc:
        raised = {"type": type(exc).__name__, "message": str(exc)}
        Path(config["out"], f"rank{rank}.json").write_text(json.dumps({"raised": raised}))
        raise
    Path(config["out"], f"rank{rank}.json").write_text(json.dumps({"raised": None}))


# the tests ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def alone() -> batchfit.Result:
    """The single-process answer on the same model, sample and limit."""
    return batchfit.find(tiny_gpt2(), token_sample(), memory_limit=LIMIT)


@pytest.fixture(scope="module")
def trained(cluster: None, alone: batchfit.Result, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("ray-trained")
    safe = alone.safe_batch
    share = 4 * safe + 1
    while any(share % d == 0 for d in range(2, share)):  # a prime share above the safe batch
        share += 1
    config = {
        "out": str(out),
        "global_batch": WORKERS * 2 * safe,  # divides: micro-batch <= safe, >= 2 accumulation steps
        "prime_batch": WORKERS * share,  # divides by the workers only: micro-batch 1
        "indivisible_batch": WORKERS * safe + 1,  # not a whole share per worker
    }
    fit(probe_then_train, config, out / "storage")
    return {"config": config, "records": _records(out)}


def test_every_worker_gets_the_single_process_answer(trained: dict[str, Any], alone: batchfit.Result) -> None:
    first, second = (record["fit"] for record in trained["records"])
    assert first == second  # the same probe, trials and split on both workers
    for record in trained["records"]:
        assert record["batchfit_file"] == batchfit.__file__  # the workers ran the code under test
        assert (record["backend"], record["model"]) == ("gloo", "DistributedDataParallel")
    assert first["result_world_size"] == WORKERS and first["world_size"] == WORKERS
    assert (first["max_batch"], first["safe_batch"]) == (alone.max_batch, alone.safe_batch)


def test_the_global_batch_is_split_exactly_and_trained_with(trained: dict[str, Any]) -> None:
    asked = trained["config"]["global_batch"]
    metrics = trained["records"][0]["fit"]["metrics"]
    micro, steps = metrics["batchfit/micro_batch"], metrics["batchfit/accumulation_steps"]
    assert micro * steps * WORKERS == metrics["batchfit/global_batch"] == asked
    assert metrics["batchfit/exact"] == 1 and metrics["batchfit/remainder"] == 0
    assert micro <= metrics["batchfit/safe_batch"] <= metrics["batchfit/max_batch"] and steps >= 2
    assert all(isinstance(value, int) for value in metrics.values())
    names = {"micro_batch", "accumulation_steps", "global_batch", "target_batch", "world_size", "max_batch"}
    assert {f"batchfit/{name}" for name in (*names, "safe_batch", "exact", "remainder")} == set(metrics)
    assert f"= global batch {asked} (as asked)" in trained["records"][0]["fit"]["summary"]
    for record in trained["records"]:
        training = record["training"]
        assert training["micro_batches"] == [micro] * (2 * steps)  # Ray's sharded loader, at the found size
        assert training["optimizer_steps"] == 2 and training["changed"]
    assert trained["records"][0]["training"]["checksum"] == trained["records"][1]["training"]["checksum"]  # DDP


def test_without_a_global_batch_every_worker_trains_at_the_safe_batch(trained: dict[str, Any]) -> None:
    for record in trained["records"]:
        plain = record["plain"]
        safe = plain["metrics"]["batchfit/safe_batch"]
        assert plain["target_batch"] is None and "batchfit/target_batch" not in plain["metrics"]
        assert plain["metrics"]["batchfit/micro_batch"] == safe
        assert plain["metrics"]["batchfit/accumulation_steps"] == 1
        assert plain["metrics"]["batchfit/global_batch"] == safe * WORKERS
        assert "no global batch asked" in plain["summary"]


def test_a_share_that_splits_poorly_says_what_an_inexact_split_would_drop(trained: dict[str, Any]) -> None:
    asked = trained["config"]["prime_batch"]
    for record in trained["records"]:
        prime = record["prime"]
        assert (prime["micro_batch"], prime["accumulation_steps"]) == (1, asked // WORKERS)
        assert prime["exact"] and prime["global_batch"] == asked
        assert "remainder" in prime["reason"] and "not chosen" in prime["reason"]


def test_a_global_batch_not_divisible_by_the_workers_is_refused_naming_the_nearest(trained: dict[str, Any]) -> None:
    asked = trained["config"]["indivisible_batch"]
    for record in trained["records"]:
        message = record["indivisible"]
        assert f"global_batch={asked} on {WORKERS} Ray Train workers" in message
        assert f"nearest are {asked - 1} and {asked + 1}" in message


def test_an_error_in_one_workers_model_fails_the_run_with_it(cluster: None, tmp_path: Path) -> None:
    with pytest.raises(TrainingFailedError) as raised:
        fit(probe_failing_model, {"out": str(tmp_path)}, tmp_path / "storage")
    first, second = (record["raised"] for record in _records(tmp_path))
    assert second["type"] == "ValueError" and second["message"].startswith("boom at batch")
    batch = int(second["message"].split()[-1])
    # The other worker did not wait for it: it raised too, naming the worker, the size and the error.
    assert first["type"] == "RankFailedError"
    said = f"rank 1 failed at batch size {batch} during forward: ValueError: boom at batch {batch}"
    assert said in first["message"]
    # What the driver gets: each worker's own exception, batchfit's come through pickling whole.
    assert f"ValueError: boom at batch {batch}" in str(raised.value) and said in str(raised.value)
    failures = getattr(raised.value, "worker_failures", None)
    if failures is not None:  # Ray Train v2's WorkerGroupError
        assert isinstance(failures[1], ValueError) and str(failures[1]) == f"boom at batch {batch}"
        assert isinstance(failures[0], batchfit.errors.RankFailedError)
        assert (failures[0].rank, failures[0].batch_size, failures[0].phase) == (1, batch, "forward")


# the front end's own checks (no Ray Train run) -----------------------------------------------------
@pytest.mark.parametrize(("bad", "error"), [("64", TypeError), (64.0, TypeError), (True, TypeError), (0, ValueError)])
def test_a_bad_global_batch_is_named(bad: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="global_batch"):
        bfr.worker_batch(torch.nn.Linear(4, 2), torch.randn(1, 4), global_batch=bad)


def test_outside_a_ray_train_worker_it_says_where_to_call_it() -> None:
    with pytest.raises(RuntimeError, match="inside a Ray Train training function") as raised:
        bfr.worker_batch(torch.nn.Linear(4, 2), torch.randn(1, 4), global_batch=8)
    assert "batchfit.plan" in str(raised.value)


def test_without_ray_it_names_the_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray.train", None)  # as if Ray Train were not installed
    with pytest.raises(ImportError, match=r"pip install 'batchfit\[ray\]'"):
        bfr.worker_batch(torch.nn.Linear(4, 2), torch.randn(1, 4))


def test_importing_batchfit_ray_imports_neither_ray_nor_torch() -> None:
    code = "import sys, batchfit, batchfit.ray; print(sorted({'ray', 'torch'} & set(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
