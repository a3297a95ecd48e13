"""A checkpoint that cannot be written is a storage fault, not the script's error.

Runs in the training process, beside :mod:`agents.runtime.saving`.  A save
that fails (a full disk, a refused write, an endpoint's error) is reported as
a ``CheckpointFailed`` event and training goes on: the next due save tries
again, and the failed save's partial directory is removed by the checkpoint
library (:func:`checkpoint.async_save.discard_uncommitted`).  The job fails for
it only by its own policy: ``checkpoint.max_consecutive_failures`` failed
saves in a row (0: never).  A save that does not end (a hung endpoint) is
reported once, as a ``CheckpointStalled`` event, when a save due after it is
skipped while it has been uploading for ``checkpoint.final_wait`` or longer
(the skips themselves are logged and counted by the checkpoint library); a job
that ends while it still uploads waits for it at most ``checkpoint.final_wait``
and says which checkpoint is the newest durable one (``CheckpointAbandoned``).
``status`` shows a save in flight as ``step 60 uploading for 95 s``.

Every rank keeps the same count: a failed save fails on every rank (DCP and
the commit tell every rank the outcome), and each rank takes an asynchronous
save's outcome at the same step boundary, one where every rank's save has
ended (:attr:`agents.runtime.boundary.Decision.settle`).  Rank 0 alone writes
the events, so it has written each before any rank fails the job for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from agents.api import StorageFaultError
from agents.messages import one_line
from orchestrator.api import EtcdError
from orchestrator.etcd.client import EtcdClient
from orchestrator.spec.checkpoint import CheckpointSpec
from orchestrator.state import events

__all__ = ["StorageFaults"]

log = logging.getLogger("ringmaster.worker")


class StorageFaults:
    """One worker's account of its failed and hanging saves (see the module docstring).

    Args:
        client: the worker's etcd client (events).
        job: the job's name.
        worker: this worker's name (the events' source).
        spec: the job's ``checkpoint`` section (its URL and failure policy).
        rank: this worker's current rank (rank 0 writes the events).
    """

    def __init__(
        self,
        client: EtcdClient,
        job: str,
        worker: str,
        spec: CheckpointSpec,
        rank: Callable[[], int],
    ) -> None:
        self._client = client
        self._job = job
        self._worker = worker
        self._spec = spec
        self._rank = rank
        #: saves that failed since the last one that committed
        self.consecutive = 0
        #: ``(step, url)`` of the newest checkpoint known committed (saved or resumed from)
        self.durable: tuple[int, str] | None = None
        self._stalled: int | None = None  # the step of the hung save already reported

    # -- what happened -----------------------------------------------------------------

    def committed(self, step: int, url: str) -> None:
        """A save committed (or a resume read one): the run of failures ends."""
        self.consecutive = 0
        if self.durable is None or step >= self.durable[0]:
            self.durable = (step, url)

    def failed(self, step: int, error: BaseException) -> None:
        """A save of ``step`` failed: report it, and fail the job if its policy says so.

        Raises:
            StorageFaultError: ``checkpoint.max_consecutive_failures`` saves in a row failed.
        """
        self.consecutive += 1
        limit = self._spec.max_consecutive_failures
        cause = one_line(error)
        in_a_row = f"{self.consecutive} in a row" + (f", {limit} fail the job" if limit else "")
        message = (
            f"checkpoint of step {step} to {self._spec.url} failed ({in_a_row}): {cause}; "
            "training goes on, the next due save tries again"
        )
        log.warning("%s", message)
        self._emit(
            "CheckpointFailed",
            message,
            step=step,
            url=self._spec.url,
            cause=cause,
            consecutive=self.consecutive,
        )
        if limit and self.consecutive >= limit:
            raise StorageFaultError(
                f"checkpoint storage fault: {self.consecutive} saves in a row to "
                f"{self._spec.url} failed (checkpoint.max_consecutive_failures is {limit}), "
                f"the last with: {cause}; {self.newest()}"
            )

    def stalled(self, uploading: int, seconds: float, skipped: int) -> None:
        """The save of ``skipped`` was skipped: ``uploading`` is still uploading (told once)."""
        if self._stalled == uploading:
            return
        self._stalled = uploading
        message = (
            f"checkpoint of step {uploading} to {self._spec.url} still uploading after "
            f"{seconds:.0f}s: the save of step {skipped} is skipped (training goes on; the next "
            f"due save tries again once it ends); {self.newest()}"
        )
        self._emit(
            "CheckpointStalled",
            message,
            step=uploading,
            url=self._spec.url,
            uploading_s=round(seconds, 1),
            skipped=skipped,
        )

    def abandoned(self, step: int, seconds: float) -> None:
        """The job ended while the save of ``step`` (started ``seconds`` ago) still uploaded."""
        wait = self._spec.final_wait.total_seconds()
        message = (
            f"checkpoint of step {step} to {self._spec.url} still uploading after {seconds:.0f}s, "
            f"{wait:g}s after training ended (checkpoint.final_wait): the job ends without it; "
            f"{self.newest()}"
        )
        log.warning("%s", message)
        newest = self.durable[0] if self.durable is not None else None
        self._emit("CheckpointAbandoned", message, step=step, url=self._spec.url, durable=newest)

    def passed_over(self, url: str, why: str, rank: int) -> None:
        """The newest checkpoint, asked for by a resume, fails verification: an older one
        that verifies is used instead (``rank``: this worker's in the generation that
        restores, which the session has not taken on yet)."""
        message = (
            f"the newest checkpoint, {url}, cannot be used ({why}); it is marked as failed "
            "verification and the job resumes from the newest one that verifies"
        )
        log.warning("%s", message)
        if rank == 0:
            self._emit("CheckpointPassedOver", message, rank=rank, url=url)

    def newest(self) -> str:
        """Which checkpoint is the newest durable one, in words."""
        if self.durable is None:
            return f"no checkpoint of this job under {self._spec.url} is committed yet"
        step, url = self.durable
        return f"the newest durable checkpoint is step {step} ({url})"

    def _emit(self, type: str, message: str, rank: int | None = None, **data: object) -> None:
        if (self._rank() if rank is None else rank) != 0:
            return
        try:
            events.emit(self._client, self._job, type, message, source=self._worker, **data)
        except EtcdError as e:  # the event is a report: training does not wait for etcd
            log.warning("could not record %s: %s", type, e)
