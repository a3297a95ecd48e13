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
#: Deadline of the first attempt of an operation on one member (later rounds
#: over every member double it).  A healthy member answers in milliseconds; a
#: write that a member forwarded to a leader that has just died is never
#: answered (etcd says so only after 5 s and two election timeouts), so it is
#: sent again after this instead.
DEFAULT_ATTEMPT_TIMEOUT = timedelta(seconds=1)
#: The environment variable that names another one holding the etcd password: what a
#: job's ``rendezvous.password_env`` becomes in its pods.
PASSWORD_ENV_VARIABLE = "RINGMASTER_ETCD_PASSWORD_ENV"


@dataclass(frozen=True)
class EtcdOptions:
    """How to reach etcd.

    Attributes:
        endpoints: ``host:port`` or ``http(s)://host:port`` client endpoints.
        ca_cert / cert / key: TLS files; ``ca_cert`` alone means server-auth TLS.
        user / password: etcd RBAC credentials (the password is never logged).
        connect_timeout: how long ``connect`` waits for some endpoint.
        op_timeout: deadline of each call, fail-over retries included.
        attempt_timeout: deadline of one attempt of a call on one member (at
            most ``op_timeout``; doubled for each round over every member).
    """

    endpoints: tuple[str, ...]
    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    connect_timeout: timedelta = DEFAULT_CONNECT_TIMEOUT
    op_timeout: timedelta = DEFAULT_OP_TIMEOUT
    attempt_timeout: timedelta = DEFAULT_ATTEMPT_TIMEOUT

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
