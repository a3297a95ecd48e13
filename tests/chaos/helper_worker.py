"""A worker with a helper process of its own, then ``examples/train_tiny.py`` as usual.

Before training, the worker starts a helper (a Python process that ignores
SIGTERM and sleeps, as a data server might) and writes the helper's pid to
``$RM_HELPER_DIR/<node>-<local rank>-<worker pid>.pid``; it leaves the helper
running when it ends.  tests/chaos/test_worker_children.py checks, by those
pids, that no helper outlives its worker.  For the restart tier the same is done
by the script that test writes.
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

from agents import runtime  # noqa: F401 - the in-process tier (what train_tiny uses)
from agents.api import ENV_LOCAL_RANK, ENV_NODE

REPO = Path(__file__).resolve().parents[2]
HELPER = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"


def main() -> None:
    helper = subprocess.Popen([sys.executable, "-c", HELPER])
    name = f"{os.environ[ENV_NODE]}-{os.environ[ENV_LOCAL_RANK]}-{os.getpid()}.pid"
    path = Path(os.environ["RM_HELPER_DIR"], name)
    path.with_suffix(".tmp").write_text(str(helper.pid))
    path.with_suffix(".tmp").rename(path)  # whole when seen
    script = REPO / "examples" / "train_tiny.py"
    sys.argv = [str(script), *sys.argv[1:]]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
