"""``checkpoint.engine: dcp``: torch.distributed.checkpoint over the trainer's FQN-keyed state.

``<url>/step_<n>/`` holds one ``__<rank>_<i>.distcp`` per rank and ``.metadata``. DCP's
coordinator writes ``.metadata`` only after it has gathered every rank's write results, to
``.metadata.tmp`` first and then renamed (``FileSystemWriter.finish``): ``.metadata`` present
means committed. DCP keeps no checksums of its own: damage is found only when a file no longer
parses (truncated, deleted, or a flip that breaks ``torch.load``); a flip inside tensor bytes
loads silently, and only the chaos checker's comparison with the reference run sees it.
DCP's own ``CheckpointException`` derives from ``BaseException``, hence the explicit catches.
``.metadata`` is a pickle: reading a DCP checkpoint unpickles it, as DCP always does.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from antifragile.engine import CheckpointError
from antifragile.trainer.ckpt_backends.base import (
    MARKERS,
    PeerBackend,
    PeerHandle,
    committed,
    done_future,
    failed_future,
    first_line,
    flat,
    load_newest,
    local_root,
    prune,
    step_name,
)

MARKER = MARKERS["dcp"]


class DcpBackend(PeerBackend):
    name = "dcp"
    marker = MARKER  # two async_saves in flight would interleave their collectives: no overlap

    def save(self, step: int, state: dict[str, Any]) -> PeerHandle:
        path = str(self.root / step_name(step))
        t0 = time.perf_counter()
        if self.async_:  # stages a CPU copy, then plans and writes in DCP's own thread
            future = dcp.async_save(state, checkpoint_id=path, process_group=self.group.pg)
            return PeerHandle(step, future, stall_s=time.perf_counter() - t0, sizes=self._sizes)
        try:
            future = done_future(dcp.save(state, checkpoint_id=path,
                                          process_group=self.group.pg))
        except (Exception, CheckpointException) as exc:  # reported as ckpt_failed
            future = failed_future(exc)
        return PeerHandle(step, future, stall_s=time.perf_counter() - t0, sizes=self._sizes,
                          started_t=t0)

    def _sizes(self, metadata: Metadata) -> tuple[int, int]:
        """(bytes this rank's files hold, bytes of the checkpoint); rank 0 then prunes."""
        infos = list((metadata.storage_data or {}).values())
        mine = sum(i.length for i in infos if i.relative_path.startswith(
            f"__{self.group.rank}_"))
        if self.group.rank == 0:
            prune(self.root, MARKER, self.keep_last)
        return mine, sum(i.length for i in infos)

    def load(self, state: dict[str, Any], memory: Any = None) -> tuple[int, list[str]]:
        def load_one(step: int) -> None:
            dcp.load(state, checkpoint_id=str(self.root / step_name(step)),
                     process_group=self.group.pg)

        return load_newest("DCP", self.root, self.candidates(), self.group, load_one, _why)

    def close(self) -> None:
        """Nothing to release: the trainer waits for the save in flight before closing."""


def _why(exc: BaseException) -> str:
    """DCP gathers every rank's failure into one exception: name the first rank's."""
    failures = getattr(exc, "failures", None)
    if isinstance(exc, CheckpointException) and failures:
        rank, (error, _) = min(failures.items())
        return f"rank {rank}: {first_line(error)}"
    return first_line(exc)


def steps(url: str) -> list[int]:
    return committed(local_root(url), MARKER)


def read(url: str, step: int) -> dict[str, Any]:
    """Every entry of a committed step as whole plain tensors and values, keyed like
    ``CheckpointEngine.read`` (``model/<fqn>``), in one process without a process group."""
    path = local_root(url) / step_name(step)
    if not (path / MARKER).is_file():
        raise CheckpointError(f"{path}: no committed DCP checkpoint (no {MARKER})")
    state: dict[str, Any] = {}
    # what torch's own dcp_to_torch_save does (public dcp.load warns when dist is not up)
    _load_state_dict(state, storage_reader=dcp.FileSystemReader(str(path)),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return flat(state)


def data_files(url: str, step: int) -> list[Path]:
    """The files holding a committed step's tensor bytes (one or more per rank)."""
    return sorted((local_root(url) / step_name(step)).glob("*.distcp"))
