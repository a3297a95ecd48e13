"""A DDP wrapper that survives a change of process group.

``DistributedDataParallel`` binds to one process group for life.  After a
hot-swap the runtime forms a new group, so :class:`ElasticDDP` keeps the user's
module (and so the optimizer's parameters) and rebuilds the DDP around it for
each generation, re-registering the comm hook.  ``state_dict()`` is the inner
module's, without DDP's ``module.`` prefix, so checkpoints load into a plain
model too.

With a :class:`~agents.failures.CollectiveFailures`, every collective DDP runs
records its error there: the comm hook (the job's, the script's or, without
one, torch's plain all-reduce hook) is wrapped on registration, and so is the
buffer broadcast of the forward pass.  The runtime then knows that a failed
step failed in a collective (a peer is gone) rather than in the script.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from agents.failures import CollectiveFailures

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

    def rebuild(self) -> None:
        """Wrap the module in a DDP on the current default group."""
        self.drop()
        ddp = DDP(self.module, init_sync=False, **self._ddp_kwargs)
        if self._failures is not None:
            _record_failures(ddp, self._failures)
        if self._hook_installer is not None:
            self._hook_installer(ddp)
        elif self._failures is not None:
            ddp.register_comm_hook(None, allreduce_hook)  # DDP's default, but seen
        object.__setattr__(self, "_ddp", ddp)  # not a submodule: keep state_dict keys clean

    def drop(self) -> None:
        """Forget the DDP of a broken group; gradients of a failed step are discarded."""
        object.__setattr__(self, "_ddp", None)
        for p in self.module.parameters():
            p.grad = None

    @property
    def ddp(self) -> DDP | None:
        return self._ddp

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._ddp is None:
            raise RuntimeError("ElasticDDP used outside a training step (no process group yet)")
        return self._ddp(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.module.load_state_dict(state, strict=strict, assign=assign)

    def parameters_flat(self) -> torch.Tensor:
        """All parameters as one vector (for comparing replicas in tests)."""
        return torch.cat([p.detach().reshape(-1) for p in self.module.parameters()])


def _record_failures(ddp: DDP, failures: CollectiveFailures) -> None:
    """Make ``ddp``'s comm hooks and buffer broadcast record their errors in ``failures``."""
    register = ddp.register_comm_hook
    sync_buffers = ddp._sync_buffers

    def register_recorded(state: object, hook: Callable[..., Any]) -> None:
        register(state, failures.wrap_hook(hook))

    def sync_buffers_recorded() -> None:
        with failures.collective():
            sync_buffers()

    # instance attributes, not submodules: DDP calls both through ``self``
    object.__setattr__(ddp, "register_comm_hook", register_recorded)
    object.__setattr__(ddp, "_sync_buffers", sync_buffers_recorded)
