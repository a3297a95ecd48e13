"""Users' commands to the controller (``stop``, ``checkpoint``, ``release``), as actions.

Pure: the commands found under the job's ``commands/`` prefix and the control
record the workers see go in; the actions (delete each command, record it as
an event, write the new control record) and the new control record come out.
"""

from __future__ import annotations

import dataclasses

from orchestrator.controller.actions import Action, DeleteCommand, Emit, ReleaseNode, WriteControl
from orchestrator.state.records import CommandRecord, ControlRecord


def take_commands(
    commands: dict[str, CommandRecord], control: ControlRecord
) -> tuple[list[Action], ControlRecord]:
    """The actions for ``commands`` (by key, oldest first) and the control record after them.

    ``stop`` sets the control's stop flag; ``checkpoint`` asks the workers for
    one more checkpoint; ``release`` lets a quarantined node be a spare again;
    anything else is reported as a ``BadCommand`` event.
    """
    actions: list[Action] = []
    new = dataclasses.replace(control)
    for key, cmd in commands.items():
        actions.append(DeleteCommand(key))
        if cmd.command == "stop":
            new.stop = True
        elif cmd.command == "checkpoint":
            new.checkpoint += 1
        elif cmd.command == "release" and isinstance(cmd.args.get("node"), str):
            actions.append(ReleaseNode(cmd.args["node"]))
        else:
            actions.append(Emit("BadCommand", f"unknown command {cmd.command!r}"))
            continue
        reason = f" ({cmd.args['reason']})" if cmd.args.get("reason") else ""
        actions.append(Emit("Command", f"{cmd.command} requested{reason}"))
    if new != control:
        actions.append(WriteControl(new))
    return actions, new
