"""What Slurm's client commands print, read into values: a node's state, its switches.

Pure (text in, values out), so every form is tested without a cluster;
:mod:`orchestrator.slurm.commands` runs the commands.  The formats are those
of Slurm 22.05 and later (``scontrol -o`` prints one ``Key=value`` record per
line; a value may hold spaces: ``OS=Linux 6.1 #1 SMP``, ``Reason=disk swap [root@...]``).
"""

from __future__ import annotations

import re

from orchestrator.slurm.api import NodeState, SlurmCommandError

__all__ = ["parse_job_id", "parse_node", "parse_record", "topology_labels"]

#: ``Key=value`` where the value runs to the next `` Key=`` (or the end of the line).
_FIELD_RE = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_]*)=(.*?)(?=\s+[A-Za-z][A-Za-z0-9_]*=|\s*$)")

#: The labels a node gets from the switches above it, by the switch's level
#: (level 0: the leaf switch the node hangs from).  Levels above 1 are labelled
#: ``switch-l<level>``.
LEVEL_LABELS = {0: "rack", 1: "zone"}


def parse_record(line: str) -> dict[str, str]:
    """One ``scontrol -o`` record as a mapping (``NodeName=n1 State=IDLE`` → two keys)."""
    return {m.group(1): m.group(2).strip() for m in _FIELD_RE.finditer(line.strip())}


def parse_node(text: str) -> NodeState:
    """The first node of ``scontrol -o show node NAME``'s output.

    Raises:
        SlurmCommandError: the text holds no node record (what scontrol printed is quoted).
    """
    for line in text.splitlines():
        record = parse_record(line)
        if "NodeName" in record and "State" in record:
            base, *flags = record["State"].split("+")
            return NodeState(
                name=record["NodeName"],
                base=base.rstrip("*").upper(),  # '*': not responding (older forms)
                flags=frozenset(f.upper() for f in flags),
                reason=_reason(record.get("Reason", "")),
                address=record.get("NodeAddr", ""),
            )
    raise SlurmCommandError(f"scontrol printed no node record: {text.strip()[:200]!r}")


def _reason(text: str) -> str:
    """``Reason=disk swap [root@2026-12-02T04:16:00]`` → ``disk swap``."""
    return re.sub(r"\s*\[[^\]]*@[^\]]*\]\s*$", "", text).strip()


def topology_labels(text: str) -> dict[str, str]:
    """Topology labels of a node from ``scontrol show topology NODE``'s output.

    Each switch line above the node gives one label by its ``Level``
    (:data:`LEVEL_LABELS`): the leaf switch is the node's ``rack``, the one
    above its ``zone``.  A cluster without a topology plugin prints no switch:
    no labels.
    """
    out: dict[str, str] = {}
    for line in text.splitlines():
        record = parse_record(line)
        name, level = record.get("SwitchName"), record.get("Level", "")
        if not name or not level.isdigit():
            continue
        out[LEVEL_LABELS.get(int(level), f"switch-l{int(level)}")] = name
    return out


def parse_job_id(text: str) -> str:
    """The job id ``sbatch --parsable`` printed (``42`` or ``42;cluster``).

    Raises:
        SlurmCommandError: no job id in the text.
    """
    first = text.strip().splitlines()[0] if text.strip() else ""
    job_id = first.split(";", 1)[0].strip()
    if not job_id.isdigit():
        raise SlurmCommandError(f"sbatch printed no job id: {text.strip()[:200]!r}")
    return job_id
