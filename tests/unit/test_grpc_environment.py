"""Importing ringmaster changes no environment variable; its own processes get gRPC's.

The checks run in fresh interpreters: the test process has imported gRPC and
applied the settings already (``tests/conftest.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.etcd.grpc_env import GRPC_DEFAULTS, apply_grpc_environment, grpc_environment

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

_CHANGES = """
import json, os, sys
preload, modules = sys.argv[1].split(","), sys.argv[2].split(",")
for module in filter(None, preload):
    __import__(module)
before = dict(os.environ)
for module in modules:
    __import__(module)
after = dict(os.environ)
print(json.dumps({k: [before.get(k), after.get(k)] for k in before.keys() | after.keys()
                  if before.get(k) != after.get(k)}))
"""


def _fresh(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPC_")}
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


@pytest.mark.parametrize(
    ("preload", "modules"),
    [
        ("", "agents.runtime,orchestrator.etcd.client"),
        # torch's own rendezvous module sets TORCHINDUCTOR_CACHE_DIR when imported.
        (
            "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
            "orchestrator.rendezvous.backend",
        ),
    ],
)
def test_importing_ringmaster_changes_no_environment_variable(preload: str, modules: str) -> None:
    done = _fresh("-c", _CHANGES, preload, modules)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {}


def test_the_command_line_sets_the_grpc_defaults_before_grpc_is_imported() -> None:
    code = (
        "import os, sys; import orchestrator.cli; "
        "print(sorted((k, os.environ[k]) for k in os.environ if k.startswith('GRPC_'))); "
        "print('grpc' in sys.modules)"
    )
    done = _fresh("-c", code)
    assert done.stdout.splitlines() == [str(sorted(GRPC_DEFAULTS.items())), "True"]


def test_a_value_already_set_wins() -> None:
    environ = {"GRPC_VERBOSITY": "DEBUG"}
    apply_grpc_environment(environ)
    assert environ == {"GRPC_VERBOSITY": "DEBUG", "GRPC_ENABLE_FORK_SUPPORT": "false"}
    child = {**grpc_environment(), **{"GRPC_ENABLE_FORK_SUPPORT": "true"}}
    assert child["GRPC_ENABLE_FORK_SUPPORT"] == "true"
    assert grpc_environment() is not GRPC_DEFAULTS  # a copy: callers may change it
