"""kopf handlers: fetch the inputs, call :func:`.reconcile.reconcile`, carry out the plan.

Every handler is thin; the work is in :func:`sync_job`, which is a plain
function of a :class:`Runtime` (the Kubernetes API, the etcd records, the
settings, the clock), so it runs the same against the real API, an HTTP
fake of it, or an in-memory fake.

* create / update (spec) / resume of a TrainingJob: validate the spec, write
  it to etcd for the controller, reconcile the children, write the status;
* a timer every ``SYNC_INTERVAL``: the same, so the status follows the
  controller and lost children come back even without events;
* agent pod events: write the Node's topology into a newly scheduled pod's
  annotations, and re-sync the job at once when a pod fails or goes away, so
  the replacement does not wait for the timer;
* delete: remove the job's keys from etcd (children go by garbage collection).

Each sync also posts the plan's Kubernetes Events on the TrainingJob
(:mod:`.events`) and, once ``ttlSecondsAfterFinished`` has passed, deletes
the TrainingJob itself.

Errors: :class:`RetryableOperatorError` becomes ``kopf.TemporaryError`` (kopf
retries after its delay), :class:`PermanentOperatorError` and an invalid spec
become ``kopf.PermanentError`` (no retry until the resource changes).  An
invalid spec also sets ``status.phase: Invalid`` with the loader's message.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, TypeVar

import kopf

from orchestrator.operator.api import (
    GROUP,
    KIND,
    LABEL_ROLE,
    PLURAL,
    ROLE_AGENT,
    SYNC_INTERVAL,
    VERSION,
    JobRecords,
    KubeApi,
    OperatorSettings,
    PermanentOperatorError,
    RejectedObjectError,
    RetryableOperatorError,
)
from orchestrator.operator.events import invalid_event
from orchestrator.operator.reconcile import (
    etcd_endpoints,
    job_spec_from_body,
    load_training_job,
    reconcile,
)
from orchestrator.operator.status import invalid_status
from orchestrator.operator.topology import (
    needs_topology,
    topology_annotations,
    topology_labels,
)
from orchestrator.spec.api import SpecError

log = logging.getLogger(__name__)

T = TypeVar("T")


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


@dataclass
class Runtime:
    """What the handlers work with; kopf hands it over in ``memo.runtime``."""

    kube: KubeApi
    records: JobRecords
    settings: OperatorSettings = field(default_factory=OperatorSettings)
    clock: Callable[[], datetime] = _utcnow
    _locks: dict[tuple[str, str], threading.Lock] = field(default_factory=dict)
    _guard: threading.Lock = field(default_factory=threading.Lock)

    @contextmanager
    def job_lock(self, namespace: str, name: str) -> Iterator[None]:
        """One sync of a job at a time (timer, spec change and pod events may overlap)."""
        with self._guard:
            lock = self._locks.setdefault((namespace, name), threading.Lock())
        with lock:
            yield


class InvalidSpecError(PermanentOperatorError):
    """The TrainingJob's spec was rejected; ``status`` is what to write anyway."""

    def __init__(self, message: str, status: dict[str, Any]) -> None:
        super().__init__(message)
        self.status = status


def sync_job(
    runtime: Runtime,
    body: dict[str, Any],
    logger: logging.Logger | logging.LoggerAdapter[Any] = log,
) -> dict[str, Any]:
    """Bring one TrainingJob's children and etcd record in line; return its new status.

    Raises:
        InvalidSpecError: the spec is invalid (its ``status`` says so).
        RetryableOperatorError: the API or etcd failed in a way worth retrying.
        PermanentOperatorError: the API refused an object, or no etcd is configured.
    """
    meta = body["metadata"]
    namespace, name = meta.get("namespace", "default"), meta["name"]
    now = runtime.clock()
    old = dict(body.get("status") or {})
    try:
        spec, fields = load_training_job(body, runtime.settings)
    except SpecError as e:
        status = invalid_status(
            old,
            str(e),
            generation=int(meta.get("generation", 0)),
            now=now,
        )
        for event in invalid_event(old, str(e)):
            runtime.kube.post_event(body, event)
        raise InvalidSpecError(str(e), status) from e
    endpoints = etcd_endpoints(spec, runtime.settings)
    with runtime.job_lock(namespace, name):
        if runtime.records.ensure_spec(endpoints, spec):
            logger.info("wrote the spec of job '%s' to etcd for its controller", name)
        controller = runtime.records.read_status(endpoints, name)
        observed = runtime.kube.list_children(namespace, name)
        plan = reconcile(
            body, observed, controller, runtime.settings, now, spec=spec, fields=fields
        )
        for gone in plan.delete:
            logger.info("%s %s: deleting (%s)", gone.kind, gone.name, gone.reason)
            runtime.kube.delete(namespace, gone.kind, gone.name)
        obj: dict[str, Any] = {}
        try:
            for obj in plan.create:
                logger.info("%s %s: creating", obj["kind"], obj["metadata"]["name"])
                runtime.kube.create(obj)
            for obj in plan.apply:
                logger.info("%s %s: updating to the spec", obj["kind"], obj["metadata"]["name"])
                runtime.kube.replace(obj)
        except RejectedObjectError as e:
            message = (
                f"{obj['kind']} {obj['metadata']['name']}: {e}. The API server checks the "
                "free-form parts of spec.template (volumes, affinity, env valueFrom, envFrom) "
                "only when it creates the pod: fix them there"
            )
            status = invalid_status(
                old, message, generation=int(meta.get("generation", 0)), now=now
            )
            for event in invalid_event(old, message):
                runtime.kube.post_event(body, event)
            raise InvalidSpecError(message, status) from e
        for event in plan.events:
            runtime.kube.post_event(body, event)
    return plan.status


def _runtime(memo: Any) -> Runtime:
    runtime = getattr(memo, "runtime", None)
    if not isinstance(runtime, Runtime):
        raise kopf.PermanentError("the operator started without a runtime (memo.runtime)")
    return runtime


def _as_kopf(fn: Callable[[], T]) -> T:
    """Run ``fn`` with operator errors turned into kopf's two kinds."""
    try:
        return fn()
    except RetryableOperatorError as e:
        raise kopf.TemporaryError(str(e), delay=e.delay.total_seconds()) from e
    except PermanentOperatorError as e:
        raise kopf.PermanentError(str(e)) from e


# --------------------------------------------------------------------------- handlers


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    """Keep kopf's bookkeeping in annotations: the status belongs to the TrainingJob schema."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.posting.level = logging.INFO


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
def on_spec(body: Any, memo: Any, patch: Any, logger: Any = log, **_: Any) -> None:
    """A TrainingJob appeared or its spec changed: reconcile now."""
    runtime = _runtime(memo)
    try:
        status = _as_kopf(lambda: sync_job(runtime, dict(body), logger))
    except kopf.PermanentError as e:
        cause = e.__cause__
        if isinstance(cause, InvalidSpecError):
            patch.status.update(cause.status)
        raise
    patch.status.update(status)


@kopf.timer(GROUP, VERSION, PLURAL, interval=SYNC_INTERVAL.total_seconds(), initial_delay=5)
def on_timer(body: Any, memo: Any, patch: Any, logger: Any = log, **_: Any) -> None:
    """Periodic sync: status from the controller, lost children recreated.

    An invalid spec only updates the status here (the spec handler already
    reported it); other permanent errors are logged and retried next interval.
    """
    runtime = _runtime(memo)
    try:
        status = _as_kopf(lambda: sync_job(runtime, dict(body), logger))
    except kopf.PermanentError as e:
        cause = e.__cause__
        if isinstance(cause, InvalidSpecError):
            patch.status.update(cause.status)
            return
        logger.error("sync failed: %s", e)
        return
    patch.status.update(status)


@kopf.on.event("", "v1", "pods", labels={LABEL_ROLE: ROLE_AGENT})
def on_agent_pod(event: Any, body: Any, memo: Any, logger: Any = log, **_: Any) -> None:
    """Topology for newly scheduled agent pods; an immediate re-sync when a pod is lost."""
    runtime = _runtime(memo)
    pod = dict(body)
    meta = pod.get("metadata") or {}
    namespace = meta.get("namespace", "default")
    if event.get("type") != "DELETED" and needs_topology(pod):
        node = pod["spec"]["nodeName"]
        labels = _as_kopf(lambda: runtime.kube.node_labels(node))
        annotations = topology_annotations(node, labels, runtime.settings)
        pod_labels = topology_labels(node, labels, runtime.settings)
        _as_kopf(
            lambda: runtime.kube.annotate_pod(namespace, meta["name"], annotations, pod_labels)
        )
    phase = (pod.get("status") or {}).get("phase")
    lost = event.get("type") == "DELETED" or phase == "Failed" or meta.get("deletionTimestamp")
    if not lost:
        return
    owner = next((r for r in meta.get("ownerReferences") or [] if r.get("kind") == KIND), None)
    if owner is None:
        return
    job = _as_kopf(lambda: runtime.kube.get_training_job(namespace, owner["name"]))
    if job is None or (job.get("metadata") or {}).get("deletionTimestamp"):
        return
    try:
        status = _as_kopf(lambda: sync_job(runtime, job, logger))
    except kopf.PermanentError:
        return  # the TrainingJob's own handlers report it
    _as_kopf(lambda: runtime.kube.patch_status(namespace, owner["name"], status))


@kopf.on.delete(GROUP, VERSION, PLURAL, retries=6, backoff=10)
def on_delete(body: Any, memo: Any, logger: Any = log, **_: Any) -> None:
    """Remove the job's records from etcd; the children go by garbage collection."""
    runtime = _runtime(memo)
    try:
        spec = job_spec_from_body(dict(body))
        endpoints = etcd_endpoints(spec, runtime.settings)
    except (SpecError, PermanentOperatorError):
        return  # never submitted
    _as_kopf(lambda: runtime.records.forget(endpoints, spec.name))
    logger.info("removed job '%s' from etcd", spec.name)
