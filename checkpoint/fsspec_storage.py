"""Storage behind a URL: fsspec filesystems and DCP writers that record checksums.

:class:`Location` resolves a checkpoint root URL (``s3://bucket/run``,
``file:///data/ckpt``, ``memory://x``) to an fsspec filesystem once, or wraps
a filesystem given by the caller (tests pass deliberately faulty ones).

:class:`ChecksummingWriter` is DCP's file-system writer, put on the
location's fsspec filesystem, that records the size and CRC-32C of every
object it writes, for the manifest.  On object stores each
chunk is checksummed as it streams out; on a local disk the file is
checksummed from the page cache while its fsync runs (the two overlap, so
the checksum costs no time of its own), see :class:`_ChecksumStream`.
While it writes, torch's own per-record zip CRC-32 is switched off
(:func:`torch_zip_crc_off`): it would be a second checksum pass over the
same bytes, and the manifest's checksum covers every byte of the object.
:class:`checkpoint.location_reader.LocationReader` is DCP's file-system reader
on the same filesystem object.

Both stand on torch's public ``FileSystemWriter``/``FileSystemReader`` with
:class:`_FsspecObjects` in place of their local ``FileSystem``: DCP lays out
the files exactly as it does on a local disk, and every byte goes through
fsspec.  (torch's own fsspec adapter lives in a private module.)
"""

from __future__ import annotations

import io
import mmap
import os
import posixpath
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import fsspec
import torch
from fsspec.core import url_to_fs
from torch.distributed.checkpoint.filesystem import (
    FileSystemBase,
    FileSystemWriter,
)

from checkpoint.api import CheckpointStorageError, ObjectEntry
from checkpoint.buffer_stream import BufferStream
from checkpoint.checksums import DEFAULT_ALGORITHM, RunningChecksum, new_checksum
from checkpoint.manifest import CHECKSUM_CHUNK_BYTES

#: Bytes of an object held in memory: read whole (``bytes``) or a mapped local file.
Buffer = bytes | mmap.mmap

#: Suffix DCP uses for the metadata object before renaming it into place.
_TMP_SUFFIX = ".tmp"


@dataclass
class Location:
    """A checkpoint root: a URL and the fsspec filesystem that reaches it.

    Attributes:
        url: the root URL as given (``s3://bucket/run``).
        fs: the filesystem.
        root: the root path in the filesystem's own terms (no protocol).
    """

    url: str
    fs: fsspec.AbstractFileSystem
    root: str
    _protocols: tuple[str, ...] = field(default=(), repr=False)

    @classmethod
    def from_url(
        cls,
        url: str,
        storage_options: dict[str, Any] | None = None,
        filesystem: fsspec.AbstractFileSystem | None = None,
    ) -> Location:
        """Resolve ``url`` to a filesystem (or use ``filesystem`` for its path).

        Credentials come from ``storage_options`` or the usual places of the
        fsspec backend (environment, config files); they are never logged.
        """
        if filesystem is not None:
            fs, root = filesystem, filesystem._strip_protocol(url)
        else:
            try:
                fs, root = url_to_fs(url, **(storage_options or {}))
            except (ImportError, ValueError) as e:
                raise CheckpointStorageError(f"cannot open checkpoint URL {url!r}: {e}") from e
        protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
        return cls(url=url.rstrip("/"), fs=fs, root=str(root).rstrip("/"), _protocols=protocols)

    @property
    def is_local(self) -> bool:
        """True for the local filesystem (where fsync means something)."""
        return "file" in self._protocols or "local" in self._protocols

    def path(self, *parts: str) -> str:
        """Filesystem path of ``parts`` under the root."""
        return posixpath.join(self.root, *parts)

    def url_of(self, *parts: str) -> str:
        """URL of ``parts`` under the root, in the form the root was given."""
        return "/".join([self.url, *parts])

    def child(self, name: str) -> Location:
        """The location of a directory under this root."""
        return Location(
            url=self.url_of(name), fs=self.fs, root=self.path(name), _protocols=self._protocols
        )

    def refresh(self) -> None:
        """Drop cached listings so other processes' writes become visible."""
        self.fs.invalidate_cache()

    def checksum_object(self, path: str, algorithm: str = DEFAULT_ALGORITHM) -> tuple[int, str]:
        """Read an object and return (size, checksum hex) with ``algorithm``."""
        crc = new_checksum(algorithm)
        with self.fs.open(path, "rb") as f:
            while chunk := f.read(CHECKSUM_CHUNK_BYTES):
                crc.update(chunk)
        return crc.size, crc.hexdigest()


class _ChecksumStream(io.RawIOBase):
    """A write-only stream that counts the bytes it passes on and checksums them.

    Elsewhere than on a local disk, each chunk is checksummed as it streams
    out.  On a local disk (``durable``) the checksum is taken from the file
    itself while it is made durable: at :meth:`close`, one thread fsyncs the
    file while another checksums its bytes straight from the page cache (a
    read-only mapping of the same file, no copy).  The CPU work then runs
    while the disk is busy flushing rather than before it, and the checksum
    covers exactly what the file holds.
    """

    def __init__(self, raw: Any, *, durable: bool) -> None:
        super().__init__()
        self._raw = raw
        self._reader_fd: int | None = _reopen_for_reading(raw) if durable else None
        self._durable = durable
        self._inline: RunningChecksum | None = (
            None if self._reader_fd is not None else new_checksum()
        )
        self._abandoned = False
        #: Bytes written.
        self.size = 0
        #: Checksum of the object (hex), once closed.
        self.checksum: str | None = None

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self._raw.write(view)
        if written is None:
            written = view.nbytes
        if self._inline is not None:
            self._inline.update(view[:written])
        self.size += int(written)
        return int(written)

    def tell(self) -> int:
        return int(self._raw.tell())

    def flush(self) -> None:
        if not getattr(self._raw, "closed", False):
            self._raw.flush()

    def fileno(self) -> int:
        return int(self._raw.fileno())

    def abandon(self) -> None:
        """The write failed: close without syncing or checksumming."""
        self._abandoned = True
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        try:
            if not self._abandoned:
                self._raw.flush()
                if self._reader_fd is not None:
                    self.checksum = _sync_and_checksum(
                        int(self._raw.fileno()), self._reader_fd, self.size
                    )
                else:
                    assert self._inline is not None
                    if self._durable:
                        os.fsync(self._raw.fileno())
                    self.checksum = self._inline.hexdigest()
        finally:
            try:
                if self._reader_fd is not None:
                    os.close(self._reader_fd)
                    self._reader_fd = None
                self._raw.close()
            finally:
                super().close()


def _reopen_for_reading(raw: Any) -> int | None:
    """A read-only descriptor of the file behind ``raw`` (None when it has none)."""
    try:
        return os.open(f"/proc/self/fd/{int(raw.fileno())}", os.O_RDONLY | os.O_CLOEXEC)
    except (AttributeError, OSError, io.UnsupportedOperation, ValueError):
        return None


def _sync_and_checksum(write_fd: int, read_fd: int, expected_size: int) -> str:
    """fsync ``write_fd`` and, at the same time, checksum the file through ``read_fd``.

    Raises:
        OSError: the fsync or the read-back failed, or the file does not hold
            the ``expected_size`` bytes that were written to it.
    """
    outcome: dict[str, Any] = {}

    def read_back() -> None:
        try:
            outcome["checksum"] = _checksum_of_file(read_fd, expected_size)
        except BaseException as e:  # re-raised on the writing thread
            outcome["error"] = e

    reader = threading.Thread(target=read_back, name="ringmaster-checksum", daemon=True)
    reader.start()
    try:
        os.fsync(write_fd)
    finally:
        reader.join()
    if "error" in outcome:
        raise outcome["error"]
    return str(outcome["checksum"])


def _checksum_of_file(fd: int, expected_size: int) -> str:
    size = os.fstat(fd).st_size
    if size != expected_size:
        raise OSError(f"file holds {size} bytes after writing {expected_size}")
    crc = new_checksum()
    if size:
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mapped:
            mapped.madvise(mmap.MADV_SEQUENTIAL)
            with memoryview(mapped) as view:
                for start in range(0, size, _READ_BACK_SLICE):
                    with view[start : start + _READ_BACK_SLICE] as part:
                        crc.update(part)
    return crc.hexdigest()


#: Slice of a mapped file checksummed per call (bounds how long one call runs).
_READ_BACK_SLICE = 64 << 20


_zip_crc_lock = threading.Lock()
_zip_crc_users = 0
_zip_crc_saved = True


@contextmanager
def torch_zip_crc_off() -> Iterator[None]:
    """Switch off the CRC-32 that ``torch.save`` computes for each zip record.

    DCP serialises each tensor with ``torch.save``; its per-record CRC would
    be a second full checksum pass over bytes the manifest checksums anyway.
    The switch is process-wide (torch has no per-call option): a
    ``torch.save`` elsewhere in the process while a checkpoint uploads writes
    records with a zero CRC field, which ``torch.load`` does not check.
    Nested and concurrent uses are counted; the setting found first is put
    back when the last one ends.
    """
    global _zip_crc_users, _zip_crc_saved
    with _zip_crc_lock:
        if _zip_crc_users == 0:
            _zip_crc_saved = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
        _zip_crc_users += 1
    try:
        yield
    finally:
        with _zip_crc_lock:
            _zip_crc_users -= 1
            if _zip_crc_users == 0:
                torch.serialization.set_crc32_options(_zip_crc_saved)


class _FsspecObjects(FileSystemBase):
    """DCP's file-system operations on an fsspec filesystem; records what is written.

    Paths are the filesystem's own (no protocol).  A write that fails leaves
    no object behind when the filesystem lets it be removed.

    Args:
        fs: the filesystem.
        durable: fsync every written file before it counts as written (local
            disks; see :class:`_ChecksumStream`).
        fetched: objects already read or mapped (and verified), by path:
            reads of them are served from these bytes instead of the filesystem.
    """

    def __init__(
        self,
        fs: fsspec.AbstractFileSystem,
        *,
        durable: bool = False,
        fetched: Mapping[str, Buffer] | None = None,
    ) -> None:
        self.fs = fs
        self.durable = durable
        self.fetched = fetched or {}
        self._lock = threading.Lock()
        #: (size, checksum hex) of each object written, by path.
        self.written: dict[str, tuple[int, str]] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        name = os.fspath(path)
        if not any(c in mode for c in "wa+"):
            if name in self.fetched:
                yield BufferStream(self.fetched[name])  # reads the bytes held, no copy
                return
            with self.fs.open(name, mode) as stream:
                yield stream
            return
        with self.fs.open(name, mode) as raw:
            stream = _ChecksumStream(raw, durable=self.durable)
            try:
                yield stream
                stream.close()  # DCP may have closed it already: then this is a no-op
            except BaseException:
                stream.abandon()  # a no-op when the close above is what failed
                self._remove_partial(name)
                raise
        assert stream.checksum is not None
        with self._lock:
            self.written[name] = (stream.size, stream.checksum)

    def _remove_partial(self, path: str) -> None:
        try:
            self.fs.rm_file(path)
        except Exception:  # the write already failed; that error is the one to report
            pass

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        return posixpath.join(os.fspath(path), suffix)

    def init_path(self, path: str | os.PathLike[str], **kwargs: Any) -> str:
        return os.fspath(path)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        old, new = os.fspath(path), os.fspath(new_path)
        self.fs.mv(old, new)
        with self._lock:
            entry = self.written.pop(old, None)
            if entry is not None:
                self.written[new] = entry

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        self.fs.makedirs(os.fspath(path), exist_ok=True)

    def exists(self, path: str | os.PathLike[str]) -> bool:
        return bool(self.fs.exists(os.fspath(path)))

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        self.fs.rm_file(os.fspath(path))

    def ls(self, path: str | os.PathLike[str]) -> list[str]:
        return [str(p) for p in self.fs.ls(os.fspath(path), detail=False)]

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        # Writers and readers here are always built from a Location, never
        # picked by DCP from a checkpoint id.
        return False


class ChecksummingWriter(FileSystemWriter):
    """DCP's file-system writer on a location's filesystem; records each object's size and checksum.

    Args:
        location: the checkpoint directory.
        thread_count: writer threads per rank.
    """

    def __init__(self, location: Location, thread_count: int = 1) -> None:
        super().__init__(
            location.root,
            single_file_per_rank=True,
            # The streams fsync local files themselves, overlapped with their
            # checksum; elsewhere DCP would fall back to a machine-wide
            # os.sync() on every object.
            sync_files=False,
            thread_count=thread_count,
            overwrite=False,
        )
        self._recorder = _FsspecObjects(location.fs, durable=location.is_local)
        # DCP annotates ``fs`` as its local FileSystem; any FileSystemBase works.
        self.fs = self._recorder  # type: ignore[assignment]
        self.path = location.root
        self._location = location

    @property
    def checksum_algorithm(self) -> str:
        """Algorithm of the checksums in :meth:`objects`."""
        return DEFAULT_ALGORITHM

    def write_data(self, plan: Any, planner: Any) -> Any:
        # Synchronous in DCP's filesystem writer: every file is written and
        # fsynced when it returns, so the scope of the switch is exact.
        with torch_zip_crc_off():
            return super().write_data(plan, planner)

    def objects(self) -> list[ObjectEntry]:
        """Objects this rank wrote, relative to the checkpoint directory."""
        out = []
        for path, (size, checksum) in sorted(self._recorder.written.items()):
            name = posixpath.relpath(path, self._location.root)
            if not name.endswith(_TMP_SUFFIX):
                out.append(ObjectEntry(path=name, size=size, checksum=checksum))
        return out
