"""Pre-imported standby workers: a restart never waits for ``import torch``.

A node agent running a job in the restart tier keeps, per local slot, one
:class:`WarmWorker`: a Python process started ahead of time that has already
imported ``torch`` and ``torch.distributed`` and waits on its stdin pipe for
one launch request.  The contract is one JSON line::

    {"argv": ["train.py", "--lr", "0.1"], "env": {...}, "cwd": "/work"}

``argv`` is what would follow the interpreter on a command line (a script
path, or ``-m`` and a module name, then the arguments).  On it the standby
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
from pathlib import Path

from agents.api import PREIMPORTS
from orchestrator.process_lifetime import start_group, stop_groups

__all__ = ["WarmWorker"]


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

    def launch(self, argv: list[str], env: dict[str, str], cwd: str) -> subprocess.Popen[bytes]:
        """Send the launch request; the process then is the worker (stop it with
        :func:`orchestrator.process_lifetime.stop_groups`, as a group).

        Raises:
            OSError: the standby is gone (its stdin is closed); start another.
        """
        if self.launched:
            raise RuntimeError("this standby was already launched")
        request = json.dumps({"argv": list(argv), "env": dict(env), "cwd": cwd}) + "\n"
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
    _finish(code)


if __name__ == "__main__":
    main()
