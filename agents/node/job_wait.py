"""An agent's wait for a run of its job that it may join.

Runs in the node agent, before it registers.  A job name has runs (a submit
starts one, a ``resume`` or a new submit of an ended job starts the next;
:func:`orchestrator.state.jobs.submit`).  An agent may start before its job is
submitted (a pod scheduled before ``ringmaster submit``), or after the job's
last run ended (between ``stop`` and ``resume``, after a failed run, as a pod
restart or a person would start it): either way it waits, and joins the first
run that has not ended.  It never registers into an ended run: that run's
plan, nodes and store keys stay in etcd until the next run clears them, and
an agent that joined them would train in no run at all.

While it waits it only reads etcd (one snapshot of the spec record and the
status every :data:`SPEC_POLL`), writes nothing, and says once what it waits
for; an etcd outage is waited out, within the wait limit.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

from agents.node.api import JobNotSubmittedError
from orchestrator.api import EtcdUnavailableError
from orchestrator.etcd.client import EtcdClient
from orchestrator.etcd.retry import retry_unavailable
from orchestrator.spec.job import JobSpec
from orchestrator.state.jobs import load_spec, read_run

__all__ = ["SPEC_POLL", "JoinableRun", "wait_for_run"]

log = logging.getLogger("ringmaster.agent")

#: How often a waiting agent looks for its job's next run.
SPEC_POLL = 0.5


@dataclass(frozen=True)
class JoinableRun:
    """A run of the job that has not ended: its spec and its number."""

    spec: JobSpec
    run: int


def wait_for_run(
    client: EtcdClient, job: str, node: str, stop: threading.Event, limit: timedelta
) -> JoinableRun | None:
    """The job's run once one that has not ended is submitted; None when stopped first.

    Args:
        client: etcd.
        job / node: whose run, and who waits (for the log).
        stop: ends the wait (None is returned).
        limit: how long to wait (zero: forever).

    Raises:
        JobNotSubmittedError: ``limit`` (non-zero) passed without a run to join.
        EtcdError: etcd failed otherwise than by being unavailable for a while.
    """
    seconds = limit.total_seconds()
    started = time.monotonic()
    said = ""  # what the agent said it waits for (said again only when that changes)
    ended = ""  # the ended run it waits past, if any
    while not stop.is_set():
        left = seconds - (time.monotonic() - started) if seconds > 0 else None
        try:
            found = retry_unavailable(
                lambda: read_run(client, job),
                f"[{node}] looking for job '{job}'",
                stop=stop,
                max_wait=timedelta(seconds=max(left, 0)) if left is not None else None,
            )
        except EtcdUnavailableError:
            if stop.is_set():
                return None
            raise
        waiting_for = ""
        if found is None:
            waiting_for = f"job '{job}' to be submitted (`ringmaster submit job.yaml`)"
        else:
            record, status = found
            if status is None or (status.run == record.run and not status.phase.terminal):
                if said:
                    what = f"run {record.run} of job '{job}'" if ended else f"job '{job}'"
                    log.info(
                        "[%s] %s submitted after %.0fs of waiting",
                        node,
                        what,
                        time.monotonic() - started,
                    )
                return JoinableRun(load_spec(record, job), record.run)
            if status.run == record.run:  # the last run ended
                ended = f"its run {record.run} is {status.phase.value}"
                waiting_for = (
                    f"the next run of job '{job}' ({ended}; "
                    f"`ringmaster resume {job}` starts the next)"
                )
            # else: a resubmit is under way (the status is still the last run's)
        if waiting_for and waiting_for != said:
            said = waiting_for
            limit_text = f"giving up after {seconds:g}s" if seconds > 0 else "no time limit"
            log.info("[%s] waiting for %s; %s", node, waiting_for, limit_text)
        left = seconds - (time.monotonic() - started) if seconds > 0 else None
        if left is not None and left <= 0:
            if ended:
                raise JobNotSubmittedError(
                    f"job '{job}' had no new run within {seconds:g}s ({ended}): resume it "
                    f"(`ringmaster resume {job}`) and start the agent again, or let it wait "
                    "longer (--wait-for-job SECONDS, 0 = forever; env RINGMASTER_JOB_WAIT)"
                )
            raise JobNotSubmittedError(
                f"job '{job}' was not submitted within {seconds:g}s: submit it "
                "(`ringmaster submit job.yaml`) and start the agent again, or let it wait "
                "longer (--wait-for-job SECONDS, 0 = forever; env RINGMASTER_JOB_WAIT)"
            )
        stop.wait(SPEC_POLL if left is None else min(SPEC_POLL, left))
    return None
