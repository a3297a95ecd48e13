"""The ``ringmaster`` command line.

Thin by design: each command parses its options, calls one library function
and prints the result.  Commands live in modules grouped by what they work
on; shared options and error handling are in ``options``.
"""

from __future__ import annotations

import click

from orchestrator.cli import (
    checkpoint_commands,
    job_commands,
    local_commands,
    observe_commands,
    service_commands,
)


@click.group()
@click.version_option(package_name="ringmaster")
def main() -> None:
    """ringmaster: fault-tolerant, elastic training for PyTorch."""


for _command in (
    local_commands.validate,
    local_commands.etcd_cmd,
    local_commands.run,
    job_commands.submit,
    job_commands.status,
    job_commands.stop,
    job_commands.logs,
    observe_commands.events_cmd,
    observe_commands.watch,
    observe_commands.report,
    checkpoint_commands.checkpoints,
    checkpoint_commands.resume,
    service_commands.agent,
    service_commands.controller,
    service_commands.operator,
):
    main.add_command(_command)

__all__ = ["main"]
