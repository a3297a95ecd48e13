"""The worker runtime: what a training script imports (runs in the training process).

A torchrun-style script becomes fault tolerant with a few lines::

    from agents import runtime

    session = runtime.init()
    model = session.wrap(Net())                      # DDP that survives hot-swaps
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session.track(model=model, optimizer=opt)         # what a replacement receives
    for step in session.steps(1000):
        with session.guard():                        # a peer's death is caught here
            x, y = batch(step, session.rank, session.world_size)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        session.report(loss=loss.item())

How recovery works: when a peer dies, the gloo collective inside the step
raises in the survivors; :meth:`Session.guard` records the error and, at the
step boundary, :meth:`Session.steps` decides whether a peer is gone
(:mod:`agents.runtime.failures`: the error came from a collective, or the control
plane published a newer generation).  If so it tears the group down, reports
to etcd, waits for the controller's next generation (a warm spare in the dead
node's place), forms a new group in-process and brings every rank to the
freshest live state (:mod:`agents.runtime.generation`, through the recovery of
the kind of state the session holds, :mod:`agents.recovery`).  The failed step
runs again; no completed step is lost or applied twice.
Survivors never restart and never read object storage.  An error of the
script's own is reported as such and raised out of :meth:`Session.steps`: the
worker exits with it, and the controller restarts or fails the job.

At every step boundary the ranks all-reduce a few control integers (known
generation, checkpoint request, stop, periodic save due; :mod:`agents.runtime.boundary`),
so planned changes (drain, scale, checkpoint-now, stop) and saves happen at
the same step on every rank.

The session owns one record of where its worker stands
(:mod:`agents.runtime.worker_state`) and the runtime's parts, which read it
and return what changed for the session to apply:
:mod:`agents.runtime.generation` (join a generation, leave a broken one),
:mod:`agents.runtime.boundary` (the step boundary's vote and what it
decides), :mod:`agents.runtime.saving` (durable checkpoints),
:mod:`agents.runtime.wrapping` (what ``wrap`` builds),
:mod:`agents.runtime.plan_watch` (plan and control keys),
:mod:`agents.runtime.heartbeat` (progress), :mod:`agents.runtime.failures`
(a peer's failure or the script's own error), and
:mod:`agents.runtime.participants` (what takes part in the step loop beside the
script's step: a delayed sync, the buddy copies).  :mod:`agents.runtime.data`
reads a step's batch.

The runtime's parts never import :mod:`agents.recovery`, nor recovery the
runtime: both speak through the contract and the sharded model's vocabulary
one floor below them (:mod:`agents.state`).  :func:`init`
(:mod:`agents.runtime.startup`, the session's composition root and the one
module that imports both) hands the session recovery's table.

A spare's workers wait inside :meth:`Session.steps` until a generation
includes their node; when the job ends first, the loop simply ends
(``session.finished`` stays False).
"""

from __future__ import annotations

from agents.runtime.session import Session
from agents.runtime.standalone import StandaloneSession
from agents.runtime.startup import init
from agents.state.pipeline import Pipeline

__all__ = ["Pipeline", "Session", "StandaloneSession", "init"]
