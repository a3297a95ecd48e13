"""An FSDP2 model in each site under a delayed sync: the pure parts.

The outer state of one slice (fragments cut by the whole parameters, sized to
the slice), where each site's slices come from at a join (its ranks, a
buddy's copy in the site, or none: the global model), and what ``wrap()`` and
the join refuse, with messages that say what to change.
"""

from __future__ import annotations

import pytest
import torch

from agents.recovery.outer_reshard import SLICED_KEYS, reshard_slice
from agents.recovery.site_plan import Held, SiteState, check_sites, site_states
from agents.recovery.state_sync import NO_STATE
from agents.runtime.failures import CollectiveFailures
from agents.runtime.outer_checkpoint import outer_rank_state, replicated
from agents.runtime.wrapping import WrappedModels, check_delayed_sharded
from agents.state.mesh_layout import Layout, chunk_rows
from agents.state.tracked_optimizers import others_of
from agents.sync.outer_sync import OuterSync, per_slice
from agents.sync.sites import Sites
from orchestrator.spec.job import JobSpec
from orchestrator.spec.loader import load_job_data

pytestmark = pytest.mark.unit


def _job(**more: object) -> JobSpec:
    return load_job_data(
        {
            "name": "j",
            "entrypoint": {"script": "x.py"},
            "sync": {"mode": "streaming_diloco", "inner_steps": 8, "fragments": 2},
            **more,
        }
    )


def test_a_slice_keeps_the_whole_models_fragments_and_its_own_rows() -> None:
    whole = [torch.zeros(8, 2), torch.zeros(8), torch.zeros(4, 4)]
    rows = [p.chunk(2)[1] for p in whole]  # rank 1 of a site of two
    outer = OuterSync(_job().sync, whole, local=lambda: rows)
    assert outer.rank_local and per_slice(outer)
    # cut by the whole parameters (16, 8, 16 values: [0], [1, 2]), the same on every
    # rank, and sized to this rank's rows of them (8, 4 + 8)
    assert outer.fragments == 2
    outer.fit()
    assert [a.numel() for a in outer.anchors] == [8, 12]
    assert [m.numel() for m in outer.momentum] == [8, 12]
    assert [t.data_ptr() for t in outer.parameters] == [t.data_ptr() for t in rows]
    with torch.no_grad():
        rows[0].fill_(1.0)
    outer.anchor_to_parameters(5)
    assert outer.anchors[0].eq(1.0).all() and outer.started == 5
    state = outer.state_dict()
    again = OuterSync(_job().sync, whole, local=lambda: rows)
    again.fit()
    again.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(again.anchors, outer.anchors, strict=True))


def test_a_ddp_outer_state_is_its_sites() -> None:
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
    outer = OuterSync(_job().sync, params)
    assert not outer.rank_local and not per_slice(outer)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tracked = {"model": model, "optimizer": opt, "outer": outer, "step": object()}
    assert set(others_of(tracked, model)) == {"outer", "step"}
    sliced = OuterSync(_job().sync, params, local=lambda: params)
    assert set(others_of({**tracked, "outer": sliced}, model)) == {"step"}


def test_sites_of_different_sizes_are_refused_naming_each() -> None:
    check_sites(Sites(("a", "b"), ((0, 1), (2, 3))), "zone")
    with pytest.raises(ValueError) as e:
        check_sites(Sites(("a", "b"), ((0, 1), (2,))), "zone")
    message = str(e.value)
    assert "a: 2, b: 1" in message and "zone" in message
    assert "as many nodes" in message and "sharding='ddp'" in message


def _held(live: int, copy: tuple[int, int, int] | None = None) -> Held:
    return Held(live, live != NO_STATE, copy)


def test_a_site_keeps_its_state_where_its_ranks_or_their_buddies_hold_it() -> None:
    sites = Sites(("a", "b", "c"), ((0, 1), (2, 3), (4, 5)))
    held = [
        _held(12),
        _held(12, (12, 2, 0)),  # a: both ranks kept theirs
        _held(12, (12, 2, 1)),
        Held(NO_STATE, False),  # b: rank 3 replaced, 2 holds its copy
        _held(12),
        _held(11),  # c: its ranks disagree
    ]
    assert site_states(held, sites) == [
        SiteState(12),
        SiteState(12, {1: 2}),
        SiteState(NO_STATE),
    ]
    # a buddy's copy of an older step does not serve (the site would go back past
    # what the other sites saw), nor one of another layout
    for copy in [(11, 2, 1), (12, 3, 1)]:
        held[2] = _held(12, copy)
        assert site_states(held, sites)[1] == SiteState(NO_STATE)


def test_a_replaced_slice_needs_its_outer_state_in_another_site() -> None:
    """Slice 1 replaced in both sites: its anchors are nowhere else, so neither site
    keeps its state (the join then raises StateLostError)."""
    sites = Sites(("a", "b"), ((0, 1), (2, 3)))
    held = [_held(8, (8, 2, 1)), Held(NO_STATE, False), _held(8, (8, 2, 1)), _held(NO_STATE)]
    assert site_states(held, sites) == [SiteState(NO_STATE), SiteState(NO_STATE)]
    held[3] = _held(8)  # site b kept slice 1: site a's replacement takes its outer state
    assert site_states(held, sites) == [SiteState(8, {1: 0}), SiteState(8)]


def test_what_a_rank_tells_round_trips() -> None:
    for h in [Held(5, True, (5, 2, 1)), Held(NO_STATE, False), Held(NO_STATE, True)]:
        assert Held.decode(h.encode()) == h


@pytest.mark.parametrize(
    ("sharding", "words"),
    [
        ("hsdp", "sharding='ddp' or sharding='fsdp' (not 'hsdp')"),
        ("mesh", "(not 'mesh')"),
    ],
)
def test_wrap_refuses_other_sharded_models_under_a_delayed_sync(sharding: str, words: str) -> None:
    with pytest.raises(ValueError, match="streaming_diloco") as e:
        check_delayed_sharded(_job(), sharding)
    assert words in str(e.value)


@pytest.mark.parametrize("second", ["ddp", "fsdp"])
def test_wrap_refuses_a_second_model_under_a_delayed_sync(second: str) -> None:
    """One outer loop per job: a second model, DDP or FSDP2, would replace the first's."""
    models = WrappedModels(_job(), torch.device("cpu"), CollectiveFailures(), lambda ddp: None)
    models.wrap(torch.nn.Linear(2, 2), None, None, None, None)
    first = models.outer
    assert first is not None
    with pytest.raises(ValueError, match="syncs one model per job and this session wrapped one"):
        models.wrap(torch.nn.Linear(2, 2), None, second, None, None)
    assert models.outer is first and len(models.ddps) == 1 and models.sharded is None


def test_the_outer_states_name_is_refused_to_a_scripts_object() -> None:
    models = WrappedModels(_job(), torch.device("cpu"), CollectiveFailures(), lambda ddp: None)
    with pytest.raises(ValueError, match=r"'outer' holds the outer state .* another name"):
        models.check_tracked(["model", "outer"])
    models.check_tracked(["model", "optimizer"])
    plain = load_job_data({"name": "j", "entrypoint": {"script": "x.py"}})
    WrappedModels(plain, torch.device("cpu"), CollectiveFailures(), lambda ddp: None).check_tracked(
        ["outer"]
    )  # no delayed sync: the name is the script's


def test_wrap_takes_fsdp_with_checkpoints_under_a_delayed_sync() -> None:
    check_delayed_sharded(_job(checkpoint={"url": "file:///tmp/x", "every_steps": 10}), "fsdp")


def test_a_slices_outer_state_is_saved_as_the_ranks_own() -> None:
    whole = [torch.zeros(4, 2), torch.zeros(4)]
    rows = [p.chunk(2)[0] for p in whole]
    sliced = OuterSync(_job().sync, whole, local=lambda: rows)
    site = OuterSync(_job().sync, whole)
    tracked = {"model": object(), "outer": sliced, "step": object()}
    assert set(replicated(tracked, ("model",))) == {"step"}
    assert set(replicated({**tracked, "outer": site}, ("model",))) == {"outer", "step"}
    assert outer_rank_state(site) == {}
    assert outer_rank_state(sliced) == {}  # outside a generation: no sites to name


def _slice_state(whole: dict[str, list[torch.Tensor]], runs: list[list[int]], at: Layout) -> dict:
    """The outer state slice ``at`` holds of ``whole`` (per key, each parameter whole)."""
    state: dict = {
        "counts": [3, 4],
        "started": 20,
        "pending_at": [22, -1],
        "pending_weight": [1.0, 0],
    }
    for key, params in whole.items():
        state[key] = [
            torch.cat(
                [params[i][slice(*chunk_rows(params[i].shape[0], at))].flatten() for i in run]
            )
            for run in runs
        ]
    return state


@pytest.mark.parametrize("old", [1, 2, 3])
@pytest.mark.parametrize("new", [1, 2, 3, 4])
def test_a_slices_outer_state_is_cut_anew_for_another_site_size(old: int, new: int) -> None:
    """Parameters of 5, 7, 2 and 1 rows (chunks of unequal and empty sizes), in two
    fragments: each new slice gets exactly the rows ``torch.chunk`` gives it."""
    g = torch.Generator().manual_seed(old * 10 + new)
    shapes = [(5, 3), (7,), (2, 2), (1, 4)]
    runs = [[0, 1], [2, 3]]
    whole = {k: [torch.randn(s, generator=g) for s in shapes] for k in SLICED_KEYS}
    pieces = {k: _slice_state(whole, runs, Layout(old, k)) for k in range(old)}
    rows = [s[0] for s in shapes]
    numels = [int(torch.Size(s).numel()) for s in shapes]
    for index in range(new):
        got = reshard_slice(pieces, Layout(new, index), rows, numels, runs)
        want = _slice_state(whole, runs, Layout(new, index))
        assert got.keys() == want.keys()
        for key in SLICED_KEYS:
            assert all(torch.equal(a, b) for a, b in zip(got[key], want[key], strict=True)), key
        assert got["counts"] == [3, 4] and got["pending_at"] == [22, -1] and got["started"] == 20


def test_a_piece_of_another_model_is_named() -> None:
    runs = [[0]]
    pieces = {0: _slice_state({k: [torch.zeros(4, 2)] for k in SLICED_KEYS}, runs, Layout(1, 0))}
    with pytest.raises(ValueError, match="slice 0 of 1 holds 8 values of fragment 0, its rows 6"):
        reshard_slice(pieces, Layout(2, 0), [3], [6], runs)  # the model has 3 x 2
