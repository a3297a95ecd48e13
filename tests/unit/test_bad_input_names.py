"""Names are validated before they become etcd keys or paths (property-based).

Job names, node names, rendezvous ids and topology labels come from users, job
files and the environment.  Whatever text they hold, either it is refused with
a clear error, or it stays inside its own key segment: no ``/``, no ``..``, no
control characters, no escape.
"""

from __future__ import annotations

import unicodedata

import pytest
import yaml
from hypothesis import example, given
from hypothesis import strategies as st

from agents.node.descriptions import parse_labels
from orchestrator.spec.api import SpecError
from orchestrator.spec.loader import load_job_text
from orchestrator.state import keys

pytestmark = pytest.mark.unit

#: Text that tends to break naive validation, besides arbitrary unicode.
NASTY = st.sampled_from(
    [
        "..",
        ".",
        "a/b",
        "../etc",
        "job\n",
        "job\x00",
        "job\r\n",
        "\u202ejob",
        "job\u0085",
        "a" * 129,
        "\uff4a\uff4f\uff42",  # fullwidth "job"
        "job ",
        " job",
        "-job",
        "job/..",
        "a..b",
        "",
    ]
)
NAMES = st.one_of(
    NASTY, st.text(max_size=140), st.from_regex(r"[A-Za-z0-9_.\-/]{0,20}", fullmatch=True)
)


def assert_safe_segment(name: str) -> None:
    assert name, "empty"
    assert len(name) <= 128
    assert "/" not in name and ".." not in name
    assert not any(unicodedata.category(c).startswith(("C", "Z")) for c in name), repr(name)
    assert name.isascii()


@given(NAMES)
@example("job\n")
def test_a_segment_is_refused_or_safe(name: str) -> None:
    try:
        accepted = keys.segment(name, "job name")
    except keys.InvalidKeySegmentError as e:
        assert "job name" in str(e)
        return
    assert accepted == name
    assert_safe_segment(name)


@given(job=NAMES, node=NAMES, run_id=NAMES)
def test_keys_built_from_names_stay_under_their_prefix(job: str, node: str, run_id: str) -> None:
    builders = {
        "node": lambda: keys.job_node(job, node),
        "agent": lambda: keys.agent_commands(job, node),
        "worker": lambda: keys.job_prefix(job) + "progress/" + keys.worker_id(node, 0),
        "rdzv": lambda: keys.rdzv_state(run_id),
    }
    expected_parts = {"node": 6, "agent": 7, "worker": 6, "rdzv": 5}
    for what, build in builders.items():
        try:
            key = build()
        except keys.InvalidKeySegmentError:
            continue
        parts = key.split("/")
        assert key.startswith(keys.ROOT + "/"), key
        assert len(parts) == expected_parts[what] + (1 if key.endswith("/") else 0), key
        assert ".." not in parts and "." not in parts
        assert "" not in parts[1:-1], key


def test_non_text_names_are_refused() -> None:
    for bad in (None, 7, b"job", ["job"]):
        with pytest.raises(keys.InvalidKeySegmentError):
            keys.segment(bad)  # type: ignore[arg-type]


@given(name=NAMES)
@example("job\n")
@example("ab\u0085")
def test_the_spec_loader_refuses_unsafe_job_names(name: str) -> None:
    text = yaml.safe_dump(
        {"name": name, "entrypoint": "train.py"}, allow_unicode=True, sort_keys=False
    )
    try:
        spec = load_job_text(text, source="job.yaml")
    except SpecError as e:
        assert [p.path for p in e.problems] == ["name"], str(e)
        assert e.problems[0].line == 1 and e.problems[0].source == "job.yaml"
        assert "\n" not in e.problems[0].message  # one line per problem
        return
    assert spec.name == name
    assert_safe_segment(spec.name)
    assert keys.job_prefix(spec.name).count("/") == 4


@given(st.dictionaries(NAMES, NAMES, max_size=3))
def test_labels_are_refused_or_safe(given_labels: dict[str, str]) -> None:
    text = ",".join(f"{k}={v}" for k, v in given_labels.items())
    try:
        parsed = parse_labels(text)
    except ValueError as e:
        assert "label" in str(e)
        return
    for key, value in parsed.items():
        assert_safe_segment(key)
        assert "/" not in value and "," not in value and "=" not in value
        assert not any(unicodedata.category(c).startswith("C") for c in value)


def test_agent_cli_labels_that_are_not_safe_are_refused() -> None:
    for text in ("zone=a/b", "zone=a\nb", "../x=1", "rack=" + "r" * 254):
        with pytest.raises(ValueError, match="label"):
            parse_labels(text)
    assert parse_labels("zone=us-east-1a,rack=r1,host=") == {
        "zone": "us-east-1a",
        "rack": "r1",
        "host": "",
    }
