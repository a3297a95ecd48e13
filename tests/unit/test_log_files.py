"""A worker's output on its node: rotated files, pages and tails, served on the agent's port."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from agents.node import log_files
from agents.node.log_files import FILES, WorkerLog, extent, read_after, read_tail
from orchestrator.ports.api import AgentUnreachableError, RequestError
from orchestrator.ports.liveness import Liveness, LivenessServer, ask, probe

pytestmark = pytest.mark.unit


def write(directory: Path, count: int, keep: int, width: int = 100, first: int = 0) -> WorkerLog:
    out = WorkerLog(directory, keep)
    for i in range(first, first + count):
        out.write(1000.0 + i, f"line {i:05d} " + "x" * width)
    return out


def texts(page: log_files.Page) -> list[str]:
    return [text.split(" ")[1] for _, text in page.lines]


def test_files_rotate_and_stay_within_the_budget(tmp_path: Path) -> None:
    keep = 40_000
    out = write(tmp_path, 2000, keep)  # ~230 KB written
    out.close()
    files = sorted(tmp_path.iterdir())
    assert len(files) == FILES
    assert sum(f.stat().st_size for f in files) <= keep + 200
    first, end = extent(tmp_path)
    assert first > 0 and end == out.offset
    # the oldest lines are gone, the newest kept, in order
    page = read_after(tmp_path, None, 1 << 20)
    numbers = [int(t) for t in texts(page)]
    assert numbers == list(range(numbers[0], 2000)) and numbers[0] > 1500
    assert page.next == end
    # a reader behind what rotation kept is told how much it missed
    behind = read_after(tmp_path, 0, 1 << 20)
    assert behind.skipped == first and texts(behind) == texts(page)


def test_pages_continue_across_files_and_a_restarted_writer_appends(tmp_path: Path) -> None:
    write(tmp_path, 300, 1 << 20).close()
    lines: list[str] = []
    after = None
    while True:  # small pages, each of whole lines
        page = read_after(tmp_path, after, 1000)
        if not page.lines:
            break
        lines += texts(page)
        after = page.next
    assert lines == [f"{i:05d}" for i in range(300)]
    again = write(tmp_path, 10, 1 << 20, first=300)  # the same worker, started again
    again.close()
    assert texts(read_after(tmp_path, after, 1 << 20)) == [f"{i:05d}" for i in range(300, 310)]
    assert [t for _, t in read_tail(tmp_path, 2, 1 << 20).lines][-1].startswith("line 00309 ")


def test_tail_is_bounded_by_lines_and_bytes(tmp_path: Path) -> None:
    write(tmp_path, 1000, 30_000).close()  # rotated: the tail spans files
    tail = read_tail(tmp_path, 100, 1 << 20)
    assert texts(tail) == [f"{i:05d}" for i in range(900, 1000)]
    assert tail.next == extent(tmp_path)[1]
    small = read_tail(tmp_path, 100, 1000)  # 1000 bytes hold 8 whole lines of 111
    assert texts(small) == [f"{i:05d}" for i in range(992, 1000)]
    assert read_tail(tmp_path, 0, 1000).lines == []
    assert read_tail(tmp_path / "none", 5, 1000).lines == []


def test_a_line_cut_by_a_crash_is_ended_before_the_next(tmp_path: Path) -> None:
    (tmp_path / "0000000000000000.log").write_bytes(b"1.0 whole\n2.0 cut in the mid")
    out = WorkerLog(tmp_path, 1 << 20)
    out.write(3.0, "after")
    out.close()
    page = read_after(tmp_path, None, 1 << 20)
    assert page.lines == [(1.0, "whole"), (2.0, "cut in the mid"), (3.0, "after")]


def test_the_port_answers_log_requests_and_still_answers_probes(tmp_path: Path) -> None:
    root = tmp_path
    write(log_files.node_dir(root, "job-a", "node-a") / "1", 20, 1 << 20).close()
    requests = log_files.requests("job-a", "node-a", root)
    with LivenessServer("127.0.0.1", lambda: {"node": "node-a"}, requests) as server:
        verdict, answer = probe(server.address)
        assert verdict is Liveness.ALIVE and answer == {"node": "node-a"}
        index = ask(server.address, {"op": "logs.index", "job": "job-a"})
        assert list(index["workers"]) == ["1"]
        tail = ask(server.address, {"op": "logs.tail", "job": "job-a", "local_rank": 1, "lines": 2})
        assert [t for _, t in tail["lines"]] == [f"line {i:05d} " + "x" * 100 for i in (18, 19)]
        page = ask(server.address, {"op": "logs.read", "job": "job-a", "local_rank": 1})
        assert len(page["lines"]) == 20 and page["next"] == tail["next"]
        with pytest.raises(RequestError, match="runs job 'job-a', not 'job-b'"):
            ask(server.address, {"op": "logs.index", "job": "job-b"})
        with pytest.raises(RequestError, match="local_rank must be"):
            ask(server.address, {"op": "logs.read", "job": "job-a", "local_rank": "../x"})
        with pytest.raises(RequestError, match="unknown request 'rm'"):
            ask(server.address, {"op": "rm", "job": "job-a"})
        # a client that says nothing holds only its own session: probes still answer
        silent = [socket.create_connection(server.address.rsplit(":", 1)) for _ in range(12)]
        try:
            assert probe(server.address, timeout=1.0)[0] is Liveness.ALIVE
        finally:
            for s in silent:
                s.close()
        address = server.address
    with pytest.raises(AgentUnreachableError, match="did not answer"):
        ask(address, {"op": "logs.index", "job": "job-a"})


def test_an_agent_without_requests_is_unreachable_for_logs() -> None:
    with (
        LivenessServer("127.0.0.1", lambda: {"node": "old"}) as server,
        pytest.raises(AgentUnreachableError, match="answers no requests"),
    ):
        ask(server.address, {"op": "logs.index", "job": "j"})
