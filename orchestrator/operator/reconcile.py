"""The reconcile function: a TrainingJob and its observed children → what to change.

:func:`reconcile` is pure: it takes the TrainingJob (a dict as the API server
returns it), the children the operator observed, the controller's status
record from etcd and the time, and returns a :class:`ReconcilePlan`.  The kopf
handlers (:mod:`.handlers`) only fetch the inputs and carry out the plan.

Agent pods (see :mod:`.pods` for why they are managed directly):

* the job wants ``nodes.max + nodes.spares`` live pods (Pending, Running or
  Unknown, not being deleted); the controller picks the active ones;
* a ``Failed`` pod (crashed beyond its restart policy, evicted, preempted) is
  deleted and a fresh pod with a new index is created in the same round; a
  pod being deleted (node lost, drained) no longer counts, so its replacement
  starts at once while it terminates;
* scaling down deletes, in this order: unscheduled pods, not-ready pods,
  registered spares, then the highest index, so the job loses active nodes
  last;
* a spec change that alters the pod template (image, resources, grace...)
  rolls the pods one at a time, spares first, only while every other pod is
  ready, so at most one node of the job recovers at any moment;
* once an agent exits with success or the controller reports a terminal
  phase the job is over: no pod is created any more, the remaining live pods
  are deleted once the phase is terminal (finished pods stay for their
  logs), and the controller Deployment is scaled to zero;
* ``spec.suspend: true``: every live agent pod is deleted; its preStop hook
  makes the agent ask for a checkpoint and leave once it is committed (as on a
  preemption).  The controller relays that request to the workers, so it keeps
  running until no agent pod is left (or every one left is past its grace
  period), and only then is scaled to zero.  The phase it last wrote is not a
  terminal one (the nodes left: Recovering), and the Services, the budget and
  the job's etcd records stay, so clearing the flag brings new pods and a new
  controller, and the job goes on from that checkpoint;
* ``spec.ttlSecondsAfterFinished``: that long after the phase became
  terminal (``status.completionTime``) the plan deletes the TrainingJob itself;
* Events for what changed (:mod:`.events`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import datetime
from typing import Any

from orchestrator.operator.api import (
    ANN_INDEX,
    ANN_TEMPLATE_HASH,
    Deletion,
    Observed,
    OperatorSettings,
    PermanentOperatorError,
    ReconcilePlan,
)
from orchestrator.operator.children import (
    controller_deployment,
    disruption_budget,
    headless_service,
    metrics_service,
)
from orchestrator.operator.etcd_access import password_source
from orchestrator.operator.events import sync_events
from orchestrator.operator.pods import agent_pod, agent_pod_hash, agent_pod_spec
from orchestrator.operator.status import build_status, controller_phase, parse_time, pod_ready
from orchestrator.operator.template import controller_scheduling, template_metadata
from orchestrator.operator.trainingjob import (
    TrainingJobFields,
    load_trainingjob_fields,
    split_spec,
)
from orchestrator.spec.api import SpecError, SpecProblem
from orchestrator.spec.job import JobSpec
from orchestrator.spec.loader import load_job_data

_LIVE_PHASES = ("Pending", "Running", "Unknown")
_INDEX_RE = re.compile(r"-agent-(\d+)$")


def job_spec_from_body(body: dict[str, Any]) -> JobSpec:
    """Validate a TrainingJob's ``spec`` with the job spec loader.

    ``spec.name`` defaults to ``metadata.name``.  The CRD's schema and CEL rules
    already reject most mistakes at the API server; the loader catches the rest
    (e.g. a compression parameter of another kind) with its own messages.

    Raises:
        SpecError: the spec is invalid (every problem listed).
    """
    meta = body.get("metadata") or {}
    name = meta.get("name", "")
    data, _ = split_spec(dict(body.get("spec") or {}))
    source = _source(body)
    given = data.get("name")
    data["name"] = given if given is not None else name
    spec = load_job_data(data, source=source)
    if spec.name != name:
        raise SpecError(
            [SpecProblem("name", f"'{spec.name}' must equal metadata.name '{name}'", None, source)]
        )
    return spec


def _source(body: dict[str, Any]) -> str:
    meta = body.get("metadata") or {}
    return f"TrainingJob {meta.get('namespace', 'default')}/{meta.get('name', '')}"


def fields_from_body(body: dict[str, Any]) -> TrainingJobFields:
    """The TrainingJob-only fields of ``spec`` (suspend, TTL, template).

    Raises:
        SpecError: a field is mistyped or unknown (each problem with its path).
    """
    _, extra = split_spec(dict(body.get("spec") or {}))
    return load_trainingjob_fields(extra, _source(body))


def load_training_job(
    body: dict[str, Any], settings: OperatorSettings
) -> tuple[JobSpec, TrainingJobFields]:
    """Everything about a TrainingJob that can be wrong, checked before anything is written.

    The job spec (the loader), the TrainingJob-only fields, and the pod template
    merged into an agent pod once, so that a template conflict is a spec problem.

    Raises:
        SpecError: every problem found, with field paths.
        PermanentOperatorError: no etcd is configured for the job.
    """
    problems: list[SpecProblem] = []
    spec: JobSpec | None = None
    fields: TrainingJobFields | None = None
    try:
        spec = job_spec_from_body(body)
    except SpecError as e:
        problems += e.problems
    try:
        fields = fields_from_body(body)
    except SpecError as e:
        problems += e.problems
    checks: list[Callable[[], object]] = []
    if fields is not None:
        template = fields.template
        checks.append(lambda: template_metadata(template, _source(body)))
        if spec is not None:
            job, endpoints = spec, etcd_endpoints(spec, settings)
            checks.append(lambda: agent_pod_spec(job, endpoints, settings, template))
    for check in checks:
        try:
            check()
        except SpecError as e:
            problems += [SpecProblem(p.path, p.message, p.line, _source(body)) for p in e.problems]
    if problems:
        raise SpecError(problems)
    assert spec is not None and fields is not None
    return spec, fields


def etcd_endpoints(spec: JobSpec, settings: OperatorSettings) -> tuple[str, ...]:
    """The job's own etcd endpoints, else the operator's.

    Raises:
        PermanentOperatorError: neither is set.
    """
    endpoints = tuple(spec.rendezvous.endpoints) or settings.etcd_endpoints
    if not endpoints:
        raise PermanentOperatorError(
            f"job '{spec.name}' gives no rendezvous.endpoints and the operator has no etcd: "
            "set RINGMASTER_ETCD on the operator Deployment or spec.rendezvous.endpoints"
        )
    return endpoints


def desired_pod_count(spec: JobSpec) -> int:
    """Agent pods the job wants: one per node up to ``nodes.max``, plus the spares."""
    return spec.nodes.max + spec.nodes.spares


def pod_index(pod: dict[str, Any]) -> int:
    """The pod's index (annotation, else the name's ``-agent-N`` suffix, else -1)."""
    meta = pod.get("metadata") or {}
    raw = (meta.get("annotations") or {}).get(ANN_INDEX)
    if raw is not None and str(raw).isdigit():
        return int(raw)
    m = _INDEX_RE.search(meta.get("name", ""))
    return int(m.group(1)) if m else -1


def reconcile(
    body: dict[str, Any],
    observed: Observed,
    controller: dict[str, Any] | None,
    settings: OperatorSettings,
    now: datetime,
    spec: JobSpec | None = None,
    fields: TrainingJobFields | None = None,
) -> ReconcilePlan:
    """Decide what to create, change and delete, the new status and the events.

    Args:
        body: the TrainingJob as the API server returns it.
        observed: its children as listed now.
        controller: the controller's status record from etcd (None before it writes one).
        settings: operator settings (default etcd, label keys...).
        now: current time, stamped on changed conditions.
        spec: the validated spec, when the caller has it already.
        fields: the TrainingJob-only fields, when the caller has them already.

    Raises:
        SpecError: the spec is invalid (or the template conflicts with the operator's fields).
        PermanentOperatorError: no etcd is configured for the job.
    """
    spec = spec or job_spec_from_body(body)
    fields = fields or fields_from_body(body)
    template = fields.template
    endpoints = etcd_endpoints(spec, settings)
    meta = body["metadata"]
    uid = meta.get("uid")
    old_status = dict(body.get("status") or {})
    plan = ReconcilePlan()

    phase = controller_phase(controller)
    terminal = bool(phase and phase.terminal)
    suspended = fields.suspend and not terminal

    pods = [p for p in observed.pods if _owned_by(p, uid)]
    current_hash = agent_pod_hash(body, spec, endpoints, settings, template)
    spares = set((controller or {}).get("spare_nodes") or [])

    pod_deletions: list[Deletion] = []
    live: list[dict[str, Any]] = []
    draining = 0  # pods being deleted whose agents may still be saving (within their grace)
    finished = False
    replaced = 0
    for pod in pods:
        pod_meta = pod.get("metadata") or {}
        pod_phase = (pod.get("status") or {}).get("phase", "Pending")
        if pod_meta.get("deletionTimestamp"):
            if pod_phase in _LIVE_PHASES and _within_grace(pod, now):
                draining += 1
            continue
        if pod_phase == "Failed":
            reason = (pod.get("status") or {}).get("reason") or "Failed"
            pod_deletions.append(Deletion("Pod", pod_meta["name"], f"pod failed ({reason})"))
            replaced += 1
        elif pod_phase == "Succeeded":
            finished = True
        elif pod_phase in _LIVE_PHASES:
            live.append(pod)

    want = 0 if (terminal or finished or suspended) else desired_pod_count(spec)
    victims: list[dict[str, Any]] = []
    if terminal or suspended:
        victims = list(live)
    elif finished:
        pass  # the job is ending: the controller's phase will follow; keep the rest
    elif len(live) > want:
        victims = sorted(live, key=lambda p: _victim_rank(p, spares))[: len(live) - want]
    for pod in victims:
        why = "job finished" if terminal else "job suspended" if suspended else "scaled down"
        pod_deletions.append(Deletion("Pod", pod["metadata"]["name"], why))
    kept = [p for p in live if p not in victims]
    # Suspending: a deleted agent pod's preStop hook makes the agent ask the controller
    # for a checkpoint and wait for it to be committed (as on a preemption); the
    # controller relays that request to the workers, so it stays until every agent pod
    # is gone (or past its grace period), and only then is scaled to zero.
    saving = suspended and bool(victims or draining)
    controller_running = not terminal and (not suspended or saving)

    for desired in (
        headless_service(body, spec),
        metrics_service(body, spec),
        controller_deployment(
            body,
            spec,
            endpoints,
            cpu=settings.controller_cpu,
            memory=settings.controller_memory,
            running=controller_running,
            service_account=settings.service_account,
            settings=settings,
            scheduling=controller_scheduling(template, bool(spec.resources.gpus)),
            password=password_source(template, spec.rendezvous.password_env),
        ),
        disruption_budget(body, spec),
    ):
        if desired["kind"] == "Service":
            is_metrics = (
                desired["metadata"]["name"] == metrics_service(body, spec)["metadata"]["name"]
            )
            current = observed.metrics_service if is_metrics else observed.service
        else:
            current = {
                "Deployment": observed.controller,
                "PodDisruptionBudget": observed.pdb,
            }[desired["kind"]]
        if current is None or not _owned_by(current, uid):
            plan.create.append(desired)
        elif not contains(current, desired):
            plan.apply.append(desired)
    plan.delete += pod_deletions

    creations = max(want - len(kept), 0)
    if creations == 0 and want and kept:
        stale = [p for p in kept if _template_hash_of(p) != current_hash]
        if stale and all(pod_ready(p) for p in kept):
            victim = sorted(stale, key=lambda p: _victim_rank(p, spares))[0]
            plan.delete.append(Deletion("Pod", victim["metadata"]["name"], "pod spec changed"))
            kept.remove(victim)
            creations = 1

    next_index = max([int(old_status.get("nextPodIndex", 0))] + [pod_index(p) + 1 for p in pods])
    for _ in range(creations):
        plan.create.append(agent_pod(body, spec, next_index, endpoints, settings, template))
        next_index += 1

    plan.status = build_status(
        spec=spec,
        controller=controller,
        pods=kept,
        old=old_status,
        generation=int(meta.get("generation", 0)),
        now=now,
        desired_pods=want,
        replaced=replaced,
        next_index=next_index,
        suspended=suspended,
        saving=len(victims) + draining if suspended else 0,
    )
    ttl = fields.ttl_seconds_after_finished
    done_at = parse_time(plan.status.get("completionTime"))
    if ttl is not None and done_at is not None and (now - done_at).total_seconds() >= ttl:
        plan.delete.append(
            Deletion(
                "TrainingJob",
                meta["name"],
                f"the job finished at {plan.status['completionTime']} and "
                f"ttlSecondsAfterFinished ({ttl}s) has passed: deleting the TrainingJob",
            )
        )
    plan.events = sync_events(old_status, plan.status, plan.delete)
    return plan


def contains(actual: Any, wanted: Any) -> bool:
    """True when ``actual`` has every field of ``wanted`` with the same value.

    The API server adds defaults (``sessionAffinity``, ``clusterIPs``...); those
    are not differences.  Lists must have the same length and match item by item.
    """
    if isinstance(wanted, dict):
        return isinstance(actual, dict) and all(
            k in actual and contains(actual[k], v) for k, v in wanted.items()
        )
    if isinstance(wanted, list):
        return (
            isinstance(actual, list)
            and len(actual) == len(wanted)
            and all(contains(a, w) for a, w in zip(actual, wanted, strict=True))
        )
    return bool(actual == wanted)


def _owned_by(obj: dict[str, Any], uid: str | None) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return uid is None or any(r.get("uid") == uid for r in refs)


def _within_grace(pod: dict[str, Any], now: datetime) -> bool:
    """A pod being deleted whose grace period has not ended (its agent may still be saving).

    The API server sets ``deletionTimestamp`` to the time of the request plus the
    grace period: the kubelet kills what is left then.  A pod past it whose object
    remains (its node is unreachable) has no agent that could still save.  A
    timestamp that cannot be read counts as within the grace.
    """
    deadline = parse_time((pod.get("metadata") or {}).get("deletionTimestamp"))
    return deadline is None or now < deadline


def _template_hash_of(pod: dict[str, Any]) -> str | None:
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    value = annotations.get(ANN_TEMPLATE_HASH)
    return str(value) if value is not None else None


def _victim_rank(pod: dict[str, Any], spares: set[str]) -> tuple[int, int, int, int]:
    """Sort key: the first pods are the cheapest to lose."""
    name = pod["metadata"]["name"]
    scheduled = bool((pod.get("spec") or {}).get("nodeName"))
    return (
        1 if scheduled else 0,
        1 if pod_ready(pod) else 0,
        0 if name in spares else 1,
        -pod_index(pod),
    )
