"""``ringmaster settings``: every ``RINGMASTER_*`` knob, its default and the value in force."""

from __future__ import annotations

import click
from rich.table import Table

from orchestrator.cli.options import console
from orchestrator.settings import knobs_in_force


@click.command()
def settings() -> None:
    """Print every RINGMASTER_* knob: its default, the value in force and its meaning."""
    table = Table(
        title="ringmaster settings (environment knobs)",
        title_justify="left",
        caption="* set in this environment",
        caption_justify="left",
    )
    table.add_column("variable", no_wrap=True)
    table.add_column("default", justify="right")
    table.add_column("in force", justify="right")
    table.add_column("meaning")
    for knob, value, from_env in knobs_in_force():
        shown = f"[bold]{value}[/bold] *" if from_env else value
        table.add_row(knob.env, knob.default or "(none)", shown, knob.meaning)
    console.print(table)
