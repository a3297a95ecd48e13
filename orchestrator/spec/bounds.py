"""Upper bounds of a job spec's sizes, each with the reason it exists.

A job spec is read by the CLI, the controller, every node agent and the
Kubernetes operator; a size past what the system can hold (a typo's extra
zeros, ``nproc_per_node: 100000000``) must be refused where it is written,
with its reason, not found out by an agent starting processes until the
machine gives out or by etcd refusing a record.  :mod:`orchestrator.spec.job`
checks these in ``problems()``; the spec loader checks that every integer
fits :data:`INT64_MAX`.  Pure data; imported by whatever validates a spec,
with the problem list type and the duration check every section of the spec uses.
"""

from __future__ import annotations

from datetime import timedelta

__all__ = [
    "INT64_MAX",
    "MAX_NODES",
    "MAX_NPROC_PER_NODE",
    "REASONS",
    "Problems",
    "out_of_int64",
    "positive_duration",
    "too_large",
]

#: ``(relative dotted path, message)`` pairs, as every ``problems()`` of the spec returns.
Problems = list[tuple[str, str]]


def positive_duration(value: timedelta, path: str) -> Problems:
    """``path``'s problem when ``value`` is not a positive duration."""
    if value.total_seconds() <= 0:
        return [(path, f"must be a positive duration, got {value.total_seconds():g}s")]
    return []


#: Largest integer anywhere in a spec: steps travel as int64 tensors in the
#: workers' step-boundary vote, and Kubernetes stores a TrainingJob's integers
#: as int64.
INT64_MAX = 2**63 - 1

#: Most worker processes on one node.  Each local rank is a process the node
#: agent starts and supervises; the largest machines have a few hundred cores
#: and 8 or 16 GPUs, so a larger number is a typo that would have the agent
#: start processes until the machine gives out.
MAX_NPROC_PER_NODE = 1024

#: Most nodes of one job, spares included.  A generation's plan lists every
#: node (its name, ranks and topology labels) in one etcd value, which etcd
#: caps at 1.5 MiB (``--max-request-bytes``): 8,192 nodes with three topology
#: labels each encode to about 1.2 MB.
MAX_NODES = 8192

#: Why each bound exists, by the name :func:`too_large` is given.
REASONS = {
    "steps": "steps are counted in 64-bit integers (the workers' step vote, Kubernetes)",
    "nproc": (
        "each local rank is a worker process on one machine, and no machine usefully runs "
        "more (one per GPU, or per CPU core)"
    ),
    "nodes": (
        "nodes.spares counted in; a generation's plan lists every node in one etcd value, "
        "which etcd caps at 1.5 MiB"
    ),
}


def _shown(value: int) -> str:
    digits = len(str(abs(value)))
    return f"{value:,}" if digits <= 30 else f"a number of {digits} digits"


def too_large(value: int, ceiling: int, reason: str) -> str:
    """The message for ``value`` over ``ceiling``: what is valid, then why (``REASONS`` key)."""
    return f"must be at most {ceiling:,}, got {_shown(value)}: {REASONS[reason]}"


def out_of_int64(value: int) -> str:
    """The message for an integer of a job file that no 64-bit integer holds."""
    return (
        f"must be between -{INT64_MAX + 1:,} and {INT64_MAX:,} (a 64-bit integer, what "
        f"Kubernetes and the workers hold), got {_shown(value)}"
    )
