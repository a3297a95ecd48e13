"""Record, then vote: is a failed step a peer's failure or the script's own error?

A step that raised is only a recovery when a peer is gone.  The worker does
not guess that from the words of the exception; it records what it can know
for certain and decides at the step boundary:

* **recorded collective failures**: the runtime sees every collective it
  runs or routes: DDP's gradient all-reduce (every comm hook is wrapped by
  :meth:`CollectiveFailures.wrap_hook`, the plain all-reduce too), DDP's
  buffer broadcast, the runtime's own control vote, state sync and the comm
  hook's after-step averaging.  An error raised there means a peer of the
  group did not take part: a peer is gone;
* **the backend's own error type**: an error that is a
  ``torch.distributed.DistError`` (or a subclass) comes from the backend;
* **gloo's transport**: a ``RuntimeError`` whose text is gloo's TCP transport
  losing a peer (below), raised by a collective no step recorded (a save's own,
  the script's own ``dist`` calls): a peer's socket went, never the script's bug;
* **the control plane**: a newer generation is published (the controller
  replaced a member, or a planned switch is under way).

Anything else is the script's own error: the worker reports it
(``BreakReport(user_error=True)``) and exits with it, so the controller
restarts or fails the job instead of recovering into the same error again.

What torch 2.13 (CPU, gloo, two processes on 127.0.0.1) raises in the
survivor, measured with a peer SIGKILLed in the middle of a loop of
``all_reduce`` (2M floats) and of DDP forward/backward steps, with a peer
that ``os._exit``-ed (its sockets close) and with a peer that raised and
exited (its interpreter closes the sockets):

* always a plain ``RuntimeError``, never a ``DistError``: not
  ``DistBackendError``, ``DistNetworkError`` nor ``DistStoreError``;
* raised 0.2-0.9 s after the peer's death, by the collective that was in
  flight (by ``backward()`` under DDP);
* its text is gloo's: ``[.../gloo/transport/tcp/pair.cc:537] Read error
  [127.0.0.1]:PORT: Connection reset by peer`` (SIGKILL, ``os._exit``) or
  ``[.../pair.cc:553] Connection closed by peer [127.0.0.1]:PORT`` (a
  raised error, and under DDP in every case).

So with gloo the type tells nothing, and a user's ``RuntimeError("socket timed
out")`` has the same type as a dead peer's: only the place where it was
raised (a collective or not) and the control plane can tell them apart.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

from agents.runtime.step_timing import StepTiming

__all__ = ["PEER_SETTLE_S", "CollectiveFailures", "peer_failure", "raised_in_collective"]

#: After a step failed without a failed collective, how long the worker waits for
#: the control plane to publish a newer generation before taking the error as the
#: script's own.
PEER_SETTLE_S = 0.2


class CollectiveFailures:
    """The first error raised by a collective of the current step (thread safe).

    DDP runs comm hook callbacks on the backend's threads, so errors are
    recorded under a lock; :meth:`take` hands the first one to the training
    loop at the step boundary.  The hooks it makes also tell ``timing`` when
    each gradient bucket was posted and when its reduction completed.
    """

    def __init__(self, timing: StepTiming | None = None) -> None:
        self._lock = threading.Lock()
        self._first: BaseException | None = None
        self.timing = timing

    def record(self, error: BaseException) -> None:
        with self._lock:
            if self._first is None:
                self._first = error

    def take(self) -> BaseException | None:
        """The recorded error, if any; the record is cleared."""
        with self._lock:
            first, self._first = self._first, None
            return first

    def clear(self) -> None:
        self.take()

    @contextlib.contextmanager
    def collective(self) -> Iterator[None]:
        """Run a collective of the runtime's own; an error raised in it is recorded."""
        try:
            yield
        except Exception as e:
            self.record(e)
            raise

    def wrap_hook(self, hook: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        """A DDP comm hook that records the errors of ``hook``'s collectives."""

        # No annotations: DDP rejects a hook whose ``bucket`` is annotated with
        # anything but the GradBucket class (here every annotation is a string).
        timing = self.timing

        def recorded(state, bucket):
            if timing is not None:
                timing.posted()
            try:
                fut = hook(state, bucket)
            except Exception as e:
                self.record(e)
                raise

            def check(done: Any) -> Any:
                try:
                    value = done.value()
                except Exception as e:
                    self.record(e)
                    raise
                if timing is not None:
                    timing.completed()
                return value

            return fut.then(check)

        return recorded

    def allreduce_hook(self) -> Callable[[Any, Any], Any]:
        """DDP's plain gradient average as a comm hook that records its errors.

        What torch's ``allreduce_hook`` does (divide by the group size, sum), in one
        Python callback instead of the two that :meth:`wrap_hook` around it would
        run on gloo's thread, and with the group's own ``allreduce`` rather than
        the checks of ``dist.all_reduce``: this runs for every bucket of every step.
        """
        import torch.distributed as dist

        timing = self.timing

        def hook(state, bucket):  # no annotations: see wrap_hook
            if timing is not None:
                timing.posted()
            group = state if state is not None else dist.group.WORLD
            assert group is not None, "a DDP comm hook runs only inside a process group"
            tensor = bucket.buffer()
            tensor.div_(group.size())
            try:
                fut = group.allreduce([tensor]).get_future()
            except Exception as e:
                self.record(e)
                raise

            def check(done: Any) -> Any:
                try:
                    value = done.value()[0]
                except Exception as e:
                    self.record(e)
                    raise
                if timing is not None:
                    timing.completed()
                return value

            return fut.then(check)

        return hook


def peer_failure(
    error: BaseException, recorded: BaseException | None, newer_generation: int | None
) -> str | None:
    """Why ``error`` means that a peer is gone, or None when it is the script's own.

    Args:
        error: what the step (or the step boundary) raised.
        recorded: the error a collective of the step recorded, if any.
        newer_generation: a generation newer than this worker's that the
            control plane published, if any.
    """
    if recorded is not None:
        return "a collective failed"
    # A save's or restore's own collective (checkpoint.api.CheckpointPeerError); the
    # checkpoint package is imported only once a generation opens its checkpointer.
    checkpoint_api = sys.modules.get("checkpoint.api")
    if checkpoint_api is not None and isinstance(error, checkpoint_api.CheckpointPeerError):
        return "a checkpoint collective failed"
    if _gloo_transport_error(error):
        return "gloo lost the connection to a peer"
    if isinstance(error, dist.DistError):
        return f"the backend raised {type(error).__name__}"
    if newer_generation is not None:
        return f"generation {newer_generation} is published"
    return None


#: What gloo's TCP transport says when a peer's socket closed or reset: text of gloo's
#: own (its source path), never a script's.
_GLOO_TRANSPORT = "gloo/transport/tcp/"


def _gloo_transport_error(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from) is gloo's transport losing a
    peer: a collective no step recorded (a save's, the upload thread's, the script's own
    ``dist`` calls) that failed because a peer's connection went."""
    seen: BaseException | None = error
    for _ in range(8):  # a short chain of causes: a storage error wrapping the collective's
        if seen is None:
            return False
        if isinstance(seen, RuntimeError) and _GLOO_TRANSPORT in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


#: Where FSDP's collectives run (paths inside torch).
_COLLECTIVE_CODE = (
    "/torch/distributed/fsdp/",
    "/torch/distributed/distributed_c10d.py",
    "/torch/distributed/_functional_collectives",
)


def raised_in_collective(error: BaseException) -> bool:
    """True when ``error`` was raised in FSDP or a torch.distributed collective.

    FSDP2 runs its all-gathers and reduce-scatters in module and autograd
    hooks, where the runtime cannot wrap them; the traceback tells.
    """
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        tb = e.__traceback__
        while tb is not None:
            path = tb.tb_frame.f_code.co_filename.replace("\\", "/")
            if any(part in path for part in _COLLECTIVE_CODE):
                return True
            tb = tb.tb_next
        e = e.__cause__ or e.__context__
    return False
