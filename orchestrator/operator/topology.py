"""Topology labels for agent pods: from the Node's labels to a file the agent reads.

The downward API cannot expose a Node's labels to a pod, so the operator
(which has RBAC to ``get`` nodes) looks up the Node an agent pod was
scheduled to and writes its zone, rack and host into the pod's annotations.
The pod mounts its annotations as a downward-API file
(``RINGMASTER_TOPOLOGY_FILE``); the kubelet refreshes that file when the
annotations change.  The operator writes ``ringmaster.dev/topology-ready:
"true"`` last, even for a Node without zone or rack labels, so the agent
knows when to stop waiting.

The same values become pod *labels* (``ringmaster.dev/zone``, ``/rack``,
``/host``; :func:`topology_labels`), so ``kubectl get pods -L
ringmaster.dev/rack`` shows where each agent runs.  The host is the Node's
well-known ``kubernetes.io/hostname`` label (its name when it has none).

The agent side is :func:`read_topology`; it needs no Kubernetes client.
``python -m orchestrator.operator.topology`` prints the labels in the form
``ringmaster agent --labels`` takes (``host=...,zone=...,rack=...``); the agent
pod's launch script puts that into ``RINGMASTER_LABELS``.
"""

from __future__ import annotations

import ast
import os
import re
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from orchestrator.operator.api import (
    ANN_HOST,
    ANN_RACK,
    ANN_TOPOLOGY_READY,
    ANN_ZONE,
    HOSTNAME_LABEL,
    LABEL_HOST,
    LABEL_RACK,
    LABEL_ZONE,
    OperatorSettings,
)
from orchestrator.settings import SETTINGS

#: How long :func:`read_topology` waits for the operator's annotations by default.
DEFAULT_TOPOLOGY_WAIT = SETTINGS.topology_wait


def needs_topology(pod: dict[str, Any]) -> bool:
    """True for a scheduled pod whose topology annotations are not written yet."""
    node = (pod.get("spec") or {}).get("nodeName")
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    return bool(node) and annotations.get(ANN_TOPOLOGY_READY) != "true"


def topology_annotations(
    node: str, node_labels: dict[str, str], settings: OperatorSettings
) -> dict[str, str]:
    """The annotations to write on a pod scheduled to ``node`` with ``node_labels``."""

    def first(keys: tuple[str, ...]) -> str | None:
        return next((node_labels[k] for k in keys if node_labels.get(k)), None)

    out = {ANN_HOST: node}
    zone = first(settings.zone_labels)
    rack = first(settings.rack_labels)
    if zone:
        out[ANN_ZONE] = zone
    if rack:
        out[ANN_RACK] = rack
    out[ANN_TOPOLOGY_READY] = "true"
    return out


_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?\Z")


def topology_labels(
    node: str, node_labels: dict[str, str], settings: OperatorSettings
) -> dict[str, str]:
    """Pod labels with the node's zone, rack and host (values that are not valid labels skipped)."""
    found = topology_annotations(node, node_labels, settings)
    host = node_labels.get(HOSTNAME_LABEL) or node
    values = {LABEL_ZONE: found.get(ANN_ZONE), LABEL_RACK: found.get(ANN_RACK), LABEL_HOST: host}
    return {k: v for k, v in values.items() if v and len(v) <= 63 and _LABEL_VALUE.match(v)}


def parse_downward_file(text: str) -> dict[str, str]:
    """Parse a downward-API labels/annotations file (``key="value"`` per line)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, raw = line.partition("=")
        if not sep or not key.strip():
            continue
        raw = raw.strip()
        try:
            value = ast.literal_eval(raw) if raw.startswith('"') else raw
        except (ValueError, SyntaxError):
            value = raw.strip('"')
        out[key.strip()] = str(value)
    return out


def read_topology(
    path: str | Path,
    timeout: timedelta = DEFAULT_TOPOLOGY_WAIT,
    poll: timedelta = timedelta(seconds=1),
) -> dict[str, str]:
    """The pod's topology labels (``zone``, ``rack``, ``host``), for the agent to register.

    Waits up to ``timeout`` for the operator to mark the file ready; returns what
    is there when the time is up (possibly only nothing), so a missing operator
    never blocks an agent for good.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    found: dict[str, str] = {}
    while True:
        try:
            found = parse_downward_file(Path(path).read_text(encoding="utf-8"))
        except OSError:
            found = {}
        if found.get(ANN_TOPOLOGY_READY) == "true" or time.monotonic() >= deadline:
            break
        time.sleep(poll.total_seconds())
    names = {ANN_ZONE: "zone", ANN_RACK: "rack", ANN_HOST: "host"}
    return {label: found[key] for key, label in names.items() if found.get(key)}


def labels_argument(labels: dict[str, str]) -> str:
    """``{"zone": "a", "host": "n1"}`` → ``host=n1,zone=a`` (separators in values dropped)."""
    order = ("host", "zone", "rack")
    items = sorted(labels.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else 9)
    clean = {k: v.replace(",", "").replace("=", "") for k, v in items}
    return ",".join(f"{k}={v}" for k, v in clean.items() if v)


def main(env: dict[str, str] | None = None) -> int:
    """Print the agent's ``--labels`` value: the node's name, then what the operator wrote."""
    env = dict(os.environ if env is None else env)
    labels: dict[str, str] = {}
    path = env.get("RINGMASTER_TOPOLOGY_FILE")
    if path:
        labels.update(read_topology(path))
    if env.get("NODE_NAME"):
        labels["host"] = env["NODE_NAME"]
    sys.stdout.write(labels_argument(labels) + "\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
