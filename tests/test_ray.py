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


def fit(train_func: Any, config: dict[str, Any], storage: Path, workers: int = WORKERS) -> None:
    """``trainer.fit()`` on ``workers`` CPU workers sharing the cluster's 2 CPUs."""
    trainer = TorchTrainer(
        train_func,
        train_loop_config=config,
        scaling_config=ScalingConfig(
            num_workers=workers, use_gpu=False, resources_per_worker={"CPU": min(1.0, WORKERS / workers)}
        ),
        run_config=RunConfig(storage_path=str(storage), name="run", failure_config=FailureConfig(max_failures=0)),
    )
    interrupt = signal.getsignal(signal.SIGINT)
    try:
        with deadline(FIT_DEADLINE_S):
            trainer.fit()
    finally:  # Ray Train's fit installs a SIGINT handler of its own and leaves it: a later Ctrl-C test met it
        signal.signal(signal.SIGINT, interrupt)


def _records(out: Path, workers: int = WORKERS) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(workers)]


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
    cache = {"memory_limit": LIMIT, "cache": config["cache"]}
    fit = bfr.worker_batch(model, token_sample(), global_batch=config["global_batch"], **cache)
    if rank == 0:
        Path(config["out"], "result.json").write_text(fit.result.to_json())
    record["fit"] = {
        "summary": fit.summary(),
        "metrics": fit.metrics(),
        "reason": fit.reason,
        "world_size": fit.world_size,
        "result_world_size": fit.result.world_size,
        "max_batch": fit.result.max_batch,
        "safe_batch": fit.result.safe_batch,
        "trials": [(t.batch_size, t.fits) for t in fit.result.trials],
        "from_cache": fit.result.from_cache is not None,
    }
    # The same probe again, from the cache the first call wrote: no trial on any worker.
    calls: list[Any] = []
    cache["callback"] = calls.append
    prime = bfr.worker_batch(model, token_sample(), global_batch=config["prime_batch"], **cache)
    record["prime"] = {
        "micro_batch": prime.micro_batch,
        "accumulation_steps": prime.accumulation_steps,
        "global_batch": prime.global_batch,
        "exact": prime.exact,
        "reason": prime.reason,
        "caveats": list(prime.recommendation.caveats),
        "from_cache": prime.result.from_cache is not None,
        "same_answer": (prime.result.max_batch, prime.result.safe_batch, prime.result.trials)
        == (fit.result.max_batch, fit.result.safe_batch, fit.result.trials),
    }
    plain = bfr.worker_batch(model, token_sample(), **cache)
    record["plain"] = {
        "summary": plain.summary(),
        "metrics": plain.metrics(),
        "target_batch": plain.target_batch,
        "recommended": (plain.result.recommend().batch_size, plain.result.recommend().accumulation),
    }
    odd = bfr.worker_batch(model, token_sample(), global_batch=config["indivisible_batch"], **cache)
    record["indivisible"] = {
        "global_batch": odd.global_batch,
        "micro_batch": odd.micro_batch,
        "accumulation_steps": odd.accumulation_steps,
        "exact": odd.exact,
        "remainder": odd.remainder,
        "summary": odd.summary(),
        "reason": odd.reason,
    }
    record["cached_calls"] = len(calls)
    record["training"] = _train(model, fit.micro_batch, fit.accumulation_steps)
    Path(config["out"], f"rank{rank}.json").write_text(json.dumps(record))
    ray.train.report(fit.metrics())


def _train(model: torch.nn.Module, micro_batch: int, accumulation_steps: int, workers: int = WORKERS) -> dict[str, Any]:
    """Two optimizer steps of a plain DDP loop with gradient accumulation, on Ray's sharded loader."""
    import ray.train.torch

    optimizer_steps = 2
    rows = micro_batch * accumulation_steps * optimizer_steps * workers
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
    _probe_and_record(model, ray.train.get_context().get_world_rank(), config["out"], rank_timeout=60)


def _probe_and_record(model: torch.nn.Module, rank: int, out: str, rank_timeout: float) -> None:
    """One worker's probe; what it raised (or None) written to ``out/rank{rank}.json``, then raised."""
    try:
        bfr.worker_batch(model, torch.randn(1, 16), global_batch=64, memory_limit="1MiB", rank_timeout=rank_timeout)
    except Exception as exc:
        raised = {"type": type(exc).__name__, "message": str(exc)}
        Path(out, f"rank{rank}.json").write_text(json.dumps({"raised": raised}))
        raise
    Path(out, f"rank{rank}.json").write_text(json.dumps({"raised": None}))


class KilledOnRank1(torch.nn.Module):
    """A model whose forward kills its own worker process on rank 1 from batch 8 on (SIGKILL, as
    the kernel's out-of-memory killer would: no exception, no cleanup)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if dist.get_rank() == 1 and x.shape[0] >= 8:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.linear(x)


def probe_killed_worker(config: dict[str, Any]) -> None:
    """Probe with a rank timeout longer than the run may take: the run must end on the kill."""
    import ray.train
    import ray.train.torch

    model = ray.train.torch.prepare_model(KilledOnRank1())
    rank = ray.train.get_context().get_world_rank()
    Path(config["out"], f"pid{rank}").write_text(str(os.getpid()))
    _probe_and_record(model, rank, config["out"], rank_timeout=600)


def _ended(pid: int, within_s: float = 60.0) -> bool:
    """Whether process ``pid`` is gone, waiting up to ``within_s`` for Ray to reap it."""
    import time

    stop = time.monotonic() + within_s
    while Path(f"/proc/{pid}").exists() and time.monotonic() < stop:
        time.sleep(0.2)
    return not Path(f"/proc/{pid}").exists()


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
        "cache": str(out / "cache"),
        "global_batch": WORKERS * 2 * safe,  # divides: micro-batch <= safe, >= 2 accumulation steps
        "prime_batch": WORKERS * share,  # divides by the workers only: micro-batch 1
        "indivisible_batch": WORKERS * safe + 1,  # not a whole share per worker
    }
    fit(probe_then_train, config, out / "storage")
    return {"config": config, "records": _records(out)}


@pytest.mark.distributed
def test_every_worker_gets_the_single_process_answer(trained: dict[str, Any], alone: batchfit.Result) -> None:
    first, second = (record["fit"] for record in trained["records"])
    assert first == second  # the same probe, trials and split on both workers
    for record in trained["records"]:
        assert record["batchfit_file"] == batchfit.__file__  # the workers ran the code under test
        assert (record["backend"], record["model"]) == ("gloo", "DistributedDataParallel")
    assert first["result_world_size"] == WORKERS and first["world_size"] == WORKERS
    assert (first["max_batch"], first["safe_batch"]) == (alone.max_batch, alone.safe_batch)


@pytest.mark.distributed
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


@pytest.mark.distributed
def test_the_same_probe_again_comes_from_the_cache_on_every_worker(trained: dict[str, Any]) -> None:
    for record in trained["records"]:
        assert not record["fit"]["from_cache"]  # the first call probed and wrote the entry
        assert record["prime"]["from_cache"] and record["prime"]["same_answer"]
        assert record["cached_calls"] == 0  # three more calls, not one trial on any worker


@pytest.mark.distributed
def test_without_a_global_batch_every_worker_trains_at_the_recommended_batch(trained: dict[str, Any]) -> None:
    for record in trained["records"]:
        plain = record["plain"]
        assert plain["target_batch"] is None and "batchfit/target_batch" not in plain["metrics"]
        micro, steps = plain["recommended"]
        assert plain["metrics"]["batchfit/micro_batch"] == micro <= plain["metrics"]["batchfit/safe_batch"]
        assert plain["metrics"]["batchfit/accumulation_steps"] == steps
        assert plain["metrics"]["batchfit/global_batch"] == micro * steps * WORKERS
        assert "no global batch asked: decided by" in plain["summary"]


@pytest.mark.distributed
def test_a_share_that_splits_poorly_is_exact_and_says_what_a_larger_micro_batch_would_change(
    trained: dict[str, Any],
) -> None:
    asked = trained["config"]["prime_batch"]
    for record in trained["records"]:
        prime = record["prime"]
        assert (prime["micro_batch"], prime["accumulation_steps"]) == (1, asked // WORKERS)
        assert prime["exact"] and prime["global_batch"] == asked
        # The one splitter says it in the reason: the larger micro-batch a non-exact split would run.
        assert "no exact split has a larger micro-batch" in prime["reason"]


@pytest.mark.distributed
def test_a_global_batch_the_workers_cannot_share_says_by_how_much_it_changed(trained: dict[str, Any]) -> None:
    asked = trained["config"]["indivisible_batch"]
    first, second = (record["indivisible"] for record in trained["records"])
    assert first == second
    assert not first["exact"] and first["remainder"] == asked - first["global_batch"] != 0
    assert first["global_batch"] == first["micro_batch"] * first["accumulation_steps"] * WORKERS
    assert abs(first["remainder"]) == 1  # an odd global batch over 2 workers: the nearest is one away
    assert f"the target global batch {asked} becomes {first['global_batch']}" in first["reason"]
    fewer = "fewer" if first["remainder"] > 0 else "more"
    assert f"({abs(first['remainder'])} {fewer} than the {asked} asked)" in first["summary"]


@pytest.mark.distributed
def test_the_two_worker_result_re_plans_for_one_and_four_keeping_the_global_batch(trained: dict[str, Any]) -> None:
    measured = batchfit.Result.from_json((Path(trained["config"]["out"]) / "result.json").read_text())
    assert measured.world_size == WORKERS
    asked = trained["config"]["global_batch"]
    for world_size in (1, 4):
        rec = measured.recommend(target_batch=asked, world_size=world_size)
        assert rec.world_size == world_size and rec.global_batch == asked and rec.exact
        assert rec.batch_size <= measured.safe_batch
        assert any(caveat.startswith(f"re-planned for {world_size} rank") for caveat in rec.caveats)


def probe_elastic(config: dict[str, Any]) -> None:
    """An elastic restart on another number of workers: the same probe, from the cache."""
    import ray.train
    import ray.train.torch

    model = ray.train.torch.prepare_model(tiny_gpt2())
    rank = ray.train.get_context().get_world_rank()
    calls: list[Any] = []
    fit = bfr.worker_batch(
        model, token_sample(), global_batch=config["global_batch"], memory_limit=LIMIT, cache=config["cache"],
        callback=calls.append,
    )  # fmt: skip
    record = {
        "world_size": fit.world_size,
        "global_batch": fit.global_batch,
        "split": (fit.micro_batch, fit.accumulation_steps),
        "exact": fit.exact,
        "from_cache": None if fit.result.from_cache is None else fit.result.from_cache.world_size,
        "trials_run": len(calls),
        "caveats": list(fit.recommendation.caveats),
        "training": _train(model, fit.micro_batch, fit.accumulation_steps, fit.world_size),
    }
    Path(config["out"], f"rank{rank}.json").write_text(json.dumps(record))


@pytest.mark.distributed
def test_an_elastic_restart_on_four_workers_keeps_the_global_batch_without_a_probe(
    cluster: None, trained: dict[str, Any], tmp_path: Path
) -> None:
    """Ray Train elastic (``num_workers=(min, max)``) restarts train_func on another number of
    workers; four workers sharing the two CPUs stand for that restart."""
    asked = trained["config"]["global_batch"]
    config = {"out": str(tmp_path), "cache": trained["config"]["cache"], "global_batch": asked}
    fit(probe_elastic, config, tmp_path / "storage", workers=4)
    records = _records(tmp_path, workers=4)
    for record in records:
        assert record["from_cache"] == WORKERS and record["trials_run"] == 0  # measured on 2, nothing probed
        assert record["world_size"] == 4 and record["global_batch"] == asked and record["exact"]
        micro, steps = record["split"]
        assert micro * steps * 4 == asked
        assert any(caveat.startswith("re-planned for 4 ranks from a probe on 2 ranks") for caveat in record["caveats"])
        assert record["training"]["optimizer_steps"] == 2 and record["training"]["changed"]
    assert len({record["training"]["checksum"] for record in records}) == 1  # DDP kept the four in step


@pytest.mark.distributed
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
    # What the driver gets: the exceptions of the workers Ray's controller had collected when it
    # polled (`WorkerGroupPollStatus.errors`: the workers failed by then). Both fail, at nearly the
    # same moment, so either may be collected first and alone (worker 0 alone failed CI once); each
    # names the cause, and batchfit's come through pickling whole.
    assert f"ValueError: boom at batch {batch}" in str(raised.value)
    failures = getattr(raised.value, "worker_failures", None)
    if failures is not None:  # Ray Train v2's WorkerGroupError
        assert set(failures) & {0, 1}, failures
        if 1 in failures:
            assert isinstance(failures[1], ValueError) and str(failures[1]) == f"boom at batch {batch}"
        if 0 in failures:
            assert isinstance(failures[0], batchfit.errors.RankFailedError) and said in str(raised.value)
            assert (failures[0].rank, failures[0].batch_size, failures[0].phase) == (1, batch, "forward")


@pytest.mark.distributed
def test_a_worker_killed_mid_probe_fails_the_run_naming_it_and_leaves_nothing_running(
    cluster: None, tmp_path: Path
) -> None:
    """A real SIGKILL of worker 1 inside its probe, with a rank timeout (600 s) far past the fit's
    deadline: the run ends on the kill itself, Ray's health check naming the dead worker, and
    neither worker's process outlives it."""
    with pytest.raises(TrainingFailedError) as raised:
        fit(probe_killed_worker, {"out": str(tmp_path)}, tmp_path / "storage")
    pids = {rank: int((tmp_path / f"pid{rank}").read_text()) for rank in range(WORKERS)}
    said = str(raised.value)
    assert "[Rank 1 Error Snippet]" in said and "died" in said and f"pid={pids[1]}" in said, said[-3000:]
    failures = getattr(raised.value, "worker_failures", None)
    if failures is not None:  # Ray Train v2's WorkerGroupError: rank 1's own entry says it died
        assert "died unexpectedly" in str(failures[1])
    assert not (tmp_path / "rank1.json").exists()  # killed: no exception, no record
    # Worker 0 heard of it at once from gloo (the dead rank's connection closed), unless Ray's
    # teardown ended it first; either way it did not wait out the rank timeout.
    if (tmp_path / "rank0.json").exists():
        survivor = json.loads((tmp_path / "rank0.json").read_text())["raised"]
        assert survivor["type"] == "RanksTimeoutError"
        assert survivor["message"].startswith("rank 0: rank 1 went away during forward at batch size "), survivor
    assert all(_ended(pid) for pid in pids.values()), pids


# the front end's own checks (no Ray Train run) -----------------------------------------------------
@pytest.mark.parametrize(("bad", "error"), [("64", TypeError), (64.0, TypeError), (True, TypeError), (0, ValueError)])
def test_a_bad_global_batch_is_named(bad: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="global_batch"):
        bfr.worker_batch(torch.nn.Linear(4, 2), torch.randn(1, 4), global_batch=bad)


def test_outside_a_ray_train_worker_it_says_where_to_call_it() -> None:
    with pytest.raises(RuntimeError, match="inside a Ray Train training function") as raised:
        bfr.worker_batch(torch.nn.Linear(4, 2), torch.randn(1, 4), global_batch=8)
    assert "result.recommend(target_batch=..., world_size=...)" in str(raised.value)


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
