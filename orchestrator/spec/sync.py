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
``delay_steps`` steps after it started, and merged with each site's own
fragment (``alpha``); the pseudo-gradients travel quantized
(``outer_quantization``).  The runtime's part is :mod:`agents.sync`.

Defaults follow the papers: an outer Nesterov SGD with learning rate 0.7 and
momentum 0.9 (DiLoCo, Douillard et al. 2023), 100 inner steps between syncs
(Streaming DiLoCo, Douillard et al. 2025; DiLoCo itself used 500 at its scale).
Two defaults depend on the mode, so the fields are None until a job file sets
them and :attr:`SyncSpec.quantization` and :attr:`SyncSpec.mixing` give the
value used: Streaming DiLoCo sends 4-bit floats (E3M0, its section 2.4) and
merges half and half (alpha 0.5, its section 2.3); DiLoCo sends float32 and
replaces each site's parameters with the global ones (alpha 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from enum import Enum

from orchestrator.spec.bounds import Problems

__all__ = [
    "PAPER_ALPHA",
    "PAPER_QUANTIZATION",
    "OuterOptimizerName",
    "OuterOptimizerSpec",
    "OuterQuantization",
    "SyncMode",
    "SyncSpec",
]

#: Most inner steps between two syncs of one fragment.
MAX_INNER_STEPS = 1_000_000
#: Most fragments a model is cut into.
MAX_FRAGMENTS = 1024
#: Longest ``sync_timeout``: a day.
MAX_SYNC_TIMEOUT = timedelta(days=1)


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
    E3M0 = "e3m0"  # 4-bit floats (sign, 3 exponent bits), one scale per block of 256 values


#: ``outer_quantization`` where a job file leaves it out, per mode: Streaming DiLoCo
#: sends 4-bit floats of 1 sign and 3 exponent bits (Douillard et al. 2025, section
#: 2.4); DiLoCo sends float32 (Douillard et al. 2023).
PAPER_QUANTIZATION = {
    SyncMode.DDP: OuterQuantization.NONE,
    SyncMode.DILOCO: OuterQuantization.NONE,
    SyncMode.STREAMING_DILOCO: OuterQuantization.E3M0,
}

#: ``alpha`` where a job file leaves it out, per mode.  Streaming DiLoCo merges the
#: global fragment that arrives with the site's own, half and half (Douillard et al.
#: 2025, section 2.3; its ablation of the overlap, section 3.3.2, compares 0 and 0.5
#: in its Figure 8 and runs at 0.5 in its Figure 10).  DiLoCo replaces the site's
#: parameters with the global ones (0).
PAPER_ALPHA = {SyncMode.DDP: 0.0, SyncMode.DILOCO: 0.0, SyncMode.STREAMING_DILOCO: 0.5}


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
    #: how pseudo-gradients travel; None: the mode's paper's (see :attr:`quantization`)
    outer_quantization: OuterQuantization | None = None
    #: the share of a site's own fragment kept when the global one arrives:
    #: ``alpha * local + (1 - alpha) * global``; None: the mode's paper's (:attr:`mixing`)
    alpha: float | None = None
    #: the node label whose value names a node's site
    site_label: str = "zone"
    #: the least number of sites an outer sync goes ahead with once ``sync_timeout``
    #: has passed since the first site reached it; None: every site (the papers')
    quorum: int | None = None
    #: how long an outer sync waits for the sites beyond ``quorum``
    sync_timeout: timedelta = timedelta(seconds=60)

    @property
    def delayed(self) -> bool:
        """The sites meet every ``inner_steps`` steps rather than every step."""
        return self.mode is not SyncMode.DDP

    @property
    def quantization(self) -> OuterQuantization:
        """How pseudo-gradients travel: ``outer_quantization``, else the mode's paper's
        (:data:`PAPER_QUANTIZATION`).  Everything that encodes reads this."""
        if self.outer_quantization is not None:
            return self.outer_quantization
        return PAPER_QUANTIZATION[self.mode]

    @property
    def mixing(self) -> float:
        """The share of a site's own fragment its parameters keep after an outer step:
        ``alpha``, else the mode's paper's (:data:`PAPER_ALPHA`)."""
        return self.alpha if self.alpha is not None else PAPER_ALPHA[self.mode]

    def problems(self) -> Problems:
        if self.mode is SyncMode.DDP:
            return self._set_under_ddp()
        out: Problems = []
        if not 1 <= self.inner_steps <= MAX_INNER_STEPS:
            out.append(("inner_steps", f"must be 1 to {MAX_INNER_STEPS}, got {self.inner_steps}"))
        out += self._fragment_problems()
        spacing = max(1, self.inner_steps // max(1, self.fragments))
        if self.delay_steps < 0:
            out.append(("delay_steps", f"must be 0 or more, got {self.delay_steps}"))
        elif self.delay_steps >= spacing:
            why = "a fragment's result is used before its next sync starts"
            out.append(
                (
                    "delay_steps",
                    f"must be below the steps between two syncs ({spacing}): {why}; "
                    f"got {self.delay_steps}",
                )
            )
        if self.alpha is not None and not 0.0 <= self.alpha < 1.0:
            out.append(("alpha", f"must be at least 0 and below 1, got {self.alpha:g}: {_ALPHA}"))
        if not self.site_label.strip():
            out.append(("site_label", "must name a node label, e.g. zone"))
        out += self._quorum_problems()
        return out

    def _quorum_problems(self) -> Problems:
        out: Problems = []
        if self.quorum is not None and self.quorum < 1:
            out.append(("quorum", f"must be 1 or more sites, got {self.quorum}"))
        if not timedelta(0) <= self.sync_timeout <= MAX_SYNC_TIMEOUT:
            out.append(("sync_timeout", f"must be 0 s to 1 day, got {self.sync_timeout}"))
        elif self.quorum is None and self.sync_timeout != SyncSpec().sync_timeout:
            out.append(
                (
                    "sync_timeout",
                    "bounds the wait for the sites beyond sync.quorum, and without a quorum "
                    "every site is waited for: set sync.quorum (the least number of sites "
                    "an outer sync goes ahead with), or remove sync_timeout",
                )
            )
        return out

    def _fragment_problems(self) -> Problems:
        if not 1 <= self.fragments <= MAX_FRAGMENTS:
            return [("fragments", f"must be 1 to {MAX_FRAGMENTS}, got {self.fragments}")]
        if self.mode is not SyncMode.STREAMING_DILOCO:
            if self.fragments == 1:
                return []
            return [
                (
                    "fragments",
                    f"only streaming_diloco cuts the model into fragments; mode "
                    f"{self.mode.value} takes 1, got {self.fragments}",
                )
            ]
        if self.fragments < 2:
            return [
                (
                    "fragments",
                    f"streaming_diloco cuts the model into 2 or more fragments; got "
                    f"{self.fragments} (use mode: diloco for one)",
                )
            ]
        if self.inner_steps % self.fragments:
            return [
                (
                    "fragments",
                    f"must divide inner_steps ({self.inner_steps}) so that the fragments "
                    f"sync at evenly staggered steps; got {self.fragments}",
                )
            ]
        return []

    def _set_under_ddp(self) -> Problems:
        """Under ``mode: ddp`` every field but ``mode`` would be ignored: each one set
        to other than its default is named (a setting accepted and ignored misleads).
        ``outer_quantization: none`` was the default before it followed the mode, so a
        job file of then that wrote it still loads."""
        default = SyncSpec()
        unset = {"outer_quantization": OuterQuantization.NONE}
        given = [
            (name, getattr(self, name))
            for name in _DELAYED_FIELDS
            if getattr(self, name) not in (getattr(default, name), unset.get(name))
        ]
        return [
            (
                name,
                f"applies to mode diloco and streaming_diloco only (mode ddp averages "
                f"every step), got {_shown(value)}: remove it, or set sync.mode",
            )
            for name, value in given
        ]


#: The fields of a delayed sync (each refused by name under ``mode: ddp``).
_DELAYED_FIELDS = (
    "inner_steps",
    "fragments",
    "delay_steps",
    "outer_optimizer",
    "outer_quantization",
    "alpha",
    "site_label",
    "quorum",
    "sync_timeout",
)

#: What ``alpha`` is, for the message that refuses one out of range.
_ALPHA = (
    "it is the share of a site's own fragment kept when the global one arrives (0 takes "
    "the global fragment, as DiLoCo does; 0.5 is Streaming DiLoCo's); at 1 a site would "
    "never take the global model and the sites would train apart"
)


def _shown(value: object) -> str:
    """A field's value as a job file writes it."""
    if isinstance(value, OuterOptimizerSpec):
        return f"{{name: {value.name.value}, lr: {value.lr:g}, momentum: {value.momentum:g}}}"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, timedelta):
        return f"{value.total_seconds():g}s"
    return str(value.value if isinstance(value, Enum) else value)
