"""Which nodes can read a restart-tier script's own checkpoint, said before the job starts.

After a failure in the restart tier every worker starts again, a spare
included, and resumes from what its script finds where it saved.  A path
relative to where each agent starts, or a directory on one machine's own
disk, is not there for a node whose agent starts elsewhere: that node trains
from zero.  :func:`script_checkpoint` puts together where the script saves
(:func:`orchestrator.checkpoint_root.script_checkpoint.find_saves`), what ringmaster gives it
(``RINGMASTER_CHECKPOINT_DIR``: :func:`script_checkpoint_dir`) and what the
path is (a URL, relative, or on a filesystem of this machine:
:func:`filesystem_type`), and words it for ``ringmaster validate`` and for the
job's events.  Runs in the CLI (``validate``, ``submit``, ``run``).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path

from orchestrator.checkpoint_root.script_checkpoint import Part, Save, find_saves
from orchestrator.etcd.client import EtcdClient
from orchestrator.spec.entrypoint import entrypoint_file
from orchestrator.spec.job import JobSpec
from orchestrator.state import events

__all__ = [
    "ENV_CHECKPOINT_DIR",
    "Reach",
    "ScriptCheckpoint",
    "filesystem_type",
    "record_event",
    "script_checkpoint",
    "script_checkpoint_dir",
    "script_storage",
]

#: Where ringmaster tells a restart-tier script to keep its checkpoints.
ENV_CHECKPOINT_DIR = "RINGMASTER_CHECKPOINT_DIR"

#: Filesystems that other machines mount too (``fuse.*``: s3fs, gcsfuse, juicefs...).
SHARED_FILESYSTEMS = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "lustre",
        "gpfs",
        "beegfs",
        "ceph",
        "glusterfs",
        "9p",
        "afs",
        "panfs",
        "wekafs",
        "cvfs",
        "ocfs2",
        "gfs2",
        "orangefs",
    }
)
#: Filesystems on this machine only.
LOCAL_FILESYSTEMS = frozenset(
    {
        "ext2",
        "ext3",
        "ext4",
        "xfs",
        "btrfs",
        "zfs",
        "tmpfs",
        "overlay",
        "f2fs",
        "vfat",
        "exfat",
        "ramfs",
        "squashfs",
        "devtmpfs",
    }
)


class Reach(str, Enum):
    """Which nodes can read the checkpoint."""

    SHARED = "shared"  # object storage or a filesystem other machines mount: every node
    ONE_MACHINE = "one_machine"  # a filesystem of this machine: nodes on this machine only
    RELATIVE = "relative"  # relative to where each agent starts: agents started there only
    UNKNOWN = "unknown"  # where it goes cannot be read from the script


@dataclass(frozen=True)
class ScriptCheckpoint:
    """Where a restart-tier script keeps its checkpoint, and who can read it.

    Attributes:
        where: what people read after ``checkpoint:`` (``validate``, the event).
        reach: who can read it.
        warning: what goes wrong and what to change, when some node may not read it
            (None when every node can, or when that cannot be told).
        location: the path as resolved from the directory it was read from ("" for
            object storage, or when it cannot be told).
    """

    where: str
    reach: Reach
    warning: str | None = None
    location: str = ""


def script_checkpoint_dir(spec: JobSpec, workdir: str | Path) -> str:
    """``RINGMASTER_CHECKPOINT_DIR`` as an agent started in ``workdir`` sets it:
    ``<checkpoint.url>/script``, a directory for a local URL (relative ones from
    ``workdir``), the URL itself for object storage (``s3://...``)."""
    url = spec.checkpoint.url
    if "://" in url and not url.startswith("file://"):
        return url.rstrip("/") + "/script"
    path = Path(url.removeprefix("file://"))
    if not path.is_absolute():
        path = Path(workdir) / path
    return str(path / "script")


def filesystem_type(path: str | Path) -> str | None:
    """The type of the filesystem that holds ``path`` (its nearest existing directory),
    from ``/proc/self/mountinfo``; None where that cannot be read (not Linux)."""
    try:
        rows = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    target = Path(os.path.abspath(path))
    best, kind = -1, None
    for row in rows:
        head, sep, tail = row.partition(" - ")
        fields = head.split()
        if not sep or len(fields) < 5 or not tail.split():
            continue
        mount = fields[4].replace("\\040", " ")
        inside = target == Path(mount) or Path(mount) in target.parents
        if inside and len(mount) > best:
            best, kind = len(mount), tail.split()[0]
    return kind


def script_checkpoint(
    spec: JobSpec, workdir: str | Path, *, one_machine: bool = False
) -> ScriptCheckpoint:
    """Where the job's script saves its checkpoint, as seen from ``workdir``.

    Args:
        spec: the job (its entrypoint, arguments, environment, ``checkpoint.url``).
        workdir: where the agents start (``ringmaster run``'s directory), or where
            ``validate`` and ``submit`` run.
        one_machine: every agent starts in ``workdir`` on this machine (``ringmaster
            run``): a relative or local path is then read by every node.
    """
    path = entrypoint_file(spec, workdir)
    if path is None:
        return ScriptCheckpoint(
            "cannot tell: the entrypoint's source cannot be read here", Reach.UNKNOWN
        )
    saves = find_saves(path, spec.entrypoint.args)
    chosen = _under_ringmaster(saves, spec)
    readable = [(s, parts) for s, parts in chosen if parts and parts[0].kind != "hole"]
    if not readable:
        return ScriptCheckpoint(_unknown(path, saves), Reach.UNKNOWN)
    save, parts = readable[0]
    at = f"{save.call} in {save.file} line {save.line}"
    shown = "".join(p.shown() for p in parts)
    if save.env == ENV_CHECKPOINT_DIR:
        url = spec.checkpoint.url.removeprefix("file://")
        folder = script_checkpoint_dir(spec, workdir)
        given = url.rstrip("/") + "/script" if "://" in url or not url.startswith("/") else folder
        where = f"{shown} ({at}), ${ENV_CHECKPOINT_DIR} being {given} (checkpoint.url + /script)"
        fix = "set checkpoint.url to a bucket (s3://...) or an absolute path on shared storage"
        return replace(_judge(where, url, folder, one_machine, fix), location=folder)
    where = f"{shown} ({at})"
    fix = (
        f"save it where every node reads it: an absolute path on shared storage, or "
        f"${ENV_CHECKPOINT_DIR} (ringmaster sets it to checkpoint.url + /script)"
    )
    literal = parts[0].text if parts[0].kind == "text" else ""
    full = str(Path(workdir) / literal)
    return replace(_judge(where, literal, full, one_machine, fix), location=full)


def script_storage(spec: JobSpec, workdir: str | Path) -> str | None:
    """Where the script's own checkpoint is, as an agent started in ``workdir`` on
    this machine sees it (``host:real path``), for the controller to compare across
    the job's nodes; None when every node reads it (object storage, a shared
    filesystem) or where it goes cannot be told.

    Two nodes that give different answers do not read each other's checkpoint: a
    node that takes another's place after a failure would train from zero.
    """
    found = script_checkpoint(spec, workdir)
    if found.reach not in (Reach.RELATIVE, Reach.ONE_MACHINE) or not found.location:
        return None
    return f"{socket.gethostname()}:{os.path.realpath(found.location)}"


def record_event(client: EtcdClient, job: str, found: ScriptCheckpoint, source: str) -> None:
    """Put where the script keeps its checkpoint in the job's events: a ``Warning`` when
    some node may not read it, else a ``ScriptCheckpoint`` event."""
    kind = "Warning" if found.warning else "ScriptCheckpoint"
    message = f"checkpoint: {found.where}" + (f"; {found.warning}" if found.warning else "")
    events.emit(client, job, kind, message, source=source, reach=found.reach.value)


def _under_ringmaster(saves: list[Save], spec: JobSpec) -> list[tuple[Save, tuple[Part, ...]]]:
    """Per save call, the alternatives that apply when ringmaster starts the script:
    ``$RINGMASTER_CHECKPOINT_DIR`` is always set, another variable only if the job sets it."""
    calls: dict[tuple[str, int], list[Save]] = {}
    for s in saves:
        calls.setdefault((s.file, s.line), []).append(s)
    out: list[tuple[Save, tuple[Part, ...]]] = []
    for alternatives in calls.values():
        ours = [s for s in alternatives if s.env == ENV_CHECKPOINT_DIR]
        if ours:
            out.append((ours[0], ours[0].parts))
            continue
        for s in alternatives:
            if s.env is None:
                out.append((s, s.parts))
            elif s.env in spec.entrypoint.env:
                out.append((s, (Part(spec.entrypoint.env[s.env]), *s.parts[1:])))
    # a save whose path is known first (the final weights may go to a path given at run time)
    return sorted(out, key=lambda item: not item[1] or item[1][0].kind == "hole")


def _judge(where: str, given: str, full: str, one_machine: bool, fix: str) -> ScriptCheckpoint:
    """Who reads ``given`` (as the script or the job file wrote it; ``full`` as resolved)."""
    if "://" in given and not given.startswith("file://"):
        return ScriptCheckpoint(f"{where}: object storage, read by every node", Reach.SHARED)
    if not given.startswith("/"):
        if one_machine:
            return ScriptCheckpoint(
                f"{where}: relative to the directory every agent of this run starts in",
                Reach.RELATIVE,
            )
        return ScriptCheckpoint(
            f"{where}: a path relative to the directory each agent starts in",
            Reach.RELATIVE,
            "a node whose agent starts in another directory or on another machine finds no "
            "checkpoint there and would train from zero after a failure, so the job fails "
            f"at its start when its nodes are in different places; {fix}",
        )
    kind = filesystem_type(full)
    if kind is not None and (kind in SHARED_FILESYSTEMS or kind.startswith("fuse.")):
        return ScriptCheckpoint(f"{where}: on a shared filesystem ({kind})", Reach.SHARED)
    if kind in LOCAL_FILESYSTEMS and not one_machine:
        return ScriptCheckpoint(
            f"{where}: on a filesystem of this machine ({kind})",
            Reach.ONE_MACHINE,
            "only agents on this machine read it: a node on another machine finds no "
            "checkpoint there and would train from zero after a failure, so the job fails "
            f"at its start when its nodes are on different machines; {fix}",
        )
    if kind in LOCAL_FILESYSTEMS:
        return ScriptCheckpoint(f"{where}: on this machine ({kind})", Reach.ONE_MACHINE)
    return ScriptCheckpoint(
        f"{where}: whether every node reads it cannot be told from here "
        f"(filesystem {kind or 'unknown'})",
        Reach.UNKNOWN,
    )


def _unknown(path: Path, saves: list[Save]) -> str:
    if not saves:
        return (
            f"cannot tell: no torch.save or torch.distributed.checkpoint.save in {path.name} "
            "(or the modules beside it that it imports); after a failure every worker starts "
            "again and resumes only from a checkpoint that every node reads"
        )
    first = saves[0]
    return (
        f"cannot tell: {first.call} in {first.file} line {first.line} saves to {first.shown}, "
        "a path known only when the script runs; after a failure every worker starts again "
        "and resumes only from a checkpoint that every node reads"
    )
