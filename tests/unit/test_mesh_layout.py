"""``wrap(mesh=...)``: the shape it takes, where each rank sits, the tensor plan."""

from __future__ import annotations

import pytest
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from agents.recovery.shard_transfer import pieces, plan, stacked
from agents.runtime.wrapping import mode_of
from agents.state.mesh_layout import Layout, MeshShape, layout_of, mesh_shape
from agents.state.pipeline import Pipeline, split_stages, stage_of
from agents.state.tensor_plan import check_plan, default_plan

pytestmark = pytest.mark.unit


def test_mesh_shape_defaults_and_replicas_from_the_world() -> None:
    shape = mesh_shape({"tensor": 2})
    assert shape == MeshShape(shard=1, tensor=2, replicate=None)
    assert shape.replicas(4) == 2 and shape.replicas(2) == 1
    assert mesh_shape({"replicate": 2, "shard": 2, "tensor": 2}).replica_size == 4
    assert mesh_shape({"replicate": -1, "shard": 3}) == MeshShape(shard=3)
    with pytest.raises(
        ValueError, match=r"multiple of pipeline \* shard \* tensor = 2; this generation has 3"
    ):
        shape.replicas(3)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"tensr": 2}, "mesh dimension 'tensr' is not one of 'replicate', 'pipeline'"),
        ({"pipelines": 2}, "'pipelines' is not one of 'replicate', 'pipeline', 'shard', 'tensor'"),
        ({"tensor": 0}, r"mesh\['tensor'\] must be 1 or more, got 0"),
        ({"replicate": -2}, r"or -1: the rest of the world"),
        ({"shard": 1.5}, r"mesh\['shard'\] must be an integer"),
        ({"shard": True}, r"mesh\['shard'\] must be an integer"),
    ],
)
def test_bad_meshes_say_what_is_wrong(spec: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        mesh_shape(spec)


def test_twins_are_ranks_of_equal_place_in_other_replicas() -> None:
    """replicate 2 x shard 1 x tensor 2: ranks 0 and 2, 1 and 3 hold the same slices."""
    layouts = [layout_of("mesh", r, 4, MeshShape(tensor=2).replica_size) for r in range(4)]
    assert layouts == [Layout(2, 0), Layout(2, 1), Layout(2, 0), Layout(2, 1)]
    # rank 2's node is replaced: it gets chunk 0 from rank 0; the others keep their own
    held = [[(7, 2, 0, True)], [(7, 2, 1, True)], [], [(7, 2, 1, True)]]
    tp = plan(held, layouts)
    assert tp is not None and tp.step == 7
    assert tp.holder[(2, 0)] == 0 and tp.holder[(0, 0)] == 0 and tp.holder[(3, 1)] == 3


def test_stacked_extents_move_whole_local_tensors() -> None:
    """A mesh's slices are local tensors of any shape: chunk i follows chunk i - 1, so
    a receiver of the same layout takes exactly its twin's tensor."""
    extent = stacked({("w", 0): 4, ("w", 1): 3})
    assert extent("w", Layout(2, 0)) == (0, 4) and extent("w", Layout(2, 1)) == (4, 7)
    got = pieces(extent, [("w", "param")], 2, Layout(2, 1))
    assert [(p.chunk, p.start, p.stop) for p in got] == [(1, 4, 7)]


def test_default_plan_pairs_linears_of_each_sequential() -> None:
    net = nn.Sequential(
        nn.Linear(4, 8),
        nn.ReLU(),
        nn.Linear(8, 4),
        nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 4), nn.Linear(4, 2)),
    )
    got = {k: type(v) for k, v in default_plan(net).items()}
    assert got == {
        "0": ColwiseParallel,
        "2": RowwiseParallel,
        "3.0": ColwiseParallel,
        "3.2": RowwiseParallel,
    }  # the odd one out (3.3) stays whole


def test_plans_that_cannot_run_are_refused_with_the_layer() -> None:
    net = nn.Sequential(nn.Linear(4, 7), nn.ReLU(), nn.Linear(7, 4))
    with pytest.raises(ValueError, match=r"tensor_plan\['0'\] splits out_features = 7 .* tensor=2"):
        check_plan(net, default_plan(net), 2)
    with pytest.raises(ValueError, match=r"the model has no submodule 'fc1'"):
        check_plan(net, {"fc1": ColwiseParallel()}, 2)
    with pytest.raises(ValueError, match="not a ParallelStyle"):
        check_plan(net, {"0": "colwise"}, 7)  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="nothing to split"):
        check_plan(nn.Linear(4, 4), {}, 2)


def test_wrap_takes_a_mesh_or_a_sharding_not_both() -> None:
    assert mode_of(None, None, None) == "ddp"
    assert mode_of("hsdp", None, None) == "hsdp"
    assert mode_of(None, {"tensor": 2}, None) == "mesh"
    with pytest.raises(ValueError, match="sharding= or mesh=, not both"):
        mode_of("fsdp", {"tensor": 2}, None)
    with pytest.raises(ValueError, match="tensor_plan= goes with mesh="):
        mode_of(None, None, {"0": ColwiseParallel()})


def test_a_pipeline_replica_is_its_stages_and_twins_hold_the_same_stage() -> None:
    """replicate 2 x pipeline 2 x tensor 2: 4 ranks a replica, stage = index // tensor."""
    shape = mesh_shape({"pipeline": 2, "tensor": 2})
    assert shape.replica_size == 4 and shape.replicas(8) == 2
    assert shape.names == ("replicate", "pipeline", "shard", "tensor")
    assert mesh_shape({"tensor": 2}).names == ("replicate", "shard", "tensor")
    layouts = [layout_of("mesh", r, 8, shape.replica_size) for r in range(8)]
    assert [shape.stage(lay) for lay in layouts] == [0, 0, 1, 1, 0, 0, 1, 1]


def _mlp() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2)
    )


def test_stages_are_cut_by_parameters_or_where_the_script_says() -> None:
    net = _mlp()  # parameters: 320, 0, 4160, 0, 130
    assert split_stages(net, 2, None) == [["0", "1", "2"], ["3", "4"]]
    assert split_stages(net, 3, None) == [["0", "1", "2"], ["3"], ["4"]]
    assert split_stages(net, 5, None) == [["0"], ["1"], ["2"], ["3"], ["4"]]
    assert split_stages(net, 2, ("2",)) == [["0", "1"], ["2", "3", "4"]]
    stage = stage_of(net, ["2", "3"])
    assert [n for n, _ in stage.named_parameters()] == ["2.weight", "2.bias"]  # names kept
    assert stage[0] is net[2]


@pytest.mark.parametrize(
    ("model", "stages", "split", "message"),
    [
        (nn.Linear(2, 2), 2, None, "cuts an nn.Sequential into stages; this model is Linear"),
        (nn.Sequential(nn.Linear(2, 2)), 2, None, "pipeline=2 but the model has 1 children"),
        (_mlp(), 2, ("7",), r"must name 1 of the model's children"),
        (_mlp(), 3, ("4", "2"), "in the model's order"),
        (_mlp(), 2, ("0",), "not its first child"),
    ],
)
def test_stages_that_cannot_be_cut_are_refused(
    model: nn.Module, stages: int, split: tuple[str, ...] | None, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        split_stages(model, stages, split)


def test_pipeline_settings_are_checked() -> None:
    def loss(out: object, target: object) -> object:
        return out

    Pipeline(loss, microbatches=2, schedule="1f1b").check(2)  # type: ignore[arg-type]
    Pipeline(loss, microbatches=1, schedule="gpipe").check(4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least as many micro-batches as stages"):
        Pipeline(loss, microbatches=2).check(4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"schedule='zb'\) is not a schedule"):
        Pipeline(loss, schedule="zb").check(2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="microbatches=0"):
        Pipeline(loss, microbatches=0).check(1)  # type: ignore[arg-type]
