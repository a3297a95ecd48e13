"""The etcd the benchmark runs against: one member, or the tests' three-member cluster.

One member is :class:`~orchestrator.etcd.embedded.EmbeddedEtcd` (what local
runs and the test fixture start); three are
:class:`tests.faults.etcd_cluster.EtcdCluster` (the chaos tests' cluster,
short raft timings).  Both get the settings of ``k8s/etcd.yaml`` and the embedded etcd that matter
at scale: revision-based auto-compaction (the newest
:data:`~orchestrator.etcd.embedded.AUTO_COMPACTION_RETENTION` revisions) and
the 2 GiB backend quota, unless the benchmark is given another retention (a
number of revisions, or a duration such as ``1m`` for periodic compaction).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from orchestrator.etcd.embedded import AUTO_COMPACTION_RETENTION, QUOTA_BACKEND_BYTES, EmbeddedEtcd
from tests.faults.etcd_cluster import EtcdCluster, Member

#: ``--quota-backend-bytes`` of k8s/etcd.yaml and the embedded etcd.
QUOTA_BYTES = QUOTA_BACKEND_BYTES


def scale_flags(retention: str = "") -> list[str]:
    """The etcd flags of the production manifest, with ``retention`` for compaction.

    Args:
        retention: empty for the product's (revision mode,
            :data:`AUTO_COMPACTION_RETENTION` revisions), a number of revisions, or a
            duration (``1m``, ``1h``) for periodic compaction.
    """
    retention = retention or str(AUTO_COMPACTION_RETENTION)
    mode = "revision" if retention.isdigit() else "periodic"
    return [
        f"--auto-compaction-mode={mode}",
        f"--auto-compaction-retention={retention}",
        f"--quota-backend-bytes={QUOTA_BYTES}",
    ]


class _Cluster(EtcdCluster):
    """The tests' cluster with the production manifest's compaction and quota."""

    def __init__(self, size: int, flags: list[str], root: Path | None = None) -> None:
        super().__init__(size, root=root)
        self._flags = flags

    def _command(self, m: Member, state: str) -> list[str]:
        return [*super()._command(m, state), *self._flags]


@dataclass
class Etcd:
    """A running etcd: client endpoints, metrics URLs, member pids and log files."""

    endpoints: tuple[str, ...]
    urls: tuple[str, ...]
    pids: tuple[int, ...]
    logs: tuple[Path, ...]

    def log_tails(self, chars: int = 1500) -> str:
        out = []
        for path in self.logs:
            with contextlib.suppress(OSError):
                out.append(f"--- {path.name}\n{path.read_text(errors='replace')[-chars:]}")
        return "\n".join(out)


@contextlib.contextmanager
def running_etcd(members: int, retention: str) -> Iterator[Etcd]:
    """Start ``members`` (1 or 3) etcd members for as long as the context lasts."""
    flags = scale_flags(retention)
    if members == 1:
        # warnings stay in its log: "apply request took too long" says etcd is saturated
        with EmbeddedEtcd(extra_args=flags) as one:
            assert one.pid is not None
            log = one.data_dir.parent / f"{one.data_dir.name}.log"
            yield Etcd((one.endpoint,), (one.url,), (one.pid,), (log,))
        return
    with _Cluster(members, flags) as cluster:
        pids = tuple(m.proc.pid for m in cluster.members if m.proc is not None)
        yield Etcd(
            cluster.endpoints,
            tuple(f"http://{ep}" for ep in cluster.endpoints),
            pids,
            tuple(m.log_path for m in cluster.members),
        )


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a live process used so far; 0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    # fields after "(comm)": state is [0]; utime and stime are the 14th and 15th of stat
    return (int(fields[11]) + int(fields[12])) / ticks
