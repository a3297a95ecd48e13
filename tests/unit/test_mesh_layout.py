"""``wrap(mesh=...)``: the shape it takes, where each rank sits, the tensor plan."""

from __future__ import annotations

import pytest
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from agents.recovery.shard_transfer import pieces, plan, stacked
from agents.runtime.mesh_layout import Layout, MeshShape, layout_of, mesh_shape
from agents.runtime.tensor_plan import check_plan, default_plan
from agents.runtime.wrapping import mode_of

pytestmark = pytest.mark.unit


def test_mesh_shape_defaults_and_replicas_from_the_world() -> None:
    shape = mesh_shape({"tensor": 2})
    assert shape == MeshShape(shard=1, tensor=2, replicate=None)
    assert shape.replicas(4) == 2 and shape.replicas(2) == 1
    assert mesh_shape({"replicate": 2, "shard": 2, "tensor": 2}).replica_size == 4
    assert mesh_shape({"replicate": -1, "shard": 3}) == MeshShape(shard=3)
    with pytest.raises(ValueError, match=r"multiple of shard \* tensor = 2; this generation has 3"):
        shape.replicas(3)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"tensr": 2}, "mesh dimension 'tensr' is not one of 'replicate', 'shard', 'tensor'"),
        ({"pipeline": 2}, "'pipeline' is not supported in this release"),
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
        nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4),
        nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 4), nn.Linear(4, 2)),
    )  # fmt: skip
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
