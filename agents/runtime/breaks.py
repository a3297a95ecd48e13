"""The generations a worker left: counted per step, and reported to the controller.

Runs in the training process.  When a generation breaks (a peer is gone, the
controller switched to a new plan, the script's own error, a storage fault),
:class:`Breaks` reports it as a :class:`~orchestrator.state.records.BreakReport`
keyed by generation, so a late report can never affect a newer one: through
the node agent, which writes one record for its workers
(:mod:`agents.node.break_reports`), or under the generation's ``reports/``
prefix itself.  It also counts the failures of one step: a step that fails
:data:`MAX_FAILURES_PER_STEP` times in a row is not a peer's failure, and the
worker gives up.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from agents.api import RecoveryError, WorkerEnv
from orchestrator.api import EtcdError
from orchestrator.state import keys, records
from orchestrator.state.records import BreakReport

if TYPE_CHECKING:
    from agents.runtime.heartbeat import Heartbeat
    from orchestrator.etcd.client import EtcdClient

__all__ = ["MAX_FAILURES_PER_STEP", "Breaks"]

log = logging.getLogger("ringmaster.worker")

#: A step that fails this many times in a row is not a peer failure: give up.
MAX_FAILURES_PER_STEP = 5


class Breaks:
    """The generations this worker left: counted per step, and reported to the controller.

    Args:
        env: the worker's environment (job, node, local rank).
        client: the worker's etcd client (a report the node agent does not relay).
        heartbeat: relays break reports through the node agent.
    """

    def __init__(self, env: WorkerEnv, client: EtcdClient, heartbeat: Heartbeat) -> None:
        self._env = env
        self._client = client
        self._heartbeat = heartbeat
        self._failures_at_step = 0

    def count_break(self, step: int, reason: str, planned: bool) -> None:
        """Count a generation left at ``step`` (a planned change counts nothing).

        Raises:
            RecoveryError: the same step failed too often.
        """
        self._failures_at_step += 0 if planned else 1
        if self._failures_at_step > MAX_FAILURES_PER_STEP:
            raise RecoveryError(
                f"step {step} failed {self._failures_at_step} times in a row; last: {reason}"
            )

    def step_completed(self) -> None:
        """A step completed: the count of failures of one step starts again."""
        self._failures_at_step = 0

    def report(
        self,
        generation: int,
        step: int,
        reason: str,
        planned: bool,
        user_error: bool = False,
        fault: str = "",
        unequal_sites: bool = False,
    ) -> None:
        """Tell the controller that ``generation`` broke here at ``step`` (best effort)."""
        report = BreakReport(step, reason, planned, time.time(), user_error, fault, unequal_sites)
        if self._heartbeat.relay_report(generation, report):
            return  # the node agent wrote it, with its other workers' (agents.node.break_reports)
        worker = keys.worker_id(self._env.node, self._env.local_rank)
        try:
            records.write(
                self._client, keys.job_reports(self._env.job, generation) + worker, report
            )
        except EtcdError as e:
            log.warning("could not report the end of generation %d: %s", generation, e)
