"""Which fragment of the model syncs at which step (pure; runs in the training process).

DiLoCo syncs the whole model every ``inner_steps`` (H) steps.  Streaming
DiLoCo cuts it into ``fragments`` (F) parts and staggers them: fragment ``f``
starts its sync when ``(f + 1) * H / F`` more steps are complete, then every
H steps, so one fragment's bytes are on the wire at a time and the peak
bandwidth falls F-fold.  A sync's result is used ``delay_steps`` (tau) steps
after it started: the all-gather runs while the next inner steps compute.

Steps are counted as the session counts them: the boundary after the step
numbered ``k`` has ``k + 1`` steps complete, and that count is what
:meth:`FragmentSchedule.starts_at` takes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["FragmentSchedule", "cut_fragments"]


@dataclass(frozen=True)
class FragmentSchedule:
    """When each fragment's sync starts and when its result is applied."""

    inner_steps: int
    fragments: int = 1
    delay_steps: int = 0

    def __post_init__(self) -> None:
        if self.inner_steps < 1 or self.fragments < 1 or self.inner_steps % self.fragments:
            raise ValueError(
                f"{self.fragments} fragment(s) cannot be staggered over {self.inner_steps} steps"
            )
        if not 0 <= self.delay_steps < self.spacing:
            raise ValueError(f"delay_steps {self.delay_steps} is not below {self.spacing}")

    @property
    def spacing(self) -> int:
        """Steps between the starts of two consecutive fragments' syncs."""
        return self.inner_steps // self.fragments

    def starts_at(self, done: int) -> int | None:
        """The fragment whose sync starts once ``done`` steps are complete, if any."""
        if done <= 0 or done % self.spacing:
            return None
        return (done // self.spacing - 1) % self.fragments

    def applies_at(self, done: int) -> int | None:
        """The fragment whose sync's result is used once ``done`` steps are complete."""
        return self.starts_at(done - self.delay_steps)

    def starts_between(self, after: int, through: int) -> list[tuple[int, int]]:
        """``(done, fragment)`` of every start with ``after < done <= through``, in order."""
        first = (after // self.spacing + 1) * self.spacing
        return [
            (done, (done // self.spacing - 1) % self.fragments)
            for done in range(max(first, self.spacing), through + 1, self.spacing)
        ]


def cut_fragments(sizes: Sequence[int], fragments: int) -> list[list[int]]:
    """Cut parameters (by element count, in model order) into ``fragments`` contiguous runs.

    Each run holds about ``sum(sizes) / fragments`` elements: a parameter goes to
    the run whose share of the total its middle falls in.  Every run holds at
    least one parameter.

    Raises:
        ValueError: fewer parameters than fragments.
    """
    if len(sizes) < fragments:
        raise ValueError(
            f"sync.fragments is {fragments} but the model has only {len(sizes)} parameter "
            f"tensor(s): use at most {len(sizes)} fragments"
        )
    total = max(1, sum(sizes))
    runs: list[list[int]] = [[] for _ in range(fragments)]
    seen = 0
    for i, size in enumerate(sizes):
        middle = seen + size / 2
        seen += size
        # never leave a later run empty: keep room for one parameter each
        last_allowed = fragments - (len(sizes) - i)
        first_allowed = next((f for f in range(fragments) if not runs[f]), fragments - 1)
        want = min(int(middle * fragments / total), fragments - 1)
        runs[max(min(want, first_allowed), last_allowed, 0)].append(i)
    return runs
