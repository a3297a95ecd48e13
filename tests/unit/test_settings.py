"""The ``RINGMASTER_*`` knobs: read once, checked, listed everywhere they are read.

Every environment variable ringmaster's packages read is either a knob of
:mod:`orchestrator.settings` or on one of the short lists below (the worker
environment contract, the operator Deployment's configuration, a variable the
operator sets on the pods it creates).  The README's table is generated from
the same list, and a test keeps the two equal.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import fields
from datetime import timedelta
from pathlib import Path

import pytest
from click.testing import CliRunner

from agents import api as agents_api
from orchestrator.settings import (
    KNOBS,
    SETTINGS,
    Settings,
    SettingsError,
    knob_table,
    knobs_in_force,
    readme_table,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("orchestrator", "agents", "checkpoint")
_NAME = re.compile(r"^RINGMASTER_[A-Z0-9_]+$")

#: The worker environment an agent sets for its workers (agents/api.py, ``ENV_*``).
WORKER_IDENTITY = frozenset(
    value
    for name, value in vars(agents_api).items()
    if name.startswith("ENV_") and isinstance(value, str) and value.startswith("RINGMASTER_")
)
#: The operator Deployment's own configuration (``OperatorSettings.from_env``).
OPERATOR_DEPLOYMENT = frozenset(
    {
        "RINGMASTER_RACK_LABELS",
        "RINGMASTER_ZONE_LABELS",
        "RINGMASTER_JOB_SERVICE_ACCOUNT",
        "RINGMASTER_ETCD_TLS_SECRET",
        "RINGMASTER_ETCD_PASSWORD_SECRET",
        "RINGMASTER_ETCD_PASSWORD_SECRET_KEY",
    }
)
#: Set by the operator on the agent pods it creates and read back inside them.
OPERATOR_POD = frozenset({"RINGMASTER_TOPOLOGY_FILE"})
NOT_KNOBS = WORKER_IDENTITY | OPERATOR_DEPLOYMENT | OPERATOR_POD


def _envish(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return "env" in node.id.lower()
    if isinstance(node, ast.Attribute):
        return "env" in node.attr.lower() or _envish(node.value)
    return False


def _literal(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and _NAME.match(node.value):
        return node.value
    return None


def environment_reads() -> dict[str, list[str]]:
    """``RINGMASTER_*`` variable → where the packages read it.

    A read is a call with the variable's name as first argument
    (``os.environ.get(...)``, ``os.getenv(...)``, ``env.get(...)``, a helper
    like ``_env_seconds(...)``), an index or an ``in`` test on a mapping whose
    name says env.  Writes (``env[NAME] = ...``) and click's ``envvar=`` (the
    CLI's option fallbacks, listed by ``--help``) are not reads.
    """
    found: dict[str, list[str]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            where = str(path.relative_to(ROOT))
            if where == "orchestrator/settings.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                name = None
                if isinstance(node, ast.Call) and node.args:
                    name = _literal(node.args[0])
                elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
                    name = _literal(node.slice) if _envish(node.value) else None
                elif isinstance(node, ast.Compare) and any(_envish(c) for c in node.comparators):
                    name = _literal(node.left)
                if name is not None:
                    found.setdefault(name, []).append(f"{where}:{getattr(node, 'lineno', 0)}")
    return found


def test_a_bad_value_is_an_error_naming_the_variable() -> None:
    with pytest.raises(SettingsError, match=r"RINGMASTER_PLAN_TIMEOUT='abc' is not a number"):
        Settings.from_environ({"RINGMASTER_PLAN_TIMEOUT": "abc"})


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("RINGMASTER_HISTORY_MAX", "1.5", "is not an integer"),
        ("RINGMASTER_NODE_TTL", "0", "must be a positive, finite number"),
        ("RINGMASTER_NODE_TTL", "-3", "must be a positive, finite number"),
        ("RINGMASTER_OUTAGE_GRACE", "inf", "must be a positive, finite number"),
        ("RINGMASTER_OUTAGE_GRACE", "nan", "must be a positive, finite number"),
        ("RINGMASTER_LOG_LEVEL", "loud", "is not one of DEBUG, INFO, WARNING, ERROR"),
    ],
)
def test_values_that_cannot_be_used(name: str, value: str, expected: str) -> None:
    with pytest.raises(SettingsError, match=re.escape(f"{name}={value!r} {expected}")):
        Settings.from_environ({name: value})


def test_values_are_read_from_the_given_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGMASTER_PLAN_TIMEOUT", "99")
    got = Settings.from_environ(
        {
            "RINGMASTER_ETCD_OP_TIMEOUT": "2.5",
            "RINGMASTER_HISTORY_MAX": "12",
            "RINGMASTER_LOG_LEVEL": "info",
            "RINGMASTER_ETCD_BINARY": "/opt/etcd/bin/etcd",
            "RINGMASTER_NODE_TTL": "",  # empty counts as unset
        }
    )
    assert got.etcd_op_timeout == timedelta(seconds=2.5)
    assert got.history_max == 12
    assert got.log_level == "INFO"
    assert got.etcd_binary == "/opt/etcd/bin/etcd"
    assert got.node_ttl == timedelta(seconds=3)
    assert got.plan_timeout == timedelta(seconds=600), "os.environ must not be read"
    assert Settings.from_environ({}) == Settings.from_environ({"RINGMASTER_UNRELATED": "x"})


def test_every_knob_has_a_field_and_every_field_a_knob() -> None:
    assert [k.field for k in KNOBS] == [f.name for f in fields(Settings)]
    assert len({k.env for k in KNOBS}) == len(KNOBS)
    for knob in KNOBS:  # every default is itself a valid value
        Settings.from_environ({knob.env: knob.default})


def test_every_variable_read_is_a_knob_or_on_a_list() -> None:
    reads = environment_reads()
    knobs = {k.env for k in KNOBS}
    unlisted = {name: at for name, at in reads.items() if name not in knobs | NOT_KNOBS}
    assert not unlisted, (
        f"environment variables read outside orchestrator.settings: {unlisted}; "
        "add a Knob (and read SETTINGS.<field>) or, if it is not a tuning knob, a list here"
    )
    knobs_read_directly = {name: at for name, at in reads.items() if name in knobs}
    assert not knobs_read_directly, f"read these through SETTINGS: {knobs_read_directly}"


def test_the_lists_of_non_knobs_are_precise() -> None:
    reads = environment_reads()
    assert not NOT_KNOBS & {k.env for k in KNOBS}
    stale = sorted((OPERATOR_DEPLOYMENT | OPERATOR_POD) - set(reads))
    assert not stale, f"no longer read anywhere, drop them from the lists: {stale}"
    assert {"RINGMASTER_JOB", "RINGMASTER_NODE", "RINGMASTER_ETCD"} <= WORKER_IDENTITY


def _used(field: str) -> bool:
    pattern = re.compile(rf"(\bSETTINGS|\))\.{field}\b")
    return any(
        pattern.search(path.read_text(encoding="utf-8"))
        for package in ("orchestrator", "agents")
        for path in (ROOT / package).rglob("*.py")
        if path.name != "settings.py"
    )


@pytest.mark.parametrize("field", [k.field for k in KNOBS])
def test_every_knob_is_read_somewhere(field: str) -> None:
    assert _used(field), f"nothing reads SETTINGS.{field}: a knob that does nothing"


def test_the_readme_lists_every_knob() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    heading = "## Settings (environment knobs)\n"
    assert heading in text
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    table = "".join(line + "\n" for line in section.splitlines() if line.startswith("|"))
    assert table == readme_table(), "regenerate the README table from settings.readme_table()"
    assert len(knob_table()) == len(KNOBS)


def test_settings_command_prints_every_knob_and_the_value_in_force() -> None:
    from orchestrator.cli import main

    result = CliRunner().invoke(main, ["settings"], terminal_width=240)
    assert result.exit_code == 0, result.output
    for knob in KNOBS:
        assert knob.env in result.output
    in_force = {k.env: (value, from_env) for k, value, from_env in knobs_in_force()}
    assert in_force["RINGMASTER_PLAN_TIMEOUT"][0] == f"{SETTINGS.plan_timeout.total_seconds():g}"


def test_knobs_in_force_says_which_come_from_the_environment() -> None:
    current = Settings.from_environ({"RINGMASTER_LEADER_TTL": "7"})
    rows = {
        k.env: (value, from_env)
        for k, value, from_env in knobs_in_force(current, {"RINGMASTER_LEADER_TTL": "7"})
    }
    assert rows["RINGMASTER_LEADER_TTL"] == ("7", True)
    assert rows["RINGMASTER_NODE_TTL"] == ("3", False)
    assert rows["RINGMASTER_ETCD_BINARY"] == ("(none)", False)


def test_the_command_line_stops_at_a_bad_knob_with_one_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "settings"],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "RINGMASTER_PLAN_TIMEOUT": "abc"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("error: RINGMASTER_PLAN_TIMEOUT='abc' is not a number")
    assert "Traceback" not in done.stderr
