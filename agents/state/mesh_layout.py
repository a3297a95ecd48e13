"""Where each rank of a sharded model sits: its layout, the generation's mesh, its rows.

Pure (but for :func:`build_mesh`, which makes a ``DeviceMesh``), the same answer
on every rank.  Ranks are laid out in rank order, which is topology order: the
innermost dimension is made of neighbouring ranks (one node's workers), the
replicas of a slice sit on other nodes.

* ``fsdp``: one ``shard`` dimension over every rank;
* ``hsdp``: ``(replicate, shard)``, ``shard_size`` ranks per replica;
* ``mesh`` (``wrap(mesh=...)``): ``(replicate, pipeline, shard, tensor)``:
  tensor parallel innermost (its ranks share a node), FSDP2 over ``shard``,
  pipeline stages across those groups (the ``pipeline`` dimension is left out
  when it is 1), and replicas across the rest of the world.

A *layout* is where a rank sits inside its replica: chunk ``index`` of
``shards``, ``shards`` being the ranks of one replica (``pipeline * shard *
tensor`` for a mesh).  Ranks of equal layout in different replicas (*twins*) hold equal
slices, which is what recovery draws on.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "MESH_DIMS",
    "Layout",
    "MeshShape",
    "build_mesh",
    "check_hsdp_world",
    "chunk_rows",
    "layout_of",
    "mesh_shape",
]

#: The dimensions ``wrap(mesh=...)`` takes, outermost first.
MESH_DIMS = ("replicate", "pipeline", "shard", "tensor")


@dataclass(frozen=True)
class Layout:
    """Where a rank sits inside its replica: chunk ``index`` of ``shards``."""

    shards: int
    index: int


@dataclass(frozen=True)
class MeshShape:
    """The sizes a ``wrap(mesh=...)`` asked for.

    ``shard`` and ``tensor`` keep their sizes for the job's life; the replicas
    are the rest of the world and change with it.  ``replicate``, when given,
    is what the first generation must have.
    """

    shard: int = 1
    tensor: int = 1
    replicate: int | None = None
    pipeline: int = 1

    @property
    def replica_size(self) -> int:
        """Ranks of one replica (``pipeline * shard * tensor``)."""
        return self.pipeline * self.shard * self.tensor

    @property
    def names(self) -> tuple[str, ...]:
        """The generation mesh's dimensions (``pipeline`` only when there are stages)."""
        return MESH_DIMS if self.pipeline > 1 else ("replicate", "shard", "tensor")

    def stage(self, layout: Layout) -> int:
        """The pipeline stage a rank of ``layout`` holds."""
        return layout.index // (self.shard * self.tensor)

    def replicas(self, world_size: int) -> int:
        """How many replicas ``world_size`` ranks make.

        Raises:
            ValueError: ``world_size`` is not a multiple of the replica size.
        """
        if world_size % self.replica_size:
            raise ValueError(
                f"mesh {self.describe()} needs a world size that is a multiple of "
                f"pipeline * shard * tensor = {self.replica_size}; this generation has "
                f"{world_size} ranks: "
                "run whole replicas (nodes * nproc_per_node)"
            )
        return world_size // self.replica_size

    def describe(self, world_size: int | None = None) -> str:
        r = self.replicate if world_size is None else self.replicas(world_size)
        return (
            f"(replicate {'*' if r is None else r}, pipeline {self.pipeline}, "
            f"shard {self.shard}, tensor {self.tensor})"
        )


def mesh_shape(spec: Mapping[str, int]) -> MeshShape:
    """``wrap(mesh=...)``'s mapping as a :class:`MeshShape`.

    Raises:
        ValueError: an unknown dimension or a size that is not a positive integer
            (``replicate`` may also be -1: the rest of the world).
    """
    unknown = sorted(set(spec) - set(MESH_DIMS))
    if unknown:
        raise ValueError(
            f"mesh dimension {unknown[0]!r} is not one of " + ", ".join(map(repr, MESH_DIMS))
        )
    sizes: dict[str, int] = {}
    for name, size in spec.items():
        if isinstance(size, bool) or not isinstance(size, int):
            raise ValueError(f"mesh[{name!r}] must be an integer, got {size!r}")
        if size < 1 and not (name == "replicate" and size == -1):
            raise ValueError(
                f"mesh[{name!r}] must be 1 or more"
                + (" (or -1: the rest of the world)" if name == "replicate" else "")
                + f", got {size}"
            )
        sizes[name] = size
    replicate = sizes.get("replicate", -1)
    return MeshShape(
        shard=sizes.get("shard", 1),
        tensor=sizes.get("tensor", 1),
        replicate=None if replicate == -1 else replicate,
        pipeline=sizes.get("pipeline", 1),
    )


def layout_of(mode: str, rank: int, world_size: int, shard_size: int) -> Layout:
    """This rank's place inside its replica for ``mode`` (``shard_size``: ranks per replica)."""
    if mode == "fsdp":
        return Layout(world_size, rank)
    return Layout(shard_size, rank % shard_size)


def check_hsdp_world(world_size: int, shard_size: int) -> None:
    """Raise unless ``world_size`` ranks form whole replica groups of ``shard_size``."""
    if shard_size < 1 or world_size % shard_size:
        raise ValueError(
            f"hsdp needs a world size that is a multiple of the shard group size: "
            f"{world_size} ranks, shard_size {shard_size}; pass shard_size= to wrap() "
            "or run whole groups of nodes"
        )


def build_mesh(
    mode: str,
    world_size: int,
    shard_size: int,
    device_type: str,
    shape: MeshShape | None = None,
) -> DeviceMesh:
    """The generation's mesh: 1-D for ``fsdp``, ``(replicate, shard)`` for ``hsdp``,
    ``(replicate[, pipeline], shard, tensor)`` for ``mesh`` (``shape`` given)."""
    if mode == "fsdp":
        return DeviceMesh(device_type, torch.arange(world_size), mesh_dim_names=("shard",))
    if shape is not None:
        sizes = {"replicate": shape.replicas(world_size), "pipeline": shape.pipeline}
        sizes |= {"shard": shape.shard, "tensor": shape.tensor}
        grid = torch.arange(world_size).view(*(sizes[n] for n in shape.names))
        return DeviceMesh(device_type, grid, mesh_dim_names=shape.names)
    check_hsdp_world(world_size, shard_size)
    grid = torch.arange(world_size).view(world_size // shard_size, shard_size)
    return DeviceMesh(device_type, grid, mesh_dim_names=("replicate", "shard"))


def chunk_rows(rows: int, layout: Layout) -> tuple[int, int]:
    """``[start, stop)`` of dimension 0 held by ``layout`` (``torch.chunk``'s split)."""
    size = math.ceil(rows / layout.shards) if rows else 0
    start = min(rows, layout.index * size)
    return start, min(rows, start + size)
