"""The (dp, pp, tp) mesh and this rank's coordinates on it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(kw_only=True, slots=True, frozen=True)
class ParallelDims:
    dp: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def build_mesh(self, device: torch.device) -> DeviceMesh:
        """Mesh dims in the order ("dp", "pp", "tp"): tp is innermost (fastest links)."""
        return init_device_mesh(device.type, (self.dp, self.pp, self.tp),
                                mesh_dim_names=("dp", "pp", "tp"))
