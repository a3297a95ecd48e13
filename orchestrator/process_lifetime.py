"""Children that never outlive their parent, and the ports they listen on.

Every long-lived child ringmaster starts (etcd, agents, workers) asks the
kernel for ``SIGKILL`` when its parent dies (``PR_SET_PDEATHSIG``), which holds
even when the parent is itself SIGKILLed, so a killed node leaves no orphans.
The signal follows the *thread* that started the child: start children from a
thread that outlives them (the main thread, normally).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:  # runs in the child, before exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def tie_to_parent() -> Callable[[], None]:
    """A ``preexec_fn`` for ``subprocess.Popen`` that kills the child with this process."""
    parent = os.getpid()
    return lambda: _die_with_parent(parent)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on at ``host`` now (bound to 0 and released).

    The child it is for binds it next; another process may take it first, as
    with any port picked this way.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
