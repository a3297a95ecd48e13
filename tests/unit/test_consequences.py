"""`ringmaster run`'s output after a node's death: the failed node's event first, the
survivors' tracebacks after it, folded and marked as a consequence."""

from __future__ import annotations

import pytest

from orchestrator.observe.consequences import HOLD_S, ConsequenceFolder
from orchestrator.state.records import Event

pytestmark = pytest.mark.unit

TRACEBACK = [
    "[rank1]: Traceback (most recent call last):",
    '[rank1]:   File "/srv/job/train.py", line 108, in main',
    "[rank1]:     loss.backward()",
    "[rank1]:            ^^^^^^^^^^",
    "[rank1]: RuntimeError: [pair.cc:537] Read error [127.0.0.1]:1524: Connection reset by peer",
]


class Printed:
    def __init__(self) -> None:
        self.out: list[str] = []
        self.now = 100.0

    def line(self, text: str) -> None:
        self.out.append(text)

    def event(self, ev: Event) -> None:
        self.out.append(f"[event] {ev.type}: {ev.message}")

    def folder(self) -> ConsequenceFolder:
        return ConsequenceFolder("probe", self.line, self.event, clock=lambda: self.now)


def _survivor_output(folder: ConsequenceFolder) -> None:
    folder.output("node-0", "step 20 loss 0.6000")
    for line in TRACEBACK:
        folder.output("node-1", line)
    folder.output(
        "node-1",
        "2026-11-25 22:12:35,325 worker node-1-0 failed in generation 1 "
        "(exit code 1: [rank1]: RuntimeError: ... reset by peer)",
    )
    folder.event(
        Event(
            "WorkerExited",
            "node-1-0 exit code 1: RuntimeError: reset",
            source="node-1",
            data={"worker": "node-1-0"},
        )
    )


def test_the_failed_nodes_event_comes_first_and_the_survivors_traceback_is_folded() -> None:
    p = Printed()
    folder = p.folder()
    _survivor_output(folder)
    assert p.out == ["[node-0] step 20 loss 0.6000"]  # the rest waits for its cause
    folder.event(Event("Generation", "generation 2: node-2, node-1 (node-2 replaces node-0)"))
    folder.event(
        Event(
            "NodeFailed",
            "node-0: agent of node-0 gone (liveness port refused)",
            data={"node": "node-0"},
        )
    )
    folder.event(Event("Phase", "Recovering: generation 2: node-2 replaces node-0"))
    assert p.out[1:] == [
        "[event] NodeFailed: node-0: agent of node-0 gone (liveness port refused)",
        "[node-1] after node-0 failed (a consequence, not the cause): [rank1]: RuntimeError: "
        "[pair.cc:537] Read error [127.0.0.1]:1524: Connection reset by peer (6 lines folded: "
        "`ringmaster logs probe --node node-1`)",
        "[event] Generation: generation 2: node-2, node-1 (node-2 replaces node-0)",
        "[event] Phase: Recovering: generation 2: node-2 replaces node-0",
    ]


def test_the_scripts_own_error_is_printed_whole_once_it_is_settled() -> None:
    p = Printed()
    folder = p.folder()
    _survivor_output(folder)
    folder.event(Event("Restart", "restart 1 of 3 after an error in the training script"))
    assert p.out[1:6] == [f"[node-1] {x}" for x in TRACEBACK]
    assert p.out[-2:] == [
        "[event] WorkerExited: node-1-0 exit code 1: RuntimeError: reset",
        "[event] Restart: restart 1 of 3 after an error in the training script",
    ]


def test_nothing_waits_longer_than_the_hold() -> None:
    p = Printed()
    folder = p.folder()
    folder.output("node-1", TRACEBACK[0])
    folder.output("node-1", TRACEBACK[1])  # the process died mid-traceback
    folder.tick()
    assert p.out == []
    p.now += HOLD_S
    folder.tick()
    assert p.out == [f"[node-1] {x}" for x in TRACEBACK[:2]]
    folder.output("controller-0", "a line of the controller")
    assert p.out[-1] == "[controller-0] a line of the controller"
