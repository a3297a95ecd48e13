"""ElasticDDP: a DDP dropped after a failed step leaves nothing behind in the next one.

A step that fails inside DDP's gradient exchange leaves that DDP's reducer in
the middle of a backward pass.  If anything still holds the old DDP (the
traceback of the step's error does when the step failed in its forward), its
autograd hooks stay on the parameters and fire in the next generation's
backward, where the stuck reducer raises "Expected to mark a variable ready
only once".  Here the failure is a comm hook that raises (one real gloo
process), and the test keeps a reference to the old DDP on purpose.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest

from tests.gloo import run_gloo

pytestmark = pytest.mark.integration


def _fail_then_retry(rank: int, world_size: int) -> list[float]:
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from agents.runtime.elastic_ddp import ElasticDDP
    from agents.runtime.failures import CollectiveFailures

    def broken(state: Any, bucket: Any) -> Any:
        raise RuntimeError("peer gone (simulated)")

    hooks = [broken, allreduce_hook]
    failures = CollectiveFailures()
    torch.manual_seed(0)
    model = ElasticDDP(
        torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)),
        hook_installer=lambda ddp: ddp.register_comm_hook(None, hooks.pop(0)),
        failures=failures,
    )
    model.rebuild()
    x = torch.randn(16, 4)
    with pytest.raises(RuntimeError, match="simulated"):
        model(x).sum().backward()
    assert failures.take() is not None  # the failed exchange was recorded
    kept = model.ddp  # what a traceback would keep alive
    gc.disable()  # no collector to the rescue
    try:
        model.rebuild()
        losses = []
        for _ in range(3):
            loss = model(x).pow(2).mean()
            loss.backward()
            losses.append(float(loss))
    finally:
        gc.enable()
    assert kept is not None
    return losses


def test_a_dropped_ddp_leaves_no_hooks_on_the_parameters() -> None:
    (losses,) = run_gloo(_fail_then_retry, 1)
    assert len(losses) == 3
