"""The global sample offset: resuming on another world size neither skips nor repeats."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoint.data_position import ElasticSampler

pytestmark = pytest.mark.unit


def _consume(n: int, world: int, offset: int, steps: int, batch: int, seed: int = 1) -> list[int]:
    """Positions' dataset indices consumed by ``steps`` steps of all ranks."""
    out: list[int] = []
    for rank in range(world):
        it = iter(ElasticSampler(n, rank, world, offset, seed=seed))
        out += list(itertools.islice(it, steps * batch))
    return out


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(5, 40),
    world_a=st.integers(1, 4),
    world_b=st.integers(1, 4),
    steps_a=st.integers(0, 6),
    steps_b=st.integers(0, 6),
    batch=st.integers(1, 3),
)
def test_resume_on_any_world_size_continues_the_global_stream(
    n: int, world_a: int, world_b: int, steps_a: int, steps_b: int, batch: int
) -> None:
    before = _consume(n, world_a, 0, steps_a, batch)
    offset = steps_a * batch * world_a
    after = _consume(n, world_b, offset, steps_b, batch)
    reference = ElasticSampler(n, 0, 1, seed=1)
    total = offset + steps_b * batch * world_b
    expected = sorted(reference.global_index(p) for p in range(total))
    assert sorted(before + after) == expected


def test_each_epoch_is_a_permutation_and_epochs_differ() -> None:
    s = ElasticSampler(10, 0, 1, seed=5)
    first = [s.global_index(p) for p in range(10)]
    second = [s.global_index(p) for p in range(10, 20)]
    assert sorted(first) == sorted(second) == list(range(10))
    assert first != second


def test_unshuffled_round_robin() -> None:
    it = iter(ElasticSampler(8, 1, 3, samples_seen=2, shuffle=False))
    assert list(itertools.islice(it, 3)) == [3, 6, 1]


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="outside"):
        ElasticSampler(10, 3, 3)
    with pytest.raises(ValueError, match="dataset_len"):
        ElasticSampler(0, 0, 1)
