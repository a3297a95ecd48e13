"""ElasticLoader: every step reads its global batch, whatever the generation.

* the index math alone: shares cover a step's positions exactly; a run whose
  world size changes twice consumes the global stream exactly once;
* a real ``DataLoader`` with two worker processes: batches are the shares, a
  step read again is the same batch, a new world size is served at once
  (nothing stale from the prefetch);
* real jobs (``ringmaster``'s local run: etcd, controller, agents, workers on
  gloo): two nodes train and save a durable checkpoint, then one node resumes
  from it and continues at the exact sample; the tracked objects other than
  model and optimizer come back from the checkpoint.
"""

from __future__ import annotations

import collections
import itertools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

from agents.runtime.data import DataLoaderError, ElasticLoader
from checkpoint.data_position import ElasticSampler, GlobalOrder, rank_positions, share_size

N = 50  # dataset length: steps straddle epochs with a batch of 12
BATCH = 12


@dataclass
class Where:
    """What the loader reads of a session: this process's rank and world size."""

    rank: int
    world_size: int


class Indexed(Dataset[torch.Tensor]):
    """Sample ``i`` is ``i`` (so a batch says which samples it holds)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


def stream(positions: int, seed: int) -> list[int]:
    order = GlobalOrder(N, seed)
    return order.indices(0, positions)


def in_position_order(shares: list[list[int]]) -> list[int]:
    """A step's global batch in the order of its positions, from the ranks' shares
    (dealt round-robin: rank ``r`` of ``w`` holds positions ``r``, ``r + w``, ...)."""
    world = len(shares)
    out: list[int] = [-1] * sum(len(s) for s in shares)
    for rank, share in enumerate(shares):
        out[rank::world] = share
    return out


@pytest.mark.unit
def test_shares_cover_each_step_once() -> None:
    for world in range(1, 8):
        shares = [rank_positions(BATCH, 2 * BATCH, r, world) for r in range(world)]
        assert sorted(p for share in shares for p in share) == list(range(BATCH, 2 * BATCH))
        sizes = [share_size(BATCH, r, world) for r in range(world)]
        assert sizes == [len(share) for share in shares]
        assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1


@pytest.mark.unit
def test_the_loader_and_the_checkpoint_sampler_deal_alike() -> None:
    """One convention: from samples_seen = s * B, ElasticSampler with a per-rank batch of
    B / w gives every rank what the loader gives it at step s."""
    world, step = 3, 5
    loader = ElasticLoader(Indexed(N), Where(0, world), BATCH, seed=3)
    for rank in range(world):
        sampler = ElasticSampler(N, rank, world, step * BATCH, seed=3)
        first = list(itertools.islice(iter(sampler), 2 * BATCH // world))
        assert first == loader.indices(step, rank, world) + loader.indices(step + 1, rank, world)


@pytest.mark.unit
def test_global_order_is_a_permutation_per_epoch_and_seeded() -> None:
    s = stream(3 * N, seed=5)
    for e in range(3):
        assert sorted(s[e * N : (e + 1) * N]) == list(range(N))
    assert s[:N] != s[N : 2 * N], "each epoch has its own order"
    assert s == stream(3 * N, seed=5) and s != stream(3 * N, seed=6)
    assert GlobalOrder(N, shuffle=False).indices(45, 55) == [*range(45, 50), *range(5)]


@pytest.mark.unit
def test_world_size_changes_skip_and_repeat_nothing() -> None:
    where = Where(0, 2)
    loader = ElasticLoader(Indexed(N), where, BATCH, seed=3)
    consumed: list[int] = []
    for step in range(13):  # 156 positions: three epochs and a bit
        world = 2 if step < 4 else 3 if step < 9 else 1
        consumed += in_position_order([loader.indices(step, r, world) for r in range(world)])
    assert consumed == stream(13 * BATCH, seed=3)
    counts = collections.Counter(consumed[: 3 * N])
    assert set(counts.values()) == {3}, "each sample once per epoch"


@pytest.mark.unit
def test_bad_setups_say_what_to_do() -> None:
    with pytest.raises(DataLoaderError, match="global_batch_size must be at least 1"):
        ElasticLoader(Indexed(N), Where(0, 1), 0)
    with pytest.raises(DataLoaderError, match="sets batch_size, drop_last itself"):
        ElasticLoader(Indexed(N), Where(0, 1), 4, batch_size=2, drop_last=True)
    with pytest.raises(DataLoaderError, match="dataset is empty"):
        ElasticLoader(Indexed(0), Where(0, 1), 4)
    loader = ElasticLoader(Indexed(N), Where(0, 5), 4)
    with pytest.raises(DataLoaderError, match=r"global_batch_size \(4\) is smaller"):
        loader.batch(0)
    loader = ElasticLoader(Indexed(N), Where(-1, 0), 4)
    with pytest.raises(DataLoaderError, match=r"inside session\.steps"):
        loader.batch(0)


@pytest.mark.integration
def test_worker_processes_serve_the_right_batch_after_reruns_and_new_worlds() -> None:
    where = Where(1, 2)
    loader = ElasticLoader(Indexed(N), where, BATCH, seed=3, num_workers=2, prefetch_factor=2)
    try:
        seen = {}
        for step in range(4):
            seen[step] = loader.batch(step).tolist()
            assert seen[step] == loader.indices(step)
        assert loader.rebuilds == 1, "steps in order come from one prefetching iterator"
        # the step fails and runs again (the prefetch holds steps 4 and on)
        assert loader.batch(3).tolist() == seen[3]
        assert loader.rebuilds == 2
        # a new generation: this process is rank 0 of 3 now
        where.rank, where.world_size = 0, 3
        b4 = loader.batch(4).tolist()
        assert b4 == loader.indices(4, 0, 3) and len(b4) == BATCH // 3
        assert loader.rebuilds == 3
        assert loader.batch(5).tolist() == loader.indices(5, 0, 3)
        # a resume that goes back (a restored checkpoint)
        assert loader.batch(1).tolist() == loader.indices(1, 0, 3)
        assert loader.loss_scale == pytest.approx(3 / BATCH) and loader.share == 4
    finally:
        loader.close()


@pytest.mark.integration
def test_persistent_workers_do_not_serve_stale_batches() -> None:
    where = Where(0, 2)
    loader = ElasticLoader(Indexed(N), where, BATCH, seed=1, num_workers=2, persistent_workers=True)
    try:
        assert loader.batch(0).tolist() == loader.indices(0)
        time.sleep(0.2)  # let the workers fill the prefetch with steps 1, 2, ...
        where.rank = 1
        assert loader.batch(1).tolist() == loader.indices(1, 1, 2)
        assert loader.batch(0).tolist() == loader.indices(0, 1, 2)
    finally:
        loader.close()


# -- real jobs: a durable resume at another world size -------------------------------


def _job(name: str, tmp: Path, nodes: int, steps: int, every: int) -> Any:
    from orchestrator.spec.loader import load_job_data
    from tests.chaos.jobs import REPO

    return load_job_data(
        {
            "name": name,
            "entrypoint": {
                "script": str(REPO / "tests" / "integration" / "loader_worker.py"),
                "args": ["--log", str(tmp / "log"), "--batch", str(BATCH), "--n", str(N)],
            },
            "nodes": {"min": nodes, "max": nodes, "spares": 0},
            "max_steps": steps,
            "checkpoint": {"url": f"file://{tmp}/ckpt", "every_steps": every},
            "fault_tolerance": {"heartbeat_interval": "500ms"},
        }
    )


def _records(log: Path) -> list[tuple[str, ...]]:
    return [
        tuple(line.split())
        for f in sorted(log.glob("*.log"))
        for line in f.read_text().splitlines()
    ]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_durable_resume_at_another_world_size_continues_at_the_exact_sample(
    tmp_path: Path,
) -> None:
    from orchestrator.api import JobPhase
    from orchestrator.state.jobs import plan_resume
    from tests.chaos.jobs import quiet_run, summary

    (tmp_path / "log").mkdir()
    lines: list[str] = []
    first = _job("loader-two", tmp_path, nodes=2, steps=4, every=4)
    with quiet_run(first, lines) as run:
        result = run.wait()
    assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)

    second = _job("loader-one", tmp_path, nodes=1, steps=9, every=0)
    resume = plan_resume(second)
    assert resume.step == 4 and resume.world_size == 2
    with quiet_run(second, lines, resume=resume) as run:
        result = run.wait()
    assert result.phase is JobPhase.SUCCEEDED, summary(result, lines)

    records = _records(tmp_path / "log")
    steps: dict[int, dict[int, list[int]]] = collections.defaultdict(dict)
    starts = []
    for rec in records:
        if rec[0] == "start":  # start <step> <progress counter> <world size>
            starts.append((int(rec[1]), int(rec[2]), int(rec[3])))
        else:  # step <step> <rank> <world size> <indices>
            steps[int(rec[1])][int(rec[2])] = [int(i) for i in rec[4].split(",")]
    assert sorted(starts) == [(0, 0, 2), (0, 0, 2), (4, 4, 1)], (
        "the resumed worker must start at step 4 with the tracked counter it saved"
    )
    assert sorted(steps) == list(range(9))
    assert all(len(steps[s]) == (2 if s < 4 else 1) for s in steps)
    batches = [in_position_order([steps[s][r] for r in sorted(steps[s])]) for s in range(9)]
    consumed = [i for batch in batches for i in batch]
    assert consumed == stream(9 * BATCH, seed=7), "a sample was skipped or read twice"
