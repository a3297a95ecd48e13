"""The operator's side of etcd: hand the spec to the controller, read its status back.

The controller of a job reads the spec from ``/ringmaster/jobs/<job>/spec``
(what ``ringmaster submit`` writes) and writes ``/ringmaster/jobs/<job>/status``.
The operator writes the spec of each TrainingJob there (and rewrites it when
the TrainingJob's spec changes), reads the status on every sync and removes
the job's keys when the TrainingJob is deleted.  Clients are kept per set of
endpoints, since a job may name its own etcd.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from orchestrator.api import EtcdAuthError, EtcdError
from orchestrator.etcd.client import EtcdClient, connect
from orchestrator.etcd.options import EtcdOptions
from orchestrator.operator.api import PermanentOperatorError, RetryableOperatorError
from orchestrator.spec.job import JobSpec
from orchestrator.state import jobs, keys, records
from orchestrator.state.api import JobExistsError
from orchestrator.state.records import SpecRecord


class EtcdJobRecords:
    """:class:`~orchestrator.operator.api.JobRecords` on a real etcd."""

    def __init__(self, base: EtcdOptions | None = None) -> None:
        """Args:
        base: options (TLS, credentials, timeouts) used for every endpoint set.
        """
        self._base = base
        self._clients: dict[tuple[str, ...], EtcdClient] = {}
        self._lock = threading.Lock()

    def _client(self, endpoints: tuple[str, ...]) -> EtcdClient:
        with self._lock:
            client = self._clients.get(endpoints)
            if client is None:
                opts = EtcdOptions(endpoints=endpoints)
                if self._base is not None:
                    opts = EtcdOptions(
                        endpoints=endpoints,
                        ca_cert=self._base.ca_cert,
                        cert=self._base.cert,
                        key=self._base.key,
                        user=self._base.user,
                        password=self._base.password,
                        connect_timeout=self._base.connect_timeout,
                        op_timeout=self._base.op_timeout,
                    )
                client = _guard(lambda: connect(opts))
                self._clients[endpoints] = client
            return client

    def ensure_spec(self, endpoints: tuple[str, ...], spec: JobSpec) -> bool:
        """Make etcd hold ``spec``; True when something was written.

        * nothing stored: submit it (what ``ringmaster submit`` does);
        * the same spec stored (same hash): nothing, whatever the job's phase, so a
          finished job stays finished;
        * another spec of a finished job: submit anew (the job runs again and
          resumes from its checkpoints);
        * another spec of a running job: replace the spec in its record, in place
          (the same run, resumed from the same checkpoint).  The job's controller
          takes the new spec at its next tick (``nodes``, the policies it decides
          by); what agents and workers read when they start (the entrypoint,
          ``checkpoint``, ``comm``, ``sync``) applies from their next start.
        """
        client = self._client(endpoints)
        record = _guard(lambda: records.read(client, keys.job_spec(spec.name), SpecRecord))
        digest = jobs.spec_hash(spec)
        if record is not None and record.hash == digest:
            return False
        status = _guard(lambda: jobs.read_status(client, spec.name))
        if record is None or (status is not None and status.phase.terminal):
            try:
                _guard(lambda: jobs.submit(client, spec))
            except JobExistsError:
                return False  # another sync submitted it a moment ago
            return True
        # the same run, resumed from where it was asked to: only the spec changes
        updated = dataclasses.replace(record, spec=spec.to_dict(), hash=digest)
        _guard(lambda: records.write(client, keys.job_spec(spec.name), updated))
        return True

    def read_status(self, endpoints: tuple[str, ...], job: str) -> dict[str, Any] | None:
        client = self._client(endpoints)
        status = _guard(lambda: jobs.read_status(client, job))
        return None if status is None else status.to_dict()

    def forget(self, endpoints: tuple[str, ...], job: str) -> None:
        client = self._client(endpoints)
        _guard(lambda: client.delete_prefix(keys.job_prefix(job)))

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()


def _translate(e: EtcdError) -> Exception:
    if isinstance(e, EtcdAuthError):
        return PermanentOperatorError(f"etcd refused the operator's credentials: {e}")
    return RetryableOperatorError(str(e))


def _guard(fn: Any) -> Any:
    try:
        return fn()
    except EtcdError as e:
        raise _translate(e) from e
