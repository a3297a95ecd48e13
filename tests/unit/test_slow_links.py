"""Slow links told from the step timings and a probe of the links: scenarios over the pure
judgement (:mod:`orchestrator.controller.slow_links`) and the controller's decisions.

The probe itself (agents streaming to each other's ports, one link limited with
``tc``) is in ``tests/integration/test_link_probe.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest

from orchestrator.api import JobPhase
from orchestrator.controller.actions import Emit, ProbeLinks, PublishPlan
from orchestrator.controller.slow_links import (
    PROBE_COOLDOWN_S,
    LinkProbeResult,
    LinkWatch,
    probe_pairs,
    slow_end,
)
from orchestrator.controller.straggler_swaps import decide_stragglers
from orchestrator.controller.stragglers import Straggler, StragglerWatch
from orchestrator.controller.world import World
from orchestrator.spec.job import EntrypointSpec, JobSpec, NodesSpec, StragglerAction, StragglerSpec
from orchestrator.state import keys
from orchestrator.state.records import (
    JobStatus,
    Member,
    NodeRecord,
    Plan,
    ProgressRecord,
    Telemetry,
)

pytestmark = pytest.mark.unit

HEALTHY = {"a": (0.05, 0.005, 20), "b": (0.05, 0.004, 20), "c": (0.05, 0.006, 20)}
#: every rank waits 60 ms a step more, nobody computes more: a slow link somewhere
SLOW_LINK = {"a": (0.05, 0.065, 20), "b": (0.05, 0.064, 20), "c": (0.05, 0.066, 20)}
#: c computes 2x: its peers wait for it, which is a compute straggler, not a link
SLOW_C = {"a": (0.05, 0.055, 20), "b": (0.05, 0.054, 20), "c": (0.1, 0.005, 20)}
MB = 1e6
#: c's links carry 1 MB/s, the others' 1000
C_SLOW = LinkProbeResult(
    {
        "a": {"b": 1000 * MB, "c": 1 * MB},
        "b": {"a": 900 * MB, "c": MB},
        "c": {"a": 1.1 * MB, "b": 0.9 * MB},
    }
)
ALIKE = LinkProbeResult(
    {
        "a": {"b": 10 * MB, "c": 9 * MB},
        "b": {"a": 11 * MB, "c": 10 * MB},
        "c": {"a": 9 * MB, "b": 10 * MB},
    }
)


def _spec(windows: int = 2) -> StragglerSpec:
    return StragglerSpec(action=StragglerAction.SWAP, threshold=1.2, windows=windows)


def a_risen_wait_asks_for_one_probe_then_waits_out_the_cooldown() -> None:
    watch = LinkWatch(_spec())
    for i in range(3):
        assert watch.window(1, HEALTHY, float(i))[0] is False
    assert watch.window(1, SLOW_LINK, 3.0)[0] is False  # one window: not yet
    assert watch.window(1, SLOW_LINK, 4.0)[0] is True  # two in a row: measure
    assert watch.window(1, SLOW_LINK, 5.0)[0] is False  # one probe at a time
    assert watch.verdict(ALIKE) is None  # nobody's links are slower: nobody called
    assert watch.window(1, SLOW_LINK, 4.0 + PROBE_COOLDOWN_S - 1)[0] is False
    assert watch.window(1, SLOW_LINK, 4.0 + PROBE_COOLDOWN_S)[0] is True


def a_compute_straggler_is_not_a_slow_link() -> None:
    watch = LinkWatch(_spec(windows=1))
    watch.window(1, HEALTHY, 0.0)
    for i in range(5):
        assert watch.window(1, SLOW_C, 1.0 + i) == (False, 0.0, False)


def a_new_generation_measures_the_rise_afresh() -> None:
    watch = LinkWatch(_spec(windows=1))
    watch.window(1, HEALTHY, 0.0)
    # a generation that starts slow has nothing to have risen from
    assert watch.window(2, SLOW_LINK, 1.0)[0] is False
    assert watch.window(2, SLOW_LINK, 2.0)[0] is False


def the_node_whose_every_link_is_slow_is_called() -> None:
    assert slow_end(C_SLOW) == ("c", 1.1 * MB, 1000 * MB)
    assert slow_end(ALIKE) is None
    # two nodes: both ends of the one pair are as slow: nobody can be called
    assert slow_end(LinkProbeResult({"a": {"b": MB}, "b": {"a": 1000 * MB}})) is None
    # a node that could not be measured is left out, not called
    assert slow_end(replace(C_SLOW, errors={"c": "refused"})) is None


def each_node_streams_to_the_next_two() -> None:
    assert probe_pairs(["a", "b", "c"]) == {"a": ["b", "c"], "b": ["c", "a"], "c": ["a", "b"]}
    pairs = probe_pairs([f"n{i}" for i in range(100)])
    assert pairs["n99"] == ["n0", "n1"] and sum(len(p) for p in pairs.values()) == 200
    assert probe_pairs(["a", "b"]) == {"a": ["b"], "b": ["a"]}


def a_called_link_is_cleared_when_the_wait_is_back() -> None:
    watch = LinkWatch(_spec())
    watch.window(1, HEALTHY, 0.0)
    watch.window(1, SLOW_LINK, 1.0)
    assert watch.window(1, SLOW_LINK, 2.0)[0]
    call = watch.verdict(C_SLOW)
    assert call is not None and call.node == "c" and call.windows == 2
    assert "c's link is slow: its fastest link to another node carries 1.1 MB/s" in (
        call.describe()
    )
    assert watch.lost_s == pytest.approx(2 * 20 * 0.06, rel=0.05)  # the rise, per step
    _, cost, ended = watch.window(1, SLOW_LINK, 3.0)
    assert cost == pytest.approx(20 * 0.06, rel=0.05) and not ended
    assert watch.window(1, HEALTHY, 4.0)[2] is False
    assert watch.window(1, HEALTHY, 5.0)[2] is True and watch.called is None


def _timed(beats: dict[str, Telemetry], per_step: dict[str, tuple[float, float, int]]) -> None:
    for node, (compute, wait, steps) in per_step.items():
        t = beats[node]
        beats[node] = replace(
            t,
            compute_s=t.compute_s + compute * steps,
            wait_s=t.wait_s + wait * steps,
            timed_steps=t.timed_steps + steps,
        )


PLAN = Plan(1, [Member("a", 0, 1), Member("b", 1, 1), Member("c", 2, 1)])  # d: a spare since


def _world(beats: dict[str, Telemetry], mono: float) -> World:
    world = World(now=1000.0 + mono, mono=mono, plan=PLAN)
    for n in "abcd":
        world.nodes[n] = NodeRecord(
            host=n,
            address="127.0.0.1",
            slots=1,
            pid=1,
            worker_pids=[1],
            started=1.0,
            liveness=f"127.0.0.1:{9000 + ord(n)}",
        )
    for i, (n, t) in enumerate({**beats, "d": Telemetry(generation=1)}.items()):  # d: warm
        world.progress[keys.worker_id(n, 0)] = ProgressRecord(
            step=100,
            generation=1,
            rank=i,
            world_size=3,
            pid=1,
            beat=world.now,
            step_time=0.0,
            telemetry=t,
        )
    return world


def the_controller_measures_calls_and_swaps_a_slow_link() -> None:
    spec = JobSpec(
        name="job",
        entrypoint=EntrypointSpec(script="t.py"),
        nodes=NodesSpec(min=3, max=3, spares=1),
    ).validate()
    spec.fault_tolerance.stragglers = StragglerSpec(action=StragglerAction.SWAP, windows=2)
    watch = StragglerWatch(spec.fault_tolerance.stragglers, window_s=1.0)
    status = JobStatus("job", JobPhase.RUNNING, step=100, steps_per_s=10.0)
    beats = {n: Telemetry(generation=1) for n in "abc"}
    probes: list[ProbeLinks] = []
    for i, per_step in enumerate([HEALTHY, HEALTHY, SLOW_LINK, SLOW_LINK]):
        _timed(beats, per_step)
        actions = decide_stragglers(spec, watch, status, _world(beats, float(i)), [])
        probes += [a for a in actions if isinstance(a, ProbeLinks)]
    (probe,) = probes
    assert probe.ports == {n: f"127.0.0.1:{9000 + ord(n)}" for n in "abcd"}  # with the spare
    world = _world(beats, 4.0)
    world.link_probe = C_SLOW
    actions = decide_stragglers(spec, watch, status, world, [])
    (called,) = [a for a in actions if isinstance(a, Emit) and a.type == "Straggler"]
    assert called.data["node"] == "c" and "c's link is slow" in called.message
    assert isinstance(watch.flagged["c"], Straggler) and watch.flagged["c"].cause == "link"
    # 2.4 s of waiting so far, under the 5 s `confirm`: no swap yet; the compute
    # judgement does not clear it (its compute is its peers')
    assert not [a for a in actions if isinstance(a, PublishPlan)]
    for i in range(3):
        _timed(beats, SLOW_LINK)
        actions = decide_stragglers(spec, watch, status, _world(beats, 5.0 + i), [])
    (publish,) = [a for a in actions if isinstance(a, PublishPlan)]
    assert [m.node for m in publish.plan.members] == ["a", "b", "d"]


def a_probe_that_calls_nobody_says_the_rates() -> None:
    spec = JobSpec(
        name="job",
        entrypoint=EntrypointSpec(script="t.py"),
        nodes=NodesSpec(min=3, max=3, spares=1),
    ).validate()
    watch = StragglerWatch(spec.fault_tolerance.stragglers, window_s=1.0)
    watch.links.probing = True
    world = _world({n: Telemetry(generation=1) for n in "abc"}, 1.0)
    world.link_probe = ALIKE
    status = JobStatus("job", JobPhase.RUNNING, step=100, steps_per_s=10.0)
    (said,) = [a for a in decide_stragglers(spec, watch, status, world, []) if isinstance(a, Emit)]
    assert said.type == "LinkProbe" and "none slower than the others: a->b 10.0 MB/s" in (
        said.message
    )
    assert said.data["rates_mb_s"]["c"] == {"a": 9.0, "b": 10.0} and not watch.links.probing


SCENARIOS: list[Callable[[], None]] = [
    a_risen_wait_asks_for_one_probe_then_waits_out_the_cooldown,
    a_compute_straggler_is_not_a_slow_link,
    a_new_generation_measures_the_rise_afresh,
    the_node_whose_every_link_is_slow_is_called,
    each_node_streams_to_the_next_two,
    a_called_link_is_cleared_when_the_wait_is_back,
    the_controller_measures_calls_and_swaps_a_slow_link,
    a_probe_that_calls_nobody_says_the_rates,
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.__name__ for s in SCENARIOS])
def test_slow_links(scenario: Callable[[], None]) -> None:
    scenario()
