"""Commands on checkpoints: ``checkpoints list|verify|gc URL`` and ``resume JOB``.

Storage is reached with the usual AWS/fsspec settings (``AWS_*`` variables,
``~/.aws``, ``FSSPEC_S3_ENDPOINT_URL`` ...); credentials are never printed.
A URL is a checkpoint root (``s3://bucket/run``) or one checkpoint directory
under it (``.../step-0000000100-1a2b3c4d``).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from functools import wraps
from typing import TYPE_CHECKING, Any, TypeVar

import click
from rich.markup import escape

from orchestrator.cli.options import (
    column,
    connect_client,
    console,
    etcd_options,
    fail,
    handle_errors,
    json_option,
    print_table,
    table,
    wide_option,
)
from orchestrator.observe.units import size_text

if TYPE_CHECKING:
    from checkpoint.api import CheckpointInfo

F = TypeVar("F", bound=Callable[..., Any])


def _local_url(url: str) -> str:
    """A plain path means a local directory."""
    import os

    return url if "://" in url else f"file://{os.path.abspath(url)}"


def handle_checkpoint_errors(fn: F) -> F:
    """Print a checkpoint error as one line and exit 1."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from checkpoint import CheckpointError
        from checkpoint.catalog import scrub

        try:
            return fn(*args, **kwargs)
        except CheckpointError as e:
            fail(scrub(str(e)))

    return wrapper  # type: ignore[return-value]


@click.group("checkpoints")
def checkpoints() -> None:
    """Inspect, verify and clean up a checkpoint root."""


@checkpoints.command("list")
@click.argument("url")
@click.option(
    "--verify",
    "check",
    is_flag=True,
    help="read back every committed checkpoint and compare checksums first (reads all of "
    "them; the outcome is recorded beside each one)",
)
@json_option
@wide_option
@handle_checkpoint_errors
def list_cmd(url: str, check: bool, as_json: bool, wide: bool) -> None:
    """Every checkpoint under URL, oldest first, committed or not.

    The status of a committed checkpoint is what is known of its objects
    without reading them: "verified" (read back and matched its manifest),
    "failed verification" (an object was missing or did not match: restore
    and retention pass it over) or "not verified" (nobody has read it back
    yet).  Restores, retention and `checkpoints verify` record what they find;
    --verify checks every committed checkpoint now.
    """
    from checkpoint.catalog import open_root, redact, verify_all
    from checkpoint.commit import list_checkpoints

    root, _ = open_root(_local_url(url))
    infos = verify_all(root) if check else list_checkpoints(root, list_unreadable=True)
    if as_json:
        for info in infos:
            click.echo(json.dumps(_info_dict(root, info)))
        return
    if not infos:
        console.print(f"no checkpoints under {redact(root.url)}", highlight=False)
        return
    runs = any(i.manifest and i.manifest.run_id for i in infos)
    out = table(
        column("step", wrap=False, justify="right"),
        column("size", wrap=False, justify="right"),
        column("time (UTC)"),
        column("world", wrap=False, justify="right"),
        *([column("run")] if runs else []),
        column("status"),
        column("directory", wrap=False),
    )
    for info in infos:
        m = info.manifest
        out.add_row(
            str(info.step),
            size_text(m.total_bytes) if m else "-",
            time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(m.created_at)) if m else "-",
            str(m.world_size) if m else "-",
            *([escape(m.run_id or "-") if m else "-"] if runs else []),
            escape(_status(root, info)),
            escape(info.name),
        )
    print_table(out, wide)


def _status(root: Any, info: CheckpointInfo) -> str:
    """The status column: verification for a committed checkpoint, else why it is not one."""
    from checkpoint.api import Verification
    from checkpoint.catalog import failure_reason, scrub

    if info.manifest is None:
        return f"not committed: {scrub(str(info.problem))}"
    if info.verification is Verification.FAILED:
        return f"{info.verification.value}: {failure_reason(root, info.name)}"
    return info.verification.value


def _info_dict(root: Any, info: CheckpointInfo) -> dict[str, Any]:
    """One checkpoint as JSON: the table's columns, sizes in bytes, times in UNIX seconds."""
    from checkpoint.api import Verification
    from checkpoint.catalog import failure_reason, redact, scrub

    m = info.manifest
    failed = m is not None and info.verification is Verification.FAILED
    return {
        "step": info.step,
        "size_bytes": m.total_bytes if m else None,
        "created_at": m.created_at if m else None,
        "world_size": m.world_size if m else None,
        "run_id": m.run_id if m else None,
        "committed": m is not None,
        "verification": info.verification.value if m else None,
        "problem": (
            failure_reason(root, info.name)
            if failed
            else scrub(info.problem)
            if info.problem
            else None
        ),
        "directory": info.name,
        "url": redact(info.url),
    }


@checkpoints.command("verify")
@click.argument("url")
@handle_checkpoint_errors
def verify_cmd(url: str) -> None:
    """Read back every object of a checkpoint and compare sizes and checksums.

    URL is one checkpoint directory, or a root (its newest committed
    checkpoint).  Exits 1 and names each bad object when one fails.  The
    outcome is recorded beside the checkpoint: one that fails is passed over
    by restore and retention from then on; one that verifies again (after a
    repair) counts again.
    """
    from checkpoint.catalog import open_root, redact, verify

    open_root(_local_url(url))
    report = verify(_local_url(url))
    where = redact(report.url)
    if report.ok:
        console.print(f"OK: {where} ({size_text(report.checked_bytes)} checked)", highlight=False)
        return
    for problem in report.problems:
        click.echo(f"bad object in {where}: {problem}", err=True)
    sys.exit(1)


@checkpoints.command("gc")
@click.argument("url")
@click.option(
    "--keep", type=click.IntRange(min=1), default=3, show_default=True, help="committed to keep"
)
@click.option(
    "--include-newer",
    is_flag=True,
    help="also remove uncommitted directories newer than the newest committed checkpoint "
    "(only when no job is saving to URL: one of them may be a save in progress)",
)
@click.option(
    "--run",
    "run_id",
    help="only the checkpoints of this run id (the run column of `checkpoints list`); "
    "default: every run's, each keeping its own --keep",
)
@handle_checkpoint_errors
def gc_cmd(url: str, keep: int, include_newer: bool, run_id: str | None) -> None:
    """Remove uncommitted directories and committed checkpoints beyond --keep.

    Checkpoints are kept per run: each run's newest committed checkpoint is
    never removed, and nothing valid is removed while a checkpoint kept in
    its place is unverified (those are read back first) or failed
    verification (those are not counted).
    """
    from checkpoint.catalog import gc, open_root, redact
    from orchestrator.checkpoint_root.writer_hold import live_marker

    _, name = open_root(_local_url(url))
    writer = live_marker(_local_url(url)) if include_newer and name is None else None
    if writer is not None:  # a save in progress is one of the directories it would remove
        fail(
            f"{redact(_local_url(url))} is being written by a live run ({writer.run_id}, run "
            f"{writer.run} of job '{writer.job}'): --include-newer would remove the save it "
            "is writing; run gc without it, or once that run has ended"
        )
    result = gc(_local_url(url), keep, all_uncommitted=include_newer, run_id=run_id)
    for name in result.failed:
        console.print(f"failed verification (marked, kept): {name}", highlight=False)
    for name in result.deleted:
        console.print(f"deleted {name}", highlight=False)
    for name in result.cleaned:
        console.print(f"removed uncommitted {name}", highlight=False)
    kept = ", ".join(result.kept) or "none"
    console.print(f"{redact(_local_url(url))}: kept {kept}", highlight=False)


@click.command()
@click.argument("job")
@click.option(
    "--from",
    "from_url",
    help="a checkpoint directory or root to resume from (default: the newest committed "
    "checkpoint under the job's checkpoint.url)",
)
@click.option(
    "--force", is_flag=True, help="resume from a checkpoint saved by a differently set-up job"
)
@etcd_options
@handle_errors
def resume(job: str, from_url: str | None, force: bool, **kw: Any) -> None:
    """Resubmit a stopped or failed JOB so that it resumes from a checkpoint.

    The checkpoint is checked before anything starts; the job may run on
    another number of nodes (its state is resharded).
    """
    from orchestrator.state import jobs

    with connect_client(kw) as client:
        request = jobs.resume(client, job, _local_url(from_url) if from_url else None, force=force)
        spec, _ = jobs.read_spec(client, job)
    print_resume(job, request, spec.nodes.max * spec.nproc_per_node)


def print_resume(job: str, request: Any, world_size: int) -> None:
    """One line saying where a job resumes from and whether it reshards."""
    from checkpoint.catalog import redact

    reshard = (
        f", resharded from {request.world_size} to up to {world_size} ranks"
        if request.world_size != world_size
        else ""
    )
    console.print(
        f"job '{job}' resumes from step {request.step} ({redact(request.url)}{reshard})",
        highlight=False,
    )
