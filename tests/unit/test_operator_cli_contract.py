"""The command lines the operator renders parse with the real ``ringmaster`` CLI.

The pods run ``ringmaster agent ...`` and ``ringmaster controller ...``; the
operator Deployment runs ``ringmaster operator``.  Each rendered command line
is parsed by the click command it names (``make_context`` parses and checks
the options without running anything), with the container's plain environment
variables set, so a renamed or removed option fails here rather than in a
cluster.  A command that the CLI does not have yet is skipped with a reason.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from orchestrator import cli
from orchestrator.operator.api import Observed, OperatorSettings
from orchestrator.operator.reconcile import reconcile

pytestmark = pytest.mark.unit

SETTINGS = OperatorSettings(etcd_endpoints=("etcd-0:2379", "etcd-1:2379"))


def rendered() -> dict[str, dict[str, Any]]:
    body = {
        "apiVersion": "ringmaster.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "demo", "namespace": "ml", "uid": "u", "generation": 1},
        "spec": {"entrypoint": {"script": "train.py"}, "nodes": {"min": 1, "max": 2}},
    }
    plan = reconcile(body, Observed(), None, SETTINGS, datetime.now(timezone.utc))
    pod = next(o for o in plan.create if o["kind"] == "Pod")
    deployment = next(o for o in plan.create if o["kind"] == "Deployment")
    operator = next(
        d
        for d in yaml.safe_load_all(
            (Path(__file__).resolve().parents[2] / "k8s" / "operator.yaml").read_text()
        )
        if d and d["kind"] == "Deployment"
    )
    return {
        "agent": pod["spec"]["containers"][0],
        "controller": deployment["spec"]["template"]["spec"]["containers"][0],
        "operator": operator["spec"]["template"]["spec"]["containers"][0],
    }


CONTAINERS = rendered()


@pytest.mark.parametrize("name", sorted(CONTAINERS))
def test_command_line_parses_with_the_cli(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    container = CONTAINERS[name]
    argv = container["command"]
    if argv[0] == "/bin/sh":  # the agent's launch script: sh -c SCRIPT NAME ARGV...
        argv = argv[4:]
    assert argv[:2] == ["ringmaster", name]
    command = cli.main.commands.get(name) if isinstance(cli.main, click.Group) else None
    if command is None:
        pytest.skip(f"`ringmaster {name}` is not in orchestrator/cli yet")
    for var in container.get("env", []):
        if "value" in var and var["name"].startswith("RINGMASTER_"):
            monkeypatch.setenv(var["name"], var["value"])
    with command.make_context(name, list(argv[2:])) as ctx:
        params = ctx.params
    if name in ("agent", "controller"):
        assert params["job"] == "demo"
    if name == "agent":
        # --node and --address come from the pod's environment
        assert params["node"] == "$(POD_NAME)" and params["address"] == "$(POD_IP)"
        labels = "host=n1,zone=z1"
        monkeypatch.setenv("RINGMASTER_LABELS", labels)
        with command.make_context(name, list(argv[2:])) as ctx:
            assert ctx.params["labels"] == labels


@pytest.mark.parametrize("name", ["agent", "controller"])
def test_job_and_etcd_are_on_the_command_line(name: str) -> None:
    argv = CONTAINERS[name]["command"]
    argv = argv[4:] if argv[0] == "/bin/sh" else argv
    assert argv[argv.index("--job") + 1] == "demo"
    assert argv[argv.index("--etcd") + 1] == "etcd-0:2379,etcd-1:2379"
