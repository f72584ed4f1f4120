"""Fault injection: real Ctrl-C (SIGINT) sent at many points of a real probe, in child processes.

Each child builds a model, records its state, runs ``batchfit.find`` and reports how it ended:

* ``interrupted``: ``find`` raised ``KeyboardInterrupt`` (and whether the model, its buffers and
  the RNG were bit-exactly as before);
* ``after``: ``find`` returned, and the SIGINT arrived afterwards, in the child's wait that
  follows (the signal was sent after the probe ended: nothing to surface);
* ``lost``: ``find`` returned and no SIGINT ever arrived: the interrupt was swallowed.

The parent measures one uninterrupted probe, then sends one SIGINT to each child at offsets
spread evenly over that duration (counted from the moment the child says the probe starts).
Besides the outcome, a child's stderr is searched for "Exception ignored" (what Python prints
when an exception dies inside a finalizer).

Run from the repository root::

    python benchmarks/faults.py                    # 40 signals into find(gpt, 24MiB), 2 at a time
    python benchmarks/faults.py --runs 100 --limit 64MiB

It prints a table and writes JSON to ``benchmarks/results/``. ``tests/test_interrupts.py`` runs
the same harness with fewer signals.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Outcome:
    offset_s: float
    outcome: str  # "interrupted", "after", "lost", or "error: ..."
    restored: bool | None
    exit_code: int | None
    swallowed_in_finalizer: bool


def child(model_name: str, limit: str) -> int:
    """The child's side: probe, and report how it ended as one JSON line."""
    # As in a terminal: a child started from a background job inherits SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import torch

    import batchfit
    from batchfit import examples

    torch.manual_seed(0)
    model, sample = getattr(examples, model_name)()
    before = _state(model)
    print("started", flush=True)
    try:
        batchfit.find(model, sample, memory_limit=limit)
    except KeyboardInterrupt:
        print(json.dumps({"outcome": "interrupted", "restored": _same(before, _state(model))}), flush=True)
        return 130
    print("returned", flush=True)
    try:
        time.sleep(10)
    except KeyboardInterrupt:
        print(json.dumps({"outcome": "after", "restored": _same(before, _state(model))}), flush=True)
        return 0
    print(json.dumps({"outcome": "lost", "restored": _same(before, _state(model))}), flush=True)
    return 1


def _state(model: object) -> dict:
    import torch

    return {
        "tensors": {k: v.detach().clone() for k, v in model.state_dict().items()},  # type: ignore[attr-defined]
        "training": [m.training for m in model.modules()],  # type: ignore[attr-defined]
        "rng": torch.random.get_rng_state(),
    }


def _same(before: dict, after: dict) -> bool:
    import torch

    return (
        before["tensors"].keys() == after["tensors"].keys()
        and all(torch.equal(v, after["tensors"][k]) for k, v in before["tensors"].items())
        and before["training"] == after["training"]
        and torch.equal(before["rng"], after["rng"])
    )


def _spawn(model_name: str, limit: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--child", "--model", model_name, "--limit", limit],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )


def measure(model_name: str, limit: str, timeout_s: float = 120) -> float:
    """Seconds from "started" to "returned" of one uninterrupted probe."""
    proc = _spawn(model_name, limit)
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "started", proc.stderr.read() if proc.stderr else ""
        start = time.monotonic()
        line = proc.stdout.readline().strip()
        elapsed = time.monotonic() - start
        if line != "returned":
            raise RuntimeError(f"the uninterrupted probe did not return: {line!r}")
        return elapsed
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=timeout_s)


def interrupt_once(model_name: str, limit: str, offset_s: float, timeout_s: float = 120) -> Outcome:
    """One child, one SIGINT ``offset_s`` seconds after it says the probe starts."""
    proc = _spawn(model_name, limit)
    assert proc.stdout is not None
    first = proc.stdout.readline().strip()
    if first != "started":
        _, err = proc.communicate(timeout=timeout_s)
        return Outcome(offset_s, f"error: {err.strip().splitlines()[-1:]}", None, proc.returncode, False)
    time.sleep(offset_s)
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return Outcome(offset_s, "error: hung", None, None, False)
    reports = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    if not reports:
        tail = err.strip().splitlines()[-1:] or ["no report"]
        return Outcome(offset_s, f"error: {tail[0]}", None, proc.returncode, "Exception ignored" in err)
    report = reports[-1]
    return Outcome(offset_s, report["outcome"], report["restored"], proc.returncode, "Exception ignored" in err)


def run(runs: int, model_name: str, limit: str, concurrency: int) -> tuple[float, list[Outcome]]:
    """Measure one probe, then ``runs`` children with signals spread over its duration."""
    duration = measure(model_name, limit)
    offsets = [duration * (index + 0.5) / runs for index in range(runs)]
    outcomes: list[Outcome | None] = [None] * runs
    pending = list(enumerate(offsets))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if not pending:
                    return
                index, offset = pending.pop(0)
            outcomes[index] = interrupt_once(model_name, limit, offset)

    threads = [threading.Thread(target=worker) for _ in range(max(1, concurrency))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return duration, [o for o in outcomes if o is not None]


def summarise(outcomes: list[Outcome]) -> dict[str, int]:
    counts = {"sent": len(outcomes), "interrupted": 0, "after": 0, "lost": 0, "errors": 0}
    for outcome in outcomes:
        key = outcome.outcome if outcome.outcome in ("interrupted", "after", "lost") else "errors"
        counts[key] += 1
    counts["restored"] = sum(1 for o in outcomes if o.outcome in ("interrupted", "after") and o.restored)
    counts["swallowed_in_finalizer"] = sum(1 for o in outcomes if o.swallowed_in_finalizer)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="real SIGINTs at many points of a real probe")
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--limit", default="24MiB")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.model, args.limit)
    started = time.monotonic()
    duration, outcomes = run(args.runs, args.model, args.limit, args.concurrency)
    counts = summarise(outcomes)
    print(f"probe: find(examples.{args.model}(), memory_limit={args.limit!r}), {duration:.2f} s uninterrupted")
    print(f"{'signals sent':<28}{counts['sent']:>6}")
    print(f"{'surfaced in find()':<28}{counts['interrupted']:>6}")
    print(f"{'arrived after find()':<28}{counts['after']:>6}")
    print(f"{'lost (find returned)':<28}{counts['lost']:>6}")
    print(f"{'errors / hangs':<28}{counts['errors']:>6}")
    print(f"{'state restored':<28}{counts['restored']:>6} of {counts['interrupted'] + counts['after']}")
    print(f"{'Exception ignored in stderr':<28}{counts['swallowed_in_finalizer']:>6}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"faults-sigint-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(
        json.dumps(
            {
                "model": args.model,
                "limit": args.limit,
                "uninterrupted_s": duration,
                "wall_s": time.monotonic() - started,
                "counts": counts,
                "outcomes": [asdict(o) for o in outcomes],
                "machine": platform.platform(),
                "cpus": os.cpu_count(),
            },
            indent=2,
        )
    )
    print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return 0 if counts["lost"] == 0 and counts["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
