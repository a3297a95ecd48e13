"""Tensor parallel for ``wrap(mesh={"tensor": T, ...})``: the plan and its default.

A plan is what DTensor's ``parallelize_module`` takes: module name (relative to
the wrapped model) → a ``ParallelStyle`` (``ColwiseParallel``, ``RowwiseParallel``,
...).  The script passes its own as ``tensor_plan=``; without one,
:func:`default_plan` pairs the ``nn.Linear`` layers of each ``nn.Sequential``
in order, the first of a pair column-wise and the second row-wise (the
feed-forward pattern: ``Linear → activation → Linear``).  Layers outside such
pairs stay whole on every tensor-parallel rank.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

__all__ = ["TensorPlan", "apply_plan", "check_plan", "default_plan"]

TensorPlan = Mapping[str, ParallelStyle]


def default_plan(module: nn.Module) -> dict[str, ParallelStyle]:
    """Column- then row-wise for each pair of ``nn.Linear`` inside an ``nn.Sequential``."""
    plan: dict[str, ParallelStyle] = {}
    for prefix, seq in module.named_modules():
        if not isinstance(seq, nn.Sequential):
            continue
        linears = [name for name, child in seq.named_children() if isinstance(child, nn.Linear)]
        for first, second in zip(linears[0::2], linears[1::2], strict=False):
            plan[_join(prefix, first)] = ColwiseParallel()
            plan[_join(prefix, second)] = RowwiseParallel()
    return plan


def check_plan(module: nn.Module, plan: TensorPlan, tensor: int) -> None:
    """Raise unless every entry of ``plan`` names a submodule and it is not empty.

    Raises:
        ValueError: naming the entry and what to do.
    """
    names = dict(module.named_modules())
    for name, style in plan.items():
        if name not in names:
            raise ValueError(
                f"tensor_plan[{name!r}]: the model has no submodule {name!r}; "
                "name submodules as model.named_modules() does"
            )
        if not isinstance(style, ParallelStyle):
            raise ValueError(
                f"tensor_plan[{name!r}] is {type(style).__name__}, not a ParallelStyle "
                "(ColwiseParallel(), RowwiseParallel(), ...)"
            )
        _check_divides(name, names[name], style, tensor)
    if not plan:
        raise ValueError(
            f"mesh tensor={tensor} but nothing to split: the model has no pair of nn.Linear "
            "inside an nn.Sequential; pass tensor_plan= (module name → ColwiseParallel() / "
            "RowwiseParallel())"
        )


def apply_plan(module: nn.Module, mesh: DeviceMesh, plan: TensorPlan) -> None:
    """Split ``module``'s planned layers over the 1-D ``mesh`` (in place)."""
    parallelize_module(module, mesh, dict(plan))


def _check_divides(name: str, layer: nn.Module, style: ParallelStyle, tensor: int) -> None:
    """A linear layer's split dimension must divide by ``tensor`` (DTensor's matmuls
    refuse uneven splits)."""
    if not isinstance(layer, nn.Linear):
        return
    if isinstance(style, ColwiseParallel):
        what, size = "out_features", layer.out_features
    elif isinstance(style, RowwiseParallel):
        what, size = "in_features", layer.in_features
    else:
        return
    if size % tensor:
        raise ValueError(
            f"tensor_plan[{name!r}] splits {what} = {size} of nn.Linear over tensor={tensor} "
            f"ranks, which does not divide it: make it a multiple of {tensor} or choose another "
            "tensor size"
        )


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
