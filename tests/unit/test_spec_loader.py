"""Job files: defaults, and errors that name the field path, the line and what is valid."""

from __future__ import annotations

import textwrap
from datetime import timedelta

import pytest

from orchestrator.spec.api import SpecError, SpecProblem
from orchestrator.spec.job import CompressionKind, JobSpec
from orchestrator.spec.loader import load_job_data, load_job_text

pytestmark = pytest.mark.unit


def problems(text: str) -> list[SpecProblem]:
    with pytest.raises(SpecError) as info:
        load_job_text(textwrap.dedent(text), source="job.yaml")
    return info.value.problems


def only(text: str) -> SpecProblem:
    found = problems(text)
    assert len(found) == 1, found
    return found[0]


def test_two_line_job_is_valid_with_defaults() -> None:
    spec = load_job_text("name: demo\nentrypoint: train.py\n")
    assert spec.entrypoint.script == "train.py" and spec.entrypoint.module is None
    assert (spec.nodes.min, spec.nodes.max, spec.nodes.spares) == (1, 1, 0)
    assert spec.checkpoint.keep == 3 and spec.checkpoint.async_ is True
    assert spec.comm.compression.type is CompressionKind.NONE
    assert spec.rendezvous.endpoints == []


def test_full_job_round_trips_through_to_dict() -> None:
    spec = load_job_text(
        textwrap.dedent(
            """
            name: big-job
            entrypoint:
              module: mypkg.train
              args: [--lr, "0.1"]
              env: {FOO: bar}
            nodes: {min: 2, max: 4, spares: 1}
            nproc_per_node: 2
            rendezvous:
              endpoints: ["10.0.0.1:2379", "https://10.0.0.2:2379"]
              join_timeout: 5m
              last_call_timeout: 500ms
            checkpoint: {url: "s3://bucket/run1", every_steps: 100, keep: 2, async: false}
            fault_tolerance: {max_restarts: 10, hang_timeout: 2m, heartbeat_interval: 5s}
            comm:
              compression: {type: powersgd, rank: 4, start_iter: 100}
              hierarchical: false
              backend: gloo
              op_timeout_floor: 30s
            resources: {image: "img:1", cpu: "4", memory: 16Gi, gpus: 1}
            """
        )
    )
    assert spec.entrypoint.command() == ["-m", "mypkg.train", "--lr", "0.1"]
    assert spec.rendezvous.join_timeout == timedelta(minutes=5)
    assert spec.rendezvous.last_call_timeout == timedelta(milliseconds=500)
    assert spec.checkpoint.async_ is False
    assert spec.comm.compression.rank == 4
    assert spec.comm.backend.value == "gloo"
    assert spec.comm.op_timeout_floor == timedelta(seconds=30)
    again = load_job_data(spec.to_dict())
    assert again == spec


@pytest.mark.parametrize(
    ("text", "path", "line", "words"),
    [
        (
            "name: a\nentrypoint: t.py\ncomm:\n  hierarchical: true\n"
            "  compression: {type: powersgd}\n",
            "comm.compression.type",
            5,
            ["'powersgd' has no hierarchical form", "topk or qsgd"],
        ),
        ("name: a\nentrypoint: t.py\nnodes:\n  min: two\n", "nodes.min", 4, ["integer", "'two'"]),
        (
            "name: a\nentrypoint: t.py\nnodes:\n  min: 4\n  max: 2\n",
            "nodes.min",
            4,
            ["nodes.min (4) is larger than nodes.max (2)"],
        ),
        (
            "name: a\nentrypoint: t.py\nnodse:\n  min: 1\n",
            "nodse",
            3,
            ["unknown key", "did you mean 'nodes'"],
        ),
        ("name: a\nnodes: {min: 1}\n", "entrypoint", 1, ["required"]),
        (
            "name: a\nentrypoint: t.py\ncheckpoint:\n  url: ftp://host/x\n",
            "checkpoint.url",
            4,
            ["'ftp'", "s3://"],
        ),
        (
            "name: a\nentrypoint: t.py\nrendezvous:\n  join_timeout: -5\n",
            "rendezvous.join_timeout",
            4,
            ["positive duration"],
        ),
        (
            "name: a\nentrypoint: t.py\nfault_tolerance:\n  hang_timeout: -1m\n",
            "fault_tolerance.hang_timeout",
            4,
            ["positive duration"],
        ),
        (
            "name: a\nentrypoint: t.py\ncomm:\n  compression: {type: zip}\n",
            "comm.compression.type",
            4,
            ["'zip'", "topk"],
        ),
        (
            "name: a\nentrypoint: t.py\ncomm:\n  compression:\n    type: topk\n    rank: 2\n",
            "comm.compression.rank",
            6,
            ["not a parameter of compression 'topk'", "ratio"],
        ),
        (
            "name: a\nentrypoint: t.py\nfault_tolerance:\n  stragglers:\n    confirm: soon\n",
            "fault_tolerance.stragglers.confirm",
            5,
            ["a duration", "'soon'"],
        ),
        ("name: Bad_Name\nentrypoint: t.py\n", "name", 1, ["lowercase"]),
        ("name: a\nentrypoint: {script: a.py, module: b}\n", "entrypoint", 2, ["exactly one"]),
    ],
)
def test_bad_field_names_path_line_and_what_is_valid(
    text: str, path: str, line: int, words: list[str]
) -> None:
    p = only(text)
    assert p.path == path
    assert p.line == line
    for w in words:
        assert w in p.message, p.message
    assert str(p).startswith(f"job.yaml:{line}: {path}: ")


def test_all_problems_are_reported_at_once() -> None:
    found = problems(
        """\
        name: Bad_Name
        entrypoint:
          script: x.py
          modul: y
        nodes: {min: 4, max: 2}
        rendezvous: {join_timeout: -5}
        checkpoint: {url: "ftp://x/y", keep: 0}
        nproc_per_node: [1]
        """
    )
    paths = [p.path for p in found]
    assert paths == [
        "name",
        "entrypoint.modul",
        "nodes.min",
        "rendezvous.join_timeout",
        "checkpoint.url",
        "checkpoint.keep",
        "nproc_per_node",
    ]
    assert [p.line for p in found] == [1, 4, 5, 6, 7, 7, 8]


def test_syntax_error_names_the_line() -> None:
    p = only("name: a\nentrypoint: [unclosed\n")
    assert "not valid YAML" in p.message and p.line is not None


def test_empty_and_non_mapping_documents() -> None:
    assert "empty" in only("").message
    assert "mapping" in only("- a\n- b\n").message


def test_duplicate_key_is_an_error() -> None:
    p = only("name: a\nname: b\nentrypoint: t.py\n")
    assert p.path == "name" and "twice" in p.message and p.line == 2


def test_inter_node_only_needs_hierarchical() -> None:
    p = only(
        "name: a\nentrypoint: t.py\ncomm:\n  compression: {type: fp16, inter_node_only: true}\n"
    )
    assert p.path == "comm.compression.inter_node_only" and "hierarchical" in p.message


def test_programmatic_spec_validate_lists_all() -> None:
    from orchestrator.spec.job import EntrypointSpec, NodesSpec

    spec = JobSpec(name="UP", entrypoint=EntrypointSpec(), nodes=NodesSpec(min=3, max=1))
    with pytest.raises(SpecError) as info:
        spec.validate()
    assert {p.path for p in info.value.problems} == {"name", "entrypoint", "nodes.min"}


@pytest.mark.parametrize("key", ["heartbeat", "close_timeout"])
def test_removed_rendezvous_settings_say_what_to_use(key: str) -> None:
    with pytest.raises(SpecError, match=rf"rendezvous\.{key}: is no longer a job setting"):
        load_job_data({"name": "j", "entrypoint": "t.py", "rendezvous": {key: 1}})


# -- fault_tolerance.recovery: auto resolved by reading the entrypoint


RUNTIME_SCRIPTS = [
    "from agents import runtime\nsession = runtime.init()\n",
    "import agents.runtime as rt\nrt.init()\n",
    "from agents.runtime import init\n",
    "def main():\n    from agents import boundary, runtime\n    runtime.init()\n",
]
PLAIN_SCRIPTS = [
    "import torch.distributed as dist\ndist.init_process_group()\n",
    "# unlike scripts that call agents.runtime.init(), this one does not\nprint(1)\n",
    "doc = 'from agents import runtime'\n",
    "from agents import boundary\n",
]


@pytest.mark.parametrize("source", RUNTIME_SCRIPTS)
def test_uses_runtime_finds_the_import(source: str) -> None:
    from orchestrator.spec.entrypoint import uses_runtime

    assert uses_runtime(source)


@pytest.mark.parametrize("source", PLAIN_SCRIPTS)
def test_uses_runtime_ignores_comments_strings_and_other_modules(source: str) -> None:
    from orchestrator.spec.entrypoint import uses_runtime

    assert not uses_runtime(source)


def test_uses_runtime_reads_a_file_that_does_not_parse_as_text() -> None:
    from orchestrator.spec.entrypoint import uses_runtime

    assert uses_runtime("from agents import runtime\nsession = runtime.init(\n")
    assert not uses_runtime("import torch\nx = (\n")


def _job(tmp_path, script: str, recovery: str | None = None):  # type: ignore[no-untyped-def]
    (tmp_path / "train.py").write_text(script)
    ft = {"recovery": recovery} if recovery else {}
    return load_job_data({"name": "j", "entrypoint": "train.py", "fault_tolerance": ft})


def test_auto_is_restart_for_a_plain_torchrun_script(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from orchestrator.spec.entrypoint import resolve_recovery
    from orchestrator.spec.job import RecoveryMode

    spec = _job(tmp_path, PLAIN_SCRIPTS[0])
    assert spec.fault_tolerance.recovery is RecoveryMode.AUTO  # the default
    resolved, why = resolve_recovery(spec, tmp_path)
    assert resolved.fault_tolerance.recovery is RecoveryMode.RESTART
    assert spec.fault_tolerance.recovery is RecoveryMode.AUTO  # not modified
    assert why == (
        "recovery: restart (train.py never calls runtime.init(); a peer's failure restarts "
        "all workers from the script's own checkpoint)"
    )
    assert resolved.to_dict()["fault_tolerance"]["recovery"] == "restart"


def test_auto_is_in_process_for_a_runtime_script(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from orchestrator.spec.entrypoint import resolve_recovery
    from orchestrator.spec.job import RecoveryMode

    resolved, why = resolve_recovery(_job(tmp_path, RUNTIME_SCRIPTS[0]), tmp_path)
    assert resolved.fault_tolerance.recovery is RecoveryMode.IN_PROCESS
    assert why.startswith("recovery: in_process (train.py uses the ringmaster runtime")


def test_auto_reads_a_module_entrypoint(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from orchestrator.spec.entrypoint import resolve_recovery
    from orchestrator.spec.job import RecoveryMode

    pkg = tmp_path / "rm_restart_pkg_x"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(RUNTIME_SCRIPTS[1])
    spec = load_job_data({"name": "j", "entrypoint": {"module": "rm_restart_pkg_x"}})
    resolved, why = resolve_recovery(spec, tmp_path)
    assert resolved.fault_tolerance.recovery is RecoveryMode.IN_PROCESS, why
    assert "module rm_restart_pkg_x" in why


def test_in_process_for_a_plain_script_is_one_clear_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from orchestrator.spec.entrypoint import resolve_recovery

    with pytest.raises(SpecError) as info:
        resolve_recovery(_job(tmp_path, PLAIN_SCRIPTS[0], "in_process"), tmp_path, "job.yaml")
    (p,) = info.value.problems
    assert p.path == "fault_tolerance.recovery"
    assert "never calls runtime.init()" in p.message and "set 'restart'" in p.message
    assert "\n" not in p.message


def test_explicit_choices_are_kept(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from orchestrator.spec.entrypoint import resolve_recovery
    from orchestrator.spec.job import RecoveryMode

    spec, why = resolve_recovery(_job(tmp_path, RUNTIME_SCRIPTS[0], "in_process"), tmp_path)
    assert spec.fault_tolerance.recovery is RecoveryMode.IN_PROCESS
    assert why == "recovery: in_process (set in the job file)"
    spec, why = resolve_recovery(_job(tmp_path, PLAIN_SCRIPTS[0], "restart"), tmp_path)
    assert spec.fault_tolerance.recovery is RecoveryMode.RESTART
    assert why.startswith("recovery: restart (set in the job file")


def test_unknown_recovery_value_says_what_is_valid() -> None:
    p = only("name: a\nentrypoint: t.py\nfault_tolerance:\n  recovery: restrat\n")
    assert (p.path, p.line) == ("fault_tolerance.recovery", 4)
    assert p.message == (
        "'restrat' is not one of: auto, in_process, restart; did you mean 'restart'?"
    )


def test_redundancy_every_steps_defaults_to_ten_and_refuses_negatives() -> None:
    base = {"name": "j", "entrypoint": {"script": "train.py"}}
    assert load_job_data(base).fault_tolerance.redundancy.every_steps == 10
    off = {**base, "faultTolerance": {"redundancy": {"everySteps": 0}}}
    assert load_job_data(off).fault_tolerance.redundancy.every_steps == 0
    with pytest.raises(SpecError) as e:
        load_job_data({**base, "fault_tolerance": {"redundancy": {"every_steps": -2}}})
    assert "fault_tolerance.redundancy.every_steps: must be 0 (off) or more, got -2" in str(e.value)
