"""Malformed job files never crash the spec loader (property-based).

Random YAML documents, random text, and random mutations of a complete valid
spec (wrong types, unknown keys, deep nesting, huge and non-finite numbers,
unicode, removed fields) go through :mod:`orchestrator.spec.loader`.  The only
outcomes allowed: a :class:`SpecError` whose every problem names the file, a
line and a field, or a spec that is valid and round-trips.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import yaml
from hypothesis import example, given
from hypothesis import strategies as st

from orchestrator.spec.api import SpecError
from orchestrator.spec.job import JobSpec
from orchestrator.spec.loader import load_job_data, load_job_text

pytestmark = pytest.mark.unit

SOURCE = "job.yaml"

#: A spec that sets every section, so mutations reach every field.
VALID: dict[str, Any] = load_job_data(
    {
        "name": "full",
        "entrypoint": {"script": "train.py", "args": ["--lr", "0.1"], "env": {"A": "1"}},
        "nodes": {"min": 1, "max": 3, "spares": 1},
        "nproc_per_node": 2,
        "max_steps": 100,
        "rendezvous": {
            "endpoints": ["etcd-0:2379", "https://etcd-1:2379"],
            "join_timeout": "10m",
            "tls": {"ca_cert": "/ca.pem", "cert": "/c.pem", "key": "/k.pem"},
            "user": "trainer",
            "password_env": "ETCD_PASSWORD",
        },
        "checkpoint": {"url": "s3://bucket/run", "every_steps": 50, "keep": 2},
        "fault_tolerance": {"max_restarts": 2, "hang_timeout": "2m"},
        "comm": {"compression": {"type": "topk", "ratio": 0.1}, "hierarchical": True},
        "resources": {"image": "ringmaster:1", "cpu": "500m", "memory": "2Gi", "gpus": 1},
    }
).to_dict()

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=10**18, max_value=10**400),
    st.floats(),  # nan and infinities included
    st.text(max_size=30),
    st.sampled_from(["", "-1", "1e999", "10x", "∞", "\uff15", "\x00", "\u202e", "30s\n", "-5m"]),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=15,
)


def paths(data: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path into the nested data (mapping keys and list indices)."""
    out = [prefix] if prefix else []
    if isinstance(data, dict):
        for k, v in data.items():
            out += paths(v, (*prefix, k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            out += paths(v, (*prefix, i))
    return out


ALL_PATHS = paths(VALID)


def deep(value: Any, levels: int) -> Any:
    for _ in range(levels):
        value = [value] if levels % 2 else {"x": value}
    return value


@st.composite
def mutated(draw: st.DrawFn) -> tuple[dict[str, Any], tuple[Any, ...]]:
    data = copy.deepcopy(VALID)
    path = draw(st.sampled_from(ALL_PATHS))
    parent: Any = data
    for part in path[:-1]:
        parent = parent[part]
    last = path[-1]
    how = draw(st.sampled_from(["replace", "unknown key", "deep", "delete"]))
    if how == "replace":
        parent[last] = draw(VALUES)
    elif how == "unknown key" and isinstance(parent, dict):
        parent[draw(st.text(min_size=1, max_size=12))] = draw(SCALARS)
    elif how == "deep":
        parent[last] = deep(parent[last], draw(st.integers(1, 200)))
    elif isinstance(parent, dict):
        del parent[last]
    else:
        parent[last] = draw(VALUES)
    return data, path


def check(load: Any) -> JobSpec | None:
    """Run a load; a SpecError must be well formed, a spec must be valid."""
    try:
        spec = load()
    except SpecError as e:
        assert e.problems
        for problem in e.problems:
            assert problem.source == SOURCE
            assert problem.line is not None and problem.line >= 1, problem
            assert problem.message
            assert str(problem).startswith(f"{SOURCE}:{problem.line}: "), str(problem)
        return None
    assert isinstance(spec, JobSpec)
    assert spec.all_problems() == []
    for value in _numbers(spec.to_dict()):
        assert math.isfinite(value), spec
    again = load_job_data(spec.to_dict(), source=SOURCE)
    assert again == spec
    return spec


def _numbers(data: Any) -> list[float]:
    if isinstance(data, dict):
        return [n for v in data.values() for n in _numbers(v)]
    if isinstance(data, list):
        return [n for v in data for n in _numbers(v)]
    if isinstance(data, float | int) and not isinstance(data, bool):
        return [float(data)]
    return []


@given(VALUES)
def test_random_documents(document: Any) -> None:
    check(lambda: load_job_text(yaml.safe_dump(document, allow_unicode=True), SOURCE))


@given(st.text(max_size=200))
@example("name: [")
@example("{{{{")
@example("name: " + "[" * 5000 + "]" * 5000)
@example("- " * 3000 + "x")
@example("\ufeffname: a\nentrypoint: b.py")
@example("name: a\nentrypoint: b.py\n\x85")
def test_random_text(text: str) -> None:
    check(lambda: load_job_text(text, SOURCE))


@given(mutated())
def test_mutations_of_a_valid_spec(case: tuple[dict[str, Any], tuple[Any, ...]]) -> None:
    data, path = case
    spec = check(lambda: load_job_data(data, SOURCE))
    if spec is None:
        if len(path) > 1:  # the problems are reported in the section that was changed
            with pytest.raises(SpecError) as caught:
                load_job_data(data, SOURCE)
            section = str(path[0])
            assert any(p.path.startswith(section) for p in caught.value.problems), (
                path,
                str(caught.value),
            )
        return
    # A mutation that still loads left a valid spec behind; a field it changed
    # reads back as the loader understood it (never silently another value).
    assert spec.to_dict()["name"] == data["name"]


@pytest.mark.parametrize(
    ("section", "field", "value", "says"),
    [
        ("fault_tolerance", "hang_timeout", math.inf, "at most"),
        ("fault_tolerance", "hang_timeout", math.nan, "duration"),
        ("fault_tolerance", "hang_timeout", 1e300, "at most"),
        ("comm", "bucket_cap_mb", math.nan, "finite"),
        ("checkpoint", "every_seconds", math.inf, "finite"),
        ("compression", "ratio", math.nan, "finite"),
        ("nodes", "max", 10**40, "nodes.min"),
        ("resources", "cpu", "\uff15", "quantity"),  # fullwidth 5
    ],
)
def test_numbers_that_used_to_slip_through(section: str, field: str, value: Any, says: str) -> None:
    data = copy.deepcopy(VALID)
    target = data["comm"]["compression"] if section == "compression" else data[section]
    if section == "nodes":
        target["min"] = 10**40 + 1
    target[field] = value
    with pytest.raises(SpecError, match=says) as caught:
        load_job_data(data, SOURCE)
    assert all(p.line for p in caught.value.problems)


def test_deep_nesting_is_one_clear_problem() -> None:
    with pytest.raises(SpecError, match="nested too deeply") as caught:
        load_job_text("name: " + "[" * 20000 + "]" * 20000, SOURCE)
    assert caught.value.problems[0].line == 1
