"""A torchrun-style script that saves when it gets SIGTERM (a preemption-aware script).

Started by a restart-tier test: it writes ``started-<RANK>`` in the directory
given, then waits; on SIGTERM it takes ``SECONDS`` (a save that takes a while)
before it writes ``saved-<RANK>`` and exits.  No torch: nothing to import.

Usage: ``sigterm_saver.py DIR SECONDS``
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType


def main() -> None:
    out, seconds = Path(sys.argv[1]), float(sys.argv[2])
    rank = os.environ["RANK"]

    def save(signum: int, frame: FrameType | None) -> None:
        time.sleep(seconds)
        (out / f"saved-{rank}").write_text(f"{seconds}\n")
        sys.exit(0)

    signal.signal(signal.SIGTERM, save)
    (out / f"started-{rank}").write_text("")
    while True:
        time.sleep(0.1)


if __name__ == "__main__":
    main()
