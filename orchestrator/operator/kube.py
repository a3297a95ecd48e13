"""The Kubernetes API, for the operator: the only module that imports the client.

:class:`KubeClient` implements :class:`~orchestrator.operator.api.KubeApi` on
the official ``kubernetes`` client.  Objects go in and come out as plain dicts
in the API's own JSON form (camelCase), the same form the reconcile function
reads and writes; responses are read raw (``_preload_content=False``) so no
client model classes leak out.

API errors are sorted for kopf: throttling, conflicts, server errors and lost
connections are :class:`RetryableOperatorError`; a refused object (400, 403,
422) is :class:`PermanentOperatorError`.  Creating an object that already
exists and deleting one that is gone are not errors (another sync did it).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import kubernetes
import urllib3
from kubernetes.client.exceptions import ApiException

from orchestrator.operator.api import (
    API_VERSION,
    GROUP,
    KIND,
    MANAGED_BY,
    PLURAL,
    VERSION,
    JobEvent,
    Observed,
    OperatorError,
    PermanentOperatorError,
    RejectedObjectError,
    RetryableOperatorError,
)
from orchestrator.operator.meta import (
    agent_selector,
    controller_name,
    metrics_service_name,
    pdb_name,
    service_name,
)

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
#: Seconds before an API call gives up (connect, read).
REQUEST_TIMEOUT = (5, 30)


class KubeClient:
    """:class:`~orchestrator.operator.api.KubeApi` on a real (or fake) API server."""

    def __init__(self, api_client: Any) -> None:
        """Args:
        api_client: a configured ``kubernetes.client.ApiClient``.
        """
        self.api_client = api_client
        self.core = kubernetes.client.CoreV1Api(api_client)
        self.apps = kubernetes.client.AppsV1Api(api_client)
        self.policy = kubernetes.client.PolicyV1Api(api_client)
        self.custom = kubernetes.client.CustomObjectsApi(api_client)

    @classmethod
    def from_environment(cls) -> KubeClient:
        """In-cluster config (service account) when running in a pod, else ``~/.kube/config``."""
        try:
            kubernetes.config.load_incluster_config()
        except kubernetes.config.ConfigException:
            try:
                kubernetes.config.load_kube_config()
            except (kubernetes.config.ConfigException, OSError) as e:
                raise PermanentOperatorError(
                    "no Kubernetes credentials: run the operator in a pod with its "
                    f"ServiceAccount, or set KUBECONFIG ({e})"
                ) from e
        return cls(kubernetes.client.ApiClient())

    @classmethod
    def for_host(cls, host: str, token: str | None = None) -> KubeClient:
        """A client for an API server at ``host`` (``http://127.0.0.1:port`` in tests)."""
        config = kubernetes.client.Configuration()
        config.host = host
        if token:
            config.api_key = {"authorization": token}
            config.api_key_prefix = {"authorization": "Bearer"}
        return cls(kubernetes.client.ApiClient(config))

    # -- reads -----------------------------------------------------------------------

    def list_children(self, namespace: str, job: str) -> Observed:
        selector = ",".join(f"{k}={v}" for k, v in agent_selector(job).items())
        pods = _call(
            lambda: self.core.list_namespaced_pod(namespace, label_selector=selector, **_raw())
        )
        return Observed(
            pods=list(pods.get("items") or []),
            service=_maybe(
                lambda: self.core.read_namespaced_service(service_name(job), namespace, **_raw())
            ),
            metrics_service=_maybe(
                lambda: self.core.read_namespaced_service(
                    metrics_service_name(job), namespace, **_raw()
                )
            ),
            controller=_maybe(
                lambda: self.apps.read_namespaced_deployment(
                    controller_name(job), namespace, **_raw()
                )
            ),
            pdb=_maybe(
                lambda: self.policy.read_namespaced_pod_disruption_budget(
                    pdb_name(job), namespace, **_raw()
                )
            ),
        )

    def node_labels(self, node: str) -> dict[str, str]:
        got = _call(lambda: self.core.read_node(node, **_raw()))
        return dict((got.get("metadata") or {}).get("labels") or {})

    def get_training_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return _maybe(
            lambda: self.custom.get_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name, **_raw()
            )
        )

    # -- writes ----------------------------------------------------------------------

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Merge ``status`` into a TrainingJob's status subresource."""
        try:
            _call(
                lambda: self.custom.patch_namespaced_custom_object_status(
                    GROUP,
                    VERSION,
                    namespace,
                    PLURAL,
                    name,
                    {"status": status},
                    _content_type=MERGE_PATCH,
                    **_raw(),
                )
            )
        except _NotFoundError:
            pass

    def create(self, obj: dict[str, Any]) -> None:
        ns = obj["metadata"]["namespace"]
        creators: dict[str, Callable[[], Any]] = {
            "Pod": lambda: self.core.create_namespaced_pod(ns, obj, **_raw()),
            "Service": lambda: self.core.create_namespaced_service(ns, obj, **_raw()),
            "Deployment": lambda: self.apps.create_namespaced_deployment(ns, obj, **_raw()),
            "PodDisruptionBudget": lambda: self.policy.create_namespaced_pod_disruption_budget(
                ns, obj, **_raw()
            ),
        }
        try:
            _call(creators[obj["kind"]])
        except _AlreadyExistsError:
            pass

    def replace(self, obj: dict[str, Any]) -> None:
        """Merge-patch ``obj`` onto the live object (the fields the operator owns)."""
        ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        patch = {"metadata": {"labels": obj["metadata"].get("labels", {})}, "spec": obj["spec"]}
        patchers: dict[str, Callable[[], Any]] = {
            "Service": lambda: self.core.patch_namespaced_service(
                name, ns, patch, _content_type=MERGE_PATCH, **_raw()
            ),
            "Deployment": lambda: self.apps.patch_namespaced_deployment(
                name, ns, patch, _content_type=MERGE_PATCH, **_raw()
            ),
            "PodDisruptionBudget": lambda: self.policy.patch_namespaced_pod_disruption_budget(
                name, ns, patch, _content_type=MERGE_PATCH, **_raw()
            ),
        }
        _call(patchers[obj["kind"]])

    def delete(self, namespace: str, kind: str, name: str) -> None:
        deleters: dict[str, Callable[[], Any]] = {
            "Pod": lambda: self.core.delete_namespaced_pod(name, namespace, **_raw()),
            "Service": lambda: self.core.delete_namespaced_service(name, namespace, **_raw()),
            "Deployment": lambda: self.apps.delete_namespaced_deployment(name, namespace, **_raw()),
            "PodDisruptionBudget": lambda: self.policy.delete_namespaced_pod_disruption_budget(
                name, namespace, **_raw()
            ),
            KIND: lambda: self.custom.delete_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name, **_raw()
            ),
        }
        try:
            _call(deleters[kind])
        except _NotFoundError:
            pass

    def post_event(self, job: dict[str, Any], event: JobEvent) -> None:
        """A core/v1 Event about the TrainingJob ``job``; a failure is logged, not raised."""
        meta = job.get("metadata") or {}
        ns = meta.get("namespace", "default")
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{meta.get('name')}.{uuid.uuid4().hex[:16]}", "namespace": ns},
            "involvedObject": {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "name": meta.get("name"),
                "namespace": ns,
                "uid": meta.get("uid"),
            },
            "type": event.type,
            "reason": event.reason,
            "message": event.message[:1024],
            "source": {"component": MANAGED_BY},
            "reportingComponent": MANAGED_BY,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            _call(lambda: self.core.create_namespaced_event(ns, body, **_raw()))
        except OperatorError as e:
            log.warning("could not post event %s on %s: %s", event.reason, meta.get("name"), e)

    def annotate_pod(
        self,
        namespace: str,
        name: str,
        annotations: dict[str, str],
        labels: dict[str, str] | None = None,
    ) -> None:
        body: dict[str, Any] = {"metadata": {"annotations": annotations}}
        if labels:
            body["metadata"]["labels"] = labels
        try:
            _call(
                lambda: self.core.patch_namespaced_pod(
                    name, namespace, body, _content_type=MERGE_PATCH, **_raw()
                )
            )
        except _NotFoundError:
            pass


# --------------------------------------------------------------------------- plumbing


class _NotFoundError(RetryableOperatorError):
    """404 (callers that expect it catch it)."""


class _AlreadyExistsError(RetryableOperatorError):
    """409 on create (callers that expect it catch it)."""


def _raw() -> dict[str, Any]:
    return {"_preload_content": False, "_request_timeout": REQUEST_TIMEOUT}


def _call(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run one API call and decode its JSON body; sort failures into the two error kinds."""
    try:
        resp = fn()
    except ApiException as e:
        raise _api_error(e) from e
    except (urllib3.exceptions.HTTPError, OSError) as e:
        raise RetryableOperatorError(f"Kubernetes API unreachable: {e}") from e
    data = resp.data if hasattr(resp, "data") else resp
    if isinstance(data, bytes | str):
        return dict(json.loads(data or b"{}"))
    return dict(data or {})


def _maybe(fn: Callable[[], Any]) -> dict[str, Any] | None:
    try:
        return _call(fn)
    except _NotFoundError:
        return None


def _api_error(e: ApiException) -> Exception:
    reason = _reason(e)
    status = int(e.status or 0)
    if status == 404:
        return _NotFoundError(f"not found: {reason}")
    if status == 409 and "AlreadyExists" in reason:
        return _AlreadyExistsError(reason)
    if status in (400, 422):
        return RejectedObjectError(f"the Kubernetes API refused it ({status}): {reason}")
    if status == 403:
        return PermanentOperatorError(f"the Kubernetes API refused it ({status}): {reason}")
    return RetryableOperatorError(f"Kubernetes API error {status}: {reason}")


def _reason(e: ApiException) -> str:
    try:
        body = json.loads(e.body or "{}")
    except (TypeError, ValueError):
        return str(e.reason or e)
    return f"{body.get('reason', e.reason)}: {body.get('message', '')}".strip(": ")
