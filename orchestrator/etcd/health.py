"""How full etcd is: its database size against the quota, and its alarms.

etcd refuses every write once its database reaches ``--quota-backend-bytes``
and raises its NOSPACE alarm, which stays raised until an operator frees space
and disarms it.  :func:`read_health` reads what `ringmaster status` and the
controller's metrics show: each member's database size (the largest counts),
the quota, and the alarms raised.

etcd 3.5 does not say what its quota is, so it is taken from the knob
``RINGMASTER_ETCD_QUOTA_BYTES`` (:mod:`orchestrator.settings`; its default is
:data:`~orchestrator.etcd.embedded.QUOTA_BACKEND_BYTES`, what the embedded
etcd and ``k8s/etcd.yaml`` set).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from orchestrator.etcd.client import EtcdClient
from orchestrator.settings import SETTINGS

#: The environment variable that tells ringmaster etcd's ``--quota-backend-bytes``.
QUOTA_ENV = "RINGMASTER_ETCD_QUOTA_BYTES"
#: A database this full (of the quota) is "near full".
NEAR_FULL_RATIO = 0.8
#: How long each member has to say its database size.
STATUS_TIMEOUT = timedelta(seconds=1)


def quota_bytes() -> int:
    """etcd's quota as configured for ringmaster (``RINGMASTER_ETCD_QUOTA_BYTES``)."""
    return SETTINGS.etcd_quota_bytes


@dataclass(frozen=True)
class EtcdHealth:
    """etcd's space as one client sees it.

    Attributes:
        db_bytes: the largest database of the members that answered (None: none did).
        quota_bytes: the quota the database may reach.
        alarms: the kinds of alarm raised (``NOSPACE``, ``CORRUPT``), sorted, once each.
    """

    db_bytes: int | None
    quota_bytes: int
    alarms: tuple[str, ...] = ()

    @property
    def no_space(self) -> bool:
        """etcd refuses writes: its NOSPACE alarm is raised."""
        return "NOSPACE" in self.alarms

    @property
    def near_full(self) -> bool:
        """The database is at :data:`NEAR_FULL_RATIO` of the quota or more."""
        return self.db_bytes is not None and self.db_bytes >= NEAR_FULL_RATIO * self.quota_bytes

    def problem(self) -> str | None:
        """One sentence for people when something is wrong, else None."""
        size = _mib(self.db_bytes) if self.db_bytes is not None else "unknown"
        of = f"database {size} of a {_mib(self.quota_bytes)} quota"
        if self.no_space:
            return (
                f"etcd is out of space (NOSPACE alarm, {of}): it refuses every write and "
                "jobs are paused. Free space and disarm the alarm: `etcdctl compact "
                "<revision>`, `etcdctl defrag`, `etcdctl alarm disarm` (or raise "
                "--quota-backend-bytes)"
            )
        others = [a for a in self.alarms if a != "NOSPACE"]
        if others:
            return f"etcd has alarms raised: {', '.join(others)} ({of}); see `etcdctl alarm list`"
        if self.near_full:
            return (
                f"etcd is nearly full ({of}); at the quota it refuses every write and jobs "
                "pause: compact and defragment it (`etcdctl defrag`) or raise "
                f"--quota-backend-bytes (and {QUOTA_ENV})"
            )
        return None


def read_health(client: EtcdClient) -> EtcdHealth:
    """Database sizes and alarms, asked of etcd now.

    Raises:
        EtcdError: etcd did not answer the alarm list.
    """
    sizes = client.db_sizes(STATUS_TIMEOUT)
    alarms = tuple(sorted({kind for _, kind in client.alarms()}))
    return EtcdHealth(
        db_bytes=max(sizes.values()) if sizes else None,
        quota_bytes=quota_bytes(),
        alarms=alarms,
    )


def _mib(n: int) -> str:
    return f"{n / 1024**2:.1f} MiB"
