"""A DDP wrapper that survives a change of process group.

``DistributedDataParallel`` binds to one process group for life.  After a
hot-swap the runtime forms a new group, so :class:`ElasticDDP` keeps the user's
module (and so the optimizer's parameters) and rebuilds the DDP around it for
each generation, re-registering the comm hook.  ``state_dict()`` is the inner
module's, without DDP's ``module.`` prefix, so checkpoints load into a plain
model too.

With a :class:`~agents.runtime.failures.CollectiveFailures`, every collective DDP runs
records its error there: the comm hook (the job's, the script's or, without
one, torch's plain all-reduce hook) is wrapped on registration, and so is the
buffer broadcast of the forward pass.  The runtime then knows that a failed
step failed in a collective (a peer is gone) rather than in the script.

Gradient accumulation works as on DDP: inside :meth:`ElasticDDP.no_sync`
backward passes only accumulate local gradients, and the first forward and
backward after it all-reduces the sum.  The setting lives on the wrapper and is
handed to whichever DDP runs the forward, so it holds across a rebuild for a
new generation too.  A step that fails part-way through its micro-batches
loses their gradients (:meth:`ElasticDDP.drop`) and runs again from the first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from agents.runtime.failures import CollectiveFailures

__all__ = ["ElasticDDP", "HookInstaller"]

#: ``(ddp) -> None``: registers a comm hook on a freshly built DDP.
HookInstaller = Callable[[DDP], None]


class ElasticDDP(nn.Module):
    """Forward to a DDP that is rebuilt whenever the process group changes."""

    def __init__(
        self,
        module: nn.Module,
        hook_installer: HookInstaller | None = None,
        failures: CollectiveFailures | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        super().__init__()
        self.module = module
        self._hook_installer = hook_installer
        self._failures = failures
        self._ddp_kwargs = ddp_kwargs
        self._ddp: DDP | None = None
        #: False inside :meth:`no_sync`: backward passes do not all-reduce gradients
        self.require_backward_grad_sync = True

    def rebuild(self, group: Any = None) -> None:
        """Wrap the module in a DDP on ``group`` (None: the current default group)."""
        self.drop()
        if self._failures is not None:
            kwargs = {"init_sync": False, "process_group": group, **self._ddp_kwargs}
            ddp: DDP = _RecordingDDP(self.module, self._failures, **kwargs)
        else:
            ddp = DDP(self.module, init_sync=False, process_group=group, **self._ddp_kwargs)
        if self._hook_installer is not None:
            self._hook_installer(ddp)
        elif self._failures is not None:  # DDP's default average, but its errors seen
            hook = self._failures.allreduce_hook()  # registered as is: not wrapped again
            DDP.register_comm_hook(ddp, group, hook)  # its state: the group it averages over
        object.__setattr__(self, "_ddp", ddp)  # not a submodule: keep state_dict keys clean

    def drop(self) -> None:
        """Forget the DDP of a broken group; gradients of a failed step are discarded.

        The old DDP's autograd hooks are removed at once: something may still
        hold the old DDP (the traceback of the step's error does when the
        step failed in its forward), and hooks left on the parameters would
        fire in the next generation's backward, where its reducer, stuck in
        the failed step, raises "Expected to mark a variable ready only once".
        """
        old = self._ddp
        object.__setattr__(self, "_ddp", None)
        if old is not None:
            old._remove_autograd_hooks()
        for p in self.module.parameters():
            p.grad = None

    @property
    def ddp(self) -> DDP | None:
        return self._ddp

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backward passes inside do not all-reduce.

        As ``DistributedDataParallel.no_sync``: run the forward pass inside the
        context too; the first backward after it exchanges the accumulated
        gradients.  Unlike DDP's, it may be entered before the first generation
        and holds across a rebuild of the DDP.
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._ddp is None:
            raise RuntimeError("ElasticDDP used outside a training step (no process group yet)")
        self._ddp.require_backward_grad_sync = self.require_backward_grad_sync
        return self._ddp(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.module.load_state_dict(state, strict=strict, assign=assign)

    def parameters_flat(self) -> torch.Tensor:
        """All parameters as one vector (for comparing replicas in tests)."""
        return torch.cat([p.detach().reshape(-1) for p in self.module.parameters()])


class _RecordingDDP(DDP):
    """A DDP whose comm hooks and buffer broadcast record their errors in ``failures``.

    A subclass rather than patched instance attributes: bound methods stored
    on the instance would make a reference cycle that keeps a dropped DDP
    (and its autograd hooks) alive until the garbage collector runs.
    """

    _failures: CollectiveFailures

    def __init__(self, module: nn.Module, failures: CollectiveFailures, **kwargs: Any) -> None:
        object.__setattr__(self, "_failures", failures)
        super().__init__(module, **kwargs)

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        super().register_comm_hook(state, self._failures.wrap_hook(hook))

    def _sync_buffers(self) -> None:
        # the forward's buffer broadcast blocks until every rank got there: a wait for
        # the slowest, to be timed as one (untimed, it counts as compute on every rank)
        timing = self._failures.timing
        started = timing.collective_started() if timing is not None else None
        with self._failures.collective():
            super()._sync_buffers()
        if timing is not None:
            timing.collective_ended(started)
