"""``kube.py`` (the real Kubernetes client) against an HTTP fake of the API server.

No Kubernetes API server runs on these machines, so :class:`FakeApiServer`
stands in for one: a small threaded HTTP server on 127.0.0.1 that stores
objects in memory and answers the REST paths the operator uses (list with a
label selector, create → 409 AlreadyExists, delete → 404, JSON merge patch,
the status subresource), with injectable errors.  The official ``kubernetes``
client talks to it over real HTTP, so the request paths, content types and
error mapping of :class:`~orchestrator.operator.kube.KubeClient` are what is
tested; the end-to-end test runs the kopf handler functions on top.
"""

from __future__ import annotations

import copy
import json
import logging
import re
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import kopf
import pytest

from orchestrator.operator import handlers
from orchestrator.operator.api import (
    OperatorSettings,
    PermanentOperatorError,
    RetryableOperatorError,
)
from orchestrator.operator.handlers import Runtime
from orchestrator.operator.kube import KubeClient
from orchestrator.process_lifetime import free_port

pytestmark = pytest.mark.unit

_PATH = re.compile(
    r"^/(?:api/v1|apis/(?P<group>[^/]+)/(?P<version>[^/]+))"
    r"(?:/namespaces/(?P<ns>[^/]+))?/(?P<resource>[a-z]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>status))?$"
)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


class FakeApiServer:
    """An in-memory HTTP fake of the Kubernetes API (no real API server runs here)."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.requests: list[tuple[str, str, str]] = []
        self.errors: dict[tuple[str, str], int] = {}
        #: delete pods as a real API server with a kubelet does: a DELETE only sets
        #: ``deletionTimestamp`` (now + the pod's grace period); :meth:`finish_deletion`
        #: is the kubelet reporting the pod gone
        self.graceful_pods = False
        self.clock: Any = lambda: datetime.now(timezone.utc)
        self._lock = threading.Lock()
        self._uid = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> Any:
                length = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(length) or b"null")

            def _handle(self, method: str) -> None:
                url = urlparse(self.path)
                fake.requests.append((method, url.path, self.headers.get("Content-Type", "")))
                code, body = fake.answer(method, url.path, parse_qs(url.query), self._body())
                self._send(code, body)

            def do_GET(self) -> None:
                self._handle("GET")

            def do_POST(self) -> None:
                self._handle("POST")

            def do_PATCH(self) -> None:
                self._handle("PATCH")

            def do_DELETE(self) -> None:
                self._handle("DELETE")

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"

    def put(self, ns: str, resource: str, obj: dict[str, Any]) -> None:
        self.objects[(ns, resource, obj["metadata"]["name"])] = copy.deepcopy(obj)

    def get(self, ns: str, resource: str, name: str) -> dict[str, Any] | None:
        return self.objects.get((ns, resource, name))

    def finish_deletion(self, ns: str, name: str) -> dict[str, Any]:
        """The kubelet is done with a pod being deleted: the object goes."""
        return self.objects.pop((ns, "pods", name))

    def names(self, resource: str) -> list[str]:
        return sorted(n for (_, r, n) in self.objects if r == resource)

    @staticmethod
    def _status(code: int, reason: str, message: str) -> tuple[int, dict[str, Any]]:
        return code, {"kind": "Status", "status": "Failure", "reason": reason, "message": message}

    def answer(
        self, method: str, path: str, query: dict[str, list[str]], body: Any
    ) -> tuple[int, dict[str, Any]]:
        m = _PATH.match(path)
        if not m:
            return self._status(404, "NotFound", f"no route {path}")
        ns, resource, name = m["ns"] or "", m["resource"], m["name"]
        if (method, resource) in self.errors:
            code = self.errors[(method, resource)]
            return self._status(code, "Injected", f"injected {code}")
        with self._lock:
            key = (ns, resource, name or "")
            if method == "GET" and name is None:
                selector = dict(
                    part.split("=", 1)
                    for part in query.get("labelSelector", [""])[0].split(",")
                    if part
                )
                items = [
                    o
                    for (n, r, _), o in sorted(self.objects.items())
                    if n == ns
                    and r == resource
                    and all(
                        o["metadata"].get("labels", {}).get(k) == v for k, v in selector.items()
                    )
                ]
                return 200, {"kind": "List", "items": items}
            if method == "POST":
                key = (ns, resource, body["metadata"]["name"])
                if key in self.objects:
                    return self._status(409, "AlreadyExists", f"{key[2]} already exists")
                self._uid += 1
                obj = copy.deepcopy(body)
                obj["metadata"]["uid"] = f"uid-{self._uid}"
                self.objects[key] = obj
                return 201, obj
            if key not in self.objects:
                return self._status(404, "NotFound", f"{resource} {name} not found")
            if method == "GET":
                return 200, self.objects[key]
            if method == "DELETE":
                if resource == "pods" and self.graceful_pods:
                    pod = self.objects[key]
                    grace = int(pod["spec"].get("terminationGracePeriodSeconds", 30))
                    when = self.clock() + timedelta(seconds=grace)
                    pod["metadata"].setdefault(
                        "deletionTimestamp", when.strftime("%Y-%m-%dT%H:%M:%SZ")
                    )
                    pod["metadata"].setdefault("deletionGracePeriodSeconds", grace)
                    return 200, pod
                return 200, self.objects.pop(key)
            if method == "PATCH":
                current = self.objects[key]
                if m["sub"] == "status":
                    body = {"status": body.get("status")}
                self.objects[key] = merge_patch(current, body)
                return 200, self.objects[key]
        return self._status(405, "MethodNotAllowed", method)

    def __enter__(self) -> FakeApiServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        yield server


@pytest.fixture
def kube(api: FakeApiServer) -> Iterator[KubeClient]:
    client = KubeClient.for_host(api.url)
    try:
        yield client
    finally:
        client.api_client.close()


def pod(name: str, job: str = "demo") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "ml",
            "labels": {"ringmaster.dev/job": job, "ringmaster.dev/role": "agent"},
        },
        "spec": {"containers": [{"name": "agent", "image": "ringmaster:latest"}]},
    }


def test_create_list_and_delete_pods(api: FakeApiServer, kube: KubeClient) -> None:
    kube.create(pod("demo-agent-0"))
    kube.create(pod("demo-agent-1"))
    kube.create(pod("other-agent-0", job="other"))
    kube.create(pod("demo-agent-0"))  # already there: not an error
    observed = kube.list_children("ml", "demo")
    assert [p["metadata"]["name"] for p in observed.pods] == ["demo-agent-0", "demo-agent-1"]
    assert observed.service is None and observed.controller is None and observed.pdb is None
    kube.delete("ml", "Pod", "demo-agent-0")
    kube.delete("ml", "Pod", "demo-agent-0")  # already gone: not an error
    assert api.names("pods") == ["demo-agent-1", "other-agent-0"]
    lists = [p for (m, p, _) in api.requests if m == "GET" and p.endswith("/pods")]
    assert lists == ["/api/v1/namespaces/ml/pods"]


def test_children_are_read_by_name(api: FakeApiServer, kube: KubeClient) -> None:
    meta = {"name": "demo-agents", "namespace": "ml", "labels": {}}
    kube.create({"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": {}})
    controller = {**meta, "name": "demo-controller"}
    kube.create({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": controller, "spec": {}})
    kube.create(
        {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": meta, "spec": {}}
    )
    observed = kube.list_children("ml", "demo")
    assert observed.service is not None and observed.service["metadata"]["name"] == "demo-agents"
    assert observed.controller is not None and observed.pdb is not None
    paths = {p for (m, p, _) in api.requests if m == "POST"}
    assert paths == {
        "/api/v1/namespaces/ml/services",
        "/apis/apps/v1/namespaces/ml/deployments",
        "/apis/policy/v1/namespaces/ml/poddisruptionbudgets",
    }


def test_replace_and_annotate_use_merge_patch(api: FakeApiServer, kube: KubeClient) -> None:
    meta = {"name": "demo-agents", "namespace": "ml", "labels": {"a": "1"}}
    pdb = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": meta}
    kube.create({**pdb, "spec": {"minAvailable": 1}})
    kube.replace({**pdb, "spec": {"minAvailable": 3}})
    stored = api.get("ml", "poddisruptionbudgets", "demo-agents")
    assert stored is not None and stored["spec"]["minAvailable"] == 3
    kube.create(pod("demo-agent-0"))
    kube.annotate_pod("ml", "demo-agent-0", {"ringmaster.dev/zone": "z1"})
    kube.annotate_pod("ml", "gone", {"ringmaster.dev/zone": "z1"})  # vanished pod: ignored
    stored = api.get("ml", "pods", "demo-agent-0")
    assert stored is not None and stored["metadata"]["annotations"] == {"ringmaster.dev/zone": "z1"}
    patches = [ct for (m, _, ct) in api.requests if m == "PATCH"]
    assert patches and all(ct == "application/merge-patch+json" for ct in patches)


def test_nodes_jobs_and_status(api: FakeApiServer, kube: KubeClient) -> None:
    api.put(
        "", "nodes", {"metadata": {"name": "n1", "labels": {"topology.kubernetes.io/zone": "z"}}}
    )
    assert kube.node_labels("n1") == {"topology.kubernetes.io/zone": "z"}
    assert kube.get_training_job("ml", "demo") is None
    api.put("ml", "trainingjobs", {"metadata": {"name": "demo"}, "spec": {}})
    assert kube.get_training_job("ml", "demo") == {"metadata": {"name": "demo"}, "spec": {}}
    kube.patch_status("ml", "demo", {"phase": "Running", "step": 3})
    stored = api.get("ml", "trainingjobs", "demo")
    assert stored is not None and stored["status"] == {"phase": "Running", "step": 3}
    assert ("PATCH", "/apis/ringmaster.dev/v1alpha1/namespaces/ml/trainingjobs/demo/status") in {
        (m, p) for (m, p, _) in api.requests
    }


@pytest.mark.parametrize(
    ("code", "error"),
    [
        (500, RetryableOperatorError),
        (429, RetryableOperatorError),
        (409, RetryableOperatorError),
        (422, PermanentOperatorError),
        (403, PermanentOperatorError),
    ],
)
def test_api_errors_are_sorted_into_retryable_and_permanent(
    api: FakeApiServer, kube: KubeClient, code: int, error: type[Exception]
) -> None:
    api.errors[("POST", "pods")] = code
    with pytest.raises(error, match=str(code)):
        kube.create(pod("demo-agent-0"))


def test_unreachable_api_is_retryable() -> None:
    client = KubeClient.for_host(f"http://127.0.0.1:{free_port()}")
    client.api_client.configuration.retries = 0
    with pytest.raises(RetryableOperatorError, match="unreachable"):
        client.list_children("ml", "demo")


def test_handlers_end_to_end_against_the_http_fake(api: FakeApiServer, kube: KubeClient) -> None:
    """Create a job, lose a pod, see it replaced: the handlers over real HTTP to the fake."""

    class Records:
        def ensure_spec(self, endpoints: tuple[str, ...], spec: Any) -> bool:
            return True

        def read_status(self, endpoints: tuple[str, ...], job: str) -> dict[str, Any] | None:
            return {
                "phase": "Running",
                "active_nodes": ["demo-agent-0"],
                "spare_nodes": ["demo-agent-1"],
            }

        def forget(self, endpoints: tuple[str, ...], job: str) -> None:
            pass

    runtime = Runtime(
        kube=kube, records=Records(), settings=OperatorSettings(etcd_endpoints=("e:2379",))
    )
    memo = kopf.Memo(runtime=runtime)
    job = {
        "apiVersion": "ringmaster.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "demo", "namespace": "ml", "uid": "job-uid", "generation": 1},
        "spec": {"entrypoint": {"script": "train.py"}, "nodes": {"min": 1, "max": 1, "spares": 1}},
    }
    api.put("ml", "trainingjobs", job)
    patch = kopf.Patch()
    handlers.on_spec(body=job, memo=memo, patch=patch, logger=logging.getLogger("t"))
    assert api.names("pods") == ["demo-agent-0", "demo-agent-1"]
    assert api.names("services") == ["demo-agents", "demo-metrics"]
    assert api.names("deployments") == ["demo-controller"]
    kube.patch_status("ml", "demo", patch["status"])

    failed = api.get("ml", "pods", "demo-agent-0")
    assert failed is not None
    failed["status"] = {"phase": "Failed", "reason": "Evicted"}
    handlers.on_agent_pod(
        event={"type": "MODIFIED"}, body=failed, memo=memo, logger=logging.getLogger("t")
    )
    assert api.names("pods") == ["demo-agent-1", "demo-agent-2"]
    stored = api.get("ml", "trainingjobs", "demo")
    assert stored is not None and stored["status"]["replacedPods"] == 1
