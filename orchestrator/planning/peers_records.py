"""``benchmarks/peers.py``'s goodput rows, read from the JSON line it ends with.

Each goodput row of that run (a node SIGKILLed every ``period`` seconds from
half a period after the first completed step, over a window) becomes a
:class:`~orchestrator.planning.api.RecordedRun` with the run's own figures:

* the kill times: ``period / 2 + i * period`` from the first step, as the
  benchmark schedules them (it kills at the first poll past each, 20 ms apart);
* each kill's cost: its ``next_step_each_s`` (the kill to the end of the first
  step that started after it) less one step: the job did not train from the
  kill to the start of that step; the step in flight at the kill is lost beside
  it (half a step on average, which the simulator adds).  ``null`` (no step
  within the window) stops the job to the end;
* the steps lost (completed before a kill and computed again), shared evenly
  among the kills the job came back from, for the systems that restart from a
  checkpoint (tier 0, torchrun: the job trains them again, one after another).
  torchft's are left out: its replica groups train side by side, and a group
  restarted alone counts its steps from 0 as lost while the other trains on,
  so the count is not time the job spent (1043 steps in a 60 s window once);
* for ringmaster, whether a warm spare stood ready at each kill and the wait
  for one still starting, from its ``Generation`` events ("the spare was still
  starting: 2.5s");
* the step time: the system's own fault-free steady-state period, the one the
  benchmark's effective training is computed with.
"""

from __future__ import annotations

import re
from typing import Any

from orchestrator.planning.api import PlanError, RecordedFault, RecordedRun, Tier

__all__ = ["SYSTEMS", "runs_from_peers", "waited_s"]

#: benchmarks/peers.py's systems and the tier each recovers in.
SYSTEMS = {
    "ringmaster": Tier.IN_PROCESS,
    "tier0": Tier.RESTART,
    "torchft": Tier.TORCHFT,
    "torchrun": Tier.TORCHRUN,
}
#: warm spares beside the 2 training nodes, by system (torchft and torchrun: none)
_SPARES = {"ringmaster": 1, "tier0": 1}
#: systems whose lost steps were trained again after the job stopped (see above)
_SERIAL_REWORK = {"tier0", "torchrun"}
_WAIT = re.compile(r"the spare was still starting: (\d+(?:\.\d+)?)s|no spare for (\d+(?:\.\d+)?)s")


def waited_s(plan: str) -> float:
    """Seconds a replacement waited for a spare, from its plan's reason (0: none)."""
    m = _WAIT.search(plan)
    return float(m.group(1) or m.group(2)) if m else 0.0


def _number(data: dict[str, Any], key: str, where: str) -> float:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PlanError(
            f"{where}: {key!r} is {value!r}, not a number; give the last line of a "
            "`benchmarks/peers.py` run that measured the goodput rows (not --skip goodput)"
        )
    return float(value)


def runs_from_peers(data: dict[str, Any], source: str = "benchmarks/peers.py") -> list[RecordedRun]:
    """Every goodput row in ``data`` (peers.py's last-line JSON), in its order.

    Raises:
        PlanError: ``data`` holds no goodput row, or a row lacks a figure it needs.
    """
    windows = data.get("windows_s")
    if not isinstance(windows, dict) or not windows:
        raise PlanError(
            f"{source}: no 'windows_s' in the JSON: not the last line of a "
            "`benchmarks/peers.py` run with its goodput rows"
        )
    runs = []
    for period_key, window in windows.items():
        period = float(period_key)
        for system, tier in SYSTEMS.items():
            prefix = f"{system}_goodput{period_key}_"
            if f"{prefix}kills" not in data:
                continue
            where = f"{source}: {prefix}*"
            step = 1.0 / _number(data, f"{system}_steps_per_s", source)
            kills = int(_number(data, f"{prefix}kills", where))
            each = list(data.get(f"{prefix}next_step_each_s") or [])
            if len(each) != kills:
                raise PlanError(
                    f"{where}: {kills} kills but {len(each)} times in next_step_each_s; "
                    "give the JSON line exactly as peers.py printed it"
                )
            warm = data.get(f"{prefix}spare_warm_at_kill") or [None] * kills
            events = list(data.get(f"{prefix}events") or [])
            plans = [str(e.get("plan", "")) for e in events] if len(events) == kills else []
            came_back = [t for t in each if t is not None]
            lost = _number(data, f"{prefix}steps_lost", where) if system in _SERIAL_REWORK else 0
            rework = lost * step / len(came_back) if came_back else 0.0
            faults = tuple(
                RecordedFault(
                    at=period / 2 + i * period,
                    stop_s=None if t is None else max(0.0, float(t) - step),
                    rework_s=rework if t is not None else 0.0,
                    warm_spare=warm[i] if i < len(warm) else None,
                    waited_s=waited_s(plans[i]) if plans else 0.0,
                )
                for i, t in enumerate(each)
            )
            runs.append(
                RecordedRun(
                    name=f"{tier.value}, kill every {period:g} s",
                    tier=tier,
                    window_s=float(window),
                    step_s=step,
                    nodes=2,
                    spares=_SPARES.get(system, 0),
                    faults=faults,
                    measured=_number(data, f"{prefix}effective", where),
                    source=source,
                )
            )
    if not runs:
        raise PlanError(
            f"{source}: no goodput row in the JSON (keys like 'ringmaster_goodput15_kills'); "
            "run benchmarks/peers.py without --skip goodput"
        )
    return runs
