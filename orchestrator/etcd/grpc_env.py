"""The gRPC environment of the processes ringmaster starts.

gRPC reads a few settings from environment variables only.  Ringmaster sets
them for its own processes (the CLI at start-up, the agents and controller a
local run starts, the workers an agent starts), never for the process of
someone who merely imports it: importing :mod:`agents.runtime` or the etcd
client changes no environment variable.

This module imports nothing of gRPC, so the CLI can apply it before gRPC is
loaded (it reads ``GRPC_ENABLE_FORK_SUPPORT`` when it is imported).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

#: Defaults for the variables gRPC reads; a value already set wins.
GRPC_DEFAULTS: dict[str, str] = {
    # gRPC's C core logs every failed TLS handshake on stderr unless told
    # otherwise; the client's errors say what went wrong in one line instead.
    "GRPC_VERBOSITY": "ERROR",
    # Every process ringmaster starts is fork+exec (workers, agents, etcd).
    # gRPC's fork handlers are for fork *without* exec; around a fork+exec they
    # race with gRPC's own threads and, under load, abort processes ("Bad file
    # descriptor" in the epoll poller, abseil mutex checks).  Off, as gRPC
    # advises for fork+exec.
    "GRPC_ENABLE_FORK_SUPPORT": "false",
}


def grpc_environment() -> dict[str, str]:
    """The gRPC variables a process started by ringmaster gets unless already set.

    Use it under the child's own environment, so a value the user set wins::

        env = {**grpc_environment(), **os.environ}
    """
    return dict(GRPC_DEFAULTS)


def apply_grpc_environment(environ: MutableMapping[str, str] | None = None) -> None:
    """Set the gRPC defaults in ``environ`` (default: ``os.environ``) where unset.

    Only for ringmaster's own entry points (the CLI), before gRPC is imported.
    """
    target: MutableMapping[str, str]
    target = os.environ if environ is None else environ
    for name, value in GRPC_DEFAULTS.items():
        target.setdefault(name, value)
