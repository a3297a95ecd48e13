"""The driver inside a Slurm allocation (``ringmaster slurm run``): the batch script's process.

Runs on the allocation's batch host, as the batch script itself (the script
``exec``\\ s it).  It starts the job's etcd (embedded here, listening on this
node's Slurm address, unless the command line or ``rendezvous.endpoints``
name a cluster), submits the job, starts a controller, then one agent per
node of the allocation with a single ``srun`` step
(:func:`~orchestrator.slurm.script.agent_step`), and follows the job to its
end as ``ringmaster run`` does (:class:`~orchestrator.local_run.LocalRun`,
whose processes here are the controller and the ``srun`` of the agents).

The allocation ending is a signal to this process:

* SIGUSR1 (``--signal=B:USR1@<slurm.signal_grace>`` before the time limit, or
  ``scancel --batch --signal=USR1``): the job saves at one step and stops
  (``ringmaster stop``) within the grace; then, with ``slurm.requeue``, the
  driver puts the Slurm job back in the queue (``scontrol requeue``): when it
  starts again, on whatever nodes it gets, the job resumes from that
  checkpoint (a job restores from the newest committed checkpoint under its
  ``checkpoint.url``).
* SIGTERM (``scancel --batch --signal=TERM``, or the time limit reached
  without the grace's signal): the same save and stop, no requeue.

A plain ``scancel`` signals every process of the allocation at once, the
embedded etcd among them: the final save is then not assured (say
``scancel --batch --signal=USR1`` instead).
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from types import FrameType

from orchestrator.api import JobPhase
from orchestrator.etcd.embedded import EmbeddedEtcd
from orchestrator.etcd.options import EtcdOptions
from orchestrator.local_run import LocalRun, RunResult, _Proc
from orchestrator.process_lifetime import free_port, start_group
from orchestrator.slurm import commands
from orchestrator.slurm.api import Allocation, SlurmError
from orchestrator.slurm.script import agent_command, agent_step
from orchestrator.spec.job import JobSpec
from orchestrator.state import jobs

__all__ = ["AllocationResult", "AllocationRun", "run_in_allocation"]

Printer = Callable[[str], None]

#: How long the driver follows a job: the allocation's time limit ends it first.
_FOREVER = timedelta(days=3650)
#: Of ``slurm.signal_grace``, what is left for stopping the processes once the job
#: has saved (and for ``scontrol requeue``): the save gets the rest.
_STOP_SHARE = 0.25
#: Exit status of a driver ended by a signal, as a shell would report it.
_SIGNALLED = 128


@dataclass
class AllocationResult:
    """How the job ended in this allocation.

    Attributes:
        run: the run's result (phase, steps, recoveries, events...).
        signal: the signal that ended the allocation early (SIGUSR1, SIGTERM), if any.
        requeued: the Slurm job was put back in the queue.
    """

    run: RunResult
    signal: int | None = None
    requeued: bool = False

    @property
    def exit_code(self) -> int:
        """The batch script's exit status: the job's."""
        if self.run.phase is JobPhase.SUCCEEDED or self.requeued:
            return 0
        if self.signal is not None:
            return _SIGNALLED + self.signal
        return 1


class _AllocationEnding(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class AllocationRun(LocalRun):
    """A :class:`LocalRun` whose agents are one ``srun`` step over the allocation's nodes."""

    def __init__(
        self,
        spec: JobSpec,
        allocation: Allocation,
        *,
        etcd: EtcdOptions | None,
        etcd_host: str,
        ringmaster: list[str],
        printer: Printer | None = None,
        workdir: str | None = None,
    ) -> None:
        super().__init__(spec, etcd=etcd, printer=printer, workdir=workdir, timeout=_FOREVER)
        self.allocation = allocation
        self.etcd_host = etcd_host
        self.ringmaster = ringmaster
        self._own_etcd: EmbeddedEtcd | None = None

    def node_names(self) -> list[str]:
        return []  # the agents are started by srun, on the allocation's nodes

    def start(self) -> None:
        """Start etcd (unless one was given), submit the job, start the controller and
        the agents' step."""
        if self.etcd_options is None:
            port = free_port()
            extra = []
            if not self.etcd_host.startswith("127."):  # reachable from the other nodes
                extra = [
                    *("--listen-client-urls", f"http://0.0.0.0:{port}"),
                    *("--advertise-client-urls", f"http://{self.etcd_host}:{port}"),
                ]
            self._own_etcd = EmbeddedEtcd(client_port=port, extra_args=extra).start()
            self.etcd_options = EtcdOptions((f"{self.etcd_host}:{port}",))
            self.print(f"[slurm] etcd on {self.etcd_host}:{port} (embedded, on this node)")
        super().start()
        command = agent_command(self.ringmaster, self.spec.name, self._cli_args())
        argv = agent_step(self.allocation.nodes, command)
        self.print(f"[slurm] {self.allocation.nodes} agents: {' '.join(argv[:8])} ...")
        popen = start_group(
            argv,
            cwd=self.workdir,
            env=self._env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self.procs["agents"] = _Proc("agents", popen)
        pump = threading.Thread(target=self._pump, args=("agents", popen.stdout), daemon=True)
        pump.start()
        self._threads.append(pump)

    def finish(self, grace: timedelta) -> RunResult:
        """Stop the job with a final checkpoint (``ringmaster stop``), following it for
        at most ``grace``."""
        jobs.request_stop(self.client, self.spec.name)
        self.timeout = grace
        return self.wait()

    def stop(self, grace: float = 15.0) -> None:
        try:
            super().stop(grace)
        finally:
            if self._own_etcd is not None:
                self._own_etcd.stop()


def batch_host_address(allocation: Allocation) -> str:
    """The address the other nodes reach this one at: its Slurm ``NodeAddr``, resolved
    (127.0.0.1 where Slurm cannot tell)."""
    if not allocation.node:
        return "127.0.0.1"
    try:
        address = commands.node_state(allocation.node).address or allocation.node
    except SlurmError:
        address = allocation.node
    try:
        return socket.gethostbyname(address)
    except OSError:
        return "127.0.0.1"


def run_in_allocation(
    spec: JobSpec,
    allocation: Allocation,
    *,
    etcd: EtcdOptions | None = None,
    ringmaster: list[str] | None = None,
    printer: Printer | None = None,
    workdir: str | None = None,
) -> AllocationResult:
    """Run ``spec`` in this allocation until it ends, or the allocation does.

    Must run in the main thread (it takes SIGUSR1 and SIGTERM for the allocation's end).

    Raises:
        SlurmError: the allocation has fewer nodes than ``nodes.min``; a requeue refused.
    """
    if allocation.nodes < spec.nodes.min:
        raise SlurmError(
            f"allocation {allocation.job_id} has {allocation.nodes} node(s), fewer than "
            f"nodes.min ({spec.nodes.min}) of job '{spec.name}': submit it with "
            f"`ringmaster slurm submit`, or ask sbatch for at least {spec.nodes.min} nodes"
        )
    run = AllocationRun(
        spec,
        allocation,
        etcd=etcd,
        etcd_host=batch_host_address(allocation) if etcd is None else "",
        ringmaster=ringmaster or [sys.executable, "-m", "orchestrator.cli"],
        printer=printer,
        workdir=workdir,
    )
    say = run.print
    say(
        f"[slurm] job {allocation.job_id} (run {allocation.restarts + 1} in Slurm): "
        f"{allocation.nodes} nodes ({allocation.node_list}), batch host {allocation.node}"
    )
    received: list[int] = []

    def ending(signum: int, _frame: FrameType | None) -> None:
        if received:  # the save is under way: a second signal changes nothing
            return
        received.append(signum)
        raise _AllocationEnding(signum)

    previous = {s: signal.signal(s, ending) for s in (signal.SIGUSR1, signal.SIGTERM)}
    grace = spec.slurm.signal_grace
    try:
        try:
            run.start()
            result = run.wait()
        except _AllocationEnding as e:
            name = signal.Signals(e.signum).name
            save = grace * (1 - _STOP_SHARE)
            say(
                f"[slurm] {name}: the allocation ends; the job saves and stops within "
                f"{save.total_seconds():g}s (of slurm.signal_grace)"
            )
            try:
                result = run.finish(save)
            except RuntimeError:  # the signal came before the job was submitted
                result = RunResult(JobPhase.STOPPED, step=0, recoveries=0, wall_s=0.0)
    finally:
        for sig in previous:  # the job has ended: a late signal has nothing left to save
            signal.signal(sig, signal.SIG_IGN)
        try:
            run.stop(grace=(grace * _STOP_SHARE).total_seconds())
        finally:
            for sig, handler in previous.items():
                with contextlib.suppress(ValueError, TypeError):
                    signal.signal(sig, handler)
    out = AllocationResult(result, signal=received[0] if received else None)
    unfinished = not result.phase.terminal or result.phase is JobPhase.STOPPED
    if out.signal == signal.SIGUSR1 and spec.slurm.requeue and unfinished:
        say(
            f"[slurm] requeueing job {allocation.job_id}: the next run resumes from the "
            "newest committed checkpoint"
        )
        commands.requeue(allocation.job_id)
        out.requeued = True
    return out
