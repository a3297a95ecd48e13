"""Cluster maintenance: status, database sizes, alarms, compaction and defragmentation.

Used by the key-value facade (:class:`~orchestrator.etcd.client.EtcdClient`):
the leading controller's compactor (:mod:`orchestrator.etcd.compactor`), the
health checks (:mod:`orchestrator.etcd.health`) and ``ringmaster etcd``
commands call these through the client.  A NOSPACE alarm found gone ends
the outage the transport counted from the first write etcd refused
(:meth:`~orchestrator.etcd.transport.EtcdTransport.end_no_space`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from etcd3 import etcdrpc

from orchestrator.api import EtcdError
from orchestrator.etcd import diagnosis
from orchestrator.etcd import quorum as quorum_mod
from orchestrator.etcd.diagnosis import EtcdNoSpaceError
from orchestrator.etcd.members import attempt_timeout
from orchestrator.etcd.transport import EtcdTransport

__all__ = ["DEFRAGMENT_TIMEOUT", "Maintenance", "alarm_name"]

#: How long one member's defragmentation may take.
DEFRAGMENT_TIMEOUT = timedelta(seconds=60)


class Maintenance:
    """The cluster calls of the facade, through ``transport``."""

    def __init__(self, transport: EtcdTransport) -> None:
        self.transport = transport

    def status(self) -> dict[str, Any]:
        """The status of the member calls go to: version, database size, raft index."""
        st = self.transport.call(lambda c: c.status(), quorum=False)
        return {"version": st.version, "db_size": st.db_size, "raft_index": st.raft_index}

    def db_sizes(self, timeout: timedelta = quorum_mod.PROBE_TIMEOUT) -> dict[str, int]:
        """Each member's database size in bytes (asked at once; members that did not
        answer within ``timeout`` are left out)."""
        statuses = quorum_mod.poll_status(self.transport.members, timeout)
        return {m.endpoint: int(st.dbSize) for m, st in statuses.items() if st is not None}

    def alarms(self) -> list[tuple[int, str]]:
        """The alarms raised in the cluster: ``(member id, kind)``, kind ``NOSPACE`` or
        ``CORRUPT``.  A NOSPACE alarm found gone ends the outage it started
        (:meth:`~orchestrator.etcd.transport.EtcdTransport.unreachable_for`)."""
        raw = self.transport.call(lambda c: list(c.list_alarms()), quorum=False)
        found = [(int(a.member_id), alarm_name(int(a.alarm_type))) for a in raw]
        if not any(kind == "NOSPACE" for _, kind in found):
            self.transport.end_no_space()
        return found

    def no_space(self) -> bool:
        """etcd refuses writes for want of space: a NOSPACE alarm is raised."""
        return any(kind == "NOSPACE" for _, kind in self.alarms())

    def check_writable(self) -> None:
        """Raise while etcd refuses writes for want of space (for waits that must last
        as long as the NOSPACE alarm, as ``retry_unavailable(client.check_writable)``).

        Raises:
            EtcdNoSpaceError: a NOSPACE alarm is raised.
        """
        if self.no_space():
            raise EtcdNoSpaceError(list(self.transport.endpoints), "NOSPACE alarm raised")

    def current_revision(self) -> int:
        """etcd's current revision (that of its newest write)."""
        return int(self.transport.call(lambda c: c.get_response("/")).header.revision)

    def compact(self, revision: int | None = None) -> int:
        """Compact etcd's history up to ``revision`` (default: the current one); returns it.

        Old versions of keys become free space in the database (reused by
        later writes; :meth:`defragment` gives it back to the file system).
        """
        at = self.current_revision() if revision is None else int(revision)
        self.transport.call(lambda c: c.compact(at, physical=True))
        return at

    def defragment(self, timeout: timedelta = DEFRAGMENT_TIMEOUT) -> None:
        """Defragment every member's database, one after another.

        A member serves nothing while it defragments; doing one at a time keeps
        a quorum of a cluster answering.

        Raises:
            EtcdError: a member's defragmentation failed (naming the member).
        """
        for member in self.transport.members.members:
            try:
                with attempt_timeout(timeout.total_seconds()):
                    self.transport.authenticate(member)
                    member.raw.defragment()
            except Exception as e:
                raise EtcdError(
                    f"defragmenting etcd at {member.endpoint} failed: {diagnosis.reason(e)}"
                ) from e

    def disarm_no_space(self) -> int:
        """Disarm every NOSPACE alarm (after space was freed); returns how many."""
        raised = [member for member, kind in self.alarms() if kind == "NOSPACE"]
        for member_id in raised:

            def disarm(c: Any, member_id: int = member_id) -> Any:
                return c.disarm_alarm(member_id=member_id)

            self.transport.call(disarm, quorum=False)
        self.transport.end_no_space()
        return len(raised)


def alarm_name(kind: int) -> str:
    """``NOSPACE``, ``CORRUPT``... for an etcd alarm type (the library knows only NOSPACE)."""
    try:
        return str(etcdrpc.AlarmType.Name(kind))
    except ValueError:
        return {2: "CORRUPT"}.get(kind, f"ALARM{kind}")
