"""Pre-imported standby workers: a restart never waits for ``import torch``.

A node agent running a job in the restart tier keeps, per local slot, one
:class:`WarmWorker`: a Python process started ahead of time that has already
imported ``torch`` and ``torch.distributed`` and waits on its stdin pipe for
one launch request.  The contract is one JSON line::

    {"argv": ["train.py", "--lr", "0.1"], "env": {...}, "cwd": "/work", "returned": "/tmp/..."}

``argv`` is what would follow the interpreter on a command line (a script
path, or ``-m`` and a module name, then the arguments); ``returned`` (optional)
names the file where the standby says that the script has returned, with its
exit code, before the process ends (:func:`read_return`): its agent then
knows that whatever still runs is teardown, which it bounds.  On it the standby
replaces its whole environment with ``env``, changes to ``cwd``, sets
``sys.argv`` and ``sys.path[0]`` as ``python script.py`` would, and runs the
script as ``__main__`` (:mod:`runpy`); its exit code is the script's.  Its
stdout and stderr (one pipe, :attr:`WarmWorker.proc`'s ``stdout``) carry the
script's output to whoever launched it.  A standby whose stdin closes before
a request (its agent discarded it or died) exits 0 without running anything;
it also dies with its agent (``PR_SET_PDEATHSIG``).  It runs in a process
group of its own (:func:`orchestrator.process_lifetime.start_group`), which the
worker it becomes keeps: stopping the worker stops whatever the script started.

A standby has imported :data:`PREIMPORTS` before it waits.  When the
script returns or raises, the process ends at once (:func:`_finish`: atexit
handlers and file buffers first, then ``os._exit``), without torch's slow
teardown.

It also holds every c10d process group the script creates until then
(:func:`_keep_process_groups`), so none is destroyed while Python runs.  A
gloo process group's destructor joins its worker threads with the GIL held,
and one of those threads may need the GIL to drop the last reference to a
finished all-reduce (torch stashes a Python context in the thread-local state
that autograd's backward hands to the collectives DDP starts in it): when the
group's last reference went with the script's ``main()`` frame, the worker
deadlocked there for good (a plain ``python`` process instead aborts at exit,
``terminate called without an active exception``, when that thread asks for
the GIL during interpreter shutdown).  Held until ``os._exit``, no group is
destroyed at all.

Variables that torch reads while it is imported must already be in the
standby's own environment: the agent starts it with the job's base
environment (``entrypoint.env``, ``OMP_NUM_THREADS``...), and only the
per-generation variables (``RANK``, ``MASTER_PORT``...) come with the request.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agents.api import PREIMPORTS
from orchestrator.process_lifetime import start_group, stop_groups

__all__ = ["ScriptReturn", "WarmWorker", "read_return"]


@dataclass(frozen=True)
class ScriptReturn:
    """The script has returned (or raised): its exit code, and when (wall clock)."""

    code: int
    at: float


def read_return(path: Path) -> ScriptReturn | None:
    """What the standby wrote at ``path`` once its script returned; None before."""
    try:
        data = json.loads(path.read_text())
        return ScriptReturn(code=int(data["code"]), at=float(data["at"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_return(path: str, code: int) -> None:
    """Say that the script returned (written whole: a temporary file renamed)."""
    with contextlib.suppress(OSError):
        tmp = f"{path}.tmp"
        Path(tmp).write_text(json.dumps({"code": code, "at": time.time()}))
        os.replace(tmp, path)


class WarmWorker:
    """One standby process (see the module docstring).

    Args:
        env: the environment it starts with (what torch may read on import).
        cwd: where it starts (the request may name another directory).
        python: the interpreter (this one by default).
    """

    def __init__(self, env: dict[str, str], cwd: str, python: str = sys.executable) -> None:
        self.launched = False
        self.proc: subprocess.Popen[bytes] = start_group(
            [python, "-m", "agents.node.warm_standby"],
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        """Still waiting for its request (not launched, not exited)."""
        return not self.launched and self.proc.poll() is None

    def launch(
        self, argv: list[str], env: dict[str, str], cwd: str, returned: Path | None = None
    ) -> subprocess.Popen[bytes]:
        """Send the launch request; the process then is the worker (stop it with
        :func:`orchestrator.process_lifetime.stop_groups`, as a group).

        Args:
            argv / env / cwd: the script's command line, environment and directory.
            returned: where to say that the script has returned (:func:`read_return`).

        Raises:
            OSError: the standby is gone (its stdin is closed); start another.
        """
        if self.launched:
            raise RuntimeError("this standby was already launched")
        fields: dict[str, Any] = {"argv": list(argv), "env": dict(env), "cwd": cwd}
        if returned is not None:
            fields["returned"] = str(returned)
        request = json.dumps(fields) + "\n"
        assert self.proc.stdin is not None
        self.proc.stdin.write(request.encode())
        self.proc.stdin.flush()
        self.proc.stdin.close()
        self.launched = True
        return self.proc

    def discard(self) -> None:
        """End an unused standby now (it holds nothing: a kill loses nothing)."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        stop_groups([self.proc], grace=0)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _keep_process_groups() -> list[object]:
    """Hold every c10d process group created from now on (see the module docstring).

    The hook is torch's own registration of a new group
    (``distributed_c10d._register_process_group``, called for
    ``init_process_group``, ``new_group`` and device meshes, from 2.7 on).  A
    torch without it keeps nothing: the agent still bounds a worker whose
    script returned.  Returns the list the groups are kept in.
    """
    import importlib

    kept: list[object] = []
    try:  # by name, as PREIMPORTS are: the node agent itself never imports torch
        distributed_c10d: Any = importlib.import_module("torch.distributed.distributed_c10d")
    except ImportError:  # a torch built without distributed
        return kept
    register = getattr(distributed_c10d, "_register_process_group", None)
    if register is None:
        return kept

    def register_and_keep(group_name: Any, process_group: Any) -> None:
        kept.append(process_group)
        register(group_name, process_group)

    distributed_c10d._register_process_group = register_and_keep
    return kept


def _run(request: dict[str, object]) -> None:
    """Become the worker the request describes (in the standby process)."""
    import runpy

    argv = [str(a) for a in request["argv"]]  # type: ignore[attr-defined]
    env = {str(k): str(v) for k, v in request["env"].items()}  # type: ignore[attr-defined]
    cwd = str(request["cwd"])
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if argv[:1] == ["-m"]:
        module = argv[1]
        sys.argv = [module, *argv[2:]]  # run_module sets argv[0] to the module's file
        sys.path[0] = cwd
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script = str(Path(argv[0]).resolve())
        sys.argv = [argv[0], *argv[1:]]
        sys.path[0] = os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")


def _exit_code(e: SystemExit) -> int:
    """The exit status Python would give ``sys.exit(e.code)`` (printing a message code)."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _finish(code: int) -> None:
    """End the process now: atexit handlers, open files flushed, then ``os._exit``.

    torch's own teardown (its threads and static objects) takes well over
    half a second here, and a failed worker's peers are restarted only once
    it has exited; what a script may rely on at exit (its atexit handlers,
    ``logging``'s flush, the buffers of files it left open) still runs.
    """
    import atexit
    import gc
    import io

    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    with contextlib.suppress(BaseException):
        for obj in gc.get_objects():
            # type(), not isinstance(): some objects warn when asked for __class__
            if issubclass(type(obj), io.IOBase) and not obj.closed:
                with contextlib.suppress(BaseException):
                    obj.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    os._exit(code)


def main() -> None:
    import importlib

    for name in PREIMPORTS:
        importlib.import_module(name)
    line = sys.stdin.readline()
    if not line.strip():
        return  # discarded before it was used
    request = json.loads(line)
    # the script gets no stdin (as under torchrun's agent), not the request pipe
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    _keep_process_groups()
    code = 0
    try:
        _run(request)
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException as e:
        # the traceback as Python prints it for the script (torch may prefix it),
        # without this module's and runpy's frames
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>"):
            tb = tb.tb_next
        if tb is not None:
            e = e.with_traceback(tb)
        sys.excepthook(type(e), e, e.__traceback__)
        code = 1
    if request.get("returned"):
        _write_return(str(request["returned"]), code)
    _finish(code)


if __name__ == "__main__":
    main()
