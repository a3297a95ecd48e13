"""Form and tear down the torch process group of one generation.

Each generation gets a fresh gloo group.  Its bootstrap store is a
``TCPStore`` hosted by the generation's rank 0, whose address is published in
etcd under ``/ringmaster/jobs/<job>/pg/<gen>/master``; the other ranks wait
for that key.  No node is special across generations: when rank 0 dies, the
next generation has another rank 0 and another store.  The store is only
needed while the group forms (gloo then talks peer to peer).

Seen on these machines: after a peer is SIGKILLed, the survivors' gloo calls
raise at once (a plain ``RuntimeError``, see :mod:`agents.runtime.failures`),
``destroy_process_group`` takes well under a millisecond and a new group
forms in tens of milliseconds, so recovering in-process is cheap.

The data plane uses the job's backend (``comm.backend``: NCCL when the worker
sees a CUDA device, gloo otherwise).  Beside an NCCL group, each generation
also forms a small gloo group, the *control group*: the step boundary's few
integers and the state sync's bookkeeping travel there, so they never wait
on the GPU stream.  Under gloo the default group serves both.

NCCL's default error handling tears a process down when a communicator
fails; hot-swap keeps exactly that process's memory, so the runtime asks for
``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (abort the communicators, keep the
process) before the group forms.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from agents.api import RecoveryError
from agents.runtime.group_store import wait_for_store
from orchestrator.api import EtcdError
from orchestrator.etcd.client import EtcdClient
from orchestrator.state import keys
from orchestrator.state.api import FencedError
from orchestrator.state.fencing import GenerationFence
from orchestrator.state.records import Plan

__all__ = [
    "DEFAULT_FORM_TIMEOUT",
    "NCCL_ERROR_HANDLING",
    "QUIESCE_S",
    "Groups",
    "abort_groups",
    "choose_device",
    "form_group",
    "hang_up",
    "publish_environment",
    "quiesce",
    "set_op_timeout",
    "socket_inodes",
    "sockets_opened_since",
    "teardown_group",
]

log = logging.getLogger(__name__)

#: How long forming a group may take before the generation is given up.
DEFAULT_FORM_TIMEOUT = timedelta(seconds=30)

#: NCCL error handling that aborts a failed communicator and keeps the process.
NCCL_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")


@dataclass(frozen=True)
class Groups:
    """One generation's process groups.

    Attributes:
        backend: the data plane's backend (``"nccl"`` or ``"gloo"``).
        control: the gloo group for the step boundary and the state sync's
            bookkeeping (None: the default group, which is gloo, serves).
        store: ``(host, port)`` of the generation's bootstrap store.
        sockets: the inodes of the TCP sockets this process opened for the
            generation's groups (see :func:`hang_up`).
        stepwise: groups formed in the generation whose collectives run once a
            step or more (a delayed sync's site groups): the learnt timeout
            applies to them as well.
    """

    backend: str
    control: dist.ProcessGroup | None
    store: tuple[str, int]
    sockets: frozenset[int] = frozenset()
    stepwise: tuple[dist.ProcessGroup, ...] = ()

    def each(self) -> list[dist.ProcessGroup]:
        """The data group, the control group when there is one of its own, then the
        stepwise groups."""
        world = dist.group.WORLD
        groups = [world] if isinstance(world, dist.ProcessGroup) else []
        control = [self.control] if self.control is not None else []
        return groups + control + list(self.stepwise)


def choose_device(backend: str, local_rank: int) -> tuple[str, torch.device]:
    """The data backend and this worker's device, from ``comm.backend``.

    ``auto`` means NCCL when CUDA devices are visible.  A worker binds the
    device of its local rank, as torchrun scripts do; on gloo, local ranks beyond
    the visible devices share them in turn (a job with ``oversubscribe: true``).

    Raises:
        RecoveryError: NCCL without a CUDA device, or NCCL (``auto`` included)
            with more local workers than visible devices (the message says what
            to change).
    """
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    chosen = ("nccl" if count else "gloo") if backend == "auto" else backend
    if count == 0:
        if chosen == "nccl":
            raise RecoveryError(
                "comm.backend is nccl, but this worker sees no CUDA device "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); "
                "use comm.backend: auto or gloo"
            )
        return chosen, torch.device("cpu")
    if local_rank >= count and chosen != "gloo":
        raise RecoveryError(
            f"local rank {local_rank} has no CUDA device of its own (this node shows {count}) "
            f"and NCCL takes one rank per device; set nproc_per_node to at most {count}, or "
            "comm.backend: gloo to share the devices"
        )
    index = local_rank % count  # past the devices (gloo only): shared in turn
    torch.cuda.set_device(index)
    return chosen, torch.device("cuda", index)


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
    backend: str = "gloo",
    device: torch.device | None = None,
) -> Groups:
    """Initialise the default process group for ``generation`` (and its control group).

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
            host, port = wait_for_store(client, key, deadline)
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
        if backend == "nccl":
            name, value = NCCL_ERROR_HANDLING
            if os.environ.get(name, value) != value:
                log.warning(
                    "%s=%s replaced by %s: a peer's failure must not end this process",
                    name,
                    os.environ[name],
                    value,
                )
            os.environ[name] = value
        try:
            dist.init_process_group(
                backend,
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=collective_timeout,
                device_id=device if backend == "nccl" else None,
            )
            control = (
                dist.new_group(backend="gloo", timeout=collective_timeout)
                if backend != "gloo"
                else None
            )
        finally:
            sys.excepthook = excepthook
        assert control is None or isinstance(control, dist.ProcessGroup)
        return Groups(backend=backend, control=control, store=(host, port))
    except (RuntimeError, OSError, EtcdError, FencedError) as e:
        teardown_group()
        raise RecoveryError(
            f"generation {generation}: process group did not form ({e}); a member may be gone"
        ) from e


def abort_groups(groups: Groups) -> None:
    """Abort ``groups``' communicators from any thread (best effort).

    NCCL's abort ends a collective that waits on a dead or cut-off peer; gloo's
    does not (its operation timeout does), and is harmless.
    """
    for group in groups.each():
        try:
            group.abort()
        except (RuntimeError, ValueError) as e:  # already torn down by the training thread
            log.debug("abort: %s", e)


def socket_inodes() -> set[int]:
    """The inodes of this process's open sockets (empty where ``/proc`` is missing)."""
    found: set[int] = set()
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            found.add(int(target[8:-1]))
    return found


#: /proc/net/tcp's state of a listening socket
_TCP_LISTEN = "0A"


def _connections() -> dict[int, int]:
    """inode → remote port of this process's connected TCP sockets (not listening ones)."""
    ports: dict[int, int] = {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] != _TCP_LISTEN:
                ports[int(fields[9])] = int(fields[2].rsplit(":", 1)[1], 16)
    return ports


def sockets_opened_since(before: AbstractSet[int], keep_ports: set[int]) -> frozenset[int]:
    """TCP connections opened since ``before`` was taken, but for those to ``keep_ports``.

    Taken around the forming of a generation's groups (the data group, the
    control group, a sharded model's mesh, the buddy exchange group), with
    etcd's client ports kept out: what remains is the groups' own connections.
    Listening sockets are left out: gloo ends the process when its listener
    fails.
    """
    ports = _connections()
    return frozenset(
        inode
        for inode in socket_inodes() - before
        if inode in ports and ports[inode] not in keep_ports
    )


def hang_up(sockets: frozenset[int]) -> int:
    """Shut down ``sockets`` (see :class:`Groups`); returns how many were still open.

    A survivor that leaves a broken generation may keep its old group alive
    for a while (a pending bucket's work, a sharded module, a traceback hold
    it), and with it its gloo connections to the other survivors.  A local peer
    whose collective waits on this rank would then wait out the operation
    timeout: gloo's ``abort()`` and ``shutdown()`` close nothing, and only a
    closed connection ends a gloo wait at once.  Shutting the sockets down
    (not closing them: the descriptors stay gloo's) does, on every peer.
    """
    if not sockets:
        return 0
    done = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if not target.startswith("socket:[") or int(target[8:-1]) not in sockets:
            continue
        try:
            with socket.socket(fileno=os.dup(int(fd))) as sock:
                sock.shutdown(socket.SHUT_RDWR)
            done += 1
        except OSError as e:  # already shut by the peer, or closed meanwhile
            log.debug("hang up fd %s: %s", fd, e)
    return done


def set_op_timeout(groups: Groups, timeout: timedelta) -> None:
    """Give every later collective of ``groups`` at most ``timeout``."""
    for group in groups.each():
        group.set_timeout(timeout)


#: How long the training thread lets go of the GIL after the last collective, so
#: gloo's worker threads can finish with their last work (see :func:`quiesce`).
QUIESCE_S = 0.05


def quiesce() -> Any:
    """Let a healthy group's worker threads go idle before the group is destroyed.

    Seen with torch 2.13 on gloo, under load, about once in a full test run: the
    last gradient all-reduce wakes the training thread, which reaches the end of
    the script and frees DDP's reducer (and with it the group) while a gloo
    worker thread is still disposing of that all-reduce's work.  Disposing of
    it needs the GIL, which the freeing thread holds while it waits for the
    worker to stop: the process never exits.  A barrier puts one more work
    behind the others, its handle is returned so that its last reference stays
    on this thread (keep it until the group is gone), and a short sleep without
    the GIL lets the workers finish the rest.

    Returns:
        The barrier's work handle, or None when there is no group.
    """
    if not dist.is_initialized():
        return None
    work = dist.barrier(async_op=True)
    if work is not None:
        work.wait()
    time.sleep(QUIESCE_S)
    return work


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


def publish_environment(plan: Plan, node: str, rank: int, host: str, port: int) -> None:
    """Keep torchrun's variables true for this generation, for libraries that read them.

    After a hot-swap a worker's global rank, the world size and the store's
    address change; code that reads ``RANK`` or ``MASTER_ADDR`` (loggers,
    data libraries, a second ``init_process_group`` of the script's own) sees
    the current generation, not the one the worker started in.
    """
    member = plan.member(node)
    assert member is not None
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(plan.world_size),
            "GROUP_RANK": str(plan.members.index(member)),
            "GROUP_WORLD_SIZE": str(len(plan.members)),
            "LOCAL_WORLD_SIZE": str(member.nproc),
            "MASTER_ADDR": host,
            "MASTER_PORT": str(port),
        }
    )
