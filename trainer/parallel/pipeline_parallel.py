"""Pipeline parallelism with ``torch.distributed.pipelining`` (GPipe or 1F1B).

Each stage is given the shapes of what it receives and sends (static mode), so its first step
does not infer them at run time: that inference is an extra exchange of pickled metadata
through the whole pipeline on the first step of every build, which an in-process recovery
(every rank rebuilds its stage) pays on its recovery path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from antifragile.trainer.model import GPT

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def build_schedule(stage_model: GPT, pp_mesh: DeviceMesh, device: torch.device, *,
                   schedule: str, num_micro_batches: int, micro_batch_size: int,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> object:
    """The schedule driving this rank's stage; ``step()`` runs one batch through the pipe.
    ``micro_batch_size``: rows per micro-batch (every batch has the same shape)."""
    cfg = stage_model.cfg
    index, stages = pp_mesh.get_local_rank(), pp_mesh.size()
    tokens = (micro_batch_size, cfg.seq_len)
    hidden = torch.empty(*tokens, cfg.d_model, device="meta")
    # a received activation needs its gradient (sent back to the previous stage): without
    # requires_grad here the stage computes none, and the earlier stages train on zeros
    inputs = (torch.empty(tokens, dtype=torch.long, device="meta") if index == 0
              else hidden.clone().requires_grad_())
    outputs = torch.empty(*tokens, cfg.vocab, device="meta") if index == stages - 1 else hidden
    stage = PipelineStage(stage_model, index, stages, device, input_args=inputs,
                          output_args=outputs, group=pp_mesh.get_group(),
                          input_grads=None if index == 0 else hidden,
                          output_grads=None if index == stages - 1 else hidden)
    return SCHEDULES[schedule](stage, n_microbatches=num_micro_batches, loss_fn=loss_fn)
