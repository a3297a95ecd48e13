"""What the CLI prints, read at 80 columns the way a new user's terminal shows it.

`status`, `events` and `checkpoints list` against an in-memory stand-in for
etcd (the commands read it through the same record functions as ever):
tables fit 80 columns without cutting a word, a long failure message is
readable whole, recovery phases come in the order they happen, ``--json``
prints the fields of the table, ``--wide`` one line per row; ``logs --node``
with a node the job never had is an error that names the nodes it has;
counts agree with their noun; worker lines carry one prefix.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result
from rich.console import Console

from agents.messages import one_line
from checkpoint import Checkpointer, TrainState
from checkpoint.commit import step_dir_name
from orchestrator.api import JobPhase
from orchestrator.cli import job_commands, main, observe_commands, options
from orchestrator.cli.options import plural
from orchestrator.etcd.kv import KeyValue
from orchestrator.local_run import LocalRun
from orchestrator.observe.records import PHASES
from orchestrator.observe.recoveries import ordered_phases
from orchestrator.spec.loader import load_job_data
from orchestrator.state import events, keys, records
from orchestrator.state.records import JobStatus, LogChunk, TrainingTime

pytestmark = pytest.mark.unit

#: A gloo error as the controller quotes it: longer than a table cell, with a path in it.
GLOO = (
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Timed out waiting 1800000ms "
    "for recv operation to complete. This is typically caused by a remote worker hanging "
    "or bugs in the application. Check the logs of the remote worker before reporting an error."
)


class MemoryEtcd:
    """The part of EtcdClient the read-only commands use, over a dict."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.revision = 0

    def __enter__(self) -> MemoryEtcd:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def put(self, key: str, value: bytes | str, lease: Any = None) -> int:
        self.revision += 1
        self.data[key] = value.encode() if isinstance(value, str) else value
        return self.revision

    def get(self, key: str) -> KeyValue | None:
        value = self.data.get(key)
        return None if value is None else KeyValue(key, value, self.revision, 0, 0, 0)

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        return [
            KeyValue(k, v, self.revision, 0, 0, 0)
            for k, v in sorted(self.data.items())
            if k.startswith(prefix)
        ]

    def child_names(self, prefix: str) -> list[str]:
        return sorted(
            {k[len(prefix) :].split("/", 1)[0] for k in self.data if k.startswith(prefix)}
        )

    def get_many(self, keys: list[str]) -> dict[str, KeyValue]:
        return {k: kv for k in keys if (kv := self.get(k)) is not None}

    def keep_newest(self, prefix: str, keep: int, slack: int = 0) -> int:
        return 0

    def db_sizes(self, timeout: Any = None) -> dict[str, int]:
        return {"memory": 0}

    def alarms(self) -> list[tuple[int, str]]:
        return []


@pytest.fixture
def etcd(monkeypatch: pytest.MonkeyPatch) -> Iterator[MemoryEtcd]:
    """A fake etcd behind every command, and an 80-column console for what they print."""
    memory = MemoryEtcd()
    for module in (job_commands, observe_commands):
        monkeypatch.setattr(module, "connect_client", lambda kw: memory)
    # an etcd is given (the fake one answers): `logs` without one reads this machine's files
    monkeypatch.setenv("RINGMASTER_ETCD", "127.0.0.1:2379")
    narrow = Console(width=80)  # writes to sys.stdout when it prints: CliRunner's
    for module in (job_commands, observe_commands, options):
        monkeypatch.setattr(module, "console", narrow)
    import orchestrator.cli.checkpoint_commands as checkpoint_commands

    monkeypatch.setattr(checkpoint_commands, "console", narrow)
    yield memory


def _cli(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), env={"COLUMNS": "80"}, catch_exceptions=False)


def _recovering(name: str = "llama-finetune", message: str = "") -> JobStatus:
    now = time.time()
    return JobStatus(
        name,
        JobPhase.RECOVERING,
        step=123456,
        world_size=4,
        generation=3,
        active_nodes=["node-a", "node-b"],
        spare_nodes=["node-d"],
        failed_nodes=["node-c"],
        recoveries=1,
        last_checkpoint="step 150 (periodic)",
        last_checkpoint_at=now - 12,
        message=message or f"node-c failed: worker node-c-0 raised RuntimeError: {GLOO}",
        steps_per_s=12.34,
        samples_per_s=789.0,
        loss=0.1234,
        train_started_at=now - 100,
        productive_s=87.0,
        effective_fraction=0.87,
        # as it comes back from etcd: the phases in key order
        last_recovery={
            "cause": "agent_gone",
            "total_s": 2.31,
            "phases": {"detect": 0.5, "first_step": 0.41, "rendezvous": 0.8, "restore": 0.6},
        },
    )


def _store(memory: MemoryEtcd, *statuses: JobStatus) -> None:
    for s in statuses:
        records.write(memory, keys.job_status(s.name), s)  # type: ignore[arg-type]


def _words(text: str) -> list[str]:
    return re.findall(r"[\w./:\[\]()-]+", text)


def _cells_are_whole(output: str, *values: str) -> None:
    """Every word of ``values`` appears whole in ``output``; no ellipsis anywhere."""
    assert "…" not in output, output
    for value in values:
        for word in value.split():
            assert word in output, f"{word!r} is cut in:\n{output}"


def _row(output: str, key: str) -> str:
    """The value of ``key`` in a two-column table, its wrapped lines joined."""
    lines = output.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(f"{key} "))
    parts = [lines[first].split("│", 1)[1].strip()]
    for line in lines[first + 1 :]:
        head, _, value = line.partition("│")
        if head.strip() or not value:
            break
        parts.append(value.strip())
    return " ".join(parts)


def _fits(output: str, width: int = 80) -> None:
    for line in output.splitlines():
        assert len(line.rstrip()) <= width, f"{len(line.rstrip())} columns: {line!r}"


# -- status -----------------------------------------------------------------------------


def test_status_of_all_jobs_fits_80_columns_without_cutting_a_word(etcd: MemoryEtcd) -> None:
    _store(etcd, _recovering("train"), JobStatus("tiny", JobPhase.SUCCEEDED))
    result = _cli("status")
    assert result.exit_code == 0, result.output
    out = result.output
    _fits(out)
    _cells_are_whole(out, "Recovering", "Succeeded", "recoveries", "effective", "checkpoint")
    _cells_are_whole(out, "step 150 (periodic), 12s ago", "123456", "12.3/s", "2/1/1", "87%")


def test_status_of_one_job_shows_the_whole_message_and_phases_in_order(etcd: MemoryEtcd) -> None:
    status = _recovering()
    _store(etcd, status)
    result = _cli("status", status.name)
    assert result.exit_code == 0, result.output
    out = result.output
    _fits(out)
    assert "…" not in out
    # the message, read across its wrapped lines, is all there, word for word
    assert _row(out, "message") == status.message
    # the recovery phases in the order they happen, not alphabetically
    assert _row(out, "last recovery") == (
        "agent_gone: 2.31s (detect 0.50s, rendezvous 0.80s, restore 0.60s, first step 0.41s)"
    )


def test_status_of_one_job_shows_start_up_failures_and_checkpoint_stalls_apart(
    etcd: MemoryEtcd,
) -> None:
    status = _recovering()
    status.training_time = TrainingTime(
        wall_s=130.0,
        startup_s=15.2,
        since_first_step_s=114.8,
        productive_s=110.0,
        failures_s=2.8,
        recovering_s=2.31,
        rerun_s=0.49,
        checkpoint_s=1.5,
        other_s=0.5,
        effective=0.9582,
        whole_run=0.8462,
        step_s=0.1,
    )
    _store(etcd, status)
    out = _cli("status", status.name).output
    _fits(out)
    assert _row(out, "start-up") == "15.2s (submission to the first step)"
    assert _row(out, "lost to failures") == "2.80s (recovering 2.31s, steps re-run 0.49s)"
    assert _row(out, "checkpoint stalls") == "1.50s"
    assert _row(out, "effective training").startswith(
        "95.8% since the first step (84.6% of the whole run)"
    )
    (row,) = [json.loads(line) for line in _cli("status", "--json").output.splitlines()]
    assert row["training_time"]["startup_s"] == 15.2 and row["effective_fraction"] == 0.87


def test_status_wide_prints_each_row_on_one_line(etcd: MemoryEtcd) -> None:
    status = _recovering()
    _store(etcd, status)
    out = _cli("status", "--wide").output
    (row,) = [line for line in out.splitlines() if line.startswith(status.name)]
    assert status.message in row and "world" in out and "samples/s" in out
    assert "detect 0.50s, rendezvous 0.80s, restore 0.60s, first step 0.41s" in row


def test_status_json_has_the_fields_of_the_table(etcd: MemoryEtcd) -> None:
    status = _recovering()
    _store(etcd, status, JobStatus("tiny", JobPhase.SUCCEEDED))
    out = _cli("status", "--json").output
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["name"] for r in rows] == ["llama-finetune", "tiny"]
    row = rows[0]
    for field in (
        "phase",
        "step",
        "steps_per_s",
        "samples_per_s",
        "world_size",
        "active_nodes",
        "spare_nodes",
        "failed_nodes",
        "recoveries",
        "last_checkpoint",
        "last_checkpoint_at",
        "effective_fraction",
        "message",
        "last_recovery",
    ):
        assert field in row, field
    assert row["phase"] == "Recovering" and row["message"] == status.message
    assert list(row["last_recovery"]["phases"]) == list(PHASES)
    assert JobStatus.from_dict({**row, "v": 1}) == status  # nothing left out
    (one,) = [json.loads(line) for line in _cli("status", "tiny", "--json").output.splitlines()]
    assert one["name"] == "tiny" and one["phase"] == "Succeeded"


def test_status_without_jobs_says_so(etcd: MemoryEtcd) -> None:
    assert _cli("status").output.startswith("no jobs")
    assert _cli("status", "--json").output == ""


def test_ordered_phases_follow_the_recovery_and_keep_unknown_names_last() -> None:
    stored = {"restore": 3.0, "later": 5.0, "first_step": 4.0, "detect": 1.0, "rendezvous": 2.0}
    assert list(ordered_phases(stored)) == [*PHASES, "later"]


# -- events -----------------------------------------------------------------------------


def test_events_fit_80_columns_and_wrap_messages_between_words(etcd: MemoryEtcd) -> None:
    etcd.put(keys.job_spec("train"), b"{}")
    message = f"node-c failed: worker node-c-0 raised RuntimeError: {GLOO}"
    events.emit(etcd, "train", "NodeFailed", message, cause="agent_gone")  # type: ignore[arg-type]
    events.emit(etcd, "train", "Recovered", "generation 2 trains again")  # type: ignore[arg-type]
    out = _cli("events", "train").output
    _fits(out)
    _cells_are_whole(out, "NodeFailed", "Recovered", "controller")
    lines = [line.split("│") for line in out.splitlines() if "│" in line]
    first = next(i for i, cells in enumerate(lines) if cells[1].strip() == "NodeFailed")
    cell = [lines[first][3].strip()]
    cell += [cells[3].strip() for cells in lines[first + 1 :] if not cells[0].strip()]
    width = len(lines[0][3]) - 1
    # every word that fits the column is on one line; the one longer (a path) is folded
    for word in message.split():
        if len(word) <= width:
            assert any(word in part.split() for part in cell), (word, cell)
    assert "".join("".join(cell).split()) == "".join(message.split())
    wide = _cli("events", "train", "--wide").output
    assert any(message in line for line in wide.splitlines())


# -- checkpoints list -------------------------------------------------------------------


def test_checkpoints_list_json_has_the_fields_of_the_table(
    etcd: MemoryEtcd, tmp_path: Path
) -> None:
    url = f"file://{tmp_path}/ckpt"
    model = torch.nn.Linear(8, 4)
    ckpt = Checkpointer(url, keep=10)
    for step in (10, 20):
        ckpt.save_now(step, TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1)))
    dead = step_dir_name(30, "dead0001")
    (tmp_path / "ckpt" / dead).mkdir()
    (tmp_path / "ckpt" / dead / "__0_0.distcp").write_bytes(b"partial")

    result = _cli("checkpoints", "list", url, "--json")
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.output.splitlines()]
    assert [(r["step"], r["committed"], r["world_size"]) for r in rows] == [
        (10, True, 1),
        (20, True, 1),
        (30, False, None),
    ]
    assert rows[0]["size_bytes"] > 0 and rows[0]["created_at"] > 0
    assert rows[2]["directory"] == dead and "manifest" in rows[2]["problem"]
    assert [r["verification"] for r in rows] == ["not verified", "not verified", None]

    table = _cli("checkpoints", "list", url).output
    _fits(table)
    _cells_are_whole(table, dead, "not committed: no manifest (never committed)")


# -- logs -------------------------------------------------------------------------------


def _log(memory: MemoryEtcd, job: str, node: str, local_rank: int, text: str) -> None:
    chunk = LogChunk(node, local_rank, [(time.time(), text)])
    key = keys.worker_logs(job, node, local_rank) + f"{time.time_ns():020d}"
    records.write(memory, key, chunk)  # type: ignore[arg-type]


def test_logs_of_an_unknown_node_is_an_error_naming_the_nodes(etcd: MemoryEtcd) -> None:
    _store(etcd, JobStatus("train", JobPhase.RUNNING, active_nodes=["node-0", "node-1"]))
    _log(etcd, "train", "node-0", 0, "hello")
    _log(etcd, "train", "node-9", 0, "from a node that died")
    result = CliRunner().invoke(main, ["logs", "train", "--node", "nonode"])
    assert result.exit_code == 1
    assert "'nonode'" in result.output
    assert "node-0, node-1, node-9" in result.output

    ok = CliRunner().invoke(main, ["logs", "train", "--node", "node-9"])
    assert ok.exit_code == 0 and ok.output == "[node-9/0] from a node that died\n"
    quiet = CliRunner().invoke(main, ["logs", "train", "--node", "node-1"])  # no output yet
    assert quiet.exit_code == 0 and quiet.output == ""


# -- counts, messages, prefixes ---------------------------------------------------------


@pytest.mark.parametrize(
    ("count", "text"), [(0, "0 recoveries"), (1, "1 recovery"), (2, "2 recoveries")]
)
def test_counts_agree_in_number(count: int, text: str) -> None:
    assert plural(count, "recovery", "recoveries") == text


def test_watch_says_1_recovery(etcd: MemoryEtcd, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = load_job_data({"name": "train", "entrypoint": "train.py"})
    monkeypatch.setattr(job_commands.jobs, "read_spec", lambda client, job: (spec, "h"))
    done = JobStatus("train", JobPhase.SUCCEEDED, step=150, recoveries=1)
    _store(etcd, done)
    out = _cli("watch", "train", "--interval", "0").output
    assert "train: Succeeded at step 150; 1 recovery;" in out


def test_a_long_failure_message_ends_with_a_whole_sentence_or_word() -> None:
    kept = one_line(RuntimeError(GLOO))
    assert kept.endswith("bugs in the application.") and len(kept) <= 200
    words = one_line(RuntimeError("lorem ipsum " * 30))
    assert words.endswith("…") and len(words) <= 200
    assert words[:-1].split()[-1] in ("lorem", "ipsum")
    assert one_line(RuntimeError("short")) == "short"
    assert one_line(RuntimeError("")) == "RuntimeError"
    assert one_line(RuntimeError("\nsecond line first")) == "second line first"
    assert one_line(f"RuntimeError: {GLOO}", 300) == f"RuntimeError: {GLOO}"
    assert one_line(f"RuntimeError: {GLOO}", 100).endswith(" 1800000ms for…")


def test_run_prints_one_prefix_per_line() -> None:
    printed: list[str] = []
    spec = load_job_data({"name": "train", "entrypoint": "train.py"})
    run = LocalRun(spec, printer=printed.append)

    class Stream:
        def __init__(self, lines: list[bytes]) -> None:
            self.lines = [*lines, b""]

        def readline(self) -> bytes:
            return self.lines.pop(0)

    run._pump(
        "node-c",
        Stream(  # type: ignore[arg-type]
            [
                b"2026-11-23 06:10:01,123 [node-c] registered for job 'train'\n",
                b"2026-11-23 06:10:02,456 generation 3 ends: a collective failed\n",
                b"step 0 loss 1.0 [node-c] is fine in a script's own words\n",
            ]
        ),
    )
    assert printed == [
        "[node-c] 2026-11-23 06:10:01,123 registered for job 'train'",
        "[node-c] 2026-11-23 06:10:02,456 generation 3 ends: a collective failed",
        "[node-c] step 0 loss 1.0 [node-c] is fine in a script's own words",
    ]
