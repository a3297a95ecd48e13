"""Child processes: each in a group of its own, tied to its parent, stopped one way.

Runs in every process that starts children: the node agent (workers and
pre-imported standbys), ``ringmaster run`` (agents, controllers, the embedded
etcd) and the tests.  The rules, in one place:

* **A group of its own** (:func:`start_group`): a child starts in a new session
  (``start_new_session``), so its process group holds it and whatever it starts
  itself (a data server, a user's helper), and nothing else.  A stop signals
  that group, not one pid; a signal to the parent's group does not reach it.
* **Dies with its parent** (:func:`die_with_parent`): the child asks the kernel
  for ``SIGKILL`` when its parent dies (``PR_SET_PDEATHSIG``), which holds even
  when the parent is itself SIGKILLed.  The request is made by a short launcher
  that then ``exec``\\ s the real program (same pid), never by a ``preexec_fn``:
  code run between ``fork`` and ``exec`` in a process full of threads (the
  agent's gRPC threads) may deadlock, as Python's documentation warns.  The
  launcher is this interpreter (``-I -S``, about 10 ms), not ``setpriv
  --pdeathsig`` from util-linux: it checks that its parent is still the one
  that started it (the parent may die before the request takes effect, which
  ``setpriv`` does not check), and it needs nothing a minimal image may lack.
  The signal follows the *thread* that started the child: start children from
  a thread that outlives them (the main thread, normally).
* **One stop sequence** (:func:`stop_groups`): SIGTERM to each group, up to
  ``grace`` for each child to exit, SIGKILL to each group (the child if still
  there, and whatever it left behind), reap.  A child is reaped only after that
  SIGKILL: while it is unreaped its pid, the group's id, cannot be reused, so
  the signal reaches no stranger.  For that reason :func:`exit_status` and
  :func:`wait_exit` see a child's exit without reaping it.
* **A machine's death, emulated** (:func:`kill_tree`): a process and every
  process descended from it, whatever their groups, SIGKILLed at once.

:func:`free_port` is here too: children that listen (etcd, a rank-0 worker's
store) are given their port by the process that starts them.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, Any

__all__ = [
    "die_with_parent",
    "exit_status",
    "free_port",
    "free_ports",
    "kill_tree",
    "signal_group",
    "start_group",
    "stop_groups",
    "wait_exit",
]

#: The launcher: ask for SIGKILL at the parent's death (PR_SET_PDEATHSIG is 1), give up
#: if the parent died before that took effect, then become the program (same pid).
_LAUNCHER = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)
#: How often :func:`wait_exit` looks where the kernel has no pidfd (before Linux 5.3).
_POLL_S = 0.01

Stream = int | IO[Any] | None


def die_with_parent(argv: Sequence[str]) -> list[str]:
    """``argv`` behind the launcher that ties it to this process (see the module docstring).

    Raises:
        FileNotFoundError: ``argv[0]`` names no program on ``PATH`` (said here, in the
            parent, as ``subprocess.Popen`` would, not by a launcher that fails later).
    """
    program = argv[0]
    if os.sep not in program:
        found = shutil.which(program)
        if found is None:
            raise FileNotFoundError(f"no program {program!r} on PATH")
        program = found
    return [sys.executable, "-I", "-S", "-c", _LAUNCHER, str(os.getpid()), program, *argv[1:]]


def start_group(
    argv: Sequence[str],
    *,
    cwd: str | Path | None = None,
    env: dict[str, str] | None = None,
    stdin: Stream = None,
    stdout: Stream = None,
    stderr: Stream = None,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` in a session and process group of its own, dying with this process.

    Stop it with :func:`stop_groups`; signal it (and what it started) with
    :func:`signal_group`.
    """
    return subprocess.Popen(
        die_with_parent(argv),
        cwd=cwd,
        env=env,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,
    )


def _code(info: os.waitid_result) -> int:
    """An exit as ``Popen.returncode`` gives it: the exit code, or minus the signal."""
    return int(info.si_status) if info.si_code == os.CLD_EXITED else -int(info.si_status)


def exit_status(proc: subprocess.Popen[bytes]) -> int | None:
    """How ``proc`` exited (``Popen.returncode``'s convention), None while it runs.

    Unlike ``Popen.poll`` it does not reap the child: until :func:`stop_groups`
    does, the child's pid (its group's id) stays taken.
    """
    if proc.returncode is not None:
        return proc.returncode
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped meanwhile, through the Popen (another thread)
        return proc.wait()
    return None if info is None else _code(info)


def wait_exit(proc: subprocess.Popen[bytes], timeout: float | None) -> int | None:
    """Wait up to ``timeout`` seconds (None: for ever) for ``proc`` to exit, without reaping.

    Returns:
        Its exit status (see :func:`exit_status`), or None if it still runs.
    """
    code = exit_status(proc)
    if code is not None or timeout == 0:
        return code
    try:
        fd = os.pidfd_open(proc.pid)
    except OSError:  # no pidfd here, or reaped meanwhile: look again and again
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := exit_status(proc)) is None:
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(_POLL_S)
        return code
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)  # readable once the process has exited
        poller.poll(None if timeout is None else max(int(timeout * 1000), 1))
    finally:
        os.close(fd)
    return exit_status(proc)


def signal_group(proc: subprocess.Popen[Any], sig: int) -> None:
    """Send ``sig`` to ``proc``'s process group (to ``proc`` alone if it leads none).

    Nothing is sent once ``proc`` is reaped: its pid may be another process's by then.
    """
    if proc.returncode is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:  # not a group leader (not started by start_group)
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)
    except PermissionError:  # pragma: no cover - a group member that changed its user
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(proc.pid, sig)


def stop_groups(
    procs: Iterable[subprocess.Popen[bytes]], grace: float, *, whole_tree: bool = False
) -> list[int]:
    """The stop sequence: SIGTERM each group, wait, SIGKILL each group, reap.

    Each child gets up to ``grace`` seconds (one deadline for all) to exit after
    the SIGTERM; then its group gets SIGKILL, whether the child exited or not,
    so nothing it started outlives it.  A child that had already exited gets no
    SIGTERM (what it left behind is killed).  A child reaped before (by
    ``Popen.poll``) is left as it is.

    Args:
        procs: children started by :func:`start_group`.
        grace: seconds between the SIGTERM and the SIGKILL.
        whole_tree: the SIGKILL also goes to every descendant of a child still
            running then (:func:`kill_tree`): for a child whose own children have
            groups of their own (a node agent and its workers).

    Returns:
        Each child's exit status, in order.
    """
    procs = list(procs)
    live = [p for p in procs if p.returncode is None]
    for p in live:
        if exit_status(p) is None:
            signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in live:
        wait_exit(p, max(deadline - time.monotonic(), 0.0))
    for p in live:
        if whole_tree and exit_status(p) is None:
            kill_tree(p.pid)
        signal_group(p, signal.SIGKILL)
    return [p.wait() for p in procs]


def _parents() -> dict[int, int]:
    """``pid -> parent pid`` of every process now (from ``/proc``)."""
    out: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # it exited meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        fields = stat[stat.rfind(")") + 2 :].split()
        out[int(entry.name)] = int(fields[1])
    return out


def _tree(pid: int) -> set[int]:
    """``pid`` and every process descended from it now."""
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    found, todo = {pid}, [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and all its descendants at once, as the death of their machine would.

    Each process of the tree is stopped first (``SIGSTOP``) until no new one
    appears (a stopped process starts no other), then all are killed: a
    descendant that left its parent's group (a worker's own session, or a
    helper that called ``setsid``) goes too.  ``pid`` must be this process's
    unreaped child or otherwise known to be alive (pids are read from ``/proc``).
    """
    frozen: set[int] = set()
    while new := _tree(pid) - frozen:
        for p in new:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, signal.SIGSTOP)
        frozen |= new
    for p in frozen:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on at ``host`` now (bound to 0 and released).

    The child it is for binds it next; another process may take it first, as
    with any port picked this way.
    """
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct TCP ports nobody listens on at ``host`` now.

    Each is held until all are picked: :func:`free_port` called twice may give
    the same port twice (the kernel hands a released port out again), and a
    child told to listen on both then fails with "address already in use".
    """
    with contextlib.ExitStack() as held:
        socks = [
            held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            for _ in range(count)
        ]
        for s in socks:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]
