""":func:`init`: the session a training process gets, by who started it.

Runs in the training process.  Started by a ringmaster node agent
(``RINGMASTER_JOB`` set), a worker connects to etcd, reads its job's spec and
gets a :class:`~agents.runtime.session.Session`, which hot-swaps; started by
plain ``torchrun`` or ``python``, it gets a
:class:`~agents.runtime.standalone.StandaloneSession`.

This is the session's composition root, the one module of the runtime that
imports :mod:`agents.recovery`: it hands the session the recoveries' table
(:data:`agents.recovery.kinds.RECOVERIES`), through which the rest of the
runtime reaches recovery by its contract (:mod:`agents.state.api`) alone.
"""

from __future__ import annotations

import gc
import logging

from agents.api import RECOVERY_RESTART, RecoveryError, WorkerEnv
from agents.recovery.kinds import RECOVERIES
from agents.runtime.session import Session
from agents.runtime.standalone import StandaloneSession
from orchestrator.etcd.client import connect
from orchestrator.etcd.options import EtcdOptions, parse_endpoints
from orchestrator.etcd.retry import retry_unavailable
from orchestrator.own_packages import check_own_packages
from orchestrator.settings import SETTINGS

__all__ = ["init"]


def init(env: WorkerEnv | None = None) -> Session | StandaloneSession:
    """Start the runtime in a worker.

    Launched by ``ringmaster agent`` (``RINGMASTER_JOB`` set), the session
    recovers in-process; launched by plain ``torchrun`` or ``python``, it is a
    :class:`agents.runtime.standalone.StandaloneSession`: the same calls, the usual
    process group and DDP, no hot-swap.

    Raises:
        RecoveryError: the job runs with ``fault_tolerance.recovery: restart``,
            which starts workers as torchrun does and has no use for the runtime.
        PackageClashError: another distribution's ``agents``, ``checkpoint`` or
            ``orchestrator`` package shadows ringmaster's.
    """
    check_own_packages()
    env = env or WorkerEnv.from_environ()
    if env is None:
        logging.basicConfig(level=SETTINGS.log_level, format="%(asctime)s %(message)s")
        return StandaloneSession()
    if env.recovery == RECOVERY_RESTART:
        raise RecoveryError(
            f"job {env.job} runs in the restart tier (fault_tolerance.recovery: restart, or "
            "auto with an entrypoint that does not import agents.runtime itself, such as a "
            "wrapper); runtime.init() needs fault_tolerance.recovery: in_process in the job file"
        )
    # One prefix per line: whoever shows this output already names the node
    # (`ringmaster run` prints `[node]`, `ringmaster logs` prints `[node/local rank]`),
    # so the worker adds its local rank only where a node runs several workers.
    who = f"local rank {env.local_rank}: " if env.local_world_size > 1 else ""
    logging.basicConfig(level=SETTINGS.log_level, format=f"%(asctime)s {who}%(message)s")
    options = EtcdOptions(
        endpoints=parse_endpoints(env.etcd_endpoints),
        ca_cert=env.etcd_ca,
        cert=env.etcd_cert,
        key=env.etcd_key,
        user=env.etcd_user,
        password=env.etcd_password,
    )
    # A worker (re)started while etcd is away waits for it rather than failing.
    client = retry_unavailable(
        lambda: connect(options),
        "connecting to etcd",
        max_wait=SETTINGS.plan_timeout,
    )
    from orchestrator.state.jobs import read_spec

    spec, _ = retry_unavailable(
        lambda: read_spec(client, env.job), "reading the job spec", max_wait=SETTINGS.plan_timeout
    )
    session = Session(env, client, spec, RECOVERIES)
    # The objects alive now are the imports (torch's among them: hundreds of
    # thousands), kept for the process's life.  Moved out of the collector's
    # generations, they are not traversed again by each full collection during
    # training, nor by the one at the interpreter's exit, which took 1-2 s of
    # a worker's end (a job's end and a replaced worker's exit wait for it).
    gc.freeze()
    return session
