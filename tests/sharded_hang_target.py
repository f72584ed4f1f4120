"""A target for ``estimate_sharded`` that never returns: it starts a child of its own (as a download
helper or a data server would), writes both pids to ``$BATCHFIT_TEST_HANG_PIDS``, then waits forever."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path


def build() -> None:
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    Path(os.environ["BATCHFIT_TEST_HANG_PIDS"]).write_text(f"{os.getpid()} {helper.pid}")
    time.sleep(3600)
