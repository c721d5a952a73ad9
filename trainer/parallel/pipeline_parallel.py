"""Pipeline parallelism with ``torch.distributed.pipelining`` (GPipe or 1F1B)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from antifragile.trainer.model import GPT

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def build_schedule(stage_model: GPT, pp_mesh: DeviceMesh, device: torch.device, *,
                   schedule: str, num_micro_batches: int,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> object:
    """The schedule driving this rank's stage; ``step()`` runs one batch through the pipe."""
    stage = PipelineStage(stage_model, pp_mesh.get_local_rank(), pp_mesh.size(), device,
                          group=pp_mesh.get_group())
    return SCHEDULES[schedule](stage, n_microbatches=num_micro_batches, loss_fn=loss_fn)
