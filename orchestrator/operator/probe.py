"""Exec probes of the agent container: readiness and the preStop drain.

``python -m orchestrator.operator.probe ready`` exits 0 while the node is
registered in etcd (``/ringmaster/jobs/<job>/nodes/<node>``, written by the
agent under its lease once its workers are started), 1 otherwise: a pod is
Ready exactly while the controller can count it, as an active node or a spare.

``python -m orchestrator.operator.probe drain`` is the preStop hook: it sends
SIGTERM to the agent (PID 1 of the container), which the agent treats as a
preemption (ask for a checkpoint, let the workers save, revoke its lease and
leave), then waits until the registration is gone or ``RINGMASTER_DRAIN_TIMEOUT``
seconds have passed.  The kubelet's own SIGTERM follows and finds the agent
already leaving; a drain that runs out of time shows as a failed preStop hook
in the pod's events.

Both read ``RINGMASTER_ETCD``, ``RINGMASTER_JOB``, ``RINGMASTER_NODE`` and the
``RINGMASTER_ETCD_*`` TLS/credential variables set on the agent container.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from datetime import timedelta

from orchestrator.api import EtcdError
from orchestrator.etcd.client import EtcdClient, connect
from orchestrator.etcd.options import PASSWORD_ENV_VARIABLE, EtcdOptions, parse_endpoints
from orchestrator.settings import Settings
from orchestrator.state import keys

#: A probe's etcd calls must end well inside the probe's own timeout.
PROBE_ETCD_TIMEOUT = timedelta(seconds=2)
#: The agent process in the container.
AGENT_PID = 1


def options_from_env(env: dict[str, str]) -> EtcdOptions:
    """etcd options from the container's ``RINGMASTER_ETCD*`` variables (the password
    from the variable ``RINGMASTER_ETCD_PASSWORD_ENV`` names, where it names one)."""
    named = env.get(PASSWORD_ENV_VARIABLE)
    return EtcdOptions(
        endpoints=parse_endpoints(env.get("RINGMASTER_ETCD", "")),
        ca_cert=env.get("RINGMASTER_ETCD_CA") or None,
        cert=env.get("RINGMASTER_ETCD_CERT") or None,
        key=env.get("RINGMASTER_ETCD_KEY") or None,
        user=env.get("RINGMASTER_ETCD_USER") or None,
        password=env.get("RINGMASTER_ETCD_PASSWORD") or (env.get(named) if named else None),
        connect_timeout=PROBE_ETCD_TIMEOUT,
        op_timeout=PROBE_ETCD_TIMEOUT,
    )


def registered(client: EtcdClient, job: str, node: str) -> bool:
    """True when the node's registration key exists."""
    return client.get(keys.job_node(job, node)) is not None


def ready(env: dict[str, str], open_client: Callable[[EtcdOptions], EtcdClient] = connect) -> int:
    """Exit code of the readiness probe: 0 registered, 1 not (or etcd unreachable)."""
    try:
        with open_client(options_from_env(env)) as client:
            return 0 if registered(client, env["RINGMASTER_JOB"], env["RINGMASTER_NODE"]) else 1
    except (EtcdError, KeyError) as e:
        sys.stderr.write(f"not ready: {e}\n")
        return 1


def drain(
    env: dict[str, str],
    open_client: Callable[[EtcdOptions], EtcdClient] = connect,
    kill: Callable[[int, int], None] = os.kill,
    poll: timedelta = timedelta(seconds=1),
) -> int:
    """The preStop hook: SIGTERM the agent, wait for it to deregister (0) or time out (1)."""
    deadline = time.monotonic() + Settings.from_environ(env).drain_timeout.total_seconds()
    try:
        kill(AGENT_PID, signal.SIGTERM)
    except ProcessLookupError:
        return 0
    try:
        with open_client(options_from_env(env)) as client:
            while time.monotonic() < deadline:
                if not registered(client, env["RINGMASTER_JOB"], env["RINGMASTER_NODE"]):
                    return 0
                time.sleep(poll.total_seconds())
    except (EtcdError, KeyError) as e:
        sys.stderr.write(f"drain: cannot follow the registration: {e}\n")
    return 1


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    env = dict(os.environ)
    if args == ["ready"]:
        return ready(env)
    if args == ["drain"]:
        return drain(env)
    sys.stderr.write("usage: python -m orchestrator.operator.probe ready|drain\n")
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
