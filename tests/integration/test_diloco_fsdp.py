"""DiLoCo with an FSDP2 model in each site: two sites x two ranks, real processes, gloo.

Two nodes of two workers each, one per ``zone`` (sites ``a`` = ranks 0-1 and
``b`` = ranks 2-3), run examples/train_sharded.py with ``sharding="fsdp"``:
each site shards the MLP over its own two ranks (its gradients reduce-scattered
inside the site only), and every ``inner_steps`` steps rank ``i`` of each site
averages its slice's pseudo-gradient with rank ``i`` of the other site and
takes the outer Nesterov step on its slice.  The run ends with the parameters
of the algorithm computed by hand (the DDP test's :class:`HandRun`, told of
the 2 slices: the arithmetic is elementwise, but a quantized pseudo-gradient,
Streaming DiLoCo's e3m0 by default, is encoded per slice, with a scale per
block of each slice's rows).

With a warm spare of zone ``a``: site ``a``'s node is SIGKILLed mid inner
period and the spare takes its slot.  No rank of the site kept its slice, so
the site starts from the global model: rank ``i`` of it takes rank ``i`` of site
``b``'s slice (its optimizer state) and outer state, and its parameters become
the anchors, while site ``b`` keeps its own; the run still ends as the
algorithm by hand with that loss in it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agents.sync.schedule import FragmentSchedule
from orchestrator.api import JobPhase
from orchestrator.local_run import LocalRun
from orchestrator.spec.job import JobSpec
from orchestrator.spec.loader import load_job_data
from orchestrator.state import jobs
from orchestrator.state.jobs import plan_resume
from tests.chaos.jobs import assert_exactly_once, quiet_run, summary, wait_for_step
from tests.chaos.sharded_jobs import assembled, assert_same_params, sharded_job
from tests.faults.partitioned_job import wait_for
from tests.integration.test_diloco import HOLD_AT, STEPS, HandRun, spare_ready, wait_for_spare

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ZONES = {"node-0": {"zone": "a"}, "node-1": {"zone": "b"}}


def fsdp_sites_job(
    name: str, tmp: Path, sync: dict[str, object], steps: int, spares: int = 0
) -> JobSpec:
    """Two nodes of two workers; with a spare, held at :data:`HOLD_AT` until ``tmp/go``."""
    base = sharded_job(
        name,
        tmp,
        "fsdp",
        nodes=2,
        nproc=2,
        steps=steps,
        step_time=0.1 if spares else 0.0,
        spares=spares,
    ).to_dict()
    base["sync"] = sync
    if spares:
        base["entrypoint"]["args"] += ["--hold-at", str(HOLD_AT), "--go-file", str(tmp / "go")]
    return load_job_data(base)


# short form: the buddy test's streaming run below (FSDP sites, by hand, a kill added)
@pytest.mark.long
def test_fsdp_in_each_site_ends_as_the_algorithm_by_hand(tmp_path: Path) -> None:
    """Streaming DiLoCo, fault free, two ranks per site on one node.  Plain DiLoCo's
    fault-free steps are part of the tests below (a kill, a checkpoint), each ending
    equal to the algorithm by hand."""
    sync = {"mode": "streaming_diloco", "inner_steps": 10, "fragments": 2, "delay_steps": 2}
    lines: list[str] = []
    spec = fsdp_sites_job("diloco-fsdp", tmp_path, sync, STEPS)
    with quiet_run(spec, lines, node_labels=ZONES) as run:
        result = run.wait()
    assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)
    assert_exactly_once(tmp_path, STEPS)
    hand = HandRun(spec.sync, [[0, 1], [2, 3]], seed=0, slices=2).train(0, STEPS)
    assert_same_params(assembled(tmp_path / "out"), hand.final())


# short form: test_diloco.py's site lost whole; a site's slices: the buddy test below
@pytest.mark.long
def test_a_site_whose_node_dies_comes_back_from_the_global_model(tmp_path: Path) -> None:
    lines: list[str] = []
    spec = fsdp_sites_job(
        "diloco-fsdp-kill", tmp_path, {"mode": "diloco", "inner_steps": 10}, STEPS, 1
    )
    run = quiet_run(spec, lines, node_labels={**ZONES, "node-2": {"zone": "a"}})
    # the spare starts once the job trains: the first generation holds both sites
    run.node_names = lambda: ["node-0", "node-1"]  # type: ignore[method-assign]
    with run:
        wait_for_step(run, 0)
        run.add_node("node-2", rack="rack-1")
        spare_ready(run, "node-2", tmp_path / "go")
        wait_for("a step 2-4 past a sync", lambda: _step(run) % 10 in (2, 3, 4))
        run.kill_node("node-0")  # site a's only node
        result = run.wait()
    assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)
    assert result.recoveries >= 1, summary(result, lines)
    back = [line for line in lines if "site a had no state" in line]
    assert back and back[0].startswith("[node-2]"), summary(result, lines)
    lost_at = int(back[0].rsplit("at step ", 1)[1])
    assert lost_at % 10 != 0, lost_at  # mid inner period, where site b was
    want = HandRun(spec.sync, [[0, 1], [2, 3]], slices=2).train(0, STEPS, lost_at=lost_at).final()
    assert_same_params(assembled(tmp_path / "out"), want)


def _step(run: LocalRun) -> int:

    status = jobs.read_status(run.client, run.spec.name)
    return status.step if status is not None else 0


def test_sites_of_different_sizes_fail_the_job_naming_each_site(tmp_path: Path) -> None:
    """Three nodes of one worker: zone a has two, zone b one.  Rank i of each site
    would hold slice i of a different cut, so the first generation's join refuses the
    layout as the script's error: the job fails at once, with each site's size."""
    lines: list[str] = []
    base = sharded_job(
        "diloco-fsdp-uneven", tmp_path, "fsdp", nodes=3, nproc=1, steps=20, spares=0
    ).to_dict()
    base["sync"] = {"mode": "diloco", "inner_steps": 10}
    base["fault_tolerance"]["max_restarts"] = 0
    zones = {"node-0": {"zone": "a"}, "node-1": {"zone": "a"}, "node-2": {"zone": "b"}}
    with quiet_run(load_job_data(base), lines, node_labels=zones) as run:
        result = run.wait()
    assert result.phase is JobPhase.FAILED, summary(result, lines)
    failed = [e for e in result.events if e.type == "Phase" and "Failed" in e.message]
    assert failed and "by zone they have a: 2, b: 1" in failed[-1].message, failed
    assert result.recoveries == 0, summary(result, lines)


def test_a_site_that_loses_a_node_with_no_spare_waits_and_the_other_site_trains_on(
    tmp_path: Path,
) -> None:
    """Sites of two nodes of one worker (a: node-0, node-1; b: node-2, node-3), no spare.
    node-3 is SIGKILLed mid inner period: the next generation's sites would be a: 2,
    b: 1, which slices cannot be cut for; its workers say so at the join, and the
    controller leaves site b out (node-2 waits as a warm spare) instead of failing the
    job, as torchft leaves out a replica group that lost a member.  Site a keeps its own
    state and trains to the end alone; no step is applied twice and no outer step is
    lost or applied twice."""
    lines: list[str] = []
    sync = {"mode": "diloco", "inner_steps": 10}
    base = sharded_job(
        "diloco-fsdp-short",
        tmp_path,
        "fsdp",
        nodes=4,
        nproc=1,
        steps=STEPS,
        step_time=0.02,
        spares=0,
        min_nodes=1,
    ).to_dict()
    base["sync"] = sync
    base["entrypoint"]["args"] += ["--hold-at", "15", "--go-file", str(tmp_path / "go")]
    zones = {
        "node-0": {"zone": "a"},
        "node-1": {"zone": "a"},
        "node-2": {"zone": "b"},
        "node-3": {"zone": "b"},
    }
    with quiet_run(load_job_data(base), lines, node_labels=zones) as run:
        wait_for("a step past the first outer one", lambda: _step(run) >= 12)
        run.kill_node("node-3")
        (tmp_path / "go").touch()
        result = run.wait()
        status = jobs.read_status(run.client, run.spec.name)
    assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)
    balanced = [e for e in result.events if e.type == "SitesBalanced"]
    assert len(balanced) == 1 and balanced[0].data["left_out"] == ["node-2"], result.events
    assert status is not None and status.active_nodes == ["node-0", "node-1"], status
    assert "node-2" in status.spare_nodes and status.failed_nodes == ["node-3"], status
    assert_exactly_once(tmp_path, STEPS)
    assert not any("had no state" in line for line in lines), summary(result, lines)
    schedule = FragmentSchedule(10, 1, 0)
    applied = len(schedule.starts_between(0, STEPS))  # every outer step, once, on site a
    # (the one at the end may be applied after rank 0's last status write)
    assert applied - 1 <= status.sync["outer_steps"] <= applied, status.sync
    assert status.sync["last_outer_sync"] >= STEPS - 10, status.sync


@pytest.mark.parametrize(
    ("sync", "hold"),
    [
        # diloco in make test: test_diloco.py's hot swap in a site
        pytest.param({"mode": "diloco", "inner_steps": 10}, 15, marks=pytest.mark.long),
        # no sync under way at 13: fragment 1's (from 10) applied at 12, fragment 0's at 15
        (
            {"mode": "streaming_diloco", "inner_steps": 10, "fragments": 2, "delay_steps": 2},
            13,
        ),
    ],
    ids=["diloco", "streaming"],
)
def test_a_replaced_rank_takes_its_slice_from_its_buddy_in_the_site(
    tmp_path: Path, sync: dict[str, object], hold: int
) -> None:
    """Sites of two nodes of one worker (a: node-0, node-1; b: node-2, node-3), slices
    copied to the buddy in the site every step, node-4 a warm spare of zone a.  While
    every worker holds before step ``hold`` (mid inner period; the copies of that many
    steps, milliseconds each, were made while the spare warmed up for seconds), node-1
    is SIGKILLed; the spare takes its slot with node-1's slice from node-0's copy and
    the outer state of slice 1 from node-3 (site b): site a keeps its inner steps, and
    the run ends as the algorithm by hand without any loss."""
    lines: list[str] = []
    base = sharded_job(
        "diloco-fsdp-buddy",
        tmp_path,
        "fsdp",
        nodes=4,
        nproc=1,
        steps=STEPS,
        step_time=0.02,
        spares=1,
        redundancy=1,
    ).to_dict()
    base["sync"] = sync
    base["entrypoint"]["args"] += ["--hold-at", str(hold), "--go-file", str(tmp_path / "go")]
    zones = {
        "node-0": {"zone": "a"},
        "node-1": {"zone": "a"},
        "node-2": {"zone": "b"},
        "node-3": {"zone": "b"},
        "node-4": {"zone": "a"},
    }
    run = quiet_run(load_job_data(base), lines, node_labels=zones)
    run.node_names = lambda: ["node-0", "node-1", "node-2", "node-3"]  # type: ignore[method-assign]
    with run:
        wait_for_step(run, 0)
        run.add_node("node-4", rack="rack-2")
        wait_for_spare(run, "node-4")
        run.kill_node("node-1")
        (tmp_path / "go").touch()
        result = run.wait()
    assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)
    assert result.recoveries >= 1, summary(result, lines)
    restored = [line for line in lines if "from its buddy's copy in the site" in line]
    assert restored and restored[0].startswith("[node-4]"), summary(result, lines)
    assert f"slice 1 of site a of step {hold} " in restored[0], restored
    assert not any("had no state" in line for line in lines), summary(result, lines)
    assert_exactly_once(tmp_path, STEPS)
    want = HandRun(load_job_data(base).sync, [[0, 1], [2, 3]], slices=2).train(0, STEPS).final()
    assert_same_params(assembled(tmp_path / "out"), want)


@pytest.mark.long  # short form: test_diloco.py's checkpoint resumed on another world size
def test_a_checkpoint_resumes_each_slices_outer_state_on_the_same_sites(tmp_path: Path) -> None:
    """Two sites of two ranks save at step 20 (after its outer step): the first site's
    ranks write the model's slices, every rank its slice's outer state.  The same
    nodes resume from it and train to step 60: every site starts from the first
    site's state, and the run ends as the algorithm by hand.  A resume on sites of
    one worker each takes every slice's outer state cut anew (the outer momentum
    matters: Nesterov 0.7/0.9) and ends as the algorithm by hand too."""
    lines: list[str] = []
    first = fsdp_sites_job(
        "diloco-fsdp-save", tmp_path, {"mode": "diloco", "inner_steps": 10}, 20
    ).to_dict()
    # saved before the next step: a save still uploading at step 20 would skip it
    first["checkpoint"].update({"every_steps": 10, "async": False})
    with quiet_run(load_job_data(first), lines, node_labels=ZONES) as run:
        result = run.wait()
    assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)

    second = {**first, "name": "diloco-fsdp-resumed", "max_steps": STEPS}
    spec = load_job_data(second)
    resume = plan_resume(spec)
    assert (resume.step, resume.world_size) == (20, 4)
    with quiet_run(spec, lines, node_labels=ZONES, resume=resume) as run:
        result = run.wait()
    assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)
    assert any("resumed from" in line and "at step 20" in line for line in lines)
    want = HandRun(spec.sync, [[0, 1], [2, 3]], slices=2).train(0, 20).resume_as([[0, 1], [2, 3]])
    assert_same_params(assembled(tmp_path / "out"), want.train(20, STEPS).final())

    # the same sites with one rank each: every slice's outer state is cut anew
    third = {**second, "name": "diloco-fsdp-other-sites", "nproc_per_node": 1}
    third["max_steps"] = STEPS + 20
    spec = load_job_data(third)
    resume = plan_resume(spec)
    assert resume.world_size == 4 and resume.step > 20
    for old in (tmp_path / "out").glob("rank-*.pt"):  # the 4-rank run's rows
        old.unlink()
    with quiet_run(spec, lines, node_labels=ZONES, resume=resume) as run:
        result = run.wait()
    assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)
    assert any(
        "the outer state was saved on sites of 2 rank(s) each and is resharded to 1" in line
        for line in lines
    ), summary(result, lines)
    hand = HandRun(spec.sync, [[0, 1], [2, 3]], slices=2).train(0, 20).resume_as([[0, 1], [2, 3]])
    hand.train(20, resume.step).resume_as([[0], [1]]).train(resume.step, STEPS + 20)
    assert_same_params(assembled(tmp_path / "out"), hand.final())
