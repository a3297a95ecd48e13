"""A ringmaster job submitted to the test's real Slurm cluster, followed from outside.

:func:`submit` writes a job file (a chaos test's tiny job plus a ``slurm``
section) and submits it with ``ringmaster slurm submit``, as a user would.
:class:`SlurmJob` reads the batch script's output file (the driver prints
where its etcd listens, the batch host, the job's events) and the job's
status from that etcd while the job runs.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from orchestrator.etcd.client import EtcdClient, connect
from orchestrator.etcd.options import EtcdOptions
from orchestrator.spec.job import JobSpec
from orchestrator.state import jobs
from tests.chaos.jobs import REPO
from tests.faults.slurm_cluster import SlurmCluster

__all__ = ["SlurmJob", "submit"]


def submit(cluster: SlurmCluster, spec: JobSpec, tmp: Path, **slurm: Any) -> SlurmJob:
    """Submit ``spec`` (its ``slurm`` section set to ``slurm``) with ``ringmaster slurm
    submit``; the submitted job."""
    data = spec.to_dict()
    data["slurm"] = {"signal_grace": 30, **slurm}
    job_file = tmp / "job.yaml"
    job_file.write_text(yaml.safe_dump(data, sort_keys=False))
    output = tmp / "slurm-%j.out"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "orchestrator.cli",
            "slurm",
            "submit",
            str(job_file),
            "-o",
            str(output),
        ],
        cwd=REPO,
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    found = re.search(r"as Slurm job (\d+)", done.stdout)
    assert found, done.stdout
    job_id = found.group(1)
    return SlurmJob(cluster, spec.name, job_id, Path(str(output).replace("%j", job_id)))


class SlurmJob:
    """One submitted job: its Slurm id, its output, its status while it runs."""

    def __init__(self, cluster: SlurmCluster, name: str, job_id: str, output: Path) -> None:
        self.cluster = cluster
        self.name = name
        self.job_id = job_id
        self.output = output
        self._client: EtcdClient | None = None
        self._endpoint = ""

    def text(self) -> str:
        try:
            return self.output.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def lines(self) -> list[str]:
        return self.text().splitlines()

    def batch_host(self) -> str:
        found = re.findall(r"batch host (\S+)", self.text())
        assert found, self.text()
        return str(found[-1])

    def client(self) -> EtcdClient | None:
        """A client of the etcd the driver of the current Slurm run started (None before)."""
        found = re.findall(r"\[slurm\] etcd on (\S+) ", self.text())
        if not found:
            return None
        if found[-1] != self._endpoint:
            self.close()
            self._endpoint = found[-1]
            self._client = connect(EtcdOptions((self._endpoint,)))
        return self._client

    def status(self) -> jobs.JobStatus | None:
        client = self.client()
        if client is None:
            return None
        try:
            return jobs.read_status(client, self.name)
        except Exception:  # the run's etcd is going away with it
            return None

    def wait_step(self, step: int, timeout: float = 150) -> jobs.JobStatus:
        """Wait until the job runs at ``step`` or later; its status then."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.status()
            if status is not None and status.step >= step and status.phase.value == "Running":
                return status
            if self.cluster.job(self.job_id).get("JobState") not in ("PENDING", "RUNNING"):
                break
            time.sleep(0.2)
        raise AssertionError(f"job did not reach step {step}:\n{self.tail()}")

    def wait_line(self, pattern: str, timeout: float = 120) -> re.Match[str]:
        """Wait until the output has a line matching ``pattern``; the match."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines():
                if found := re.search(pattern, line):
                    return found
            time.sleep(0.2)
        raise AssertionError(f"no line matching {pattern!r}:\n{self.tail()}")

    def wait_end(self, timeout: float = 180) -> dict[str, str]:
        """Wait until the Slurm job ended; its fields (JobState, ExitCode...)."""
        try:
            return self.cluster.wait_job(
                self.job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}, timeout
            )
        finally:
            self.close()

    def events(self, kind: str) -> list[str]:
        """The ``[event] KIND: message`` lines the driver printed."""
        prefix = f"[event] {kind}: "
        return [line.split(prefix, 1)[1] for line in self.lines() if prefix in line]

    def tail(self, n: int = 80) -> str:
        return "\n".join(self.lines()[-n:]) + "\n" + self.cluster.log_tails(8)

    def close(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
        self._client = None
        self._endpoint = ""
