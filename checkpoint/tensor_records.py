"""A tensor that DCP saved with ``torch.save``, read in place from the bytes that hold it.

DCP writes each tensor of a checkpoint as one ``torch.save`` record: a zip
archive, stored (never compressed), whose ``data.pkl`` says the dtype, size,
stride and storage offset and whose ``data/<key>`` entry is the storage's raw
bytes.  ``torch.load`` reads such a record by copying the storage out of the
archive into new memory, and DCP then copies that into the state: two copies
of every byte, the first into memory the process has never touched.

:func:`tensor_in_record` finds the storage inside the record and returns a
tensor over those very bytes (no copy), so a restore copies each byte once,
straight into the state.  It reads the archive's directory with :mod:`zipfile`
and ``data.pkl`` with an unpickler that knows only the few names a saved
tensor uses; any record in another form (a storage other than CPU, another
byte order, a compressed entry, anything unexpected in the pickle) gives
None, and the caller reads it with ``torch.load`` as before.
"""

from __future__ import annotations

import io
import pickle
import struct
import sys
import warnings
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from checkpoint.buffer_stream import BufferStream

__all__ = ["tensor_in_record"]

#: Fixed part of a zip local file header, before its name and extra field.
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_LOCAL_SIGNATURE = b"PK\x03\x04"


@dataclass(frozen=True)
class _Storage:
    dtype: torch.dtype
    key: str
    numel: int


@dataclass(frozen=True)
class _Tensor:
    storage: _Storage
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _NotPlain(Exception):
    """The record holds something other than one plain CPU tensor."""


class _StorageType:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


def _rebuild(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> _Tensor:
    if not isinstance(storage, _Storage) or not isinstance(offset, int):
        raise _NotPlain("not a storage")
    # rest: requires_grad, then backward hooks and metadata, both empty for a plain tensor
    if len(rest) > 3 or any(rest[1:]):
        raise _NotPlain("tensor with hooks or metadata")
    return _Tensor(storage, offset, tuple(size), tuple(stride))


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name.endswith("Storage") and name != "UntypedStorage":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # typed storages are deprecated
                dtype = getattr(getattr(torch, name, None), "dtype", None)
            if isinstance(dtype, torch.dtype):
                return _StorageType(dtype)
        raise _NotPlain(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise _NotPlain("persistent id")
        kind, key, location, numel = pid[1:]
        if not isinstance(kind, _StorageType) or location != "cpu" or not isinstance(numel, int):
            raise _NotPlain("storage")
        return _Storage(kind.dtype, str(key), numel)


def _entry_data(buf: memoryview, info: zipfile.ZipInfo) -> memoryview:
    """The stored bytes of ``info`` inside the archive ``buf``."""
    start = info.header_offset
    fields = _LOCAL_HEADER.unpack_from(buf, start)
    if fields[0] != _LOCAL_SIGNATURE or info.compress_type != zipfile.ZIP_STORED:
        raise _NotPlain("entry")
    begin = start + _LOCAL_HEADER.size + fields[9] + fields[10]
    if begin + info.file_size > len(buf):
        raise _NotPlain("entry past the record")
    return buf[begin : begin + info.file_size]


def tensor_in_record(record: memoryview) -> torch.Tensor | None:
    """The tensor saved in ``record`` (one ``torch.save`` of a CPU tensor), over its bytes.

    The tensor shares ``record``'s memory (read-only memory included: write
    nothing to it); copy out of it.  None when the record is not in the plain
    form this reads (the caller falls back to ``torch.load``).
    """
    record = record.cast("B")
    try:
        with zipfile.ZipFile(BufferStream(record)) as archive:
            return _tensor(record, archive)
    except (
        _NotPlain,
        zipfile.BadZipFile,
        pickle.UnpicklingError,
        struct.error,
        EOFError,
        KeyError,
        ValueError,
        TypeError,
        AttributeError,
    ):
        return None  # not the plain form (or not a record at all)


def _tensor(record: memoryview, archive: zipfile.ZipFile) -> torch.Tensor:
    names = archive.namelist()
    prefix = names[0].split("/", 1)[0] if names else ""
    # Entries are read through their headers, not zipfile's reader: checkpoints are
    # written with torch's per-entry CRC switched off (the manifest's checksum covers
    # every byte), and zipfile would refuse the zero CRC.
    byteorder = f"{prefix}/byteorder"
    order = bytes(_entry_data(record, archive.getinfo(byteorder))) if byteorder in names else None
    if order is not None and order.decode() != sys.byteorder:
        raise _NotPlain("byte order")
    pickled = bytes(_entry_data(record, archive.getinfo(f"{prefix}/data.pkl")))
    saved = _Unpickler(io.BytesIO(pickled)).load()
    if not isinstance(saved, _Tensor):
        raise _NotPlain("not a tensor")
    data = _entry_data(record, archive.getinfo(f"{prefix}/data/{saved.storage.key}"))
    itemsize = torch.empty((), dtype=saved.storage.dtype).element_size()
    if len(data) != saved.storage.numel * itemsize:
        raise _NotPlain("storage size")
    if not data:
        flat = torch.empty(0, dtype=saved.storage.dtype)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only memory; nothing writes it
            flat = torch.frombuffer(data, dtype=saved.storage.dtype)
    return flat.as_strided(saved.size, saved.stride, saved.offset)
