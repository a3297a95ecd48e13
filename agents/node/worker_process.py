"""One worker process under a node agent's supervision (either tier).

Runs in the node agent.  A :class:`WorkerProcess` is a training process the
agent started (or a pre-imported standby it launched): a process group of its
own that dies with the agent (:mod:`orchestrator.process_lifetime`), its output
read by a :class:`~agents.node.log_shipper.LogShipper`, and the torch elastic
error file it may write.  It is stopped as a group, in the one stop sequence
(SIGTERM, a grace, SIGKILL, reap), so a helper process the script started
never outlives it.

A thread per worker notes when it exits (which failure came first matters to
the restart tier) without reaping it; the tier that runs it reaps it with
:meth:`WorkerProcess.stop`, which also kills whatever it left behind.

A worker launched from a pre-imported standby also says when its script has
returned (:meth:`WorkerProcess.script_return`): what still runs after that is
the process's teardown, which its supervisor bounds
(:meth:`WorkerProcess.end_after_return`), so a script that finished never
keeps its job running.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from agents.node.log_shipper import LogShipper
from agents.node.warm_standby import ScriptReturn, read_return
from agents.node.worker_exits import describe_failure
from orchestrator.process_lifetime import (
    exit_status,
    signal_group,
    start_group,
    stop_groups,
    wait_exit,
)

__all__ = ["WorkerProcess", "stop_workers"]


class WorkerProcess:
    """A worker: its process group, output, error file and place on the node.

    Args:
        local_rank: its slot on the node.
        proc: the process, started with :func:`orchestrator.process_lifetime.start_group`
            (its stdout a pipe when ``shipper`` is given).
        error_file: where torch elastic's ``@record`` writes its error
            (``TORCHELASTIC_ERROR_FILE``).
        shipper: reads its output (started here, on ``proc.stdout``).
        restarts: how often its slot was restarted before (the in-process tier).
        generation: the generation it was launched for (the restart tier).
        returned: where its standby says that the script returned (the restart tier).
    """

    def __init__(
        self,
        local_rank: int,
        proc: subprocess.Popen[bytes],
        error_file: Path,
        shipper: LogShipper | None = None,
        *,
        restarts: int = 0,
        generation: int = 0,
        returned: Path | None = None,
    ) -> None:
        self.local_rank = local_rank
        self.proc = proc
        self.error_file = error_file
        self.shipper = shipper
        self.restarts = restarts
        self.generation = generation
        self.started_at = time.time()
        #: when it exited (wall clock), noted by its exit thread
        self.exited_at: float | None = None
        #: its supervisor has handled its exit (recorded or reported it)
        self.exit_handled = False
        #: its group was killed because it outlived its script (see end_after_return)
        self.ended_after_return = False
        self._returned_file = returned
        self._returned: ScriptReturn | None = None
        # signals to its group and its reaping, one at a time (a reaped pid may be reused)
        self._lock = threading.Lock()
        if shipper is not None and proc.stdout is not None:
            shipper.start(proc.stdout)
        threading.Thread(target=self._note_exit, name="worker-exit", daemon=True).start()

    @classmethod
    def start(
        cls,
        argv: Sequence[str],
        *,
        env: dict[str, str],
        cwd: str,
        local_rank: int,
        error_file: Path,
        shipper: LogShipper | None,
        restarts: int = 0,
    ) -> WorkerProcess:
        """Start ``argv`` as worker ``local_rank``, in a process group of its own."""
        proc = start_group(
            argv,
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE if shipper is not None else None,
            stderr=subprocess.STDOUT if shipper is not None else None,
        )
        return cls(local_rank, proc, error_file, shipper, restarts=restarts)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def first_output_at(self) -> float | None:
        """When its first line of output was read (None before, or when not read)."""
        return self.shipper.first_output_at if self.shipper is not None else None

    def exit_code(self) -> int | None:
        """Its exit status (``Popen.returncode``'s convention), None while it runs."""
        return exit_status(self.proc)

    def running(self) -> bool:
        return self.exit_code() is None

    def describe_exit(self) -> str:
        """How it ended, with its error (torch's error file, else its last error line).

        The script's own exit code where its standby said it (the process may have
        been killed after the script returned), else the process's.
        """
        returned = self.script_return()
        code = returned.code if returned is not None else self.exit_code()
        return describe_failure(code if code is not None else 0, self.error_file, self.shipper)

    def script_return(self) -> ScriptReturn | None:
        """Its script's exit code and end, once the script has returned (or raised);
        None before that, and for a worker started without a standby."""
        if self._returned is None and self._returned_file is not None:
            self._returned = read_return(self._returned_file)
        return self._returned

    def end_after_return(self, grace: float) -> bool:
        """Kill its group when its script returned over ``grace`` seconds ago and the
        process still runs (stuck in teardown).  True when that was done now."""
        if self.ended_after_return or not self.running():
            return False
        returned = self.script_return()
        if returned is None or time.time() - returned.at < grace:
            return False
        self.ended_after_return = True
        self.kill()
        return True

    def kill(self) -> None:
        """SIGKILL its group now (a hung worker); its supervisor sees the exit and reaps it."""
        with self._lock:
            signal_group(self.proc, signal.SIGKILL)

    def stop(self, grace: float) -> int:
        """The stop sequence for this worker alone; see :func:`stop_workers`."""
        return stop_workers([self], grace)[0]

    def _note_exit(self) -> None:
        wait_exit(self.proc, None)
        self.exited_at = time.time()


def stop_workers(workers: Iterable[WorkerProcess], grace: float) -> list[int]:
    """Stop ``workers`` together: SIGTERM each group, up to ``grace`` seconds, SIGKILL, reap.

    A worker that has already exited is reaped and what it left behind killed;
    one already reaped is left as it is.  Returns each worker's exit status.
    """
    workers = list(workers)
    locked = sorted(workers, key=id)  # one lock order for every caller
    for w in locked:
        w._lock.acquire()
    try:
        return stop_groups([w.proc for w in workers], grace)
    finally:
        for w in locked:
            w._lock.release()
