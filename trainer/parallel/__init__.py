"""The three parallel axes, one module each: data (FSDP2), tensor, pipeline."""

from antifragile.trainer.parallel.data_parallel import apply_fsdp
from antifragile.trainer.parallel.dims import ParallelDims
from antifragile.trainer.parallel.pipeline_parallel import build_schedule
from antifragile.trainer.parallel.tensor_parallel import apply_tp

__all__ = ["ParallelDims", "apply_fsdp", "apply_tp", "build_schedule"]
