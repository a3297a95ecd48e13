"""How to reach etcd: endpoints, TLS files, credentials and timeouts.

:class:`EtcdOptions` is what :func:`orchestrator.etcd.client.connect` takes;
the CLI, the worker environment and the torchrun backend all build one.  The
default timeouts are the ``RINGMASTER_ETCD_CONNECT_TIMEOUT`` and
``RINGMASTER_ETCD_OP_TIMEOUT`` knobs (:mod:`orchestrator.settings`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from orchestrator.api import EtcdError
from orchestrator.settings import SETTINGS

#: How long :func:`~orchestrator.etcd.client.connect` waits for some endpoint to answer.
DEFAULT_CONNECT_TIMEOUT = SETTINGS.etcd_connect_timeout
#: Per-operation deadline, including fail-over retries across endpoints.
DEFAULT_OP_TIMEOUT = SETTINGS.etcd_op_timeout


@dataclass(frozen=True)
class EtcdOptions:
    """How to reach etcd.

    Attributes:
        endpoints: ``host:port`` or ``http(s)://host:port`` client endpoints.
        ca_cert / cert / key: TLS files; ``ca_cert`` alone means server-auth TLS.
        user / password: etcd RBAC credentials (the password is never logged).
        connect_timeout: how long ``connect`` waits for some endpoint.
        op_timeout: deadline of each call, fail-over retries included.
    """

    endpoints: tuple[str, ...]
    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    connect_timeout: timedelta = DEFAULT_CONNECT_TIMEOUT
    op_timeout: timedelta = DEFAULT_OP_TIMEOUT

    @property
    def secure(self) -> bool:
        return bool(self.ca_cert) or any(e.startswith("https://") for e in self.endpoints)


def parse_endpoints(text: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """``"a:1,b:2"`` or a list → a tuple of endpoints, whitespace trimmed, empties dropped."""
    items = text.split(",") if isinstance(text, str) else list(text)
    return tuple(s.strip() for s in items if s.strip())


def host_port(endpoint: str) -> tuple[str, int]:
    """``host:port``, ``http(s)://host:port/`` or ``[v6]:port`` → ``(host, port)``.

    Raises:
        EtcdError: the endpoint is not ``host:port``.
    """
    rest = endpoint.split("://", 1)[1] if "://" in endpoint else endpoint
    rest = rest.rstrip("/")
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        raise EtcdError(f"etcd endpoint {endpoint!r} is not host:port")
    return host.strip("[]"), int(port)
