"""Form and tear down the torch process group of one generation.

Each generation gets a fresh gloo group.  Its bootstrap store is a
``TCPStore`` hosted by the generation's rank 0, whose address is published in
etcd under ``/ringmaster/jobs/<job>/pg/<gen>/master``; the other ranks wait
for that key.  No node is special across generations: when rank 0 dies, the
next generation has another rank 0 and another store.  The store is only
needed while the group forms (gloo then talks peer to peer).

Seen on these machines: after a peer is SIGKILLed, the survivors' gloo calls
raise at once (a plain ``RuntimeError``, see :mod:`agents.failures`),
``destroy_process_group`` takes well under a millisecond and a new group
forms in tens of milliseconds, so recovering in-process is cheap.
"""

from __future__ import annotations

import logging
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from agents.api import RecoveryError
from orchestrator import keys
from orchestrator.api import EtcdError
from orchestrator.etcd.client import EtcdClient
from orchestrator.etcd.fencing import FencedError, GenerationFence

log = logging.getLogger(__name__)

#: How long forming a group may take before the generation is given up.
DEFAULT_FORM_TIMEOUT = timedelta(seconds=30)


def form_group(
    client: EtcdClient,
    job: str,
    generation: int,
    rank: int,
    world_size: int,
    address: str,
    timeout: timedelta = DEFAULT_FORM_TIMEOUT,
    collective_timeout: timedelta = timedelta(minutes=5),
    fence: GenerationFence | None = None,
) -> tuple[str, int]:
    """Initialise the default process group for ``generation``; return its store's address.

    Args:
        fence: when given, rank 0 publishes the store address only while
            ``generation`` is still the job's current one, so a process that
            was fenced out never advertises a store to the current members.

    Raises:
        RecoveryError: the group did not form within ``timeout`` (a member is
            gone, etcd is away, or this process was fenced out).
    """
    key = keys.pg_store(job, generation) + "master"
    deadline = time.monotonic() + timeout.total_seconds()
    try:
        if rank == 0:
            store = dist.TCPStore(
                address,
                0,
                world_size,
                is_master=True,
                timeout=timeout,
                wait_for_workers=False,
                multi_tenant=False,
            )
            host, port = address, store.port
            if fence is not None:
                fence.put(key, f"{host}:{port}")
            else:
                client.put(key, f"{host}:{port}")
        else:
            host, port = _wait_for_master(client, key, deadline)
            # rank 0 waits at most collective_timeout for the others: connecting
            # for longer would only keep this worker from a newer generation
            store = dist.TCPStore(
                host,
                port,
                world_size,
                is_master=False,
                timeout=min(timeout, collective_timeout),
                wait_for_workers=False,
            )
        # init_process_group wraps sys.excepthook to prefix every line of an
        # uncaught error's traceback with "[rank<r>]: ", once more per group
        # formed: after a few generations a script's error would be printed
        # behind a pile of prefixes (and its own rank twice).  The agent already
        # prefixes each line with the worker, so the hook is left as it was.
        excepthook = sys.excepthook
        try:
            dist.init_process_group(
                "gloo",
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=collective_timeout,
            )
        finally:
            sys.excepthook = excepthook
        return host, port
    except (RuntimeError, OSError, EtcdError, FencedError) as e:
        teardown_group()
        raise RecoveryError(
            f"generation {generation}: process group did not form ({e}); a member may be gone"
        ) from e


def _wait_for_master(client: EtcdClient, key: str, deadline: float) -> tuple[str, int]:
    while True:
        try:
            kv = client.get(key)
        except EtcdError as e:  # etcd away for a moment: keep waiting until the deadline
            log.debug("waiting for %s: %s", key, e)
            kv = None
        if kv is not None:
            host, _, port = kv.value.decode().rpartition(":")
            return host, int(port)
        if time.monotonic() >= deadline:
            raise RuntimeError(f"rank 0 did not publish the store address at {key} in time")
        time.sleep(0.01)


def teardown_group() -> None:
    """Destroy the default group if there is one; safe after a failed collective."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except (RuntimeError, ValueError) as e:  # a broken group may complain; it is gone anyway
            log.debug("destroy_process_group: %s", e)
    _reset_group_names()


def _reset_group_names() -> None:
    """Number the next generation's groups from 0 again, as on every other rank.

    torch names groups from a process-wide counter and prefixes their store
    keys with that name.  ``destroy_process_group`` resets it, but a failed
    ``init_process_group`` has already taken a name and leaves the counter one
    ahead: this rank would then wait for keys under ``1/`` while a fresh peer
    writes under ``0/``, and no later generation could form.  torch has no
    public way to reset it, so the private counter is set when it exists.
    """
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and hasattr(world, "group_count") and not dist.is_initialized():
        world.group_count = 0
