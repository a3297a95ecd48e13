"""Secrets never leak: not into output, etcd, events, error messages or command lines.

A real one-node job checkpoints to a real S3 API endpoint (moto server) with
AWS keys from the environment, through an etcd with auth on (the job user's
password reaches the controller, the agent and the workers through the
environment).  Everything the run leaves behind is searched for the S3
secret key and the etcd password: every line the controller, the agent and the
workers printed, every key and value under ``/ringmaster/`` (events and status
included), the command line of every process alive during the run, and the
error messages of failing runs (a bucket that does not exist, a wrong
password).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from orchestrator.api import EtcdAuthError, JobPhase
from orchestrator.etcd.client import connect
from orchestrator.etcd.embedded import EmbeddedEtcd, EtcdUser
from orchestrator.etcd.options import EtcdOptions
from orchestrator.local_run import LocalRun, RunResult
from orchestrator.process_lifetime import free_port
from orchestrator.state import events, jobs
from tests.conftest import S3Endpoint
from tests.integration.security_jobs import REPO, auth_etcd, one_node_job, ringmaster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ETCD_PASSWORD = f"etcd-Pw-{uuid.uuid4().hex[:12]}"
S3_SECRET = f"s3-Secret-{uuid.uuid4().hex}"
S3_KEY_ID = "AKIARINGMASTERLEAK01"
SECRETS = (ETCD_PASSWORD, S3_SECRET)


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedEtcd]:
    with auth_etcd(f"root-{uuid.uuid4().hex}", EtcdUser("trainer", ETCD_PASSWORD)) as etcd:
        yield etcd


@pytest.fixture
def aws_env(s3: S3Endpoint, monkeypatch: pytest.MonkeyPatch) -> S3Endpoint:
    """The job's S3 credentials and endpoint, as a real deployment gives them: env only."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", S3_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", S3_SECRET)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint_url)
    monkeypatch.setenv("AWS_DEFAULT_REGION", s3.region)
    return s3


def options(server: EmbeddedEtcd, password: str = ETCD_PASSWORD) -> EtcdOptions:
    return EtcdOptions(
        (server.endpoint,),
        user="trainer",
        password=password,
        connect_timeout=timedelta(seconds=3),
    )


class CommandLines:
    """Collects the command line of every process that appears while it runs."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(0.1):
            for entry in os.listdir("/proc"):
                if not entry.isdigit():
                    continue
                try:  # read again each time: a fresh child shows its parent's line until exec
                    raw = Path(f"/proc/{entry}/cmdline").read_bytes()
                except OSError:
                    continue
                if raw:
                    self.seen.add(raw.replace(b"\0", b" ").decode(errors="replace"))

    def __enter__(self) -> CommandLines:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def run_and_collect(
    server: EmbeddedEtcd, name: str, tmp: Path, url: str
) -> tuple[RunResult, list[str], CommandLines]:
    """Run the job to its end and collect what it printed and every command line."""
    spec = one_node_job(name, tmp, checkpoint={"url": url, "every_steps": 4})
    lines: list[str] = []
    with CommandLines() as commands:
        run = LocalRun(
            spec,
            etcd=options(server),
            printer=lines.append,
            workdir=str(REPO),
            timeout=timedelta(seconds=120),
        )
        with run:
            result = run.wait()
    return result, lines, commands


def run_until_worker_exits(
    server: EmbeddedEtcd, name: str, tmp: Path, url: str
) -> tuple[list[str], list[events.Event], CommandLines]:
    """Run a job bound to fail; stop once a worker's exit or the job's failure is seen."""
    spec = one_node_job(name, tmp, checkpoint={"url": url, "every_steps": 4})
    spec.fault_tolerance.max_restarts = 0
    lines: list[str] = []
    run = LocalRun(spec, etcd=options(server), printer=lines.append, workdir=str(REPO))
    found: list[events.Event] = []
    with CommandLines() as commands, connect(options(server)) as client, run:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            found = events.list_events(client, name)
            if any(e.type == "WorkerExited" or e.message.startswith("Failed") for e in found):
                break
            time.sleep(0.2)
    return lines, found, commands


def etcd_dump(server: EmbeddedEtcd) -> str:
    """Every key and value ringmaster wrote, as text."""
    with connect(options(server)) as client:
        items = client.get_prefix("/ringmaster/")
    assert items, "nothing in etcd"
    return "\n".join(f"{kv.key} = {kv.value.decode(errors='replace')}" for kv in items)


def assert_no_secret(where: str, text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"a secret leaked into {where}"


def test_a_job_with_s3_and_etcd_credentials_leaks_neither(
    server: EmbeddedEtcd, aws_env: S3Endpoint, tmp_path: Path
) -> None:
    prefix = f"leak-{uuid.uuid4().hex[:8]}"
    result, lines, commands = run_and_collect(server, "leak-ok", tmp_path, aws_env.url(prefix))
    output = "\n".join(lines)
    assert result.phase is JobPhase.SUCCEEDED, "\n".join(lines[-40:])
    # The checkpoints really went to S3 with those credentials.
    written = aws_env.fs().find(f"{aws_env.bucket}/{prefix}")
    assert any(p.endswith("manifest.json") for p in written), written
    assert any("[node-0]" in line for line in lines) and any(
        "[controller-0]" in line for line in lines
    )
    assert_no_secret("the output of the controller, agent and workers", output)
    assert_no_secret("etcd", etcd_dump(server))
    assert_no_secret("events", "\n".join(f"{e.type} {e.message}" for e in result.events))
    # The agent, the controller and the worker were all seen, with their etcd options.
    seen = "\n".join(commands.seen)
    assert "agent --job leak-ok" in seen and "controller --job leak-ok" in seen
    assert "train_tiny.py" in seen and "--etcd-user trainer" in seen
    assert_no_secret("a command line", "\n".join(commands.seen))


def test_an_unreachable_checkpoint_store_leaks_nothing(
    server: EmbeddedEtcd, aws_env: S3Endpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", closed)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    url = aws_env.url(f"unreachable-{uuid.uuid4().hex[:8]}")
    # `run` refuses before anything starts: one line with the endpoint, no secret
    with pytest.raises(jobs.CheckpointStorageRefusedError) as refused:
        run_until_worker_exits(server, "leak-refused", tmp_path, url)
    assert closed in str(refused.value)
    assert_no_secret("the refusal of a run", f"{refused.value}\n{refused.value!r}")
    # submitted past that check (as to a cluster): the controller, holding the root
    # before any worker trains, fails the job, naming the endpoint, and leaks nothing
    monkeypatch.setattr(jobs, "check_checkpoint_url", lambda spec: None)
    lines, found, commands = run_until_worker_exits(server, "leak-fail", tmp_path, url)
    output = "\n".join(lines)
    failed = [e.message for e in found if e.message.startswith("Failed")]
    assert failed and closed in failed[0], "\n".join(lines[-40:])
    assert closed in output  # the failure is reported ...
    assert_no_secret("the output of a failing run", output)  # ... without the secrets
    assert_no_secret("etcd", etcd_dump(server))
    assert_no_secret("events", "\n".join(f"{e.type} {e.message}" for e in found))
    assert_no_secret("a command line", "\n".join(commands.seen))


def test_a_wrong_password_error_leaks_neither_password(server: EmbeddedEtcd) -> None:
    wrong = f"wrong-Pw-{uuid.uuid4().hex[:8]}"
    with pytest.raises(EtcdAuthError) as caught:
        connect(options(server, wrong))
    text = f"{caught.value}\n{caught.value!r}\n{options(server, wrong)!r}"
    assert server.endpoint in text
    assert wrong not in text and ETCD_PASSWORD not in text
    done = ringmaster(
        ["run", str(REPO / "examples" / "demo.yaml"), "--etcd", server.endpoint],
        {"RINGMASTER_ETCD_USER": "trainer", "RINGMASTER_ETCD_PASSWORD": wrong},
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert wrong not in done.stdout + done.stderr
