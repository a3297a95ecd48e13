"""The ``ringmaster`` command line.

Thin by design: each command parses its options, calls one library function
and prints the result.  Commands live in modules grouped by what they work
on; shared options and error handling are in ``options``.
"""

from __future__ import annotations

import sys

from orchestrator.api import OrchestratorError
from orchestrator.etcd.grpc_env import apply_grpc_environment

# The command line is one of ringmaster's own processes: it (and every process
# it starts) gets ringmaster's gRPC settings, set before gRPC is first imported.
apply_grpc_environment()

try:  # every knob is read once, here; a bad one is one line and exit code 2
    from orchestrator.own_packages import check_own_packages
    from orchestrator.settings import SETTINGS  # noqa: F401

    check_own_packages()  # another `agents` or `checkpoint` would fail far from here
except OrchestratorError as _e:
    sys.stderr.write(f"error: {_e}\n")
    sys.exit(2)

import click  # noqa: E402

from orchestrator.cli import (  # noqa: E402
    checkpoint_commands,
    job_commands,
    local_commands,
    observe_commands,
    plan_command,
    service_commands,
    settings_command,
    slurm_commands,
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
    job_commands.release,
    job_commands.logs,
    observe_commands.events_cmd,
    observe_commands.watch,
    observe_commands.report,
    checkpoint_commands.checkpoints,
    checkpoint_commands.resume,
    service_commands.agent,
    service_commands.controller,
    service_commands.operator,
    settings_command.settings,
    plan_command.plan,
    slurm_commands.slurm,
):
    main.add_command(_command)

__all__ = ["main"]
