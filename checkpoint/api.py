"""Contracts of the checkpoint package: what is saved, what a commit is, and errors.

A training runtime hands a :class:`TrainState` to a checkpointer.  A durable
checkpoint is a directory of objects (one per writing rank plus DCP's
``.metadata``) and a :class:`Manifest` written last; the manifest's presence
and integrity *is* the commit.  Saves are asynchronous and return a
:class:`SaveHandle`.  A restore loads the newest committed checkpoint that
verifies and says so in a :class:`RestoreResult`.

Errors share one base, :class:`CheckpointError`.  A
:class:`RetryableCheckpointError` may succeed if tried again (storage hiccup,
a timeout, a save skipped because the previous one is still uploading); a
:class:`PermanentCheckpointError` will not (corrupt data, a state that does not
match the checkpoint, no checkpoint at all).

Nothing here imports an implementation module.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

# --------------------------------------------------------------------------- constants

#: Name of the commit object inside a checkpoint directory.  Written last.
MANIFEST_NAME = "manifest.json"

#: Prefix of checkpoint directory names: ``step-<step>-<token>``.
STEP_DIR_PREFIX = "step-"

#: Version of the manifest format; readers reject newer versions.
MANIFEST_FORMAT = 1

#: Checksum algorithm of objects in new manifests (CRC-32C); manifests name
#: theirs, and older ones written with ``"crc32"`` still verify.
CHECKSUM_ALGORITHM = "crc32c"

#: Marker object written beside the manifest once every object matched its checksum.
VERIFIED_MARKER = "verified.json"

#: Marker object written beside the manifest when an object did not match (or is
#: missing): the checkpoint then counts for neither restore nor retention.  It is
#: never deleted for it; ``ringmaster checkpoints verify`` checks it again.
FAILED_MARKER = "verification-failed.json"

#: fsspec protocols a checkpoint root may use: local disks, the object stores
#: (their fsspec packages installed), and ``memory://`` for one process's tests.
CHECKPOINT_PROTOCOLS = ("file", "s3", "s3a", "gs", "gcs", "az", "abfs", "memory")


# Timeouts are plain defaults: this package reads no environment variable.  A
# caller passes its own (ringmaster's worker runtime passes the
# ``RINGMASTER_CHECKPOINT_SAVE_TIMEOUT`` knob of :mod:`orchestrator.settings`).

#: Default bound on one save's upload (all ranks write and the manifest lands).
DEFAULT_SAVE_TIMEOUT = timedelta(seconds=1800)

#: Default bound on collectives of the checkpoint process groups.
DEFAULT_COLLECTIVE_TIMEOUT = timedelta(seconds=600)

#: Bound meant for a restore (discovery, verification, load); nothing enforces it yet:
#: :meth:`~checkpoint.checkpointer.Checkpointer.restore` takes no timeout.
DEFAULT_RESTORE_TIMEOUT = timedelta(seconds=1800)

# --------------------------------------------------------------------------- errors


class CheckpointError(Exception):
    """Base of every error raised by the ``checkpoint`` package."""


class RetryableCheckpointError(CheckpointError):
    """The operation failed but may succeed if tried again."""


class PermanentCheckpointError(CheckpointError):
    """The operation cannot succeed without a change (data, state or configuration)."""


class CommitFencedError(PermanentCheckpointError):
    """The saver is no longer a member of the current generation: it must not commit.

    Raised by a commit fence (see :data:`CommitFence`); the checkpoint stays
    uncommitted (no manifest), so nobody ever restores from it.
    """


#: Called right before a manifest is written; raises :class:`CommitFencedError`
#: when the saver cannot prove it still belongs to the job's current generation.
CommitFence = Callable[[], None]


class CheckpointStorageError(RetryableCheckpointError):
    """Reading or writing objects failed (network, permissions that may be fixed, I/O)."""


class CheckpointTimeoutError(RetryableCheckpointError):
    """A save, restore or coordination step did not finish within its timeout."""


class CheckpointPeerError(RetryableCheckpointError, RuntimeError):
    """A collective of the checkpoint's own groups failed: a rank of the group is gone
    (or cut off).  Still a ``RuntimeError``, as torch's collectives raise."""


class SaveInProgressError(RetryableCheckpointError):
    """A save was requested while the previous one is still uploading."""


class CheckpointCorruptError(PermanentCheckpointError):
    """An object is missing, has the wrong size, or fails its checksum."""


class CheckpointNotFoundError(PermanentCheckpointError):
    """No committed checkpoint exists where one was asked for."""


class CheckpointMismatchError(PermanentCheckpointError):
    """Ranks disagree (step, state layout) or the state does not fit the checkpoint."""


# --------------------------------------------------------------------------- manifest


@dataclass(frozen=True)
class ObjectEntry:
    """One object of a checkpoint, relative to its directory.

    Attributes:
        path: object name relative to the checkpoint directory (``__0_0.distcp``).
        size: size in bytes.
        checksum: checksum of the content as 8 lowercase hex digits, computed
            with the manifest's ``checksum_algorithm``.
    """

    path: str
    size: int
    checksum: str


@dataclass(frozen=True)
class Manifest:
    """The commit record of one checkpoint; its presence means the checkpoint exists.

    Attributes:
        step: training step the state belongs to.
        world_size: number of ranks that saved it.
        job_spec_hash: hash of the job spec that produced it ("" when unknown).
        created_at: UNIX time the manifest was written.
        objects: every object of the checkpoint with size and checksum.
        samples_seen: global data position (samples consumed by all ranks).
        format: manifest format version.
        checksum_algorithm: how ``ObjectEntry.checksum`` was computed.
        run_id: the run that wrote it, its lineage: retention removes only
            checkpoints of its own run ("" when unknown: written before runs
            were recorded, or by a checkpointer given no run id).
    """

    step: int
    world_size: int
    job_spec_hash: str
    created_at: float
    objects: tuple[ObjectEntry, ...]
    samples_seen: int = 0
    format: int = MANIFEST_FORMAT
    checksum_algorithm: str = CHECKSUM_ALGORITHM
    run_id: str = ""

    @property
    def total_bytes(self) -> int:
        return sum(o.size for o in self.objects)


class Verification(str, Enum):
    """What is known of a committed checkpoint's objects, from the markers beside it.

    ``NOT_VERIFIED``: no one has read its objects back since it was written.
    ``VERIFIED``: every object matched the manifest when last read back
    (:data:`VERIFIED_MARKER`).  ``FAILED``: an object was missing or did not
    match (:data:`FAILED_MARKER`); restore and retention pass it over.
    """

    NOT_VERIFIED = "not verified"
    VERIFIED = "verified"
    FAILED = "failed verification"


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint directory as found by listing.

    Attributes:
        url: URL of the checkpoint directory.
        name: directory name (``step-0000000100-1a2b3c4d``).
        step: step parsed from the name (or the manifest when committed).
        manifest: the manifest when the checkpoint is committed, else None.
        problem: why it does not count as committed, when it does not.
        verification: what the markers beside the manifest say (listing
            reads no object to know it).
    """

    url: str
    name: str
    step: int
    manifest: Manifest | None = None
    problem: str | None = None
    verification: Verification = Verification.NOT_VERIFIED

    @property
    def committed(self) -> bool:
        return self.manifest is not None

    @property
    def usable(self) -> bool:
        """Committed and not known to be corrupt: a candidate for restore and retention."""
        return self.manifest is not None and self.verification is not Verification.FAILED


@dataclass(frozen=True)
class VerifyReport:
    """Result of checking every object of a checkpoint against its manifest.

    Attributes:
        url: checkpoint directory checked.
        ok: True when every object is present with the right size and checksum.
        problems: one line per object that failed.
        checked_bytes: bytes read to compute checksums.
    """

    url: str
    ok: bool
    problems: tuple[str, ...] = ()
    checked_bytes: int = 0


# --------------------------------------------------------------------------- state


@dataclass
class TrainState:
    """What a training runtime asks to save and restore.

    Replicated parts (model, optimizer, scheduler, ``extra``, ``objects``) are
    identical on every rank in data-parallel training and are written once,
    spread across ranks.  ``rank_state`` differs per rank (gradient compression residuals,
    for example) and is saved per rank; RNG states are added automatically.

    Attributes:
        model: the module (a DDP wrapper is fine; keys are saved without ``module.``).
        optimizer: its optimizer, if any.
        scheduler: anything with ``state_dict()``/``load_state_dict()`` (LR scheduler).
        samples_seen: global data position: samples consumed by all ranks so far.
        extra: further small replicated state (saved as one pickled object).
        rank_state: per-rank state; on restore at a rank the checkpoint did not
            have, it is left as is.
        replica_writers: the ranks that write the replicated parts (None: any
            rank, balanced by bytes).  Under a delayed sync the sites' models
            differ between syncs: only the first site's ranks write them, so a
            checkpoint holds one site's state, never a mix.  Given, they also
            write the sharded parts alone (an FSDP2 model in each site: the
            first site's slices).
        stages: per rank, the pipeline stage it holds (None: every rank holds
            the same keys).  Ranks of one stage must hold the same layout; each
            replicated key is written by a rank of a stage that holds it.
        objects: further replicated objects by name, anything with
            ``state_dict()``/``load_state_dict()`` (a ``GradScaler``, more LR
            schedulers, EMA weights, a counter, a DCP ``Stateful``).  Their state
            dicts are taken when a save starts; the tensors in them are
            entries of their own, like the model's (a model-sized EMA is
            fine), the rest travels in ``extra``'s pickled object
            (:mod:`checkpoint.object_state`); a restore calls
            ``load_state_dict`` on each one the checkpoint holds and leaves
            the others as they are (logged).
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any | None = None
    samples_seen: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    rank_state: dict[str, Any] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)
    replica_writers: tuple[int, ...] | None = None
    stages: tuple[int, ...] | None = None


class SaveStatus(str, Enum):
    """Lifecycle of one asynchronous save.

    Transitions::

        STAGED ──► COMMITTED
           │
           └─────► FAILED
    """

    STAGED = "staged"
    COMMITTED = "committed"
    FAILED = "failed"


@runtime_checkable
class SaveHandle(Protocol):
    """An asynchronous save in flight; returned once state is staged in memory."""

    @property
    def step(self) -> int: ...

    @property
    def url(self) -> str:
        """URL of the checkpoint directory being written."""
        ...

    def done(self) -> bool:
        """True once the upload finished (committed or failed)."""
        ...

    def wait(self, timeout: timedelta | None = None) -> Manifest:
        """Block until committed and return the manifest.

        Raises:
            CheckpointTimeoutError: not finished within ``timeout``.
            CheckpointError: the background upload failed (the original
                exception is chained).
        """
        ...

    @property
    def status(self) -> SaveStatus: ...


class RestoreSource(str, Enum):
    """Where a restore took its state from."""

    DURABLE = "durable"
    NONE = "none"


@dataclass(frozen=True)
class RestoreResult:
    """Outcome of a restore.

    Attributes:
        source: ``DURABLE``, or ``NONE`` when nothing was found (a fresh start).
        step: step of the restored state (None for a fresh start).
        samples_seen: restored global data position.
        url: checkpoint directory, for durable restores.
        rank_state_restored: whether this rank's per-rank state and RNG came back.
        skipped: durable checkpoints passed over (corrupt, incomplete), newest first.
        seconds: where the restore's time went, on this rank, by phase:
            ``prepare`` (the state's tensors as targets; an optimizer that has
            not stepped gets its state allocated), ``find`` (listing, manifest,
            completeness), ``verify`` (reading objects back and comparing
            their checksums with the manifest), ``load`` (DCP's metadata, plan
            and reads into the targets), ``apply`` (into the model, optimizer,
            scheduler and objects).  Phases that did not run are absent.
    """

    source: RestoreSource
    step: int | None
    samples_seen: int = 0
    url: str | None = None
    rank_state_restored: bool = False
    skipped: tuple[str, ...] = ()
    seconds: Mapping[str, float] = field(default_factory=dict)
