"""The soak test's training script: examples/train_tiny.py with ``file://``
checkpoints written slowly, so that kills land during uploads.

It imports the runtime itself: ``fault_tolerance.recovery: auto`` reads only
the entrypoint, and a wrapper that runs another script would look like a
plain torchrun script (the restart tier).
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from agents import runtime  # noqa: E402, F401  (train_tiny.py calls runtime.init())
from tests.chaos.slow_storage import register  # noqa: E402

register()
runpy.run_path(str(REPO / "examples" / "train_tiny.py"), run_name="__main__")
