"""Node labels → pod annotations → the agent's topology labels."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from orchestrator.operator.api import OperatorSettings
from orchestrator.operator.topology import (
    labels_argument,
    main,
    needs_topology,
    parse_downward_file,
    read_topology,
    topology_annotations,
    topology_labels,
)

pytestmark = pytest.mark.unit


def test_annotations_from_node_labels() -> None:
    labels = {
        "topology.kubernetes.io/zone": "eu-west-1a",
        "topology.ringmaster.dev/rack": "r12",
        "kubernetes.io/hostname": "gpu-7",
    }
    out = topology_annotations("gpu-7", labels, OperatorSettings())
    assert out == {
        "ringmaster.dev/host": "gpu-7",
        "ringmaster.dev/zone": "eu-west-1a",
        "ringmaster.dev/rack": "r12",
        "ringmaster.dev/topology-ready": "true",
    }


def test_node_without_topology_labels_is_still_marked_ready() -> None:
    out = topology_annotations("n1", {}, OperatorSettings())
    assert out == {"ringmaster.dev/host": "n1", "ringmaster.dev/topology-ready": "true"}


def test_rack_label_keys_are_configurable() -> None:
    settings = OperatorSettings.from_env({"RINGMASTER_RACK_LABELS": "example.com/rack"})
    out = topology_annotations("n1", {"example.com/rack": "b3"}, settings)
    assert out["ringmaster.dev/rack"] == "b3"


def test_needs_topology_only_once_scheduled() -> None:
    assert not needs_topology({"spec": {}, "metadata": {}})
    assert needs_topology({"spec": {"nodeName": "n1"}, "metadata": {"annotations": {}}})
    done = {"ringmaster.dev/topology-ready": "true"}
    assert not needs_topology({"spec": {"nodeName": "n1"}, "metadata": {"annotations": done}})


def test_parse_downward_api_file() -> None:
    text = 'ringmaster.dev/zone="eu-west-1a"\nringmaster.dev/rack="r \\"12\\""\nbroken\n'
    assert parse_downward_file(text) == {
        "ringmaster.dev/zone": "eu-west-1a",
        "ringmaster.dev/rack": 'r "12"',
    }


def test_read_topology_waits_for_the_operator(tmp_path: Path) -> None:
    path = tmp_path / "annotations"
    path.write_text('ringmaster.dev/index="0"\n')

    def operator_writes() -> None:
        time.sleep(0.2)
        path.write_text(
            'ringmaster.dev/host="n1"\nringmaster.dev/zone="z1"\n'
            'ringmaster.dev/topology-ready="true"\n'
        )

    writer = threading.Thread(target=operator_writes)
    writer.start()
    got = read_topology(path, timeout=timedelta(seconds=5), poll=timedelta(milliseconds=50))
    writer.join()
    assert got == {"zone": "z1", "host": "n1"}


def test_read_topology_gives_up_after_the_timeout(tmp_path: Path) -> None:
    start = time.monotonic()
    got = read_topology(
        tmp_path / "missing", timeout=timedelta(milliseconds=200), poll=timedelta(milliseconds=50)
    )
    assert got == {} and time.monotonic() - start < 2


def test_main_prints_what_the_agent_parses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from agents.node.descriptions import parse_labels

    path = tmp_path / "annotations"
    path.write_text(
        'ringmaster.dev/zone="eu,west"\nringmaster.dev/rack="r1"\n'
        'ringmaster.dev/topology-ready="true"\n'
    )
    assert main({"RINGMASTER_TOPOLOGY_FILE": str(path), "NODE_NAME": "gpu-7"}) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == "host=gpu-7,zone=euwest,rack=r1"
    assert parse_labels(printed) == {"host": "gpu-7", "zone": "euwest", "rack": "r1"}


def test_labels_argument_skips_empty_values() -> None:
    assert labels_argument({"rack": "", "host": "n1"}) == "host=n1"


def test_pod_labels_from_the_nodes_well_known_labels() -> None:
    labels = {
        "topology.kubernetes.io/zone": "eu-west-1a",
        "topology.ringmaster.dev/rack": "r12",
        "kubernetes.io/hostname": "gpu-7",
    }
    # the host is the node's hostname label, not its (possibly longer) name
    out = topology_labels("gpu-7.eu-west-1.compute.internal", labels, OperatorSettings())
    assert out == {
        "ringmaster.dev/zone": "eu-west-1a",
        "ringmaster.dev/rack": "r12",
        "ringmaster.dev/host": "gpu-7",
    }


def test_values_that_cannot_be_labels_are_left_out() -> None:
    long_name = "n" * 70
    out = topology_labels(long_name, {"topology.ringmaster.dev/rack": "rack 1"}, OperatorSettings())
    assert out == {}
