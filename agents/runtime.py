"""The worker runtime: what a training script imports.

A torchrun-style script becomes fault tolerant with a few lines::

    from agents import runtime

    session = runtime.init()
    model = session.wrap(Net())                      # DDP that survives hot-swaps
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session.track(model=model, optimizer=opt)         # what a replacement receives
    for step in session.steps(1000):
        with session.guard():                        # a peer's death is caught here
            x, y = batch(step, session.rank, session.world_size)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        session.report(loss=loss.item())

How recovery works: when a peer dies, the gloo collective inside the step
raises in the survivors; :meth:`Session.guard` swallows it and
:meth:`Session.steps` tears the group down, reports to etcd, waits for the
controller's next generation (a warm spare in the dead node's place), forms a
new group in-process and brings every rank to the freshest live state
(:mod:`agents.state_sync`).  The failed step runs again; no completed step is
lost or applied twice.  Survivors never restart and never read object storage.

At every step boundary the ranks all-reduce a few control integers (known
generation, checkpoint request, stop), so planned changes (drain, scale,
checkpoint-now, stop) happen at the same step on every rank.

A spare's workers wait inside :meth:`Session.steps` until a generation
includes their node; when the job ends first, the loop simply ends
(``session.finished`` stays False).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from agents.api import JobEndedError, RecoveryError, Stateful, WorkerEnv
from agents.elastic_ddp import ElasticDDP, HookInstaller
from agents.process_group import form_group, is_collective_failure, teardown_group
from agents.state_sync import NO_STATE, sync_state
from agents.telemetry import WorkerTelemetry
from orchestrator import keys
from orchestrator.api import EtcdError, JobPhase, JobSpec
from orchestrator.etcd.client import EtcdClient, connect
from orchestrator.etcd.fencing import FencedError, GenerationFence
from orchestrator.etcd.options import EtcdOptions, parse_endpoints
from orchestrator.etcd.retry import retry_unavailable
from orchestrator.records import Plan

log = logging.getLogger("ringmaster.worker")

#: A step that fails this many times in a row is not a peer failure: give up.
MAX_FAILURES_PER_STEP = 5
#: Longest wait for the controller's next generation before giving up.
DEFAULT_PLAN_TIMEOUT = timedelta(seconds=float(os.environ.get("RINGMASTER_PLAN_TIMEOUT", "600")))

#: Key of the comm hook's state in a checkpoint's per-rank state.
_HOOK_STATE = "comm_hook"

#: A worker that has not heard from etcd for this long pauses at the next step
#: boundary (with every rank) until etcd answers again: without etcd it can
#: neither be told about a newer generation nor prove it still belongs.
ETCD_CONTACT_TIMEOUT = timedelta(
    seconds=float(os.environ.get("RINGMASTER_ETCD_CONTACT_TIMEOUT", "2"))
)

# Indices of the control vector all-reduced (MAX) at every step boundary.
_CTL_GENERATION, _CTL_CHECKPOINT, _CTL_SEEN, _CTL_STOP, _CTL_ETCD_LOST, _CTL_LEN = range(6)

SaveFn = Callable[["Session", str], None]


class Session:
    """One worker's view of the job; build it with :func:`init`."""

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
        self._tracked: dict[str, Stateful] = {}
        self._wrapped: list[ElasticDDP] = []
        self._metrics: dict[str, float] = {}
        self._step_error: BaseException | None = None
        self._failures_at_step = 0
        self._control_seen = 0
        self._stop_requested = False
        self._save_fn: SaveFn | None = None
        self._ckpt: Any = None
        self._plan: Plan | None = None
        self._hook: Any = None
        self._hook_resume: dict[str, Any] | None = None  # comm hook state from a checkpoint
        self._pending_save: Any = None
        self.restored_from: str | None = None
        self._telemetry = WorkerTelemetry()
        self.paused: str | None = None
        self._fence = GenerationFence(client, env.job)
        self._commit_refused: str | None = None
        self._watch = _PlanWatcher(client, env.job)
        self._heartbeat = _Heartbeat(self, spec.fault_tolerance.heartbeat_interval)
        self._heartbeat.start()
        self._heartbeat.beat_now()  # a waiting worker is a warm one: the controller counts it

    # -- identity ----------------------------------------------------------------------

    @property
    def worker(self) -> str:
        return keys.worker_id(self.env.node, self.env.local_rank)

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    # -- what the script registers -----------------------------------------------------

    def wrap(self, module: nn.Module, hook_installer: HookInstaller | None = None) -> ElasticDDP:
        """Wrap ``module`` for data-parallel training across generations."""
        comm = self.spec.comm
        if hook_installer is None and (comm.hierarchical or comm.compression.type.value != "none"):
            hook_installer = self._install_spec_hook
        wrapped = ElasticDDP(
            module,
            hook_installer=hook_installer,
            bucket_cap_mb=self.spec.comm.bucket_cap_mb,
        )
        self._wrapped.append(wrapped)
        if dist.is_initialized():
            wrapped.rebuild()
        return wrapped

    def _install_spec_hook(self, ddp: Any) -> None:
        """Register the job's comm hook on a DDP built for this generation."""
        from agents.comm import NodeLayout, build_comm_hook

        assert self._plan is not None
        node_of_rank = [i for i, m in enumerate(self._plan.members) for _ in range(m.nproc)]
        hook = build_comm_hook(
            self.spec.comm, ddp, layout=NodeLayout.from_node_ranks(node_of_rank), seed=0
        )
        # Every rank starts the generation with a fresh hook: a replacement has no
        # hook state, and ranks whose warm-up counters differ would run different
        # collectives.  Error-feedback residuals of the old generation are dropped;
        # after a durable resume at the same world size, every rank loads its own.
        state, self._hook_resume = self._hook_resume, None
        if state is not None:
            from agents.comm.api import HookStateError

            try:
                hook.load_state_dict(state)
            except HookStateError as e:  # resumed with --force under another compression
                log.warning("[%s] %s: the comm hook starts fresh", self.worker, e)
                hook = build_comm_hook(
                    self.spec.comm, ddp, layout=NodeLayout.from_node_ranks(node_of_rank), seed=0
                )
        hook.register(ddp)
        self._hook = hook

    def track(self, **objects: Stateful) -> None:
        """Register state a replacement must receive (model, optimizer, scheduler, data)."""
        for name, obj in objects.items():
            if not isinstance(obj, Stateful):
                raise TypeError(f"{name} has no state_dict()/load_state_dict()")
            self._tracked[name] = obj

    def on_save(self, fn: SaveFn) -> None:
        """Call ``fn(session, reason)`` on every rank when a durable save is due."""
        self._save_fn = fn

    def report(self, **metrics: float) -> None:
        """Record metrics of the last step (published with progress).

        ``loss`` is plotted by ``ringmaster report``; ``samples`` (this rank's
        samples in the step) gives the job's samples/s.
        """
        self._metrics.update({k: float(v) for k, v in metrics.items()})

    # -- the loop ----------------------------------------------------------------------

    def steps(self, total: int | None = None) -> Iterator[int]:
        """Yield step numbers from the restored step to ``total``, recovering as needed."""
        limit = total if total is not None else (self.spec.max_steps or math.inf)
        try:
            self._join_next(1)
            yield from self._loop(limit)
        except JobEndedError as e:
            log.warning("[%s] %s; leaving", self.worker, e)
            self.close()
            return
        self.finished = True
        self._finish()

    def _loop(self, limit: float) -> Iterator[int]:
        while self.step < limit and not self._stop_requested:
            self._step_error = None
            current = self.step
            yield current
            if self._step_error is not None:
                self._recover(f"step {current} failed: {_short(self._step_error)}")
                continue
            if self._hook is not None:
                for w in self._wrapped:
                    self._hook.after_optimizer_step(w.module)  # local SGD averages here
            self.step = current + 1
            self.has_state = True
            self._telemetry.step_done(self._hook, self._wrapped)
            self._failures_at_step = 0
            try:
                self._boundary()
            except RecoveryError:
                raise
            except Exception as e:
                if not is_collective_failure(e):
                    raise
                self._recover(f"step boundary {self.step} failed: {_short(e)}")

    @property
    def step_failed(self) -> bool:
        """True after a :meth:`guard` body whose step failed (it will run again)."""
        return self._step_error is not None

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Run one step's body; a collective failure inside it triggers recovery."""
        try:
            yield
        except Exception as e:
            if not dist.is_initialized() or not is_collective_failure(e):
                raise
            self._step_error = e

    # -- recovery ----------------------------------------------------------------------

    def _recover(self, reason: str, planned: bool = False) -> None:
        started = time.monotonic()
        self._failures_at_step += 0 if planned else 1
        if self._failures_at_step > MAX_FAILURES_PER_STEP:
            raise RecoveryError(
                f"step {self.step} failed {self._failures_at_step} times in a row; last: {reason}"
            )
        self.recoveries += 0 if planned else 1
        log.warning("[%s] generation %d ends: %s", self.worker, self.generation, reason)
        self._hook = None
        for w in self._wrapped:
            w.drop()
        teardown_group()
        self._report(self.generation, reason, planned)
        self._join_next(self.generation + 1)
        self.last_recovery_s = time.monotonic() - started
        log.warning(
            "[%s] rejoined as rank %d/%d in generation %d at step %d (%.3fs)",
            self.worker,
            self.rank,
            self.world_size,
            self.generation,
            self.step,
            self.last_recovery_s,
        )

    def _join_next(self, min_generation: int) -> None:
        """Join the first generation from ``min_generation`` on whose group forms.

        A group that does not form (a member died or came too late) is
        reported like a broken generation, and the worker waits for the next.
        """
        while True:
            plan = self._await_plan(min_generation)
            try:
                self._join(plan)
                return
            except RecoveryError as e:
                log.warning("[%s] %s", self.worker, e)
                self._report(plan.generation, str(e), False)
                min_generation = plan.generation + 1

    def _report(self, generation: int, reason: str, planned: bool) -> None:
        """Tell the controller that ``generation`` broke here (best effort: keyed by
        generation, so a late report can never affect a newer one)."""
        try:
            self.client.put_json(
                keys.job_reports(self.env.job, generation) + self.worker,
                {"step": self.step, "reason": reason, "planned": planned, "at": time.time()},
            )
        except EtcdError as e:
            log.warning(
                "[%s] could not report the end of generation %d: %s", self.worker, generation, e
            )

    def _await_plan(self, min_generation: int) -> Plan:
        """Block until a plan of at least ``min_generation`` that includes this worker."""
        deadline = time.monotonic() + DEFAULT_PLAN_TIMEOUT.total_seconds()
        while True:
            plan = self._watch.wait_newer(min_generation - 1, timeout=1.0)
            if plan is not None:
                member = plan.member(self.env.node)
                if member is not None and self.env.local_rank < member.nproc:
                    return plan
                if self.has_state and self.generation > 0:
                    # Replaced while away (partitioned, or too slow): the state held
                    # here is stale.  Drop it and wait as a spare that gets live state.
                    log.warning(
                        "[%s] fenced out: generation %d does not include this node; "
                        "dropping the state of step %d and waiting as a spare",
                        self.worker,
                        plan.generation,
                        self.step,
                    )
                    self.has_state = False
                    self._fence.leave()
                min_generation = plan.generation + 1  # not in it: wait as a spare
            phase = self._job_phase()
            if phase is not None and phase.terminal:
                raise JobEndedError(f"job {self.env.job} is {phase.value}")
            if time.monotonic() > deadline:
                raise RecoveryError(
                    f"no generation >= {min_generation} including {self.worker} within "
                    f"{DEFAULT_PLAN_TIMEOUT.total_seconds():g}s"
                )

    def _join(self, plan: Plan) -> None:
        member = plan.member(self.env.node)
        assert member is not None
        self.generation = plan.generation
        self._plan = plan
        self.rank = member.rank_base + self.env.local_rank
        self.world_size = plan.world_size
        self._fence.join(plan.generation, self._watch.revision_of(plan.generation))
        form_group(
            self.client,
            self.env.job,
            plan.generation,
            self.rank,
            self.world_size,
            self.env.address,
            collective_timeout=self.spec.fault_tolerance.hang_timeout * 2,
            fence=self._fence,
        )
        self._telemetry.group_formed(plan.generation)
        self._open_checkpointer(first=plan.generation == 1)
        result = sync_state(self.step if self.has_state else NO_STATE, self._capture, self._restore)
        if result.step != NO_STATE:
            self.step = result.step
            self.has_state = True
        elif self._train_state() is not None:
            self._resume_durable()
        self._telemetry.state_restored(self.step)
        for w in self._wrapped:
            w.rebuild()
        self._heartbeat.start()
        self._heartbeat.poke()

    def _capture(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "tracked": {name: obj.state_dict() for name, obj in self._tracked.items()},
            "rng": torch.get_rng_state(),
        }

    def _restore(self, state: dict[str, Any]) -> None:
        for name, obj in self._tracked.items():
            if name in state["tracked"]:
                obj.load_state_dict(state["tracked"][name])
        torch.set_rng_state(state["rng"])
        self.step = int(state["step"])
        self.has_state = True

    # -- step boundary -----------------------------------------------------------------

    def _boundary(self) -> None:
        control = self._watch.control()
        vec = torch.zeros(_CTL_LEN, dtype=torch.int64)
        vec[_CTL_GENERATION] = self._watch.latest_generation()
        vec[_CTL_CHECKPOINT] = int(control.get("checkpoint", 0))
        vec[_CTL_SEEN] = self._control_seen
        vec[_CTL_STOP] = int(bool(control.get("stop", False)))
        vec[_CTL_ETCD_LOST] = int(
            self.client.unreachable_for() > ETCD_CONTACT_TIMEOUT.total_seconds()
        )
        dist.all_reduce(vec, op=dist.ReduceOp.MAX)
        if int(vec[_CTL_ETCD_LOST]):
            self._pause_for_etcd()
        self._heartbeat.poke()
        self._poll_save()
        every = self.spec.checkpoint.every_steps
        # Every rank decides from the same reduced numbers (a replacement has seen
        # no request yet, its peers have): a request is new only if no rank served it.
        requested, served = int(vec[_CTL_CHECKPOINT]), int(vec[_CTL_SEEN])
        self._control_seen = max(requested, served)
        if requested > served:
            self._save("requested")
        elif every and self.step % every == 0:
            self._save("periodic")
        if int(vec[_CTL_STOP]):
            self._save("stop")
            self._stop_requested = True
            return
        if int(vec[_CTL_GENERATION]) > self.generation:
            self._recover(f"generation {int(vec[_CTL_GENERATION])} published", planned=True)

    def _pause_for_etcd(self) -> None:
        """Wait, state kept, until etcd answers again (every rank pauses at this step).

        Training on without etcd would go unnoticed by the controller and could
        not be fenced, so an outage pauses the job instead of failing it.
        """
        started = time.monotonic()
        self.paused = f"etcd unreachable at step {self.step}"
        log.warning("[%s] %s: pausing until etcd is back", self.worker, self.paused)
        try:
            retry_unavailable(
                self._watch.load,
                f"[{self.worker}] paused at step {self.step}",
                max_wait=DEFAULT_PLAN_TIMEOUT,
            )
        except EtcdError as e:
            raise RecoveryError(
                f"etcd stayed unreachable for {DEFAULT_PLAN_TIMEOUT.total_seconds():g}s "
                f"(RINGMASTER_PLAN_TIMEOUT) while paused at step {self.step}: {e}"
            ) from e
        finally:
            self.paused = None
        log.warning(
            "[%s] etcd is back; resuming at step %d after %.1fs",
            self.worker,
            self.step,
            time.monotonic() - started,
        )

    def _check_commit(self) -> None:
        """Commit fence for durable checkpoints: only a current member commits."""
        from checkpoint.api import CommitFencedError

        try:
            self._fence.check()
        except FencedError as e:
            self._commit_refused = str(e)
            raise CommitFencedError(f"checkpoint not committed: {e}") from e

    # -- durable checkpoints -----------------------------------------------------------

    def _open_checkpointer(self, first: bool) -> None:
        """A checkpointer on this generation's group (creating it is collective)."""
        from checkpoint import Checkpointer
        from orchestrator.jobs import checkpoint_hash

        previous = self._ckpt
        self._ckpt = None
        self._pending_save = None
        cfg = self.spec.checkpoint
        url = cfg.url if "://" in cfg.url else f"file://{os.path.abspath(cfg.url)}"
        self._ckpt = Checkpointer(
            url,
            keep=cfg.keep,
            job_spec_hash=checkpoint_hash(self.spec),
            job=self.env.job,
            check_storage=first,
            fence=self._check_commit,
        )
        if previous is not None:
            # Same model, and usually the same share: the first save of this
            # generation then copies into existing buffers instead of allocating.
            self._ckpt.adopt_staging(previous)

    def _train_state(self) -> Any:
        from checkpoint import TrainState

        model = self._tracked.get("model")
        if isinstance(model, ElasticDDP):
            model = model.module  # the plain module: checkpoints load without ringmaster
        if not isinstance(model, nn.Module):
            return None
        rank_state = {}
        if self._hook is not None:  # per rank: residuals, PowerSGD factors, its RNG
            rank_state[_HOOK_STATE] = {
                "world_size": self.world_size,
                "state": self._hook.state_dict(),
            }
        return TrainState(
            model=model,
            optimizer=self._tracked.get("optimizer"),  # type: ignore[arg-type]
            scheduler=self._tracked.get("scheduler"),
            samples_seen=self.step,
            rank_state=rank_state,
        )

    def _resume_durable(self) -> None:
        from orchestrator.jobs import read_resume

        # A resubmitted job (`ringmaster resume`, `run --from`) starts from the checkpoint
        # it was given, until it has committed one of its own; every rank reads the same
        # records, as no save can happen before all ranks have restored.
        request = read_resume(self.client, self.env.job)
        if request is not None and self.client.get(keys.job_checkpoint(self.env.job)) is None:
            url: str | None = request.url
        else:
            url = None
        state = self._train_state()
        result = self._ckpt.restore(state, url=url)
        self._hook_resume = self._saved_hook_state(state.rank_state.get(_HOOK_STATE))
        if result.step is not None:
            self.step = int(result.step)
            self.has_state = True
            self.restored_from = result.url
            log.warning("[%s] resumed from %s at step %d", self.worker, result.url, self.step)

    def _saved_hook_state(self, saved: dict[str, Any] | None) -> dict[str, Any] | None:
        """The comm hook state to load, or None to start the hook fresh (and say why)."""
        if saved is None:
            return None
        if int(saved["world_size"]) != self.world_size:
            # Residuals belong to a rank's share of the data; at another world size
            # they would not, and ranks would disagree on warm-up counters.
            log.warning(
                "[%s] checkpoint was saved by %d ranks, now %d: the comm hook starts fresh",
                self.worker,
                int(saved["world_size"]),
                self.world_size,
            )
            return None
        log.warning("[%s] comm hook state restored from the checkpoint", self.worker)
        return dict(saved["state"])

    def _save(self, reason: str) -> None:
        if self._save_fn is not None:
            self._save_fn(self, reason)
        state = self._train_state()
        if self._ckpt is None or state is None:
            return
        started = time.perf_counter()
        if reason == "periodic" and self.spec.checkpoint.async_:
            job = self._ckpt.save_async(self.step, state)
            self._telemetry.checkpoint_blocked(time.perf_counter() - started)
            if job is not None:
                self._pending_save = job
            return
        try:
            manifest = self._ckpt.save_now(self.step, state)
        except Exception as e:
            if not self._refused_commit(e):
                raise
            return
        self._telemetry.checkpoint_blocked(time.perf_counter() - started)
        self._telemetry.checkpoint_uploaded(time.perf_counter() - started)
        self._record_checkpoint(manifest.step, reason)

    def _poll_save(self) -> None:
        job = self._pending_save
        if job is not None and job.done():
            self._pending_save = None
            try:
                manifest = job.wait()
            except Exception as e:
                if not self._refused_commit(e):
                    raise
                return
            self._telemetry.checkpoint_uploaded(getattr(job, "upload_seconds", None))
            self._record_checkpoint(manifest.step, "periodic")

    def _refused_commit(self, e: BaseException) -> bool:
        """True (and logged) when a save failed because the commit fence refused it."""
        refused, self._commit_refused = self._commit_refused, None
        if refused is None:
            return False
        log.warning("[%s] %s (%s)", self.worker, refused, _short(e))
        return True

    def _record_checkpoint(self, step: int, reason: str) -> None:
        if self.rank == 0:
            record = {
                "url": self.spec.checkpoint.url,
                "step": step,
                "reason": reason,
                "at": time.time(),
            }
            try:
                self._fence.put_json(keys.job_checkpoint(self.env.job), record)
            except (FencedError, EtcdError) as e:
                log.warning("[%s] checkpoint of step %d not recorded: %s", self.worker, step, e)

    def _finish(self) -> None:
        if self._ckpt is not None:
            job, self._pending_save = self._pending_save, None
            if job is not None:
                self._record_checkpoint(job.wait().step, "periodic")
            self._ckpt.close()
            self._ckpt = None
        with contextlib.suppress(EtcdError):
            self._heartbeat.beat_now()
        done = {"step": self.step, "generation": self.generation, "at": time.time()}
        try:
            retry_unavailable(
                lambda: self._fence.put_json(keys.job_done(self.env.job) + self.worker, done),
                f"[{self.worker}] recording the end of training",
                max_wait=DEFAULT_PLAN_TIMEOUT,
            )
        except FencedError as e:
            log.warning("[%s] not recording the end of training: %s", self.worker, e)
        self._heartbeat.stop()
        for w in self._wrapped:
            w.drop()
        teardown_group()

    def _job_phase(self) -> JobPhase | None:
        try:
            data = self.client.get_json(keys.job_status(self.env.job))
        except EtcdError as e:
            log.debug("[%s] job phase unknown: %s", self.worker, e)
            return None
        return JobPhase(data["phase"]) if data else None

    def progress(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "generation": self.generation,
            "rank": self.rank,
            "world_size": self.world_size,
            "recoveries": self.recoveries,
            "last_recovery_s": self.last_recovery_s,
            "paused": self.paused,
            "metrics": dict(self._metrics),
            "pid": os.getpid(),
            "telemetry": self._telemetry.as_dict(),
        }

    def close(self) -> None:
        self._heartbeat.stop()
        self._watch.stop()
        teardown_group()
        self.client.close()


class _PlanWatcher:
    """Follows the plan and control keys in background threads.

    A watch ends when etcd goes away (a member killed, quorum lost, the node
    cut off); each is re-established, after a fresh read, until :meth:`stop`.
    """

    def __init__(self, client: EtcdClient, job: str) -> None:
        self._client = client
        self._job = job
        self._cond = threading.Condition()
        self._plan: Plan | None = None
        self._plan_revision = -1
        self._control: dict[str, Any] = {}
        self._stopped = threading.Event()
        self._watches: dict[str, Any] = {}
        self.load()
        for key in (keys.job_plan(job), keys.job_control(job)):
            threading.Thread(target=self._follow, args=(key,), daemon=True).start()

    def load(self) -> None:
        """Read plan and control now.

        Raises:
            EtcdError: etcd did not answer.
        """
        kv = self._client.get(keys.job_plan(self._job))
        control = self._client.get_json(keys.job_control(self._job))
        with self._cond:
            if kv is not None:
                self._set_plan(Plan.from_dict(json.loads(kv.value)), kv.mod_revision)
            if control is not None:
                self._control = control
            self._cond.notify_all()

    def _load(self) -> None:
        try:
            self.load()
        except EtcdError as e:
            log.debug("plan not re-read: %s", e)

    def _set_plan(self, plan: Plan, revision: int) -> None:
        if self._plan is None or plan.generation > self._plan.generation:
            self._plan = plan
            self._plan_revision = revision

    def _follow(self, key: str) -> None:
        while not self._stopped.is_set():
            try:
                watch = self._client.watch(key)
                self._watches[key] = watch
                if self._stopped.is_set():
                    watch.cancel()
                    return
                self._load()  # whatever changed while no watch was running
                for ev in watch:
                    if ev.value is None:
                        continue
                    data = json.loads(ev.value)
                    with self._cond:
                        if key.endswith("/plan"):
                            self._set_plan(Plan.from_dict(data), ev.mod_revision)
                        else:
                            self._control = data
                        self._cond.notify_all()
            except Exception as e:  # etcd went away; the loop watches again
                log.debug("watch of %s ended: %s", key, e)
            self._stopped.wait(0.5)

    def wait_newer(self, generation: int, timeout: float) -> Plan | None:
        """The current plan if newer than ``generation``, waiting up to ``timeout``."""
        with self._cond:
            self._cond.wait_for(
                lambda: self._plan is not None and self._plan.generation > generation, timeout
            )
            plan = self._plan
        if plan is None or plan.generation <= generation:
            self._load()  # a watch may have missed an event while etcd was away
            plan = self._plan
        return plan if plan is not None and plan.generation > generation else None

    def latest_generation(self) -> int:
        with self._cond:
            return self._plan.generation if self._plan else 0

    def revision_of(self, generation: int) -> int:
        """``mod_revision`` of the plan of ``generation``; -1 when it is no longer current."""
        with self._cond:
            if self._plan is not None and self._plan.generation == generation:
                return self._plan_revision
            return -1

    def control(self) -> dict[str, Any]:
        with self._cond:
            return dict(self._control)

    def stop(self) -> None:
        self._stopped.set()
        for w in list(self._watches.values()):
            with contextlib.suppress(Exception):
                w.cancel()


class _Heartbeat:
    """Publishes progress every ``interval`` from a thread (a frozen process stops beating)."""

    def __init__(self, session: Session, interval: timedelta) -> None:
        self._session = session
        self._interval = interval.total_seconds()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_step = -1
        self._step_time = time.time()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            with contextlib.suppress(Exception):
                self.beat_now()

    def poke(self) -> None:
        """Beat soon, from the heartbeat thread (the training loop never waits on etcd)."""
        self._wake.set()

    def beat_now(self) -> None:
        s = self._session
        now = time.time()
        if s.step != self._last_step:
            self._last_step = s.step
            self._step_time = now
        data = s.progress()
        data.update({"beat": now, "step_time": self._step_time})
        s.client.put_json(keys.job_progress(s.env.job) + s.worker, data)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None


def _short(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    return text[:200]


def init(env: WorkerEnv | None = None) -> Session:
    """Start the runtime in a worker launched by ``ringmaster agent``.

    Raises:
        RecoveryError: when not launched by an agent (no ``RINGMASTER_JOB``); use
            :func:`init_or_plain` for scripts that also run under plain torchrun.
    """
    env = env or WorkerEnv.from_environ()
    if env is None:
        raise RecoveryError(
            "not started by `ringmaster agent` (RINGMASTER_JOB is not set); "
            "run the script through `ringmaster run job.yaml`"
        )
    logging.basicConfig(
        level=os.environ.get("RINGMASTER_LOG_LEVEL", "WARNING"),
        format=f"%(asctime)s [{env.node}/{env.local_rank}] %(message)s",
    )
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
        f"[{env.node}/{env.local_rank}] connecting to etcd",
        max_wait=DEFAULT_PLAN_TIMEOUT,
    )
    from orchestrator.jobs import read_spec

    spec, _ = retry_unavailable(
        lambda: read_spec(client, env.job), "reading the job spec", max_wait=DEFAULT_PLAN_TIMEOUT
    )
    return Session(env, client, spec)
