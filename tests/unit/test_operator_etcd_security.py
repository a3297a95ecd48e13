"""The operator gives job pods etcd TLS and credentials through Secrets, and runs them locked down.

With ``RINGMASTER_ETCD_TLS_SECRET`` / ``RINGMASTER_ETCD_PASSWORD_SECRET`` on
the operator, every agent pod and the controller mount the TLS Secret
read-only and get the password through ``secretKeyRef``: never as a literal
in a rendered object, never on a command line.  Every rendered pod runs as
non-root with a read-only root filesystem and no capabilities, and stays
valid Kubernetes.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

import kubernetes_validate
import pytest

from orchestrator.operator.api import Observed, OperatorSettings
from orchestrator.operator.etcd_access import TLS_DIR
from orchestrator.operator.probe import options_from_env
from orchestrator.operator.reconcile import reconcile
from orchestrator.operator.runner import etcd_base_options
from tests.unit.test_operator_reconcile import job

pytestmark = pytest.mark.unit

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
OPERATOR_PASSWORD = "operator-own-Pw-9e2c"
ENV = {
    "RINGMASTER_ETCD": "etcd-0:2379,etcd-1:2379",
    "RINGMASTER_ETCD_CA": "/etc/operator-tls/ca.crt",
    "RINGMASTER_ETCD_CERT": "/etc/operator-tls/tls.crt",
    "RINGMASTER_ETCD_KEY": "/etc/operator-tls/tls.key",
    "RINGMASTER_ETCD_USER": "trainer",
    "RINGMASTER_ETCD_PASSWORD": OPERATOR_PASSWORD,
    "RINGMASTER_ETCD_TLS_SECRET": "etcd-client-tls",
    "RINGMASTER_ETCD_PASSWORD_SECRET": "etcd-auth",
}
SETTINGS = OperatorSettings.from_env(ENV)


def pods(body: dict[str, Any], settings: OperatorSettings = SETTINGS) -> list[dict[str, Any]]:
    """Pod specs of every agent pod and of the controller Deployment."""
    plan = reconcile(body, Observed(), None, settings, NOW)
    out = [o["spec"] for o in plan.create if o["kind"] == "Pod"]
    out += [o["spec"]["template"]["spec"] for o in plan.create if o["kind"] == "Deployment"]
    assert len(out) == 5
    return out


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container["env"]}


def test_settings_from_the_environment_hide_the_password() -> None:
    assert SETTINGS.etcd_tls_secret == "etcd-client-tls"
    assert SETTINGS.etcd_password_secret == "etcd-auth"
    assert SETTINGS.etcd_password_key == "password"
    assert OPERATOR_PASSWORD not in repr(SETTINGS)


def test_the_operator_uses_its_own_tls_and_credentials_for_etcd() -> None:
    base = etcd_base_options(SETTINGS)
    assert base.endpoints == ("etcd-0:2379", "etcd-1:2379")
    assert (base.ca_cert, base.cert, base.key) == (
        "/etc/operator-tls/ca.crt",
        "/etc/operator-tls/tls.crt",
        "/etc/operator-tls/tls.key",
    )
    assert (base.user, base.password) == ("trainer", OPERATOR_PASSWORD)
    assert OPERATOR_PASSWORD not in repr(base)


def test_every_pod_mounts_the_tls_secret_and_takes_the_password_from_a_secret() -> None:
    for spec in pods(job()):
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["etcd-tls"]["secret"] == {
            "secretName": "etcd-client-tls",
            "defaultMode": 0o440,
        }
        (container,) = spec["containers"]
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["etcd-tls"] == {"name": "etcd-tls", "mountPath": TLS_DIR, "readOnly": True}
        env = env_of(container)
        assert env["RINGMASTER_ETCD_CA"]["value"] == f"{TLS_DIR}/ca.crt"
        assert env["RINGMASTER_ETCD_CERT"]["value"] == f"{TLS_DIR}/tls.crt"
        assert env["RINGMASTER_ETCD_KEY"]["value"] == f"{TLS_DIR}/tls.key"
        assert env["RINGMASTER_ETCD_USER"]["value"] == "trainer"
        assert env["RINGMASTER_ETCD_PASSWORD"] == {
            "name": "RINGMASTER_ETCD_PASSWORD",
            "valueFrom": {"secretKeyRef": {"name": "etcd-auth", "key": "password"}},
        }
        # the group can read the mounted key files
        assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsUser"]


def test_no_password_is_ever_rendered() -> None:
    plan = reconcile(job(), Observed(), None, SETTINGS, NOW)
    assert OPERATOR_PASSWORD not in json.dumps(plan.create)
    for spec in pods(job()):
        for c in spec["containers"]:
            assert "--etcd-password" not in c["command"]


def test_paths_a_job_gives_win_over_the_secret() -> None:
    body = job(rendezvous={"tls": {"ca_cert": "/job/ca.pem"}, "user": "job-user"})
    for spec in pods(body):
        env = env_of(spec["containers"][0])
        assert env["RINGMASTER_ETCD_CA"]["value"] == "/job/ca.pem"
        assert "RINGMASTER_ETCD_CERT" not in env
        assert env["RINGMASTER_ETCD_USER"]["value"] == "job-user"


@pytest.mark.parametrize("by", ["env", "envFrom"])
def test_a_jobs_password_env_wins_over_the_operators_secret(by: str) -> None:
    """The job's pods read the password from the variable the job names (its pod
    template sets it, by name or through envFrom), through RINGMASTER_ETCD_PASSWORD_ENV,
    which the agent's and the controller's etcd options and the probes follow
    (tests/integration/test_security_etcd.py).  The controller's container, which gets
    none of the template's other env, gets where the variable comes from."""
    secret = {"secretKeyRef": {"name": "job-etcd", "key": "password"}}
    agent: dict[str, Any] = {"name": "agent"}
    if by == "env":
        agent["env"] = [{"name": "JOB_ETCD_PASSWORD", "valueFrom": secret}]
    else:
        agent["envFrom"] = [{"secretRef": {"name": "job-etcd"}}]
    body = job(
        rendezvous={"user": "job-user", "password_env": "JOB_ETCD_PASSWORD"},
        template={"spec": {"containers": [agent]}},
    )
    for spec in pods(body):
        (container,) = spec["containers"]
        env = env_of(container)
        assert env["RINGMASTER_ETCD_PASSWORD_ENV"]["value"] == "JOB_ETCD_PASSWORD"
        assert "RINGMASTER_ETCD_PASSWORD" not in env
        assert env["RINGMASTER_ETCD_USER"]["value"] == "job-user"
        if by == "env":
            assert env["JOB_ETCD_PASSWORD"]["valueFrom"] == secret, container["name"]
        else:
            assert {"secretRef": {"name": "job-etcd"}} in container["envFrom"], container["name"]
    probe_env = {"RINGMASTER_ETCD": "e:2379", "RINGMASTER_ETCD_PASSWORD_ENV": "JOB_ETCD_PASSWORD"}
    assert options_from_env({**probe_env, "JOB_ETCD_PASSWORD": "pw"}).password == "pw"


def test_without_secrets_nothing_is_added() -> None:
    plain = OperatorSettings(etcd_endpoints=("etcd-0:2379",))
    for spec in pods(job(), plain):
        assert "etcd-tls" not in {v["name"] for v in spec["volumes"]}
        assert not {n for n in env_of(spec["containers"][0]) if n.startswith("RINGMASTER_ETCD_")}


@pytest.mark.parametrize("settings", [SETTINGS, OperatorSettings(etcd_endpoints=("e:2379",))])
def test_every_rendered_pod_is_non_root_and_locked_down(settings: OperatorSettings) -> None:
    for spec in pods(job(resources={"gpus": 1}), settings):
        ctx = spec["securityContext"]
        assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] != 0
        assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["automountServiceAccountToken"] is False
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"] == {"drop": ["ALL"]}
            assert not sc.get("privileged")
            # writable places are volumes, never the image
            writable = {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")}
            assert writable <= {"/tmp", "/dev/shm"}
    plan = reconcile(job(resources={"gpus": 1}), Observed(), None, settings, NOW)
    for obj in plan.create:
        kubernetes_validate.validate(obj, "1.37.0", strict=True)
