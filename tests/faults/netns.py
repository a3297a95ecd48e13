"""Network partitions with Linux network namespaces.

:class:`IsolatedNode` is a network namespace joined to the host by one veth
pair (a /30: host side ``host_ip``, namespace side ``node_ip``).  Processes
started with :meth:`IsolatedNode.command` run inside it and reach the host
(etcd, peers) only through that link; :meth:`cut` takes the host end down,
which silently drops everything both ways (no resets: established TCP
connections just stop, as in a real partition), and :meth:`heal` brings it
back.  Host processes keep reaching ``host_ip`` while the link is down (a
local address), so host-side peers can advertise it to the namespace.

Creating namespaces needs root (CAP_NET_ADMIN); :func:`unavailable_reason`
says why not, for ``pytest.skip``.  Names carry the creating process id so
parallel runs never collide, and :meth:`destroy` (also on ``__exit__``)
removes the namespace and both veth ends even after a failure.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
from collections.abc import Iterator
from types import TracebackType

_counter = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=10)


def unavailable_reason() -> str | None:
    """Why namespaces cannot be used here, or None when they can."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN); run the chaos tests as root"
    probe = f"rmprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        return f"cannot create a network namespace: {detail.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@contextlib.contextmanager
def isolated_or_skip(label: str, needed_by: str) -> Iterator[IsolatedNode]:
    """An :class:`IsolatedNode` for a test, or the test skipped with the reason."""
    reason = unavailable_reason()
    if reason is not None:
        import pytest

        pytest.skip(f"{needed_by} needs network namespaces: {reason}")
    with IsolatedNode(label) as node:
        yield node


class IsolatedNode:
    """A network namespace linked to the host by a veth pair that can be cut.

    Args:
        label: a short word in the namespace name (for people reading ``ip netns``).
    """

    def __init__(self, label: str = "node") -> None:
        n = next(_counter)
        tag = f"{os.getpid() % 100000}{n}"
        self.namespace = f"rm-{label}-{tag}"
        self.host_if = f"rmh{tag}"[:15]
        self.node_if = f"rmn{tag}"[:15]
        # a /30 per pair, spread by pid so parallel runs pick different subnets
        block = (os.getpid() * 7 + n * 4) % 16000 * 4
        self.host_ip = f"10.{90 + block // 65536}.{block // 256 % 256}.{block % 256 + 1}"
        self.node_ip = f"10.{90 + block // 65536}.{block // 256 % 256}.{block % 256 + 2}"
        self.created = False

    def create(self) -> IsolatedNode:
        """Create the namespace and the link, both ends up."""
        try:
            _ip("netns", "add", self.namespace)
            self.created = True
            _ip(
                "link",
                "add",
                self.host_if,
                "type",
                "veth",
                "peer",
                "name",
                self.node_if,
                "netns",
                self.namespace,
            )
            _ip("addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
            _ip("link", "set", self.host_if, "up")
            inside = ("netns", "exec", self.namespace, "ip")
            _ip(*inside, "addr", "add", f"{self.node_ip}/30", "dev", self.node_if)
            _ip(*inside, "link", "set", self.node_if, "up")
            _ip(*inside, "link", "set", "lo", "up")
            _ip(*inside, "route", "add", "default", "via", self.host_ip)
        except subprocess.CalledProcessError as e:
            self.destroy()
            raise RuntimeError(f"could not set up namespace {self.namespace}: {e.stderr}") from e
        return self

    def limit(self, rate: str, burst: str = "32kb", latency: str = "50ms") -> None:
        """Limit the link both ways to ``rate`` (``tc … tbf`` on both ends of the veth),
        as a slow NIC or a congested port would."""
        tbf = ["root", "tbf", "rate", rate, "burst", burst, "latency", latency]
        subprocess.run(["tc", "qdisc", "replace", "dev", self.host_if, *tbf], check=True)
        subprocess.run(
            self.command(["tc", "qdisc", "replace", "dev", self.node_if, *tbf]), check=True
        )

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def cut(self) -> None:
        """Partition: take the host end of the link down (packets dropped both ways).

        With the link's route gone, the host would send packets for the node's
        address out of its default route, where this sandbox answers with a
        reset, which reads as "nothing listens" rather than "cut off".  A
        blackhole route keeps them on the host: a cut link, not a dead node.
        """
        _ip("link", "set", self.host_if, "down")
        _ip("route", "add", "blackhole", f"{self.node_ip}/32")

    def heal(self) -> None:
        """End the partition."""
        _ip("route", "del", "blackhole", f"{self.node_ip}/32", check=False)
        _ip("link", "set", self.host_if, "up")

    def destroy(self) -> None:
        """Remove the namespace and the veth pair (idempotent)."""
        _ip("link", "del", self.host_if, check=False)
        if self.created:
            _ip("netns", "del", self.namespace, check=False)
            self.created = False

    def __enter__(self) -> IsolatedNode:
        return self.create()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with contextlib.suppress(Exception):
            self.destroy()
