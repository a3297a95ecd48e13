"""Each worker's output, kept on its node in rotated files, and read back for ``ringmaster logs``.

The node agent writes every line a worker prints to files of its own (see
:class:`agents.node.log_shipper.LogShipper`); etcd keeps only the last few lines of
a worker that exited.  The layout, under ``RINGMASTER_LOG_DIR`` (default
``ringmaster-logs`` in the system's temporary directory)::

    <root>/<job>/<node>/<local_rank>/<offset>.log

One line per line printed: ``<unix time> <text>``.  A worker's output is one
stream of bytes; ``<offset>`` (16 digits) is where the file starts in it, so
a reader's position survives rotation.  When the newest file reaches its
share of the byte budget a new one starts, and the oldest beyond
:data:`FILES` are deleted: a worker keeps at most ``RINGMASTER_LOG_KEEP_MIB``
on disk.  A worker restarted under the same local rank appends to the same
stream.

:func:`requests` answers the reads (an index, a page after a position, the
last lines) on the agent's liveness port (:mod:`orchestrator.ports.liveness`),
each answer bounded in size.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.ports.api import RequestError
from orchestrator.settings import SETTINGS
from orchestrator.state import keys

log = logging.getLogger("ringmaster.agent")

#: Files per worker: the budget is split between them.
FILES = 4
#: Bounds of one answer's worth of file content (bytes): pages are at least and at most these.
MIN_PAGE = 64 * 1024
MAX_PAGE = 1024 * 1024
#: Most lines one ``tail`` request may ask for.
MAX_TAIL_LINES = 100_000
_SUFFIX = ".log"


def default_root() -> Path:
    """``RINGMASTER_LOG_DIR``, else ``ringmaster-logs`` in the temporary directory."""
    configured = SETTINGS.log_dir
    return Path(configured) if configured else Path(tempfile.gettempdir()) / "ringmaster-logs"


def node_dir(root: Path, job: str, node: str) -> Path:
    """Where the files of ``node``'s workers in ``job`` are (names checked as etcd keys are)."""
    return root / keys.segment(job, "job name") / keys.segment(node, "node name")


def keep_bytes() -> int:
    """Bytes kept on disk per worker (``RINGMASTER_LOG_KEEP_MIB``)."""
    return int(SETTINGS.log_keep_mib) * 1024 * 1024


def format_line(at: float, text: str) -> bytes:
    """One stored line: ``<unix time> <text>\\n`` (``text`` holds no newline)."""
    return f"{at:.6f} {text}\n".encode("utf-8", errors="replace")


def parse_line(raw: bytes) -> tuple[float, str]:
    """The ``(time, text)`` of a stored line; a line not in the format has time 0."""
    text = raw.decode("utf-8", errors="replace").rstrip("\n")
    stamp, _, rest = text.partition(" ")
    try:
        return float(stamp), rest
    except ValueError:
        return 0.0, text


# -- writing ------------------------------------------------------------------------------


def _segments(directory: Path) -> list[tuple[int, Path]]:
    """``(start offset, path)`` of a worker's files, oldest first."""
    found: list[tuple[int, Path]] = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(directory):
            name = entry.name
            if name.endswith(_SUFFIX) and name[: -len(_SUFFIX)].isdigit():
                found.append((int(name[: -len(_SUFFIX)]), Path(entry.path)))
    return sorted(found)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


class WorkerLog:
    """Appends one worker's lines to its rotated files (``directory`` is the worker's own).

    Args:
        directory: ``<node dir>/<local_rank>``; created if missing.
        keep: bytes kept in all, over :data:`FILES` files.
    """

    def __init__(self, directory: Path, keep: int) -> None:
        self.directory = directory
        self.file_bytes = max(keep // FILES, 4096)
        directory.mkdir(parents=True, exist_ok=True)
        existing = _segments(directory)
        self._start, path = existing[-1] if existing else (0, directory / _name(0))
        size = _size(path)
        self._file = open(path, "ab")  # noqa: SIM115 (kept open across writes)
        if size and not _ends_with_newline(path):
            self._file.write(b"\n")  # a line cut by a crash of the agent ends here
            size += 1
        self.offset = self._start + size

    def write(self, at: float, text: str) -> None:
        """Append one line and flush it (a reader sees it at once); rotate when full."""
        data = format_line(at, text)
        if self.offset > self._start and self.offset - self._start + len(data) > self.file_bytes:
            self._rotate()
        self._file.write(data)
        self._file.flush()
        self.offset += len(data)

    def _rotate(self) -> None:
        self._file.close()
        self._start = self.offset
        self._file = open(self.directory / _name(self._start), "ab")  # noqa: SIM115
        for _, old in _segments(self.directory)[:-FILES]:
            with contextlib.suppress(FileNotFoundError):
                old.unlink()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._file.close()


def _name(offset: int) -> str:
    return f"{offset:016d}{_SUFFIX}"


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


# -- reading ------------------------------------------------------------------------------


@dataclass
class Page:
    """Lines read from a worker's stream.

    Attributes:
        lines: ``(time, text)``, oldest first.
        next: the position after the last line returned (ask from there next time).
        skipped: bytes asked for that rotation had already deleted.
    """

    lines: list[tuple[float, str]]
    next: int
    skipped: int = 0

    def answer(self) -> dict[str, Any]:
        return {"lines": self.lines, "next": self.next, "skipped": self.skipped}


def extent(directory: Path) -> tuple[int, int]:
    """``(first, end)`` positions of the stream still on disk (``(0, 0)`` when none)."""
    segments = _segments(directory)
    if not segments:
        return 0, 0
    return segments[0][0], segments[-1][0] + _size(segments[-1][1])


def read_after(directory: Path, after: int | None, limit: int) -> Page:
    """Whole lines from position ``after`` (``None``: the oldest kept), at most ``limit`` bytes."""
    for _ in range(3):  # a file may be rotated away while it is read: start over
        try:
            return _read_after(directory, after, limit)
        except FileNotFoundError:
            continue
    return _read_after(directory, after, limit)


def _read_after(directory: Path, after: int | None, limit: int) -> Page:
    segments = _segments(directory)
    if not segments:
        return Page([], after or 0)
    first = segments[0][0]
    position = first if after is None else after
    skipped = max(0, first - position)
    position = max(position, first)
    data = b""
    for start, path in segments:
        size = _size(path)
        if start + size <= position or len(data) >= limit:
            continue
        with open(path, "rb") as f:
            f.seek(position + len(data) - start)
            data += f.read(limit - len(data))
    whole = data[: data.rfind(b"\n") + 1]
    lines = [parse_line(raw) for raw in whole.splitlines()]
    return Page(lines, position + len(whole), skipped)


def read_tail(directory: Path, count: int, limit: int) -> Page:
    """The last ``count`` whole lines (fewer if they are over ``limit`` bytes)."""
    for _ in range(3):
        try:
            return _read_tail(directory, count, limit)
        except FileNotFoundError:
            continue
    return _read_tail(directory, count, limit)


def _read_tail(directory: Path, count: int, limit: int) -> Page:
    segments = _segments(directory)
    if not segments:
        return Page([], 0)
    end = segments[-1][0] + _size(segments[-1][1])
    data = b""
    aligned = True  # data starts where a file starts: at the start of a line
    for start, path in reversed(segments):
        with open(path, "rb") as f:
            size = min(f.seek(0, os.SEEK_END), end - start)
            take = min(size, limit - len(data))
            f.seek(size - take)
            data = f.read(take) + data
        aligned = take == size
        if data.count(b"\n") > count or len(data) >= limit:
            break
    whole = data[: data.rfind(b"\n") + 1]
    raw_lines = whole.splitlines()
    if not aligned and raw_lines:
        raw_lines = raw_lines[1:]  # the first may be the end of a line begun before
    raw_lines = raw_lines[-count:] if count else []
    return Page([parse_line(raw) for raw in raw_lines], end - (len(data) - len(whole)))


# -- answering ----------------------------------------------------------------------------


def requests(job: str, node: str, root: Path | None = None) -> dict[str, Callable[..., Any]]:
    """The log reads an agent answers on its liveness port, for its own job's files.

    ``logs.index`` → ``{"workers": {local_rank: [first, end]}}``;
    ``logs.read`` (``local_rank``, ``after``, ``limit``) → a :class:`Page`;
    ``logs.tail`` (``local_rank``, ``lines``, ``limit``) → a :class:`Page`.
    """
    base = node_dir(root or default_root(), job, node)

    def check(request: dict[str, Any]) -> None:
        if request.get("job") != job:
            raise RequestError(f"this agent runs job '{job}', not {request.get('job')!r}")

    def worker_dir(request: dict[str, Any]) -> Path:
        check(request)
        rank = request.get("local_rank")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise RequestError(f"local_rank must be a whole number >= 0, not {rank!r}")
        return base / str(rank)

    def limit(request: dict[str, Any]) -> int:
        asked = request.get("limit", MAX_PAGE)
        return min(max(int(asked) if isinstance(asked, int) else MAX_PAGE, MIN_PAGE), MAX_PAGE)

    def index(request: dict[str, Any]) -> dict[str, Any]:
        check(request)
        ranks = []
        with contextlib.suppress(FileNotFoundError):
            ranks = sorted(int(e.name) for e in os.scandir(base) if e.name.isdigit())
        return {"workers": {str(r): list(extent(base / str(r))) for r in ranks}}

    def read(request: dict[str, Any]) -> dict[str, Any]:
        after = request.get("after")
        if after is not None and (not isinstance(after, int) or after < 0):
            raise RequestError(f"after must be a position >= 0 or null, not {after!r}")
        return read_after(worker_dir(request), after, limit(request)).answer()

    def tail(request: dict[str, Any]) -> dict[str, Any]:
        lines = request.get("lines")
        if not isinstance(lines, int) or lines < 0:
            raise RequestError(f"lines must be a whole number >= 0, not {lines!r}")
        count = min(lines, MAX_TAIL_LINES)
        return read_tail(worker_dir(request), count, limit(request)).answer()

    return {"logs.index": index, "logs.read": read, "logs.tail": tail}
