"""When a compressed exchange must not be trusted: warm-up, periodic sync, bad gradients.

Every decision here is taken identically on all ranks, from values every rank
has (the step counter, the gathered status words), because ranks that pick
different collectives deadlock.  Each rank appends its local gradient norm
to its compressed payload, so the check costs no extra round trip: after
the all-gather every rank sees every norm.  A non-finite norm anywhere, or
a norm far above the running average, makes the step fall back to a dense
all-reduce of the corrected gradient, and error-feedback buffers are not
fed garbage.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

#: A gradient norm this many times the running average counts as exploding.
DEFAULT_EXPLODE_FACTOR = 50.0
#: Steps of norm history before the exploding check is armed.
DEFAULT_MIN_HISTORY = 5


class Verdict(str, Enum):
    """How a compressed bucket is treated once the status words are in."""

    USE = "use"  # decode the compressed payloads
    EXPLODING = "exploding"  # finite, too large: dense all-reduce, flush buffers
    NON_FINITE = "non_finite"  # NaN/Inf somewhere: dense all-reduce, keep buffers


@dataclass
class SafetyPolicy:
    """Knobs of the safety net.

    Attributes:
        warmup_steps: steps sent dense before compression starts.
        dense_sync_every: every this many steps after warm-up, send dense and
            flush the error-feedback buffers (0: never).
        explode_factor: a rank's norm above this multiple of the running
            average norm falls back to dense (0: never).
        ema_decay: decay of the running average of norms.
        min_history: steps of history before the exploding check is armed.
    """

    warmup_steps: int = 0
    dense_sync_every: int = 0
    explode_factor: float = DEFAULT_EXPLODE_FACTOR
    ema_decay: float = 0.9
    min_history: int = DEFAULT_MIN_HISTORY

    def dense_step(self, step: int) -> bool:
        """Whether ``step`` is sent dense whatever the compressor says."""
        if step < self.warmup_steps:
            return True
        return (
            self.dense_sync_every > 0
            and (step - self.warmup_steps + 1) % (self.dense_sync_every) == 0
        )


@dataclass
class NormTracker:
    """Running average of the mean gradient norm, per bucket key.

    Attributes:
        ema: running average per key.
        count: samples seen per key.
    """

    ema: dict[str, float] = field(default_factory=dict)
    count: dict[str, int] = field(default_factory=dict)

    def verdict(self, key: str, norms: Sequence[float], policy: SafetyPolicy) -> Verdict:
        """Judge one bucket from every rank's norm, then record the norms if sane."""
        if not all(math.isfinite(n) for n in norms):
            return Verdict.NON_FINITE
        mean = sum(norms) / max(1, len(norms))
        seen = self.count.get(key, 0)
        average = self.ema.get(key)
        if (
            policy.explode_factor > 0
            and average is not None
            and seen >= policy.min_history
            and max(norms) > policy.explode_factor * max(average, 1e-12)
        ):
            return Verdict.EXPLODING
        self.observe(key, mean, policy)
        return Verdict.USE

    def observe(self, key: str, mean_norm: float, policy: SafetyPolicy) -> None:
        """Fold one finite mean norm into the running average."""
        if not math.isfinite(mean_norm):
            return
        average = self.ema.get(key)
        self.ema[key] = (
            mean_norm
            if average is None
            else policy.ema_decay * average + (1 - policy.ema_decay) * mean_norm
        )
        self.count[key] = self.count.get(key, 0) + 1

    def state_dict(self) -> dict[str, Any]:
        return {"ema": dict(self.ema), "count": dict(self.count)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.ema = {str(k): float(v) for k, v in state.get("ema", {}).items()}
        self.count = {str(k): int(v) for k, v in state.get("count", {}).items()}
