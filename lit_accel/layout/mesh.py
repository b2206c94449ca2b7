"""``ParallelLayout``: how the world's ranks divide into pipeline, data (replicated x sharded) and tensor dimensions.

The mesh is ``(pipeline, data_replicate, data_shard, tensor)``, tensor innermost so that a tensor-parallel group is
made of neighbouring ranks (one node's fast links on a GPU cluster), pipeline outermost as in torchtitan's
``ParallelDims``. The data-parallel size is what is left of the world once the other sizes are given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["DIM_NAMES", "ParallelLayout"]

DIM_NAMES = ("pipeline", "data_replicate", "data_shard", "tensor")


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of the four mesh dimensions; their product is the world size."""

    pipeline: int
    data_replicate: int
    data_shard: int
    tensor: int

    @classmethod
    def from_world(cls, owner: str, world_size: int, pipeline: int, tensor: int, data_replicate: int) -> ParallelLayout:
        """The layout with the data-sharded size inferred from ``world_size``.

        Raises:
            ValueError: the given sizes do not divide the world size.
        """
        given = pipeline * tensor * data_replicate
        if world_size % given:
            raise ValueError(
                f"{owner}(pipeline_parallel={pipeline}, tensor_parallel={tensor}, data_replicate={data_replicate})"
                f" needs a world size that is a multiple of {given}, got {world_size} processes. Fix: run"
                f" {_multiples(given, world_size)} processes, or choose sizes whose product divides {world_size}."
            )
        return cls(pipeline, data_replicate, world_size // given, tensor)

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        """The mesh shape, in the order of :data:`DIM_NAMES`."""
        return (self.pipeline, self.data_replicate, self.data_shard, self.tensor)

    @property
    def data(self) -> int:
        """Ranks that see different samples: replicated x sharded."""
        return self.data_replicate * self.data_shard

    @property
    def world_size(self) -> int:
        """Ranks in the mesh."""
        return self.pipeline * self.data * self.tensor

    def coordinates(self, rank: int) -> tuple[int, int, int, int]:
        """``rank``'s index along each dimension (row-major, tensor innermost)."""
        coords = []
        for size in reversed(self.sizes):
            coords.append(rank % size)
            rank //= size
        return tuple(reversed(coords))  # type: ignore[return-value]

    def data_rank(self, rank: int) -> int:
        """Which data-parallel replica ``rank`` belongs to: the ranks of one replica load the same samples."""
        _, replicate, shard, _ = self.coordinates(rank)
        return replicate * self.data_shard + shard

    def describe(self) -> str:
        """One line, e.g. ``pipeline 2 x data 2 (sharded) x tensor 2 = 8 processes``."""
        data = f"data {self.data_shard} (sharded)"
        if self.data_replicate > 1:
            data = f"data {self.data_replicate} (replicated) x {self.data_shard} (sharded)"
        return f"pipeline {self.pipeline} x {data} x tensor {self.tensor} = {self.world_size} processes"

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The four-dimensional device mesh (one process group per dimension); every rank must call it."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, self.sizes, mesh_dim_names=DIM_NAMES)

    def data_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The mesh FSDP shards over: 1-D (sharded), or 2-D (replicated, sharded: HSDP) with ``data_replicate > 1``."""
        if self.data_replicate > 1:
            return mesh["data_replicate", "data_shard"]
        return mesh["data_shard"]


def _multiples(step: int, near: int) -> str:
    below = max(step, near // step * step)
    above = -(-near // step) * step
    return str(below) if below == above else f"{below} or {above}"
