"""Tensor parallelism with ``parallelize_module``: Megatron-style column/row splits.

Attention q/k/v and the MLP's first projection are column-parallel (heads and hidden units
sharded), the output projections row-parallel, so each block needs one all-reduce forward and
one backward. The token embedding is row-parallel over the vocabulary, the LM head column-
parallel with replicated logits. Norms and the position embedding stay replicated.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from antifragile.trainer.model import GPT


def apply_tp(model: GPT, tp_mesh: DeviceMesh) -> None:
    if tp_mesh.size() == 1:
        return
    if model.cfg.heads % tp_mesh.size():
        raise ValueError(f"heads {model.cfg.heads} not divisible by tp {tp_mesh.size()}")
    plan: dict[str, ParallelStyle] = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(),
                                                 output_layouts=Replicate())
    if model.output is not None:
        plan["output"] = ColwiseParallel(output_layouts=Replicate())
    if plan:
        parallelize_module(model, tp_mesh, plan)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attn.wq": ColwiseParallel(),
            "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(),
            "mlp.w1": ColwiseParallel(),
            "mlp.w2": RowwiseParallel(),
        })
