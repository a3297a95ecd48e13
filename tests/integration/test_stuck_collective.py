"""A gloo collective stuck on a SIGSTOPped peer ends at the guard's operation
timeout, whatever the abort does (gloo's abort does not interrupt a wait).

Two real processes form a gloo generation with the runtime's ``form_group``
and guard it with a :class:`~agents.runtime.collective_guard.CollectiveGuard`
(tests/faults/stuck_pair.py); rank 1 is SIGSTOPped, the test then
announces a newer generation, and rank 0 reports what ended its all-reduce.
The two-GPU NCCL twin of this test (tests/cuda/test_nccl_groups.py) expects
the abort to end it instead.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.etcd.embedded import EmbeddedEtcd
from tests.faults.stuck_pair import run_stuck_pair

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

OP_TIMEOUT_S = 2.0


def test_gloo_wait_on_a_stopped_peer_ends_at_the_operation_timeout(
    etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    result = run_stuck_pair(etcd.endpoint, tmp_path, backend="gloo", op_timeout=OP_TIMEOUT_S)
    assert result["ended_by"] == "timeout", result
    # the learnt timeout, not torch's default (30 min) or twice hang_timeout
    assert 1.0 < result["seconds"] < 10.0, result


def test_a_wait_between_sites_ends_at_the_timeout_learnt_from_outer_syncs(
    etcd: EmbeddedEtcd, tmp_path: Path
) -> None:
    """Two sites of a delayed sync, one rank each: the other site's leader stops while
    this one waits for its offer to an outer sync's round.  The guard learnt from two
    outer syncs of 0.05 s that such a wait may take its floor, 1 s: the wait ends
    there, not at the ceiling (60 s here)."""
    result = run_stuck_pair(
        etcd.endpoint, tmp_path, backend="gloo", op_timeout=60.0, between_sites=True
    )
    assert result["ended_by"] == "timeout", result
    assert 0.5 < result["seconds"] < 10.0, result
