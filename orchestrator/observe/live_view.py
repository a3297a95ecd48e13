"""The live view of a job: a progress bar with step, rate, ETA and phase.

Used by ``ringmaster watch`` and ``ringmaster run``.  Lines printed through
:meth:`LiveView.print` (worker output, events) appear above the bar, so the
prefixed output of ``run`` stays readable.  When the console is not a
terminal the bar is left out and only the lines are printed.  Failures and
recoveries are highlighted as they happen.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn
from rich.table import Column

from orchestrator.state.events import Event
from orchestrator.state.records import JobStatus

#: Event types shown as failures (red) and as recoveries (green).
FAILURE_EVENTS = frozenset(
    {"NodeFailed", "WorkerExited", "WorkerHung", "Preempted", "NodeLost", "NodeRefused"}
)
RECOVERY_EVENTS = frozenset({"Recovered"})


def format_eta(seconds: float | None) -> str:
    if seconds is None:
        return "--:--"
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


def eta_seconds(status: JobStatus, total: int) -> float | None:
    """Time left at the current rate (None while the rate is unknown or zero)."""
    if total <= 0 or status.steps_per_s <= 0:
        return None
    return max(0, total - status.step) / status.steps_per_s


def event_line(ev: Event) -> str:
    """One event as a rich-markup line, coloured by kind."""
    text = escape(f"[event] {ev.type}: {ev.message}")
    if ev.type in FAILURE_EVENTS:
        return f"[bold red]{text}[/]"
    if ev.type in RECOVERY_EVENTS:
        return f"[bold green]{text}[/]"
    if ev.type == "Warning":
        return f"[bold yellow]{text}[/]"
    if ev.type == "Checkpoint":
        return f"[cyan]{text}[/]"
    return text


def _whole() -> Column:
    """A column of the bar's line that is never wrapped nor cut."""
    return Column(no_wrap=True, overflow="ignore")


class LiveView:
    """A job's progress bar plus the lines printed above it.

    Args:
        console: where to draw.
        job: the job's name (shown before the bar).
        total: the job's ``max_steps`` (0: unknown, the bar shows the step only).
        bar: draw the bar; default: only when the console is a terminal.
    """

    def __init__(self, console: Console, job: str, total: int, bar: bool | None = None) -> None:
        self.console = console
        self.job = job
        self.total = total
        self.bar = console.is_terminal if bar is None else bar
        # The numbers stay whole on one line; the bar takes the width that is left.
        self._progress = Progress(
            TextColumn("[bold]{task.description}", table_column=_whole()),
            TextColumn("{task.fields[phase]}", table_column=_whole()),
            BarColumn(bar_width=None, table_column=Column(ratio=1)),
            MofNCompleteColumn(table_column=_whole()),
            TextColumn("{task.fields[rate]} steps/s", table_column=_whole()),
            TextColumn("ETA {task.fields[eta]}", table_column=_whole()),
            console=console,
            disable=not self.bar,
            transient=False,
            expand=True,
        )
        self._task: TaskID | None = None

    def __enter__(self) -> LiveView:
        self._progress.start()
        self._task = self._progress.add_task(
            self.job, total=self.total or None, phase="Pending", rate="0.0", eta="--:--"
        )
        return self

    def __exit__(self, *exc: Any) -> None:
        self._progress.stop()

    def print(self, line: str) -> None:
        """A plain line (no markup) above the bar."""
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def event(self, ev: Event) -> None:
        self.console.print(event_line(ev), highlight=False, soft_wrap=True)

    def update(self, status: JobStatus) -> None:
        if self._task is None:
            return
        self._progress.update(
            self._task,
            completed=status.step,
            phase=status.phase.value,
            rate=f"{status.steps_per_s:.1f}",
            eta=format_eta(eta_seconds(status, self.total)),
        )
