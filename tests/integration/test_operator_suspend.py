"""``spec.suspend`` end to end without Kubernetes: the operator's own sync, real processes.

No Kubernetes API server can run on these machines.  Here the operator's
:func:`~orchestrator.operator.handlers.sync_job` (spec to etcd, reconcile,
carry out the plan, status) runs against :class:`ProcessKube`, a stand-in for
the API server *and* the kubelet: an agent pod it is asked to create is a real
``ringmaster agent`` process registered under the pod's name, the controller
Deployment at one replica is a real ``ringmaster controller --job`` process,
and deleting a pod runs the pod's preStop hook as the kubelet would, a new
process (:func:`orchestrator.operator.probe.drain`: SIGTERM to the agent, PID 1
of its container, here its pid; then wait for it to deregister), the pod
staying "terminating" until the agent exits or its grace period ends.
Scaling the Deployment to zero SIGTERMs the controller at once.
The job's records are in a private etcd (controllers elect one leader per
etcd), read and written by the operator's real :class:`EtcdJobRecords`.

The story: the job trains; ``suspend: true`` makes every agent save a
checkpoint of the step it is at (the controller must still be there to relay
their checkpoint request to the workers) and leave; the controller goes once
they are gone, and the phase it last wrote is not terminal; ``suspend: false``
brings new pods and a new controller, and the job goes on from that
checkpoint to the end, with the parameters of an uninterrupted run.
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import torch

from orchestrator.etcd.client import EtcdClient, connect
from orchestrator.etcd.embedded import EmbeddedEtcd
from orchestrator.etcd.options import EtcdOptions
from orchestrator.operator.api import JobEvent, Observed, OperatorSettings
from orchestrator.operator.handlers import Runtime, sync_job
from orchestrator.operator.records import EtcdJobRecords
from orchestrator.operator.status import rfc3339
from orchestrator.state import jobs, keys, records
from orchestrator.state.records import CheckpointRecord
from tests.chaos.jobs import REPO, assert_exactly_once, step_log
from tests.chaos.tiny_by_hand import tiny_final
from tests.faults.processes import Services

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

# long enough that the agents still training after the suspend checkpoint (at most
# preemptionGrace) cannot reach the end
STEPS = 350
STEP_TIME = 0.02
SUSPEND_AT = 25
JOB = "suspend"
NAMESPACE = "ml"


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    """Final parameters of an uninterrupted run of the same job (computed here)."""
    return tiny_final(STEPS)


def training_job(tmp: Path, endpoint: str) -> dict[str, Any]:
    """The TrainingJob: tiny_job's job in camelCase, no periodic checkpoints."""
    (tmp / "steps").mkdir(exist_ok=True)
    return {
        "apiVersion": "ringmaster.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": JOB, "namespace": NAMESPACE, "uid": "uid-1", "generation": 1},
        "spec": {
            "entrypoint": {
                "script": str(REPO / "examples" / "train_tiny.py"),
                "args": [
                    "--step-time",
                    str(STEP_TIME),
                    "--out",
                    str(tmp / "final.pt"),
                    "--step-log",
                    str(tmp / "steps"),
                ],
                "env": {"RINGMASTER_LOG_EVERY": "1000"},
            },
            "nodes": {"min": 2, "max": 2, "spares": 1},
            "maxSteps": STEPS,
            # the only checkpoint the job gets is the one suspending it asks for
            "checkpoint": {"url": f"file://{tmp}/ckpt", "everySteps": 0},
            "faultTolerance": {
                "hangTimeout": "30s",
                "heartbeatInterval": "500ms",
                "preemptionGrace": "5s",
            },
            "rendezvous": {"endpoints": [endpoint]},
        },
        "status": {},
    }


class ProcessKube:
    """The operator's :class:`~orchestrator.operator.api.KubeApi`, with processes for pods.

    See the module docstring.  Pod ``status.phase`` is ``Running`` (``Ready``)
    while the agent runs, ``Succeeded`` / ``Failed`` by its exit code; a
    deleted pod carries ``deletionTimestamp`` (now + its grace period, as the
    API server sets it) until its agent has exited, then it is gone.
    """

    def __init__(self, services: Services) -> None:
        self.services = services
        self.pods: dict[str, dict[str, Any]] = {}
        self.others: dict[tuple[str, str], dict[str, Any]] = {}
        self.events: list[JobEvent] = []
        self.controllers = 0  # controller processes started
        self.log: list[str] = []  # what the "cluster" did, in order
        self.hooks: list[subprocess.Popen[bytes]] = []  # preStop hooks run

    # -- processes ---------------------------------------------------------------------

    def _proc(self, name: str) -> subprocess.Popen[bytes] | None:
        return self.services.procs.get(name)

    def _alive(self, name: str) -> bool:
        proc = self._proc(name)
        return proc is not None and proc.poll() is None

    @property
    def controller_name(self) -> str:
        return f"controller.{self.controllers}"

    def controller_running(self) -> bool:
        return self.controllers > 0 and self._alive(self.controller_name)

    def _start_agent(self, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        command = pod["spec"]["containers"][0]["command"]
        args = command[command.index("ringmaster") + 1 :]  # `agent --job J --etcd E`
        env = {"RINGMASTER_NODE": name, "RINGMASTER_LABELS": f"zone=z,rack=r,host={name}"}
        self.services.start(name, args, env=env)
        self.log.append(f"start {name}")

    def _sync_controller(self) -> None:
        deployment = self.others.get(("Deployment", f"{JOB}-controller"))
        want = int(deployment["spec"]["replicas"]) if deployment else 0
        if want and not self.controller_running():
            command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
            args = command[1:]  # `controller --job J --etcd E --metrics-port 9400 ...`
            args[args.index("--metrics-port") + 1] = "0"  # any free port here
            self.controllers += 1
            self.services.start(self.controller_name, args)
            self.log.append("start controller")
        elif not want and self.controller_running():
            self.log.append("stop controller")
            proc = self._proc(self.controller_name)
            assert proc is not None
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)

    # -- KubeApi -----------------------------------------------------------------------

    def list_children(self, namespace: str, job: str) -> Observed:
        now = time.time()
        observed = Observed(
            service=self.others.get(("Service", f"{job}-agents")),
            metrics_service=self.others.get(("Service", f"{job}-metrics")),
            controller=self.others.get(("Deployment", f"{job}-controller")),
            pdb=self.others.get(("PodDisruptionBudget", f"{job}-agents")),
        )
        for name, pod in list(self.pods.items()):
            proc = self._proc(name)
            deleting = pod["metadata"].get("_deadline")
            if proc is not None and proc.poll() is None and deleting and now > deleting:
                self.services.signal(name, signal.SIGKILL)  # the kubelet, after the grace
                proc.wait(10)
            code = proc.poll() if proc is not None else None
            if deleting and code is not None:
                del self.pods[name]  # the kubelet is done with it: the API object goes
                self.log.append(f"gone {name} (exit {code})")
                continue
            view = copy.deepcopy(pod)
            view["metadata"].pop("_deadline", None)
            view["spec"]["nodeName"] = "local"
            if code is None:
                view["status"] = {
                    "phase": "Running",
                    "conditions": [{"type": "Ready", "status": "True"}],
                }
            else:
                view["status"] = {"phase": "Succeeded" if code == 0 else "Failed"}
            observed.pods.append(view)
        return observed

    def create(self, obj: dict[str, Any]) -> None:
        obj = copy.deepcopy(obj)
        name = obj["metadata"]["name"]
        if obj["kind"] == "Pod":
            self.pods[name] = obj
            self._start_agent(obj)
            return
        self.others[obj["kind"], name] = obj
        if obj["kind"] == "Deployment":
            self._sync_controller()

    def replace(self, obj: dict[str, Any]) -> None:
        self.create(obj)

    def delete(self, namespace: str, kind: str, name: str) -> None:
        if kind != "Pod":
            self.others.pop((kind, name), None)
            return
        pod = self.pods.get(name)
        if pod is None or pod["metadata"].get("deletionTimestamp"):
            return
        grace = int(pod["spec"]["terminationGracePeriodSeconds"])
        pod["metadata"]["deletionTimestamp"] = rfc3339(
            datetime.now(timezone.utc) + timedelta(seconds=grace)
        )
        pod["metadata"]["_deadline"] = time.time() + grace
        self.log.append(f"delete {name}")
        proc = self._proc(name)
        if proc is not None and proc.poll() is None:
            self._pre_stop(pod, proc.pid)

    def _pre_stop(self, pod: dict[str, Any], agent_pid: int) -> None:
        """Run the pod's preStop hook as the kubelet does: a new process in the "container"
        (``python -m orchestrator.operator.probe drain``, with the container's environment),
        here told the agent's pid in place of PID 1."""
        container = pod["spec"]["containers"][0]
        env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        env["RINGMASTER_NODE"] = pod["metadata"]["name"]
        script = (
            "import sys; from orchestrator.operator import probe; "
            "probe.AGENT_PID = int(sys.argv[1]); sys.exit(probe.main(['drain']))"
        )
        self.hooks.append(
            subprocess.Popen(
                [sys.executable, "-c", script, str(agent_pid)],
                cwd=REPO,
                env={**os.environ, **env},
            )
        )

    def node_labels(self, node: str) -> dict[str, str]:
        return {}

    def annotate_pod(
        self,
        namespace: str,
        name: str,
        annotations: dict[str, str],
        labels: dict[str, str] | None = None,
    ) -> None:
        pass

    def get_training_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return None

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        pass

    def post_event(self, job: dict[str, Any], event: JobEvent) -> None:
        self.events.append(event)


class Operator:
    """Runs the operator's sync of one TrainingJob over and over, as its timer and pod
    events would, keeping the status it writes on the body."""

    def __init__(self, runtime: Runtime, body: dict[str, Any], lines: list[str]) -> None:
        self.runtime = runtime
        self.body = body
        self.lines = lines

    def sync(self) -> dict[str, Any]:
        status = sync_job(self.runtime, self.body)
        self.body["status"] = {k: v for k, v in status.items() if v is not None}
        return status

    def until(self, what: str, check: Callable[[dict[str, Any]], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if check(self.sync()):
                return
            time.sleep(0.2)
        tail = "\n".join(self.lines[-60:])
        raise AssertionError(
            f"timed out after {timeout:g}s waiting for {what}\n"
            f"status: {self.body.get('status')}\n{tail}"
        )


def _checkpoint(client: EtcdClient) -> CheckpointRecord | None:
    return records.read(client, keys.job_checkpoint(JOB), CheckpointRecord)


def test_suspend_saves_the_step_it_is_at_and_resume_goes_on_from_it(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    lines: list[str] = []
    with (
        EmbeddedEtcd() as etcd,
        Services(lines) as services,
        connect(EtcdOptions((etcd.endpoint,))) as client,
    ):
        kube = ProcessKube(services)
        job_records = EtcdJobRecords()
        runtime = Runtime(
            kube=kube,
            records=job_records,
            settings=OperatorSettings(etcd_endpoints=(etcd.endpoint,)),
        )
        operator = Operator(runtime, training_job(tmp_path, etcd.endpoint), lines)
        try:
            # -- the job trains ------------------------------------------------------
            operator.until(
                f"step {SUSPEND_AT}",
                lambda s: s["phase"] == "Running" and s["step"] >= SUSPEND_AT,
                90,
            )
            assert _checkpoint(client) is None, "a checkpoint before suspending"

            # -- suspend: every pod saves and leaves; the controller goes after them ---
            operator.body["spec"]["suspend"] = True
            operator.body["metadata"]["generation"] = 2
            first = operator.sync()
            suspended_at = int(first["step"])
            assert first["phase"] == "Suspended", first
            assert kube.controller_running(), "the controller went with the pods: " + str(kube.log)
            operator.until(
                "every pod and the controller to be gone",
                lambda s: not kube.pods and not kube.controller_running(),
                60,
            )
            for hook in kube.hooks:
                hook.wait(30)
            saved = _checkpoint(client)
            assert saved is not None, "suspending saved no checkpoint\n" + "\n".join(lines[-60:])
            # the state the job had when it was suspended is in a checkpoint: no agent
            # leaves before one is committed after its SIGTERM, so the first to leave
            # saw one of at least that step.  (Later ones may wait out their grace: once
            # the first has left, the group re-forms without it.)
            assert suspended_at <= saved.step < STEPS, (saved, suspended_at)
            left = [ln for ln in lines if "] leaving: " in ln]
            assert len(left) == 3, "\n".join(lines[-60:])
            assert "leaving: preempted; checkpoint committed" in left[0], "\n".join(lines[-60:])
            # the controller went only after the last pod
            order = kube.log
            last_gone = max(i for i, e in enumerate(order) if e.startswith("gone "))
            assert order.index("stop controller") > last_gone, order
            status = jobs.read_status(client, JOB)
            assert status is not None and not status.phase.terminal, status
            assert operator.body["status"]["phase"] == "Suspended"
            reasons = [e.reason for e in kube.events]
            assert "Suspended" in reasons and "Checkpoint" in reasons, reasons
            assert "NodeFailed" not in reasons and "Recovered" not in reasons, kube.events
            (tmp_path / "final.pt").unlink(missing_ok=True)
            before = set(step_log(tmp_path))

            # -- resume: new pods, a new controller, on from the checkpoint -------------
            operator.body["spec"]["suspend"] = False
            operator.body["metadata"]["generation"] = 3
            operator.until("the end of the job", lambda s: s["phase"] == "Succeeded", 120)
            assert kube.controllers == 2, kube.log
            assert sorted(kube.pods) == [f"{JOB}-agent-{i}" for i in range(3, 6)], kube.pods
        finally:
            job_records.close()
            for hook in kube.hooks:
                if hook.poll() is None:
                    hook.kill()
                    hook.wait()

    text = "\n".join(lines[-60:])
    resumed = {w: s for w, s in step_log(tmp_path).items() if w not in before}
    assert resumed and all(seq[0] == saved.step for seq in resumed.values() if seq), (
        saved,
        resumed,
        text,
    )
    assert_exactly_once(tmp_path, STEPS)
    assert_same_params(torch.load(tmp_path / "final.pt"), reference)
    assert "Resumed" in [e.reason for e in kube.events]


def assert_same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-6, atol=1e-7), f"{k} differs"
