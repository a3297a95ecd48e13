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
it also dies with its agent (``PR_SET_PDEATHSIG``).

Variables that torch reads while it is imported must already be in the
standby's own environment: the agent starts it with the job's base
environment (``entrypoint.env``, ``OMP_NUM_THREADS``...), and only the
per-generation variables (``RANK``, ``MASTER_PORT``...) come with the request.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


class WarmWorker:
    """One standby process (see the module docstring).

    Args:
        env: the environment it starts with (what torch may read on import).
        cwd: where it starts (the request may name another directory).
        python: the interpreter (this one by default).
    """

    def __init__(self, env: dict[str, str], cwd: str, python: str = sys.executable) -> None:
        from orchestrator.process_lifetime import tie_to_parent

        self.launched = False
        self.proc: subprocess.Popen[bytes] = subprocess.Popen(
            [python, "-m", "agents.warm_worker"],
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            preexec_fn=tie_to_parent(),
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        """Still waiting for its request (not launched, not exited)."""
        return not self.launched and self.proc.poll() is None

    def launch(self, argv: list[str], env: dict[str, str], cwd: str) -> subprocess.Popen[bytes]:
        """Send the launch request; the process then is the worker.

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
        """End an unused standby (closing its stdin ends it; a kill makes sure)."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(1.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
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


def main() -> None:
    # the point of a standby: torch is imported before the script needs it
    import torch
    import torch.distributed  # noqa: F401

    line = sys.stdin.readline()
    if not line.strip():
        return  # discarded before it was used
    request = json.loads(line)
    # the script gets no stdin (as under torchrun's agent), not the request pipe
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    _run(request)


if __name__ == "__main__":
    main()
