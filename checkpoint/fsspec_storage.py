"""Storage behind a URL: fsspec filesystems and DCP writers that record checksums.

:class:`Location` resolves a checkpoint root URL (``s3://bucket/run``,
``file:///data/ckpt``, ``memory://x``) to an fsspec filesystem once, or wraps
a filesystem given by the caller (tests pass deliberately faulty ones).

:class:`ChecksummingWriter` is DCP's fsspec writer with every written object
passed through a CRC-32C as it streams out, so the manifest gets sizes and
checksums in the same pass as the write, without reading anything back.
While it writes, torch's own per-record zip CRC-32 is switched off
(:func:`torch_zip_crc_off`): it would be a second checksum pass over the
same bytes, and the manifest's checksum covers every byte of the object.
:class:`LocationReader` is DCP's fsspec reader on the same filesystem object.
"""

from __future__ import annotations

import io
import os
import posixpath
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import fsspec
import torch
from fsspec.core import url_to_fs
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as _DcpFsspecFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

from checkpoint.api import CheckpointStorageError, ObjectEntry
from checkpoint.checksums import DEFAULT_ALGORITHM, RunningChecksum, new_checksum
from checkpoint.manifest import CHECKSUM_CHUNK_BYTES

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
    """A write-only stream that checksums and counts bytes on their way out."""

    def __init__(self, raw: Any) -> None:
        super().__init__()
        self._raw = raw
        self.crc: RunningChecksum = new_checksum()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self._raw.write(view)
        if written is None:
            written = view.nbytes
        self.crc.update(view[:written])
        return int(written)

    def tell(self) -> int:
        return int(self._raw.tell())

    def flush(self) -> None:
        if not getattr(self._raw, "closed", False):
            self._raw.flush()

    def fileno(self) -> int:
        return int(self._raw.fileno())

    def close(self) -> None:
        if self.closed:
            return
        try:
            self._raw.close()
        finally:
            super().close()


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


class _RecordingFileSystem(_DcpFsspecFileSystem):
    """DCP's fsspec adapter on a given filesystem; records what is written."""

    def __init__(self, fs: fsspec.AbstractFileSystem) -> None:
        super().__init__()
        self.fs = fs
        self._lock = threading.Lock()
        self.written: dict[str, tuple[int, str]] = {}

    def init_path(self, path: str | os.PathLike[str], **kwargs: Any) -> str | os.PathLike[str]:
        return path

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = _ChecksumStream(raw)
            yield stream
            stream.close()
        with self._lock:
            self.written[os.fspath(path)] = (stream.crc.size, stream.crc.hexdigest())

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)
        with self._lock:
            entry = self.written.pop(os.fspath(path), None)
            if entry is not None:
                self.written[os.fspath(new_path)] = entry


class ChecksummingWriter(FsspecWriter):
    """DCP's fsspec writer that records (size, checksum) of every object it writes.

    Args:
        location: the checkpoint directory.
        thread_count: writer threads per rank.
    """

    def __init__(self, location: Location, thread_count: int = 1) -> None:
        super().__init__(
            location.root,
            single_file_per_rank=True,
            # fsync is meaningful on local disks; elsewhere DCP would fall back
            # to a machine-wide os.sync() on every object.
            sync_files=location.is_local,
            thread_count=thread_count,
            overwrite=False,
        )
        self._recorder = _RecordingFileSystem(location.fs)
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


class LocationReader(FsspecReader):
    """DCP's fsspec reader over a :class:`Location`'s filesystem object."""

    def __init__(self, location: Location) -> None:
        super().__init__(location.root)
        self.fs = _RecordingFileSystem(location.fs)  # type: ignore[assignment]
        self.path = location.root
