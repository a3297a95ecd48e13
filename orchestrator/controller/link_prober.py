"""The controller's side of a link probe: ask each node's agent to measure, off the tick.

I/O, run by the executor (:mod:`orchestrator.controller.job`) for a
:class:`~orchestrator.controller.actions.ProbeLinks` action.  One thread asks
the agents one after the other (two probes at once would share a link and
halve each other's figures), each to stream to its next two nodes: a probe
of ``n`` nodes takes about ``n x 2 x 2 x 0.2`` seconds.  The tick that follows
the last answer finds the result in its world (:attr:`World.link_probe`), and
the pure :mod:`orchestrator.controller.slow_links` reads it.  Each request
carries the job's port credential, read from etcd
(:mod:`orchestrator.state.port_credential`): an agent answers link probes to no one
else, and probes only its job's registered nodes, at their registered ports.
"""

from __future__ import annotations

import logging
import threading

from orchestrator.api import EtcdError
from orchestrator.controller.slow_links import LinkProbeResult, probe_pairs
from orchestrator.etcd.client import EtcdClient
from orchestrator.ports.api import AgentUnreachableError, RequestError
from orchestrator.ports.link_probe import PROBE_OP
from orchestrator.ports.liveness import ask
from orchestrator.state.api import PortCredentialError
from orchestrator.state.port_credential import read_token

__all__ = ["PROBE_ROUNDS", "PROBE_SECONDS", "LinkProber"]

log = logging.getLogger("ringmaster.controller")

#: Seconds one try streams to one peer (it stops sooner at ``PROBE_MAX_BYTES``).
PROBE_SECONDS = 0.2
#: Bytes one try sends at most (a fast link is through them long before the time).
PROBE_MAX_BYTES = 16 * 1024 * 1024
#: Tries per pair; the best counts.
PROBE_ROUNDS = 2


class LinkProber:
    """Runs one probe at a time in the background; :meth:`take` hands its result over.

    Args:
        client / job: where the job's port credential is read (at each probe).
    """

    def __init__(self, client: EtcdClient, job: str) -> None:
        self._client = client
        self._job = job
        self._lock = threading.Lock()
        self._result: LinkProbeResult | None = None
        self._thread: threading.Thread | None = None

    def start(self, ports: dict[str, str]) -> None:
        """Measure the links of ``ports``' nodes (node → its agent's ``host:port``, in the
        order :func:`~orchestrator.controller.slow_links.probe_pairs` pairs them)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._thread = threading.Thread(
            target=self._run, args=(dict(ports),), name="link-probe", daemon=True
        )
        self._thread.start()

    def take(self) -> LinkProbeResult | None:
        """The result of the probe that ended since the last call, if one did."""
        with self._lock:
            result, self._result = self._result, None
        return result

    def _run(self, ports: dict[str, str]) -> None:
        rates: dict[str, dict[str, float]] = {}
        errors: dict[str, str] = {}
        try:
            token = read_token(self._client, self._job)
        except (PortCredentialError, EtcdError) as e:
            log.warning("link probe not asked: %s", e)
            with self._lock:
                self._result = LinkProbeResult({}, {node: str(e) for node in ports})
            return
        pairs = probe_pairs(list(ports))
        for node, port in ports.items():
            peers = {n: ports[n] for n in pairs[node]}
            budget = len(peers) * PROBE_ROUNDS * (PROBE_SECONDS + 5.0) + 10.0
            request = {
                "op": PROBE_OP,
                "peers": peers,
                "seconds": PROBE_SECONDS,
                "max_bytes": PROBE_MAX_BYTES,
                "rounds": PROBE_ROUNDS,
            }
            try:
                answer = ask(port, request, timeout=budget, token=token)
            except (AgentUnreachableError, RequestError) as e:
                errors[node] = str(e)
                continue
            rates[node] = {str(n): float(r) for n, r in dict(answer.get("rates", {})).items()}
            for peer, why in dict(answer.get("errors", {})).items():
                errors.setdefault(str(peer), str(why))
        log.info("link probe: %s; errors: %s", rates, errors or "none")
        with self._lock:
            self._result = LinkProbeResult(rates, errors)
