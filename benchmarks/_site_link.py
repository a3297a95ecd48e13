"""Two sites joined by one rate-limited link, in network namespaces (used by ``cross_site.py``).

Each site is a network namespace with two links:

* a *control* link to the host (:class:`tests.faults.netns.IsolatedNode`, unlimited): the
  site's agents reach etcd on the host through it, and the controller on the host
  reaches their liveness ports through it;
* the *site link*: one veth pair straight from one site's namespace to the other's,
  ``tc … tbf`` on both ends (each direction limited once).  The agents' addresses
  (where a generation's store listens) are their site's end of it, and gloo binds it
  (``GLOO_SOCKET_IFNAME``), so everything one site sends the other (gradients, outer
  syncs, state for a replacement, the store's and the step boundary's small messages)
  crosses it and nothing else does.

Name lookups: c10d's store asks for the name of each client's address, and a lookup
that goes to the host's DNS server (unreachable from a namespace) blocks 10 s.  Each
namespace gets its own ``/etc/netns/<ns>/hosts`` (every address of the layout, named)
and a ``resolv.conf`` with no server, which ``ip netns exec`` puts in place of the
host's: every lookup is answered from the file at once.

Several agents of one site share the site's namespace and address (a node and its
warm spare).  The host routes each site-link address over that site's control link
(the controller's liveness probes), never between the sites.

:meth:`SiteLink.limit` sets the rate (``None``: no limit, a plain FIFO that still
counts) and restarts the byte counters; :meth:`SiteLink.bytes_sent` reads them back
from ``tc -s qdisc show``: the bytes that crossed between the sites, both directions.
Needs root; :meth:`SiteLink.close` removes everything it made.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from tests.faults.netns import IsolatedNode

#: The site link's /24 (its two ends are .1 and .2).
SUBNET = "10.79.{}"
#: Where ``ip netns exec`` finds a namespace's own ``hosts`` and ``resolv.conf``.
NETNS_ETC = Path("/etc/netns")
#: tbf's bucket: at least this, or 10 ms at the rate (a 1 Gbit/s bucket must outlast a tick).
MIN_BURST_BYTES = 256 * 1024


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), check=check, capture_output=True, text=True, timeout=20)


def rate_bits(rate: str) -> int:
    """``100mbit`` / ``1gbit`` / ``500kbit`` in bits per second.

    Raises:
        ValueError: not a rate tc would take in those units.
    """
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(k|m|g)bit", rate.strip().lower())
    if m is None:
        raise ValueError(f"rate {rate!r}: write it as tc does, e.g. 100mbit or 1gbit")
    return int(float(m.group(1)) * {"k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)])


@dataclass
class Site:
    """One site: its namespace (with the control link) and its end of the site link."""

    name: str
    node: IsolatedNode
    wan_if: str
    wan_ip: str

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the site's namespace."""
        return self.node.command(argv)


@dataclass
class SiteLink:
    """Two sites and the limited link between them (see the module docstring)."""

    names: tuple[str, str] = ("a", "b")
    sites: list[Site] = field(default_factory=list)
    _routes: list[str] = field(default_factory=list)

    def build(self) -> SiteLink:
        tag = os.getpid() % 100000
        subnet = SUBNET.format(tag % 200 + 20)
        try:
            for i, name in enumerate(self.names):
                node = IsolatedNode(f"site{name}").create()
                self.sites.append(Site(name, node, f"wan{name}{tag}"[:15], f"{subnet}.{i + 1}"))
            a, b = self.sites
            veth = ["type", "veth", "peer", "name", b.wan_if, "netns", b.node.namespace]
            _sh("ip", "link", "add", a.wan_if, "netns", a.node.namespace, *veth)
            for site in self.sites:
                ns = site.node.namespace
                _sh("ip", "-n", ns, "addr", "add", f"{site.wan_ip}/24", "dev", site.wan_if)
                _sh("ip", "-n", ns, "link", "set", site.wan_if, "up")
                # the host reaches the site's address (liveness) over the control link
                _sh("ip", "route", "add", f"{site.wan_ip}/32", "via", site.node.node_ip)
                self._routes.append(f"{site.wan_ip}/32")
            self._name_files()
            self.limit(None)
        except BaseException:
            self.close()
            raise
        return self

    def _name_files(self) -> None:
        names = ["127.0.0.1 localhost"]
        for site in self.sites:
            names.append(f"{site.wan_ip} site-{site.name}")
            names.append(f"{site.node.node_ip} ctl-{site.name}")
            names.append(f"{site.node.host_ip} host-{site.name}")
        for site in self.sites:
            etc = NETNS_ETC / site.node.namespace
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text("\n".join(names) + "\n")
            (etc / "resolv.conf").write_text("options timeout:1 attempts:1\n")

    def limit(self, rate: str | None) -> None:
        """Set the link's rate each way (``None``: unlimited) and zero its byte counters."""
        for site in self.sites:
            if rate is None:
                qdisc = ["pfifo", "limit", "10000"]
            else:
                burst = max(MIN_BURST_BYTES, rate_bits(rate) // 8 // 100)
                qdisc = ["tbf", "rate", rate, "burst", str(burst), "latency", "50ms"]
            # a new root qdisc (never `change`): its counters start at zero
            _sh(*site.command(["tc", "qdisc", "del", "dev", site.wan_if, "root"]), check=False)
            _sh(*site.command(["tc", "qdisc", "add", "dev", site.wan_if, "root", *qdisc]))

    def bytes_sent(self) -> int:
        """Bytes both ends of the link sent since the last :meth:`limit` (tc's counters)."""
        total = 0
        for site in self.sites:
            out = _sh(*site.command(["tc", "-s", "qdisc", "show", "dev", site.wan_if])).stdout
            m = re.search(r"Sent (\d+) bytes", out)
            if m is None:
                raise RuntimeError(f"no byte counter in tc's output for {site.wan_if}: {out}")
            total += int(m.group(1))
        return total

    def qdiscs(self) -> str:
        """What tc says of both ends (for the log)."""
        return "; ".join(
            _sh(*s.command(["tc", "qdisc", "show", "dev", s.wan_if])).stdout.strip()
            for s in self.sites
        )

    def close(self) -> None:
        for route in self._routes:
            _sh("ip", "route", "del", route, check=False)
        self._routes.clear()
        for site in self.sites:
            shutil.rmtree(NETNS_ETC / site.node.namespace, ignore_errors=True)
            site.node.destroy()  # the site link's ends go with their namespaces
        self.sites.clear()
