"""The job spec's ``sync`` section: every step (DDP) or delayed (DiLoCo, Streaming DiLoCo).

Part of the job spec's dataclass tree (:mod:`orchestrator.spec.job`, which
re-exports these names).  With ``mode: ddp`` every step's gradients are
averaged over every rank.  With ``diloco`` the ranks are cut into *sites*
(the nodes that share the value of ``site_label``, ``zone`` by default): a
site trains alone (DDP among its own ranks) for ``inner_steps`` steps, then
the sites average their *pseudo-gradients* (the parameters at the last sync
minus the parameters now) and an outer optimizer (Nesterov SGD) applies the
average to every site's copy.  ``streaming_diloco`` cuts the parameters into
``fragments`` that sync at staggered steps, each sync's result applied
``delay_steps`` steps after it started, optionally quantized
(``outer_quantization``).  The runtime's part is :mod:`agents.sync`.

Defaults follow the papers: an outer Nesterov SGD with learning rate 0.7 and
momentum 0.9 (DiLoCo, Douillard et al. 2023), 100 inner steps between syncs
(Streaming DiLoCo, Douillard et al. 2025; DiLoCo itself used 500 at its scale).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from orchestrator.spec.bounds import Problems

__all__ = ["OuterOptimizerName", "OuterOptimizerSpec", "OuterQuantization", "SyncMode", "SyncSpec"]

#: Most inner steps between two syncs of one fragment.
MAX_INNER_STEPS = 1_000_000
#: Most fragments a model is cut into.
MAX_FRAGMENTS = 1024


class SyncMode(str, Enum):
    """When the sites' parameters meet."""

    DDP = "ddp"  # every step, every rank (the comm section's hooks apply)
    DILOCO = "diloco"  # every inner_steps steps, the whole model
    STREAMING_DILOCO = "streaming_diloco"  # fragments at staggered steps, delayed


class OuterOptimizerName(str, Enum):
    """The optimizer applied to the sites' averaged pseudo-gradient."""

    NESTEROV = "nesterov"  # SGD with Nesterov momentum (the papers' choice)
    SGD = "sgd"  # SGD with plain momentum (lr 1, momentum 0: averaging, as local SGD)


class OuterQuantization(str, Enum):
    """How a pseudo-gradient travels between the sites."""

    NONE = "none"  # float32
    BF16 = "bf16"
    INT8 = "8bit"  # 8-bit integers, one scale per block of 256 values
    INT4 = "4bit"  # 4-bit integers, one scale per block of 256 values


@dataclass
class OuterOptimizerSpec:
    """``sync.outer_optimizer``: the optimizer the sites' average goes through."""

    name: OuterOptimizerName = OuterOptimizerName.NESTEROV
    lr: float = 0.7
    momentum: float = 0.9

    def problems(self) -> Problems:
        out: Problems = []
        if not 0.0 < self.lr <= 10.0:
            out.append(("lr", f"must be above 0 and at most 10, got {self.lr:g}"))
        if not 0.0 <= self.momentum < 1.0:
            out.append(("momentum", f"must be at least 0 and below 1, got {self.momentum:g}"))
        if self.name is OuterOptimizerName.NESTEROV and self.momentum == 0.0:
            out.append(("momentum", "nesterov needs a momentum above 0; use name: sgd for none"))
        return out


@dataclass
class SyncSpec:
    """``sync``: how often and how the parameters of the sites meet (see the module)."""

    mode: SyncMode = SyncMode.DDP
    #: inner steps between two syncs of a fragment (H)
    inner_steps: int = 100
    #: ``streaming_diloco``: parts of the model, synced at staggered steps (F)
    fragments: int = 1
    #: steps between the start of a fragment's sync and the use of its result (tau)
    delay_steps: int = 0
    outer_optimizer: OuterOptimizerSpec = field(default_factory=OuterOptimizerSpec)
    outer_quantization: OuterQuantization = OuterQuantization.NONE
    #: the node label whose value names a node's site
    site_label: str = "zone"

    @property
    def delayed(self) -> bool:
        """The sites meet every ``inner_steps`` steps rather than every step."""
        return self.mode is not SyncMode.DDP

    def problems(self) -> Problems:
        if self.mode is SyncMode.DDP:
            return self._set_under_ddp()
        out: Problems = []
        if not 1 <= self.inner_steps <= MAX_INNER_STEPS:
            out.append(("inner_steps", f"must be 1 to {MAX_INNER_STEPS}, got {self.inner_steps}"))
        if not 1 <= self.fragments <= MAX_FRAGMENTS:
            out.append(("fragments", f"must be 1 to {MAX_FRAGMENTS}, got {self.fragments}"))
        elif self.mode is SyncMode.STREAMING_DILOCO:
            if self.fragments < 2:
                out.append(
                    ("fragments", "streaming_diloco cuts the model into 2 or more fragments; "
                     f"got {self.fragments} (use mode: diloco for one)")
                )  # fmt: skip
            elif self.inner_steps % self.fragments:
                out.append(
                    ("fragments", f"must divide inner_steps ({self.inner_steps}) so that the "
                     f"fragments sync at evenly staggered steps; got {self.fragments}")
                )  # fmt: skip
        elif self.fragments != 1:
            out.append(
                ("fragments", f"only streaming_diloco cuts the model into fragments; mode "
                 f"{self.mode.value} takes 1, got {self.fragments}")
            )  # fmt: skip
        spacing = max(1, self.inner_steps // max(1, self.fragments))
        if self.delay_steps < 0:
            out.append(("delay_steps", f"must be 0 or more, got {self.delay_steps}"))
        elif self.delay_steps >= spacing:
            out.append(
                ("delay_steps", f"must be below the steps between two syncs ({spacing}): a "
                 f"fragment's result is used before its next sync starts; got {self.delay_steps}")
            )  # fmt: skip
        if not self.site_label.strip():
            out.append(("site_label", "must name a node label, e.g. zone"))
        return out

    def _set_under_ddp(self) -> Problems:
        """Under ``mode: ddp`` every field but ``mode`` would be ignored: each one set
        to other than its default is named (a setting accepted and ignored misleads)."""
        default = SyncSpec()
        given = [
            (name, getattr(self, name))
            for name in ("inner_steps", "fragments", "delay_steps", "outer_optimizer",
                         "outer_quantization", "site_label")
            if getattr(self, name) != getattr(default, name)
        ]  # fmt: skip
        return [
            (name, f"applies to mode diloco and streaming_diloco only (mode ddp averages "
             f"every step), got {_shown(value)}: remove it, or set sync.mode")
            for name, value in given
        ]  # fmt: skip


def _shown(value: object) -> str:
    """A field's value as a job file writes it."""
    if isinstance(value, OuterOptimizerSpec):
        return f"{{name: {value.name.value}, lr: {value.lr:g}, momentum: {value.momentum:g}}}"
    return str(value.value if isinstance(value, Enum) else value)
