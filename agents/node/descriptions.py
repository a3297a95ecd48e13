"""How a node agent reads and words things: topology labels, worker exits, its role.

Pure text in and out, no etcd and no processes: ``--labels`` parsed into a
mapping, a worker's exit code and error file turned into one line, and this
node's place in a generation as the line the agent logs.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

from agents.messages import one_line
from orchestrator.state import keys
from orchestrator.state.records import Plan


def parse_labels(text: str | None) -> dict[str, str]:
    """``zone=a,rack=r1`` → ``{"zone": "a", "rack": "r1"}``.

    Raises:
        ValueError: an item is not ``key=value``, or a name or value is not safe
            (see :func:`orchestrator.state.keys.labels`).
    """
    out: dict[str, str] = {}
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"label {item!r} is not key=value (e.g. zone=a,rack=r1)")
        out[key.strip()] = value.strip()
    return keys.labels(out)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def describe_role(plan: Plan, node: str) -> tuple[str, str]:
    """``(role, line)``: this node's place in ``plan``, and how the agent logs it.

    The role is ``active <generation>`` or ``spare``: the agent logs a line
    when it changes, so a spare left out of one generation after another says so once.
    """
    member = plan.member(node)
    if member is None:
        return "spare", f"spare: generation {plan.generation} trains without this node"
    last = member.rank_base + member.nproc - 1
    ranks = f"rank {last}" if member.nproc == 1 else f"ranks {member.rank_base}-{last}"
    return (
        f"active {plan.generation}",
        f"active in generation {plan.generation}: {ranks} of {plan.world_size}",
    )


def read_error_file(path: Path) -> str | None:
    """The root-cause message from a torch elastic error file, if the worker wrote one."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    message = data.get("message", data)
    if isinstance(message, dict):
        message = message.get("message", json.dumps(message))
    return one_line(str(message), 300) if message else None
