"""Recovery from a *real* CPU allocator failure, not the meter's limit.

A child process (spawned, never forked from a process that ran threaded torch work) caps its
address space with ``RLIMIT_AS``; torch's CPU allocator then fails with
"DefaultCPUAllocator: can't allocate memory". The finder must catch it, recover, go on, and
return a batch that really trains in the same process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CHILD = textwrap.dedent(
    """
    import json, resource
    import torch
    import batchfit
    from batchfit import examples

    model, sample = examples.mlp(in_features=4096, hidden=32, depth=1)
    # Warm up first: torch's thread pool and kernels, created after the cap, would eat it.
    with batchfit.Prober(model, sample, memory_limit="1TiB") as prober:
        prober.trial(8)
    with open("/proc/self/status") as status:
        vm = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    headroom = 160 * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (vm + headroom, resource.RLIM_INFINITY))

    # The meter's own limit is far away: only the real allocator can say no.
    result = batchfit.find(model, sample, memory_limit="1TiB", max_batch=1 << 20)
    with batchfit.Prober(model, sample, memory_limit="1TiB") as prober:
        again = prober.trial(result.safe_batch, steps=3)
    print(json.dumps({"result": result.to_json(), "again_fits": again.fits, "headroom": headroom}))
    """
)


@pytest.mark.slow  # a fresh process under RLIMIT_AS: the cap must not touch this one
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux")
def test_finder_recovers_from_real_allocator_failures(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    env["MALLOC_MMAP_THRESHOLD_"] = "131072"  # big blocks via mmap: freed memory goes back at once
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    payload = json.loads(done.stdout.strip().splitlines()[-1])
    import batchfit

    result = batchfit.Result.from_json(payload["result"])
    failures = [t for t in result.trials if not t.fits]
    assert failures, "the address-space cap never made an allocation fail"
    messages = [t.message or "" for t in failures]
    assert any("DefaultCPUAllocator: can't allocate memory" in m for m in messages), messages
    # oneDNN reports the same exhaustion as "could not create a primitive" (see batchfit.backends.oom).
    assert all("can't allocate memory" in m or "could not create a primitive" in m for m in messages), messages
    assert result.boundary_reached
    # The boundary sits well inside the cap: each sample costs ~16 KiB of input alone.
    assert 16 < result.max_batch < payload["headroom"] // (16 * 1024)
    assert result.safe_verified
    assert payload["again_fits"], "the safe batch did not train again in the same process"
