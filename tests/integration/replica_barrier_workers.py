"""Worker functions for the replica barrier test (run in gloo processes by ``run_gloo``)."""

from __future__ import annotations

from typing import Any


def step_then_leave(rank: int, world: int) -> dict[str, Any]:
    """Both ranks step once together; then rank 1 leaves its step before the optimizer
    (its groups go with it) and rank 0 tries to step alone."""
    import torch

    from agents.state.replica_barrier import ReplicaBarrier

    barrier = ReplicaBarrier()
    barrier.form(rank, world, replica_size=world)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    barrier.attach({"optimizer": opt})
    barrier.attach({"optimizer": opt})  # a second generation's attach adds no second hook
    out: dict[str, Any] = {}
    for step in range(2):
        model(torch.ones(1, 4)).sum().backward()
        before = model.weight.detach().clone()
        if step == 1 and rank == 1:
            return {"left": True}  # the step failed here: no optimizer step, groups destroyed
        try:
            opt.step()
        except RuntimeError as e:
            out["error"] = str(e)
        out[f"changed_{step}"] = not torch.equal(before, model.weight.detach())
        opt.zero_grad()
    out["met"] = barrier.met
    return out
