"""The job file's ``checkpoint`` section: where durable checkpoints go, and storage faults.

Part of the job spec tree (:mod:`orchestrator.spec.job` holds the rest and
re-exports these names); the loader, the CRD schema and every process read it
from there.  A save that fails or hangs is a storage fault, not the script's
error (:mod:`agents.runtime.storage_faults`): the fields at the end say when
such faults end the job, and how long its end waits for a save still uploading.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

__all__ = ["CHECKPOINT_SCHEMES", "DEFAULT_FINAL_WAIT", "CheckpointSpec"]

#: URL schemes accepted for durable checkpoints (fsspec protocols).
CHECKPOINT_SCHEMES = ("file", "s3", "s3a", "gs", "gcs", "az", "abfs", "memory")
_SCHEME_LIST = ", ".join(s + "://" for s in CHECKPOINT_SCHEMES)

Problems = list[tuple[str, str]]

#: Default of ``checkpoint.final_wait``: how long a job that ends waits for a save still
#: uploading before it ends without it (the newest committed checkpoint stays the durable one).
DEFAULT_FINAL_WAIT = timedelta(seconds=15)


@dataclass
class CheckpointSpec:
    """Durable checkpoints: where, how often, how many to keep, and what a storage fault does.

    A save that fails (a full disk, a refused write, an endpoint's error) is a
    storage fault, not the script's: training goes on and the next due save
    tries again.  ``max_consecutive_failures`` failed saves in a row fail the
    job (0: never for this reason).  ``final_wait`` bounds how long a job that
    has ended waits for a save still uploading (a hung endpoint).
    """

    url: str = "file://./checkpoints"
    every_steps: int = 0
    every_seconds: float = 0.0
    keep: int = 3
    async_: bool = field(default=True, metadata={"key": "async"})  # the YAML key
    max_consecutive_failures: int = 0
    final_wait: timedelta = DEFAULT_FINAL_WAIT

    def problems(self) -> Problems:
        out: Problems = []
        scheme = self.url.split("://", 1)[0] if "://" in self.url else "file"
        if not self.url.strip():
            out.append(
                (
                    "url",
                    "is empty: give a directory (a path or file://...) or an object-store "
                    "URL (s3://bucket/path)",
                )
            )
        elif scheme not in CHECKPOINT_SCHEMES:
            out.append(
                (
                    "url",
                    f"scheme '{scheme}' is not supported for checkpoints; "
                    f"use one of {_SCHEME_LIST} or a local path",
                )
            )
        elif "://" in self.url and not self.url.split("://", 1)[1].strip("/"):
            out.append(("url", f"'{self.url}' has no bucket or path after the scheme"))
        if self.every_steps < 0:
            out.append(("every_steps", f"must be 0 (off) or more, got {self.every_steps}"))
        if self.every_seconds < 0:
            out.append(("every_seconds", f"must be 0 (off) or more, got {self.every_seconds:g}"))
        if self.keep < 1:
            out.append(("keep", f"must keep at least 1 checkpoint, got {self.keep}"))
        if self.max_consecutive_failures < 0:
            out.append(
                (
                    "max_consecutive_failures",
                    f"must be 0 (never fail for failed saves) or more, "
                    f"got {self.max_consecutive_failures}",
                )
            )
        if self.final_wait.total_seconds() <= 0:
            wait = self.final_wait.total_seconds()
            out.append(("final_wait", f"must be a positive duration, got {wait:g}s"))
        return out
