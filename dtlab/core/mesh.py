"""One mesh value for every layout: each parallelism's degree on a named axis, the ranks' grid, one DeviceMesh.

A ``Layout`` names its axes outermost first (``Layout.of(pp=2, dp=2, tp=2)``), as picotron's
``torch.arange(world).view(pp, dp, tp)`` and torchtitan's ``ParallelDims`` do: ``grid()`` is that tensor, which a
learner can print; a rank's coordinates are read off it, never computed by hand; ``build`` is the one place that
calls ``init_device_mesh`` (with the same shape and names), and a tier takes each axis's sub-mesh from what it
returns (``mesh["tp"]``). ``check`` raises the field-naming errors a tier's ``validate`` gives before any process
starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["Layout"]


@dataclass(frozen=True)
class Layout:
    """The axes of a mesh and their degrees, outermost first: ``(("pp", 2), ("dp", 1), ("tp", 2))``."""

    axes: tuple[tuple[str, int], ...]

    @classmethod
    def of(cls, **degrees: int) -> Layout:
        """A layout from keywords, in their order: ``Layout.of(dp=2, tp=2)`` (rank = dp index * 2 + tp index)."""
        return cls(tuple(degrees.items()))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.axes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(degree for _, degree in self.axes)

    @property
    def world(self) -> int:
        return math.prod(self.shape)

    def check(self, world_size: int, where: str) -> None:
        """ValueError naming the field (``where.NAME``) unless every degree is an integer >= 1 and they multiply
        to ``world_size``."""
        for name, degree in self.axes:
            if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
                raise ValueError(f"{where}.{name}={degree!r} is invalid: must be an integer >= 1")
        if self.world != world_size:
            product = " x ".join(f"{name}={degree}" for name, degree in self.axes)
            names = ", ".join(self.names[:-1]) + f" and {self.names[-1]}" if len(self.axes) > 1 else self.names[0]
            raise ValueError(f"{where}: {product} = {self.world} ranks, but world_size={world_size}: choose "
                             f"{names} whose product is the world size")

    def grid(self) -> torch.Tensor:
        """Every rank at its place: ``torch.arange(world).view(shape)``, the numbering ``init_device_mesh`` uses."""
        return torch.arange(self.world).view(self.shape)

    def coordinates(self, rank: int) -> dict[str, int]:
        """``rank``'s index on each axis, read off the grid."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is not on a mesh of {self.world} ranks")
        place = (self.grid() == rank).nonzero()[0].tolist()
        return dict(zip(self.names, place))

    def build(self, device_type: str) -> DeviceMesh:
        """The DeviceMesh (one process group per axis, made by torch): each rank calls it once, in ``wrap``."""
        return init_device_mesh(device_type, self.shape, mesh_dim_names=self.names)
