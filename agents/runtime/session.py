"""The :class:`Session` a training script holds, and :func:`init`, which makes one.

Runs in the training process.  The package's docstring (:mod:`agents.runtime`)
shows a script's use of it and how recovery works.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist
from torch import nn

from agents.api import (
    PREIMPORTS,
    RECOVERY_RESTART,
    JobEndedError,
    RecoveryError,
    Stateful,
    WorkerEnv,
)
from agents.channels.plan_feed import ENV_PLAN_FEED
from agents.messages import one_line
from agents.recovery.buddy_copies import BuddyCopies
from agents.recovery.shard_recovery import RecoveryTelemetry
from agents.runtime import boundary
from agents.runtime.collective_guard import CollectiveGuard, OpTimeout
from agents.runtime.elastic_ddp import ElasticDDP, HookInstaller
from agents.runtime.failures import CollectiveFailures, peer_failure
from agents.runtime.generation import Generations
from agents.runtime.heartbeat import Heartbeat
from agents.runtime.plan_watch import PlanWatcher
from agents.runtime.process_group import Groups, choose_device, quiesce, teardown_group
from agents.runtime.saving import Saving
from agents.runtime.sharding import (
    ShardedModel,
    check_mode,
    optimizers_of,
    others_of,
    raised_in_collective,
    redundancy_ignored,
)
from agents.runtime.standalone import StandaloneSession
from agents.runtime.telemetry import WorkerTelemetry
from orchestrator import keys
from orchestrator.api import EtcdError
from orchestrator.etcd.client import EtcdClient, connect
from orchestrator.etcd.fencing import FencedError, GenerationFence
from orchestrator.etcd.options import EtcdOptions, parse_endpoints
from orchestrator.etcd.retry import retry_unavailable
from orchestrator.own_packages import check_own_packages
from orchestrator.records import DoneRecord, Plan, ProgressRecord
from orchestrator.settings import SETTINGS
from orchestrator.spec import DEFAULT_REDUNDANCY_EVERY_STEPS, JobSpec

log = logging.getLogger("ringmaster.worker")

#: After a step failed without a failed collective, how long the worker waits for
#: the control plane to publish a newer generation before taking the error as the
#: script's own.
PEER_SETTLE_S = 0.2

SaveFn = Callable[["Session", str], None]


class Session:
    """One worker's view of the job; build it with :func:`init`.

    The attributes without a leading underscore that are not documented in
    the module docstring (``plan``, ``hook``, ``tracked``, ``wrapped``,
    ``telemetry``, ``fence``, ``watch``, ``heartbeat``, ``saving``,
    ``save_fn``) are shared with the runtime's parts, not part of the API.
    """

    def __init__(self, env: WorkerEnv, client: EtcdClient, spec: JobSpec) -> None:
        self.env = env
        self.client = client
        self.spec = spec
        self.rank = -1
        self.world_size = 0
        self.generation = 0
        self.step = 0
        self.has_state = False
        self.recoveries = 0
        self.finished = False
        self.last_recovery_s: float | None = None
        self.restored_from: str | None = None
        self.paused: str | None = None
        self.plan: Plan | None = None
        self.hook: Any = None
        self.tracked: dict[str, Stateful] = {}
        self.wrapped: list[ElasticDDP] = []
        self.save_fn: SaveFn | None = None
        self.backend, self.device = choose_device(spec.comm.backend.value, env.local_rank)
        self.groups: Groups | None = None
        self.telemetry: WorkerTelemetry = RecoveryTelemetry()
        #: the sharded model (``wrap(..., sharding="fsdp"|"hsdp")``), if any
        self.sharded: ShardedModel | None = None
        #: ``fsdp`` with redundancy: this rank's snapshots and its ward's copy
        self.buddies: BuddyCopies | None = None
        self.fence = GenerationFence(client, env.job)
        self._metrics: dict[str, float] = {}
        self._step_error: BaseException | None = None
        #: the first step boundary that votes (0: the next one; set again at every vote
        #: and when a generation is joined, the same on every rank)
        self.vote_at = 0
        self._failures = CollectiveFailures()
        self._control_seen = 0
        self._stop_requested = False
        self.saving = Saving(self)
        self.generations = Generations(self)
        self.watch = PlanWatcher(client, env.job, os.environ.get(ENV_PLAN_FEED))
        ft, comm = spec.fault_tolerance, spec.comm
        self.collective_guard = CollectiveGuard(
            OpTimeout(
                floor=comm.op_timeout_floor.total_seconds(),
                multiple=comm.op_timeout_multiple,
                ceiling=2 * ft.hang_timeout.total_seconds(),
            ),
            self.watch.latest_generation,
        )
        self.heartbeat = Heartbeat(
            client,
            keys.job_progress(env.job) + self.worker,
            lambda: self.step,
            self.progress,
            spec.fault_tolerance.heartbeat_interval,
        )
        # What the first DDP of a generation imports lazily (torch._dynamo: about a second
        # alone, several on a loaded machine) is imported before the first beat: a node
        # counts as a warm spare only once joining costs it no import.
        for name in PREIMPORTS:
            importlib.import_module(name)
        self.heartbeat.start()
        self.heartbeat.beat_now()  # a waiting worker is a warm one: the controller counts it

    # -- identity ----------------------------------------------------------------------

    @property
    def worker(self) -> str:
        return keys.worker_id(self.env.node, self.env.local_rank)

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    # -- what the script registers -----------------------------------------------------

    def wrap(
        self,
        module: nn.Module,
        hook_installer: HookInstaller | None = None,
        *,
        sharding: str = "ddp",
        shard_size: int | None = None,
        redundancy_every_steps: int | None = None,
    ) -> Any:
        """Wrap ``module`` for data-parallel training across generations.

        Args:
            module: the model, built the same way (same seed) on every rank.
            hook_installer: a DDP comm hook of the script's own (``ddp`` only).
            sharding: ``ddp`` (every rank holds the whole model; DDP), ``fsdp``
                (FSDP2's ``fully_shard`` over every rank: a lost slice comes from
                a buddy's copy, see ``redundancy_every_steps``, else from the
                newest durable checkpoint) or ``hsdp`` (shard within groups of
                ``shard_size`` neighbouring ranks, replicate across the groups:
                a lost slice comes from its twin in another group).
            shard_size: ``hsdp`` only: ranks per shard group (default: one
                node's workers, ``nproc_per_node``).
            redundancy_every_steps: ``fsdp`` only: every this many steps each
                rank's slice is copied to a buddy on the next node
                (:mod:`agents.recovery.buddy_copies`); 0 turns copies off (a lost slice
                then comes from the durable checkpoint).  Default: the job
                file's ``fault_tolerance.redundancy.every_steps`` (itself 10
                by default).

        Returns:
            An :class:`ElasticDDP` for ``ddp``, a
            :class:`~agents.runtime.sharding.ShardedModel` otherwise; build optimizers
            on its ``parameters()`` after this call.

        Raises:
            ValueError: an unknown mode, options of another mode, or a second
                sharded model in one session.

        On a GPU worker the module moves to :attr:`device` (the local rank's
        CUDA device) and DDP gets ``device_ids``, as in a torchrun script.
        """
        ignored = redundancy_ignored(
            check_mode(sharding),
            self.spec.fault_tolerance.redundancy.every_steps,
            DEFAULT_REDUNDANCY_EVERY_STEPS,
        )
        if ignored is not None:
            log.warning("%s", ignored)
        if sharding != "ddp":
            return self._wrap_sharded(
                module, sharding, shard_size, redundancy_every_steps, hook_installer
            )
        if shard_size is not None:
            raise ValueError("shard_size is an option of sharding='hsdp'")
        if redundancy_every_steps is not None:
            raise ValueError("redundancy_every_steps is an option of sharding='fsdp'")
        comm = self.spec.comm
        if hook_installer is None and (comm.hierarchical or comm.compression.type.value != "none"):
            hook_installer = self._install_spec_hook
        placement: dict[str, Any] = {}
        if self.device.type == "cuda":
            module = module.to(self.device)
            placement["device_ids"] = [self.device.index]
        wrapped = ElasticDDP(
            module,
            hook_installer=hook_installer,
            failures=self._failures,
            bucket_cap_mb=self.spec.comm.bucket_cap_mb,
            **placement,
        )
        self.wrapped.append(wrapped)
        if dist.is_initialized():
            wrapped.rebuild()
        return wrapped

    def _wrap_sharded(
        self,
        module: nn.Module,
        sharding: str,
        shard_size: int | None,
        every_steps: int | None,
        hook_installer: HookInstaller | None,
    ) -> ShardedModel:
        if every_steps is not None and sharding != "fsdp":
            raise ValueError(
                f"redundancy_every_steps is an option of sharding='fsdp'; {sharding!r} keeps "
                "each slice in its twin of another replica group"
            )
        if every_steps is not None and every_steps < 0:
            raise ValueError(f"redundancy_every_steps must be 0 (off) or more, got {every_steps}")
        if hook_installer is not None:
            raise ValueError(f"a DDP comm hook cannot be installed with sharding={sharding!r}")
        if shard_size is not None and sharding != "hsdp":
            raise ValueError(f"shard_size is an option of sharding='hsdp', not {sharding!r}")
        if self.sharded is not None:
            raise ValueError("this session already has a sharded model; wrap one model per job")
        if dist.is_initialized():
            raise ValueError(f"wrap(sharding={sharding!r}) before the first session.steps()")
        comm = self.spec.comm
        if comm.hierarchical or comm.compression.type.value != "none":
            raise ValueError(
                f"comm.compression and comm.hierarchical are DDP comm hooks; sharding={sharding!r} "
                "reduce-scatters gradients itself: remove them from the job file"
            )
        if self.device.type == "cuda":
            module = module.to(self.device)
        wrapped = ShardedModel(module, sharding, shard_size)
        self.sharded = wrapped
        if sharding == "fsdp":
            every = self.spec.fault_tolerance.redundancy.every_steps
            if every_steps is not None:  # the script's own choice wins over the job file
                every = every_steps
            self.buddies = BuddyCopies(every) if every > 0 else None
        return wrapped

    def _install_spec_hook(self, ddp: Any) -> None:
        """Register the job's comm hook on a DDP built for this generation."""
        from agents.comm import NodeLayout, build_comm_hook

        assert self.plan is not None
        node_of_rank = [i for i, m in enumerate(self.plan.members) for _ in range(m.nproc)]
        hook = build_comm_hook(
            self.spec.comm, ddp, layout=NodeLayout.from_node_ranks(node_of_rank), seed=0
        )
        # Every rank starts the generation with a fresh hook: a replacement has no
        # hook state, and ranks whose warm-up counters differ would run different
        # collectives.  Error-feedback residuals of the old generation are dropped;
        # after a durable resume at the same world size, every rank loads its own.
        state, self.saving.hook_resume = self.saving.hook_resume, None
        if state is not None:
            from agents.comm.api import HookStateError

            try:
                hook.load_state_dict(state)
            except HookStateError as e:  # resumed with --force under another compression
                log.warning("%s: the comm hook starts fresh", e)
                hook = build_comm_hook(
                    self.spec.comm, ddp, layout=NodeLayout.from_node_ranks(node_of_rank), seed=0
                )
        hook.register(ddp)
        self.hook = hook

    def track(self, **objects: Stateful) -> None:
        """Register state a replacement must receive (model, optimizer, scheduler, data)."""
        for name, obj in objects.items():
            if not isinstance(obj, Stateful):
                raise TypeError(f"{name} has no state_dict()/load_state_dict()")
            self.tracked[name] = obj

    def on_save(self, fn: SaveFn) -> None:
        """Call ``fn(session, reason)`` on every rank when a durable save is due."""
        self.save_fn = fn

    def report(self, **metrics: float) -> None:
        """Record metrics of the last step (published with progress).

        ``loss`` is plotted by ``ringmaster report``; ``samples`` (this rank's
        samples in the step) gives the job's samples/s.
        """
        self._metrics.update({k: float(v) for k, v in metrics.items()})

    # -- the loop ----------------------------------------------------------------------

    def steps(self, total: int | None = None) -> Iterator[int]:
        """Yield step numbers from the restored step to ``total``, recovering as needed.

        Raises:
            Exception: the script's own error, raised in a step (inside
                :meth:`guard`) or at a step boundary (an ``on_save`` callback),
                after it was reported to the controller.
            RecoveryError: the job could not be recovered in-process.
        """
        limit = total if total is not None else (self.spec.max_steps or math.inf)
        try:
            self.generations.join_next(1)
            yield from self._loop(limit)
        except JobEndedError as e:
            log.warning("%s; leaving", e)
            self.close()
            return
        self.finished = True
        self._finish()

    def _loop(self, limit: float) -> Iterator[int]:
        while self.step < limit and not self._stop_requested:
            self._step_error = None
            self._failures.clear()
            current = self.step
            started = time.monotonic()
            yield current
            if self._step_error is not None:
                self._failed(self._step_error, f"step {current}")
                continue
            try:
                if self.hook is not None:
                    with self._failures.collective():
                        for w in self.wrapped:
                            self.hook.after_optimizer_step(w.module)  # local SGD averages here
                self.step = current + 1
                self.has_state = True
                if self.buddies is not None and self.sharded is not None:
                    self.buddies.after_step(self.step, self._capture_slice)
                self.telemetry.step_done(self.hook, self.wrapped)
                self.generations.failures_at_step = 0
                self._boundary(time.monotonic() - started)
                self.collective_guard.step_ended(time.monotonic() - started)
            except (RecoveryError, JobEndedError):
                raise
            except Exception as e:
                self._failed(e, f"step boundary {self.step}")

    def _capture_slice(self) -> Any:
        assert self.sharded is not None
        tracked = self.tracked
        return self.sharded.capture(
            self.step, optimizers_of(tracked), others_of(tracked, self.sharded)
        )

    @property
    def step_failed(self) -> bool:
        """True after a :meth:`guard` body whose step failed (it will run again)."""
        return self._step_error is not None

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Run one step's body; an error inside it is recorded and judged at the step
        boundary: a peer's failure triggers recovery, the script's own error ends
        the worker (raised by :meth:`steps`)."""
        try:
            yield
        except Exception as e:
            if not dist.is_initialized():
                raise
            self._step_error = e

    def _failed(self, error: BaseException, where: str) -> None:
        """Record, then vote: recover when a peer is gone, else raise the script's error."""
        plan = self.watch.wait_newer(self.generation, timeout=PEER_SETTLE_S)
        recorded = self._failures.take()
        if recorded is None and self.sharded is not None and raised_in_collective(error):
            recorded = error  # FSDP's collectives run in its hooks, where none is wrapped
        why = peer_failure(error, recorded, plan.generation if plan is not None else None)
        if why is not None:
            ended_by = self.collective_guard.ended_by(error)
            self.telemetry.left_by = ended_by
            self.generations.recover(
                f"{where} failed: {one_line(error)} ({why}; ended by {ended_by})"
            )
            return
        reason = f"{where} raised {type(error).__name__}: {one_line(error)}"
        log.warning("%s; the error is the script's own: leaving", reason)
        self.generations.report(self.generation, reason, planned=False, user_error=True)
        self.heartbeat.stop()
        self.watch.stop()
        self.collective_guard.close()
        if self.buddies is not None:
            self.buddies.stop()
        teardown_group()
        raise error

    # -- step boundary -----------------------------------------------------------------

    def _boundary(self, step_seconds: float) -> None:
        """The step boundary: vote when one is due (:mod:`agents.runtime.boundary`), then act."""
        if self.step >= self.vote_at:
            agreed = self._vote(step_seconds)
            self.vote_at = self.step + agreed.every
            if agreed.etcd_lost:
                self.generations.pause_for_etcd()
        else:
            agreed = boundary.Agreement.quiet(self.generation, self._control_seen)
        self.heartbeat.poke()
        self.saving.poll()
        # Every rank decides from the same reduced numbers (a replacement has seen
        # no request yet, its peers have): a request is new only if no rank served it.
        # Served once the saves below are made: a save that breaks with the group
        # (a peer left, e.g. the first of several preempted nodes) is asked again in
        # the next generation instead of counting as done.
        seen = max(agreed.checkpoint_requested, agreed.checkpoint_served)
        saves = []
        if agreed.checkpoint_request_new:
            saves.append("requested")
        elif agreed.periodic_save_due(self.step, self.spec.checkpoint.every_steps):
            saves.append("periodic")
        if agreed.stop:
            saves.append("stop")
        if saves:  # a save's collectives may wait on rank 0's storage: no learnt timeout
            with self.collective_guard.relaxed():
                for reason in saves:
                    self.saving.save(reason)
        self._control_seen = seen
        if agreed.stop:
            self._stop_requested = True
            return
        if agreed.generation > self.generation:
            self.telemetry.left_by = None  # this step ended well: nothing had to end it
            self.generations.recover(f"generation {agreed.generation} published", planned=True)

    def _vote(self, step_seconds: float) -> boundary.Agreement:
        control = self.watch.control()
        contact = SETTINGS.etcd_contact_timeout.total_seconds()
        with self._failures.collective():
            return boundary.agree(
                boundary.Proposal(
                    generation=self.watch.latest_generation(),
                    checkpoint_requested=control.checkpoint,
                    checkpoint_served=self._control_seen,
                    stop=control.stop,
                    etcd_lost=self.client.unreachable_for() > contact,
                    save_due_by_time=self.saving.save_due_by_time(),
                    every=boundary.steps_between_votes(step_seconds),
                ),
                group=self.groups.control if self.groups is not None else None,
            )

    # -- the end -----------------------------------------------------------------------

    def _finish(self) -> None:
        self.saving.close()
        with contextlib.suppress(EtcdError):
            self.heartbeat.beat_now()
        done = DoneRecord(step=self.step, generation=self.generation, at=time.time())
        try:
            retry_unavailable(
                lambda: self.fence.put(keys.job_done(self.env.job) + self.worker, done.encode()),
                "recording the end of training",
                max_wait=SETTINGS.plan_timeout,
            )
        except FencedError as e:
            log.warning("not recording the end of training: %s", e)
        self.heartbeat.stop()
        try:
            last = quiesce()  # held until the group is gone (see quiesce)
        except RuntimeError as e:  # a peer left at the very end: nothing to wait for
            log.debug("no barrier before leaving: %s", e)
            last = None
        self.collective_guard.close()
        for w in self.wrapped:
            w.drop()
        if self.buddies is not None:
            self.buddies.stop()
        teardown_group()
        del last

    def progress(self, beat: float, step_time: float) -> ProgressRecord:
        """This worker's progress as of ``beat``, for its heartbeat."""
        return ProgressRecord(
            step=self.step,
            generation=self.generation,
            rank=self.rank,
            world_size=self.world_size,
            pid=os.getpid(),
            beat=beat,
            step_time=step_time,
            recoveries=self.recoveries,
            last_recovery_s=self.last_recovery_s,
            paused=self.paused,
            metrics=dict(self._metrics),
            telemetry=self.telemetry.record(),
        )

    def close(self) -> None:
        self.heartbeat.stop()
        self.watch.stop()
        self.collective_guard.close()
        if self.buddies is not None:
            self.buddies.stop()
        teardown_group()
        self.client.close()


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
    from orchestrator.jobs import read_spec

    spec, _ = retry_unavailable(
        lambda: read_spec(client, env.job), "reading the job spec", max_wait=SETTINGS.plan_timeout
    )
    return Session(env, client, spec)
