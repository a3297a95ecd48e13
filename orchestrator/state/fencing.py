"""Fencing: writes on behalf of a membership generation succeed only in that generation.

The controller publishes each generation under ``/ringmaster/jobs/<job>/plan``.
A worker remembers the ``mod_revision`` of the plan it joined; every write
that could change what the job believes (the process-group store address,
the committed-checkpoint record, the "done" record) is an etcd transaction
that compares the plan key against that revision first.  A node that was cut
off, declared dead and replaced comes back holding an old revision: its
writes fail, and it learns that it was fenced out.

Commits to object storage cannot be made conditional on etcd, so a
checkpoint commit asks :meth:`GenerationFence.check` right before writing its
manifest: a linearizable read of the plan key, which needs the etcd quorum.
A saver that cannot reach etcd cannot prove it is still a member, so it does
not commit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from orchestrator.api import EtcdError
from orchestrator.etcd.client import EtcdClient
from orchestrator.state import keys
from orchestrator.state.api import FencedError, RecordError
from orchestrator.state.records import Plan, decode

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Membership:
    """The generation a process joined and the plan revision that published it."""

    generation: int
    plan_revision: int


class GenerationFence:
    """Guards writes of one job with the plan revision its holder joined.

    Args:
        client: the etcd client.
        job: the job name.
    """

    def __init__(self, client: EtcdClient, job: str) -> None:
        self.client = client
        self.job = job
        self.plan_key = keys.job_plan(job)
        self.membership: Membership | None = None

    def join(self, generation: int, plan_revision: int) -> None:
        """Record the generation this process now belongs to."""
        self.membership = Membership(generation, plan_revision)

    def leave(self) -> None:
        self.membership = None

    def _current(self) -> Membership:
        if self.membership is None:
            raise FencedError(f"job {self.job}: this process belongs to no generation")
        return self.membership

    def check(self) -> None:
        """Prove, with a quorum read, that the joined generation is still current.

        Raises:
            FencedError: a newer plan was published, or etcd could not confirm.
        """
        mine = self._current()
        try:
            kv = self.client.get(self.plan_key)
        except EtcdError as e:
            raise FencedError(
                f"job {self.job}: cannot confirm generation {mine.generation} is current "
                f"(etcd: {e})"
            ) from e
        if kv is None or kv.mod_revision != mine.plan_revision:
            raise FencedError(self._moved(mine, kv.value if kv else None))

    def put(self, key: str, value: str | bytes) -> None:
        """Write ``key`` only if the joined generation is still current.

        Raises:
            FencedError: the plan moved on (this process was fenced out).
            EtcdError: etcd could not be reached.
        """
        mine = self._current()
        ok, guard = self.client.put_guarded(key, value, self.plan_key, mine.plan_revision)
        if not ok:
            raise FencedError(self._moved(mine, guard.value if guard else None))

    def _moved(self, mine: Membership, plan: bytes | None) -> str:
        newer = "none"
        if plan is not None:
            try:
                newer = str(decode(Plan, plan, self.plan_key).generation)
            except RecordError:
                newer = "unreadable"
        return (
            f"job {self.job}: generation {mine.generation} is no longer current "
            f"(plan now at generation {newer}); this process was fenced out"
        )
