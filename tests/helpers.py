"""Shared test helpers: an exhaustive scan (the ground truth) and exact state comparison."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import batchfit
from batchfit.probe.timing import SPREAD_BELOW, SPREAD_STEPS


def exhaustive_boundary(model: nn.Module, sample: Any, limit: str | int, steps: int, beyond: int = 3) -> int:
    """The largest batch that fits, by trying 1, 2, 3, ... with the same meter and steps.

    Goes on ``beyond`` sizes past the first failure and checks that they fail too, so a
    non-monotone model cannot make the truth ambiguous.
    """
    with batchfit.Prober(model, sample, memory_limit=limit, steps_per_trial=steps) as prober:
        size = 1
        while prober.trial(size).fits:
            size += 1
        for extra in range(1, beyond + 1):
            assert not prober.trial(size + extra).fits, f"memory not monotone at {size + extra}"
    return size - 1


def state_of(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Everything a probe must leave as it was, copied for an exact comparison."""
    state: dict[str, Any] = {
        "tensors": {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()},
        "devices": {k: v.device for k, v in model.state_dict(keep_vars=True).items()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "training": {n: m.training for n, m in model.named_modules()},
        "rng": torch.random.get_rng_state(),
        "param_ids": [id(p) for p in model.parameters()],
    }
    if optimizer is not None:
        state["optimizer"] = {
            id(p): {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for p, s in optimizer.state.items()
        }
        state["groups"] = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return state


def assert_same_state(before: dict[str, Any], after: dict[str, Any]) -> None:
    """Bit-exact equality of two :func:`state_of` snapshots."""
    assert before.keys() == after.keys()
    for name, tensor in before["tensors"].items():
        assert torch.equal(tensor, after["tensors"][name]), f"{name} changed"
        assert tensor.dtype == after["tensors"][name].dtype
    assert before["devices"] == after["devices"]
    for name, grad in before["grads"].items():
        other = after["grads"][name]
        assert (grad is None) == (other is None), f"grad of {name} appeared or vanished"
        if grad is not None:
            assert torch.equal(grad, other), f"grad of {name} changed"
    assert before["requires_grad"] == after["requires_grad"]
    assert before["training"] == after["training"]
    assert torch.equal(before["rng"], after["rng"]), "RNG state changed"
    assert before["param_ids"] == after["param_ids"]
    if "optimizer" in before:
        assert before["optimizer"].keys() == after["optimizer"].keys()
        for key, entries in before["optimizer"].items():
            for name, value in entries.items():
                other = after["optimizer"][key][name]
                if isinstance(value, torch.Tensor):
                    assert torch.equal(value, other), f"optimizer state {name} changed"
                else:
                    assert value == other
        assert before["groups"] == after["groups"]


class ItemGate(nn.Module):
    """Takes a branch on an activation's value (``.item()``): fake tensors have no value."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(256, 512)
        self.drop = nn.Dropout(0.1)
        self.out = nn.Linear(512, 10)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.inp(x))
        if h.sum().item() > 0:
            h = torch.relu(h)
        return self.out(h)


def expected_steps(result: batchfit.Result, *, cold_after_release: bool) -> list[int]:
    """The real steps each fitting trial of ``result`` runs, by its kind: the one table of them.

    The CPU test (``tests/test_device_seam.py``) and its CUDA half (``tests/test_cuda.py``) both
    assert it, so a change to how many steps a kind runs fails on CPU until this table, and with
    it the CUDA test, says the same. ``cold_after_release``: the backend's flag (CUDA's first step
    after a release runs cold, so every search trial runs a warm one after it).
    """
    timed_steps = batchfit.Options().timed_steps
    expected: list[int] = []
    fitting = [t for t in result.trials if t.fits]
    for trial in fitting:
        if trial.kind == "search":  # two with a fresh optimizer (step 1 makes its state) or a cold device
            steps = 2 if cold_after_release or not expected else 1
        elif trial.kind == "verify":  # when the throughput is timed, its warm steps are the safe batch's rate:
            verify = result.settings.verify_steps  # on the CPU, whose meter slows every step, timed after it
            extended = verify + timed_steps if not cold_after_release else max(verify, 1 + timed_steps)
            steps = extended if timed_steps else verify
        elif trial.kind == "time":  # one untimed step, then the timed ones (two for the spread, see timing)
            repeated = trial.batch_size > result.max_batch // SPREAD_BELOW or any(
                earlier - 1 >= SPREAD_STEPS for earlier in expected  # steps after the first are timed
            )
            steps = 1 + (timed_steps if repeated else max(timed_steps, SPREAD_STEPS))
        else:
            raise AssertionError(f"a trial of kind {trial.kind!r} in a find() result: add it to this table")
        expected.append(steps)
    return expected


def plain_workload(model: nn.Module, sample: torch.Tensor, device: torch.device, mode: str = "train") -> Any:
    """A :class:`batchfit.probe.Workload` of ``model`` on ``device`` with every default (AdamW, the
    default loss, no amp), for tests that drive ``run_trial`` directly."""
    from batchfit.probe.workload import Workload, optimizer_factory

    return Workload(
        model=model,
        device=device,
        mode=mode,  # type: ignore[arg-type]
        sample=sample,
        sample_size=sample.shape[0],
        make_batch=None,
        loss_fn=None,
        step_fn=None,
        new_optimizer=optimizer_factory(None),
        amp=None,
    )


def hf_sample() -> dict[str, torch.Tensor]:
    """Two seeded rows of 128 token ids (vocabulary 1000), as inputs and labels of a causal LM."""
    ids = torch.randint(0, 1000, (2, 128), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def tiny_llama() -> tuple[nn.Module, Any]:
    """A seeded two-layer `LlamaForCausalLM` from a config (grouped KV heads) and `hf_sample()`."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=1000,
        max_position_embeddings=128,
    )
    return transformers.LlamaForCausalLM(config), hf_sample()


def join_gloo(rank: int, out: str, world_size: int) -> None:
    """One rank of a test job (``tests/*_job.py`` under ``mp.spawn``) joins its gloo group through a
    file store in ``out``, with one torch thread: the ranks share the 2 cores of CI."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{out}/store", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    torch.set_num_threads(1)


def processes_naming(token: str) -> dict[int, str]:
    """The running processes (but this one) whose command line names ``token``: pid -> command line,
    read from Linux's /proc (zombies have none)."""
    found = {}
    for path in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            line = path.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if token in line and int(path.parent.name) != os.getpid():
            found[int(path.parent.name)] = line
    return found
