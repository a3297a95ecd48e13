"""Contracts of the job spec: one problem in a job file, and the error that lists them all.

The spec tree itself is :mod:`orchestrator.spec.job`, loaded from YAML by
:mod:`orchestrator.spec.loader` and from plain data (a Kubernetes object) by
:mod:`orchestrator.spec.dict_loader`.  Pure: imports only :mod:`orchestrator.api`.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.api import OrchestratorError

__all__ = ["SpecError", "SpecProblem"]


@dataclass(frozen=True)
class SpecProblem:
    """One thing wrong with a job spec.

    Attributes:
        path: dotted path of the field in the job file (``nodes.min``).
        message: what is wrong and what would be valid.
        line: 1-based line in the job file, when known.
        source: name of the job file, when known.
    """

    path: str
    message: str
    line: int | None = None
    source: str | None = None

    def __str__(self) -> str:
        where = self.source or "<spec>"
        if self.line is not None:
            where = f"{where}:{self.line}"
        return f"{where}: {self.path or '<root>'}: {self.message}"


class SpecError(OrchestratorError):
    """A job spec is invalid; ``problems`` lists everything found, not just the first."""

    def __init__(self, problems: list[SpecProblem]) -> None:
        self.problems = list(problems)
        count = len(self.problems)
        head = f"{count} problem{'s' if count != 1 else ''} in job spec"
        super().__init__(head + ":\n" + "\n".join(f"  {p}" for p in self.problems))
