"""The one hop between processes: [`Options`][batchfit.Options] as JSON both ways, and what a worker must do.

Why: a job per trial (`batchfit.probe.job_runner`), the sharded estimate
(`batchfit.estimation.rank_estimate`) and the soak of a target (`batchfit.soak` given
``"module:factory"``) run their model in a fresh process. That process is
`batchfit.worker`, started by `worker_command` (the one place its module name is written), given
one `WorkerRequest` file; it answers in files of its ``out`` folder, an error as
`batchfit.errors.error_document`. The command line is not on the way: the options cross as JSON
(`to_wire`, `from_wire`), and a code option (a callable) comes from the target in that process.

Pure Python: no torch import (the CLI reads `CLI_CPU_MEMORY_LIMIT` before it loads torch).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal, get_args

from batchfit.probe.options import Options
from batchfit.probe.sessions import in_session

__all__ = ["CLI_CPU_MEMORY_LIMIT", "WorkerRequest", "answer_of", "from_wire", "to_wire", "worker_command"]

#: Without a memory limit, a CPU probe from the command line (and a rank of a job per trial on the
#: CPU) caps live tensor bytes at this. On a CPU the time of a trial grows with the memory it touches,
#: so the cap is what keeps ``batchfit probe batchfit.examples:gpt`` under a minute on a 2-core
#: machine; it also keeps a first run from taking a large share of the host. (The Python API's
#: default is half the available memory: a caller of ``find()`` chose to probe on this machine.)
CLI_CPU_MEMORY_LIMIT = "256MiB"

#: The module a worker process runs (`batchfit.worker`), named here only.
_WORKER = "batchfit.worker"

WorkerKind = Literal["trial", "estimate", "soak"]


def to_wire(
    options: Options | Mapping[str, Any],
    names: Iterable[str] | None = None,
    *,
    plain_only: bool = False,
    process: str = "the estimate's process",
) -> dict[str, Any]:
    """The options that cross into a worker, as JSON values: an `Options`' fields not at their
    default (a default stays one on the other side), or a mapping's keywords as given; only
    ``names`` when given. A value JSON cannot carry (an object, a callable) is a ``TypeError`` that
    says where to give it instead; with ``plain_only`` only strings and numbers are kept, and the
    rest left out (a key of what the options ask, where the code comes from the target).
    ``process`` names where the options go, in that refusal."""
    if isinstance(options, Options):
        given = {
            option.name: getattr(options, option.name)
            for option in fields(Options)
            if getattr(options, option.name) != option.default
        }
    else:
        given = dict(options)
    if names is not None:
        wanted = set(names)
        given = {name: value for name, value in given.items() if name in wanted}
    if plain_only:
        given = {name: value for name, value in given.items() if isinstance(value, (str, int, float))}
    for name, value in given.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            raise TypeError(
                f"{name}= is a {type(value).__name__}, which cannot cross into {process}: give it from "
                f"the target (a factory returning a dict with '{name}'), or a JSON value"
            ) from None
    return given


def from_wire(data: Mapping[str, Any], **code: Any) -> Options:
    """The `Options` `to_wire` wrote, with ``code`` (the callables the target gave in this process)."""
    return Options(**{**code, **data})


@dataclass(frozen=True)
class WorkerRequest:
    """What a worker process must do: a ``"trial"`` (one rank of a job: one trial at ``batch_size``
    for ``steps``, under ``cap_bytes``, or under its budget less ``headroom``), an ``"estimate"``
    (the sharded estimate of ``world_size`` ranks) or a ``"soak"`` (the steps ``shapes``, each
    ``[rows, seq_len]``, replayed with the target's ``make_batch``; ``name``: what formed them); of
    ``target``, with ``options`` (`to_wire`'s form); its answer goes to the folder ``out``."""

    kind: WorkerKind
    target: str
    options: dict[str, Any]
    world_size: int
    out: str
    batch_size: int | None = None
    steps: int | None = None
    cap_bytes: int | None = None
    headroom: float | None = None
    shapes: list[list[int]] | None = None
    name: str | None = None

    @property
    def answer_path(self) -> Path:
        """Where an estimate's worker writes its `Result`'s JSON (a soak's its `Soak`'s), or its error."""
        return Path(self.out) / "answer.json"

    def write(self, path: Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), sort_keys=True))

    @classmethod
    def read(cls, path: Path) -> WorkerRequest:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict) or data.get("kind") not in get_args(WorkerKind):
            raise ValueError(f"{path} is not a batchfit worker request")
        return cls(**data)


def worker_command(request_path: Path | str, world_size: int | None = None) -> list[str]:
    """The command that runs the worker on ``request_path``: one process, or with ``world_size`` a
    ``torchrun`` job of that many ranks on this node."""
    if world_size is None:
        return [sys.executable, "-m", _WORKER, str(request_path)]
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
        "-m", _WORKER, str(request_path),
    ]  # fmt: skip


def answer_of(request: WorkerRequest, timeout_s: float | None = None) -> tuple[int | None, Any, str]:
    """Run ``request`` in one worker process and wait for it: its exit code (``None``: no answer
    within ``timeout_s``; the process and all it started were killed, as on any way out, a Ctrl-C
    included: `in_session`), its answer document (``None`` if it wrote none) and the end of its stderr.
    The request file and stderr go in the request's ``out`` folder."""
    path, said = Path(request.out) / "request.json", Path(request.out) / "stderr.txt"
    request.write(path)
    with open(said, "w") as stderr, in_session(worker_command(path), stdout=subprocess.DEVNULL, stderr=stderr) as job:
        try:
            code: int | None = job.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None  # the way out of in_session kills the process's whole session
    tail = said.read_text(errors="replace")[-2000:]
    answer = request.answer_path
    return code, json.loads(answer.read_text()) if answer.exists() else None, tail
