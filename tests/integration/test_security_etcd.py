"""Real jobs and the real CLI through etcd with client certificates and with user/password.

Two real etcd servers: one serves TLS only and requires client certificates
signed by a throwaway CA (``--client-cert-auth``); the other is plain text with
auth enabled, a ``root`` user and a ``trainer`` user whose role may only touch
``/ringmaster/``.  A one-node job runs end to end through each, and
``ringmaster submit`` / ``status`` work with the TLS and auth options.  Every
way of getting the options wrong must end in one ``error:`` line that names the
endpoint and what to check, exit code 1, and no traceback.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import yaml

from orchestrator.api import EtcdAuthError, JobPhase
from orchestrator.etcd import channel, diagnosis
from orchestrator.etcd.client import connect
from orchestrator.etcd.embedded import EmbeddedEtcd, EtcdUser
from orchestrator.etcd.options import EtcdOptions
from orchestrator.local_run import run_job
from tests.certs import TLSFiles, make_tls_files
from tests.integration.security_jobs import REPO, auth_etcd, one_node_job, ringmaster, tls_etcd

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ROOT_PASSWORD = "root-Pw-7c1e0a"
TRAINER_PASSWORD = "trainer-Pw-52d9be"
QUICK = timedelta(seconds=3)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    return make_tls_files(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def tls_server(certs: TLSFiles) -> Iterator[EmbeddedEtcd]:
    with tls_etcd(certs) as server:
        yield server


@pytest.fixture(scope="module")
def auth_server() -> Iterator[EmbeddedEtcd]:
    with auth_etcd(ROOT_PASSWORD, EtcdUser("trainer", TRAINER_PASSWORD)) as server:
        yield server


def tls_options(server: EmbeddedEtcd, certs: TLSFiles) -> EtcdOptions:
    return EtcdOptions(
        (server.endpoint,),
        ca_cert=str(certs.ca),
        cert=str(certs.client_cert),
        key=str(certs.client_key),
        connect_timeout=QUICK,
    )


def job_file(tmp: Path, name: str) -> Path:
    path = tmp / f"{name}.yaml"
    path.write_text(
        yaml.safe_dump({"name": name, "entrypoint": str(REPO / "examples" / "train_tiny.py")})
    )
    return path


def assert_one_clear_line(done: object, *needles: str) -> str:
    rc, out, err = done.returncode, done.stdout, done.stderr  # type: ignore[attr-defined]
    assert rc == 1, (rc, out, err)
    assert "Traceback" not in out + err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


# -- whole jobs ----------------------------------------------------------------------------


def test_a_job_runs_through_etcd_with_client_certificates(
    tls_server: EmbeddedEtcd, certs: TLSFiles, tmp_path: Path
) -> None:
    lines: list[str] = []
    spec = one_node_job("tls-job", tmp_path)
    result = run_job(
        spec,
        etcd=tls_options(tls_server, certs),
        printer=lines.append,
        workdir=str(REPO),
        timeout=timedelta(seconds=150),
    )
    assert result.phase is JobPhase.SUCCEEDED, "\n".join(lines[-40:])
    assert (tmp_path / "final.pt").is_file()
    # The controller and the agent reached etcd through TLS: their records are there.
    with connect(tls_options(tls_server, certs)) as client:
        assert client.get("/ringmaster/jobs/tls-job/status") is not None


def test_a_job_runs_as_an_etcd_user_limited_to_its_prefix(
    auth_server: EmbeddedEtcd, tmp_path: Path
) -> None:
    options = EtcdOptions(
        (auth_server.endpoint,), user="trainer", password=TRAINER_PASSWORD, connect_timeout=QUICK
    )
    lines: list[str] = []
    spec = one_node_job("auth-job", tmp_path)
    result = run_job(
        spec, etcd=options, printer=lines.append, workdir=str(REPO), timeout=timedelta(seconds=150)
    )
    assert result.phase is JobPhase.SUCCEEDED, "\n".join(lines[-40:])
    assert (tmp_path / "final.pt").is_file()
    with connect(options) as client:
        assert client.get("/ringmaster/jobs/auth-job/status") is not None
        # The role really is limited to the prefix.
        with pytest.raises(EtcdAuthError, match="permission denied"):
            client.put("/elsewhere/key", b"x")


# -- the CLI -------------------------------------------------------------------------------


def test_cli_submit_and_status_with_client_certificates(
    tls_server: EmbeddedEtcd, certs: TLSFiles, tmp_path: Path
) -> None:
    tls = [
        "--etcd",
        tls_server.endpoint,
        "--etcd-ca",
        str(certs.ca),
        "--etcd-cert",
        str(certs.client_cert),
        "--etcd-key",
        str(certs.client_key),
    ]
    done = ringmaster(["submit", str(job_file(tmp_path, "cli-tls")), *tls])
    assert done.returncode == 0, done.stderr
    assert "submitted job 'cli-tls'" in done.stdout
    done = ringmaster(["status", "cli-tls", *tls])
    assert done.returncode == 0, done.stderr
    assert "cli-tls" in done.stdout and "Pending" in done.stdout


def test_cli_submit_and_status_with_a_password_from_the_environment(
    auth_server: EmbeddedEtcd, tmp_path: Path
) -> None:
    env = {
        "RINGMASTER_ETCD": auth_server.endpoint,
        "RINGMASTER_ETCD_USER": "trainer",
        "RINGMASTER_ETCD_PASSWORD": TRAINER_PASSWORD,
    }
    done = ringmaster(["submit", str(job_file(tmp_path, "cli-auth"))], env)
    assert done.returncode == 0, done.stderr
    done = ringmaster(["status", "cli-auth"], env)
    assert done.returncode == 0, done.stderr
    assert "cli-auth" in done.stdout and "Pending" in done.stdout


def test_cli_submit_reaches_the_etcd_of_the_job_files_rendezvous_section(
    auth_server: EmbeddedEtcd, tmp_path: Path
) -> None:
    """No --etcd: the job file's ``rendezvous.endpoints``, ``user`` and the password in
    the variable its ``password_env`` names serve (as the operator's pods use them)."""
    path = tmp_path / "own-etcd.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": "own-etcd",
                "entrypoint": str(REPO / "examples" / "train_tiny.py"),
                "rendezvous": {
                    "endpoints": [auth_server.endpoint],
                    "user": "trainer",
                    "password_env": "TRAINER_ETCD_PASSWORD",
                },
            }
        )
    )
    unset = ringmaster(["submit", str(path)])
    assert unset.returncode == 2, (unset.stdout, unset.stderr)
    assert "rendezvous.password_env names $TRAINER_ETCD_PASSWORD, which is not set" in (
        unset.stderr
    )
    done = ringmaster(["submit", str(path)], {"TRAINER_ETCD_PASSWORD": TRAINER_PASSWORD})
    assert done.returncode == 0, done.stderr
    assert "submitted job 'own-etcd'" in done.stdout
    env = {"RINGMASTER_ETCD": auth_server.endpoint, "RINGMASTER_ETCD_USER": "trainer"}
    # what the operator gives the job's pods for password_env
    env |= {"RINGMASTER_ETCD_PASSWORD_ENV": "TRAINER_ETCD_PASSWORD"}
    done = ringmaster(["status", "own-etcd"], {**env, "TRAINER_ETCD_PASSWORD": TRAINER_PASSWORD})
    assert done.returncode == 0, done.stderr
    assert "own-etcd" in done.stdout and "Pending" in done.stdout


def test_a_connection_attempt_that_takes_the_whole_deadline_still_gets_its_diagnosis(
    auth_server: EmbeddedEtcd, certs: TLSFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a busy machine one TLS handshake against the plain-text server may wait out the
    whole ``connect_timeout`` right after a probe that timed out: before it gives up,
    ``connect`` asks once more why, and says TLS, not "could not reach etcd"."""
    real_probe, real_open = diagnosis.tls_mismatch, channel.open_endpoint
    calls: list[str | None] = []

    def slow_first(options: EtcdOptions, host: str, port: int) -> str | None:
        found = None if not calls else real_probe(options, host, port)
        calls.append(found)
        return found

    def slow_open(
        options: EtcdOptions, host: str, port: int, creds: object, timeout: float
    ) -> object:
        time.sleep(timeout)  # the handshake waited the whole time left
        return real_open(options, host, port, creds, 0.2)

    monkeypatch.setattr(diagnosis, "tls_mismatch", slow_first)
    monkeypatch.setattr(channel, "open_endpoint", slow_open)
    options = EtcdOptions(
        (auth_server.endpoint,), ca_cert=str(certs.ca), connect_timeout=timedelta(seconds=1)
    )
    with pytest.raises(EtcdAuthError, match="does not answer TLS"):
        connect(options)
    assert calls[0] is None and calls[-1] is not None, calls


@pytest.mark.parametrize(
    ("case", "check"),
    [
        ("no client certificate", "--etcd-cert"),
        ("client certificate of another CA", "--etcd-cert"),
        ("server CA not trusted", "--etcd-ca"),
        ("plain text against TLS", "--etcd-ca"),
    ],
)
def test_cli_tls_mistakes_give_one_clear_line(
    tls_server: EmbeddedEtcd, certs: TLSFiles, case: str, check: str
) -> None:
    options = {
        "no client certificate": ["--etcd-ca", str(certs.ca)],
        "client certificate of another CA": [
            "--etcd-ca",
            str(certs.ca),
            "--etcd-cert",
            str(certs.foreign_client_cert),
            "--etcd-key",
            str(certs.foreign_client_key),
        ],
        "server CA not trusted": [
            "--etcd-ca",
            str(certs.foreign_ca),
            "--etcd-cert",
            str(certs.client_cert),
            "--etcd-key",
            str(certs.client_key),
        ],
        "plain text against TLS": [],
    }[case]
    done = ringmaster(["status", "--etcd", tls_server.endpoint, "--etcd-timeout", "3", *options])
    assert_one_clear_line(done, tls_server.endpoint, check)


def test_cli_tls_against_a_plain_text_etcd_says_so(
    auth_server: EmbeddedEtcd, certs: TLSFiles
) -> None:
    done = ringmaster(
        [
            "status",
            "--etcd",
            auth_server.endpoint,
            "--etcd-ca",
            str(certs.ca),
            "--etcd-timeout",
            "3",
        ]
    )
    assert_one_clear_line(done, auth_server.endpoint, "does not answer TLS")


def test_cli_wrong_password_gives_one_clear_line_without_the_password(
    auth_server: EmbeddedEtcd,
) -> None:
    wrong = "not-the-Pw-0f3b"
    env = {"RINGMASTER_ETCD_USER": "trainer", "RINGMASTER_ETCD_PASSWORD": wrong}
    done = ringmaster(["status", "--etcd", auth_server.endpoint], env)
    line = assert_one_clear_line(done, auth_server.endpoint, "--etcd-password")
    assert wrong not in line and TRAINER_PASSWORD not in line


def test_cli_without_credentials_says_auth_is_required(auth_server: EmbeddedEtcd) -> None:
    done = ringmaster(["status", "--etcd", auth_server.endpoint])
    assert_one_clear_line(done, auth_server.endpoint, "--etcd-user")


def test_an_expired_auth_token_is_renewed() -> None:
    """etcd forgets idle tokens (``--auth-token-ttl``); the client authenticates again."""
    with EmbeddedEtcd(extra_args=["--auth-token-ttl", "1"]) as server:
        server.enable_auth(ROOT_PASSWORD, [EtcdUser("trainer", TRAINER_PASSWORD)])
        options = EtcdOptions((server.endpoint,), user="trainer", password=TRAINER_PASSWORD)
        with connect(options) as client:
            client.put("/ringmaster/renew", b"1")
            first_token = client.transport.raw.metadata
            time.sleep(3)  # idle past the token's life
            kv = client.get("/ringmaster/renew")
            assert kv is not None and kv.value == b"1"
            assert client.transport.raw.metadata != first_token  # a new token was obtained


def test_cli_password_on_the_command_line_works_with_a_warning(
    auth_server: EmbeddedEtcd,
) -> None:
    done = ringmaster(
        [
            "status",
            "--etcd",
            auth_server.endpoint,
            "--etcd-user",
            "trainer",
            "--etcd-password",
            TRAINER_PASSWORD,
        ]
    )
    assert done.returncode == 0, done.stderr
    assert "RINGMASTER_ETCD_PASSWORD" in done.stderr and "visible" in done.stderr
    assert TRAINER_PASSWORD not in done.stdout + done.stderr


def test_a_tls_probe_that_timed_out_is_asked_again(
    auth_server: EmbeddedEtcd, certs: TLSFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a busy machine the plain-text server may not refuse the probe's handshake
    within its second: that probe says nothing, and the next round probes again."""
    real = diagnosis.tls_mismatch
    calls: list[str | None] = []

    def slow_first(options: EtcdOptions, host: str, port: int) -> str | None:
        found = None if not calls else real(options, host, port)  # the first timed out
        calls.append(found)
        return found

    monkeypatch.setattr(diagnosis, "tls_mismatch", slow_first)
    options = EtcdOptions(
        (auth_server.endpoint,), ca_cert=str(certs.ca), connect_timeout=timedelta(seconds=5)
    )
    with pytest.raises(EtcdAuthError, match="does not answer TLS"):
        connect(options)
    # the first (made to time out) said nothing, and the rounds went on probing until a
    # probe answered: on a busy machine a real probe may time out too before one does
    assert len(calls) >= 2 and calls[-1] is not None, calls
    assert all(found is None for found in calls[:-1]), calls


@pytest.mark.parametrize(
    ("case", "check"),
    [
        ("certificate without its key", "--etcd-key"),
        ("key without its certificate", "--etcd-cert"),
        ("a CA file that is not PEM", "--etcd-ca"),
        ("certificate and key swapped", "swapped"),
    ],
)
def test_cli_tls_files_that_cannot_work_give_one_clear_line(
    tls_server: EmbeddedEtcd, certs: TLSFiles, tmp_path: Path, case: str, check: str
) -> None:
    """Checked before gRPC sees them: it aborts the process on a certificate without a
    key, and logs raw lines of its own for files that are not PEM."""
    not_pem = tmp_path / "ca.txt"
    not_pem.write_text("this is not a certificate\n")
    options = {
        "certificate without its key": [
            "--etcd-ca",
            str(certs.ca),
            "--etcd-cert",
            str(certs.client_cert),
        ],
        "key without its certificate": [
            "--etcd-ca",
            str(certs.ca),
            "--etcd-key",
            str(certs.client_key),
        ],
        "a CA file that is not PEM": ["--etcd-ca", str(not_pem)],
        "certificate and key swapped": [
            "--etcd-ca",
            str(certs.ca),
            "--etcd-cert",
            str(certs.client_key),
            "--etcd-key",
            str(certs.client_cert),
        ],
    }[case]
    done = ringmaster(["status", "--etcd", tls_server.endpoint, "--etcd-timeout", "3", *options])
    assert_one_clear_line(done, check)
