"""DCP's failures in one line: which rank failed and with what.

``torch.distributed.checkpoint`` gathers every rank's exception into a
``CheckpointException`` whose text is a traceback per rank; users need the
rank and the error, not the frames inside DCP.
"""

from __future__ import annotations

import traceback

from torch.distributed.checkpoint.api import CheckpointException


def describe(e: BaseException) -> str:
    """``rank 0: OSError: [Errno 5] Input/output error; rank 1: ...`` for a DCP failure,
    ``str(e)`` for anything else."""
    if not isinstance(e, CheckpointException):
        return str(e)
    parts = []
    for rank, failure in sorted(e.failures.items()):
        exc = failure[0] if isinstance(failure, tuple) else failure
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        parts.append(f"rank {rank}: {text}")
    return "; ".join(parts) or "DCP reported a failure without details"
