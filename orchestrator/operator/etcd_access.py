"""How the pods of a job reach etcd: TLS files from a Secret, the password from a Secret.

The operator never reads Secrets itself (its RBAC has no access to them): it
names them in the pods it renders and the kubelet does the rest.

* TLS: with ``OperatorSettings.etcd_tls_secret`` the Secret is mounted
  read-only at :data:`TLS_DIR` and ``RINGMASTER_ETCD_CA`` / ``_CERT`` / ``_KEY``
  point at its ``ca.crt`` / ``tls.crt`` / ``tls.key``.  Paths a job gives in
  ``rendezvous.tls`` win over the Secret's (a job with its own etcd).
* User: ``rendezvous.user`` of the job, else the operator's ``etcd_user``.
* Password: with ``etcd_password_secret`` it reaches the container as
  ``RINGMASTER_ETCD_PASSWORD`` through ``secretKeyRef``, never as a literal in
  the pod spec or on a command line.  A job's ``rendezvous.password_env`` wins:
  it names a variable the job's pod template sets (from a Secret of its own),
  and reaches the container as ``RINGMASTER_ETCD_PASSWORD_ENV``, which the
  agent and the controller read it through.
"""

from __future__ import annotations

import copy
from typing import Any

from orchestrator.etcd.options import PASSWORD_ENV_VARIABLE
from orchestrator.operator.api import OperatorSettings
from orchestrator.operator.template import AGENT_CONTAINER, env_var
from orchestrator.operator.trainingjob import PodTemplate
from orchestrator.spec.job import JobSpec

#: Where the etcd TLS Secret is mounted in agent and controller pods.
TLS_DIR = "/etc/ringmaster/etcd-tls"
#: Name of the volume that holds it.
TLS_VOLUME = "etcd-tls"
#: Owner and group may read; the pods' fsGroup makes the group the pod's user.
TLS_FILE_MODE = 0o440


def etcd_env(spec: JobSpec, settings: OperatorSettings | None) -> list[dict[str, Any]]:
    """``RINGMASTER_ETCD_*`` variables for a container (the endpoints are set elsewhere)."""
    tls = spec.rendezvous.tls
    secret = settings.etcd_tls_secret if settings else ""
    from_secret = bool(secret) and not (tls.ca_cert or tls.cert or tls.key)
    values = (
        ("RINGMASTER_ETCD_CA", tls.ca_cert or (f"{TLS_DIR}/ca.crt" if from_secret else None)),
        ("RINGMASTER_ETCD_CERT", tls.cert or (f"{TLS_DIR}/tls.crt" if from_secret else None)),
        ("RINGMASTER_ETCD_KEY", tls.key or (f"{TLS_DIR}/tls.key" if from_secret else None)),
        (
            "RINGMASTER_ETCD_USER",
            spec.rendezvous.user or (settings.etcd_user if settings else None),
        ),
    )
    env: list[dict[str, Any]] = [{"name": n, "value": v} for n, v in values if v]
    if spec.rendezvous.password_env:  # a variable of the pod template's (its own Secret)
        env.append({"name": PASSWORD_ENV_VARIABLE, "value": spec.rendezvous.password_env})
    elif settings and settings.etcd_password_secret:
        ref = {"name": settings.etcd_password_secret, "key": settings.etcd_password_key}
        env.append({"name": "RINGMASTER_ETCD_PASSWORD", "valueFrom": {"secretKeyRef": ref}})
    return env


def etcd_volumes(settings: OperatorSettings | None) -> list[dict[str, Any]]:
    """The Secret volume for etcd TLS, when one is configured."""
    if not settings or not settings.etcd_tls_secret:
        return []
    return [
        {
            "name": TLS_VOLUME,
            "secret": {"secretName": settings.etcd_tls_secret, "defaultMode": TLS_FILE_MODE},
        }
    ]


def etcd_mounts(settings: OperatorSettings | None) -> list[dict[str, Any]]:
    """Where :func:`etcd_volumes` appear in the container (read-only)."""
    if not settings or not settings.etcd_tls_secret:
        return []
    return [{"name": TLS_VOLUME, "mountPath": TLS_DIR, "readOnly": True}]


def password_source(template: PodTemplate, name: str | None) -> dict[str, list[dict[str, Any]]]:
    """Where the template's agent container gets the variable ``name`` from (the job's
    ``rendezvous.password_env``), for the controller's container, which gets nothing
    else of the template's env: ``{"env": [...], "envFrom": [...]}``, each left out
    when empty.  The variable's own entry where the template sets it by name, else the
    agent container's ``envFrom`` (a Secret or ConfigMap whose keys may hold it)."""
    if not name:
        return {}
    agent = [c for c in template.spec.containers if c.name == AGENT_CONTAINER]
    named = [env_var(v) for c in agent for v in c.env if v.name == name]
    if named:
        return {"env": named[:1]}
    sources = [copy.deepcopy(e) for c in agent for e in c.env_from]
    return {"envFrom": sources} if sources else {}
