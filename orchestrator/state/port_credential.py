"""The credential of a job's agents' ports: a secret kept under the job's etcd prefix.

Runs wherever an agent's port is served or asked: the node agent, the
controller's link prober, ``ringmaster logs``.

An agent's port (:mod:`orchestrator.ports.liveness`) listens on the node's address.
Its status line and its watch say only whether the agent is alive, and stay
open to anyone who reaches the port.  Everything else it answers (the workers'
output, the link sink, link probes to other agents) is asked with the job's
port token: a random secret created once per job (by ``ringmaster submit``,
or by the first agent of a job submitted without one) and kept at
:func:`orchestrator.state.keys.job_port_token`.  So whoever may read the job's keys
in etcd (its TLS client certificate, its user and role) may ask its agents,
and nobody else: the ports are held to etcd's own standard.

A request carries it as ``"token"`` (:data:`TOKEN_FIELD`); the agent compares
it in constant time (:func:`hmac.compare_digest`).  A request without it, or
with another, is answered with one line saying so and what to do, and nothing
else (:class:`PortGuard`).
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass, field
from typing import Any

from orchestrator.etcd.client import EtcdClient
from orchestrator.state import keys
from orchestrator.state.api import PortCredentialError

#: The request field that carries the job's port credential
#: (:func:`orchestrator.ports.liveness.ask`'s ``token``).
TOKEN_FIELD = "token"

__all__ = [
    "TOKEN_BYTES",
    "TOKEN_FIELD",
    "PortGuard",
    "ensure_token",
    "read_token",
]

#: Random bytes of a job's token (written as hex: twice as many characters).
TOKEN_BYTES = 32


def read_token(client: EtcdClient, job: str) -> str:
    """The job's port token, as stored in etcd.

    Raises:
        PortCredentialError: the job has none (its agents create it when they start).
        EtcdError: etcd refused the read (a user not allowed the job's keys).
    """
    key = keys.job_port_token(job)
    kv = client.get(key)
    token = kv.value.decode("ascii", errors="replace").strip() if kv is not None else ""
    if not token:
        raise PortCredentialError(
            f"job '{job}' has no credential for its agents' ports at {key}: its agents write "
            "it when they start (a ringmaster older than this one does not); start them with "
            "this ringmaster, or read what they kept in etcd"
        )
    return token


def ensure_token(client: EtcdClient, job: str) -> str:
    """The job's port token, created now if it has none (one writer wins; all read it).

    Raises:
        EtcdError: etcd refused the read or the write.
    """
    key = keys.job_port_token(job)
    kv = client.get(key)
    if kv is None or not kv.value.strip():
        client.create(key, secrets.token_hex(TOKEN_BYTES).encode("ascii"))
    return read_token(client, job)


@dataclass(frozen=True)
class PortGuard:
    """What an agent's port asks of every request but the status and the watch.

    Args:
        job: whose agent serves the port.
        token: the job's port token (:func:`ensure_token`).
    """

    job: str
    token: str = field(repr=False)

    def refusal(self, op: str, request: dict[str, Any]) -> str | None:
        """Why ``request`` (of kind ``op``) is refused, or None when it carries the token."""
        where = keys.job_port_token(self.job)
        given = request.get(TOKEN_FIELD)
        if not isinstance(given, str) or not given:
            return (
                f"{op!r} refused: the request carries no credential. Send the job's port "
                f"token as {TOKEN_FIELD!r}: it is in etcd at {where}, for whoever may read "
                "the job's keys (`ringmaster logs` and the controller send it)"
            )
        if not hmac.compare_digest(given.encode("utf-8"), self.token.encode("utf-8")):
            return (
                f"{op!r} refused: the credential sent is not this job's. Read the port token "
                f"again from etcd at {where} and send it as {TOKEN_FIELD!r}"
            )
        return None
