"""Data parallelism with FSDP2 (``fully_shard``) over the dp mesh dimension.

Each block is its own FSDP unit, then the stage's root module. With pipeline parallelism,
parameters stay unsharded between micro-batches (``reshard_after_forward=False``) so they
are gathered once per step, not once per micro-batch.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from antifragile.trainer.model import GPT


def apply_fsdp(model: GPT, dp_mesh: DeviceMesh, *, pipelined: bool) -> None:
    if dp_mesh.size() == 1:
        return
    reshard = not pipelined
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard)
