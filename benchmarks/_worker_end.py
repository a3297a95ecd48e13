"""How a benchmark's gloo worker ends: without ever freeing a DDP or its group.

Seen with torch 2.13 on gloo, 1 run in 5 of ``slow_link.py --smoke``: a DDP
with a Python comm hook is freed when the worker's function returns; that
frees its reducer and with it the process group, whose destructor joins
gloo's worker threads with the GIL held.  One of those threads was still
disposing of the last collective's work, which needs the GIL: the worker
never exits (py-spy: ``~ProcessGroupGloo`` in ``std::thread::join`` on the
main thread, ``~AsyncWork`` in ``gil_scoped_acquire`` on gloo's).

The product's workers avoid it the same way (:mod:`agents.node.warm_standby`
holds every group until ``os._exit``); a benchmark's gloo workers are plain
processes, so they do it here: :func:`keep` holds every DDP for the life of
the process and :func:`exit_now` leaves without running a destructor.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn, TypeVar

__all__ = ["exit_now", "keep"]

T = TypeVar("T")
_KEPT: list[object] = []


def keep(obj: T) -> T:
    """Hold ``obj`` (a DDP, a group) until the process ends; returns it."""
    _KEPT.append(obj)
    return obj


def exit_now(code: int = 0) -> NoReturn:
    """Flush stdout and stderr and end the process with ``code``, skipping destructors."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
