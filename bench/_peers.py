"""The baselines the engine is measured against: an O_DIRECT sequential write, torch.save, DCP
and torchsnapshot, and a checkpoint saved by two gloo processes (for the resharded load)."""

from __future__ import annotations

import errno
import inspect
import os
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from antifragile.engine import CheckpointEngine
from antifragile.engine.storage._local import _fsync  # the engine's own, for its peers
from bench._machine import timed
from bench._state import map_tensors

DIRECT_BLOCK_BYTES = 64 * 2**20


@contextmanager
def single_rank_group(root: str) -> Iterator[None]:
    """A 1-rank gloo process group (DCP's async_save requires one), on a FileStore."""
    store = dist.FileStore(os.path.join(root, "pg-store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class DirectIORefused(OSError):
    """The O_DIRECT baseline could not write with O_DIRECT where it was asked to."""

    @staticmethod
    def of(path: str, exc: OSError) -> DirectIORefused:
        return DirectIORefused(exc.errno, f"the file system refused O_DIRECT ({exc.strerror}); "
                               "no buffered write is timed in its place", path)


class DirectWriter:
    """Sequential O_DIRECT writes of ``nbytes`` from a page-aligned buffer in 64 MiB requests.

    The buffer is the engine's staging arena after its first save (the same bytes, laid out as
    the objects it writes), so the baseline needs no memory of its own and no copy inside the
    timing: the figure is what the disk takes for one sequential stream of this size, fsync
    of the file and of its folder (its new entry) included, as the engine's persist includes
    its own.
    """

    def __init__(self, buffer: memoryview, nbytes: int) -> None:
        self.nbytes = nbytes
        self.buffer = buffer

    @staticmethod
    def of(ckpt: CheckpointEngine) -> DirectWriter:
        arena = ckpt._staging.arena if ckpt._staging is not None else None
        if arena is None:
            raise RuntimeError("the engine has not staged yet")
        buffer = memoryview(arena.numpy())
        return DirectWriter(buffer, len(buffer))

    def write(self, path: str) -> None:
        """Raises :class:`DirectIORefused` where the file system refuses O_DIRECT (EINVAL at
        the open or the first write, as tmpfs did): no buffered write is timed in its place."""
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                raise DirectIORefused.of(path, exc) from exc
            raise
        try:
            done = 0
            while done < self.nbytes:
                try:
                    done += os.write(fd, self.buffer[done : done + DIRECT_BLOCK_BYTES])
                except OSError as exc:
                    if exc.errno == errno.EINVAL:
                        raise DirectIORefused.of(path, exc) from exc
                    raise
            os.fsync(fd)
        finally:
            os.close(fd)
        _fsync(os.path.dirname(os.path.abspath(path)))  # its entry, as the engine's files'

    def close(self) -> None:
        self.buffer.release()


def fsync_tree(path: str) -> None:
    """Make what a peer wrote at ``path`` durable, as the engine makes its own: every file and
    folder under it, and its entry in the parent folder. Not ``os.sync()``, which also waits
    for every other process's dirty pages on every file system."""
    if os.path.isdir(path):
        for folder, dirs, files in os.walk(path, topdown=False):
            for name in (*files, *dirs):
                _fsync(os.path.join(folder, name))
    _fsync(path)
    _fsync(os.path.dirname(os.path.abspath(path)))


def torch_save_fsync(state: dict[str, Any], path: str) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
    fsync_tree(path)


#: DCP's writer threads: as many as the engine's default ``io_threads``. DCP's own default
#: (1) would hold it to one file at a time while the engine writes several
DCP_THREADS = int(inspect.signature(CheckpointEngine).parameters["io_threads"].default)


def _dcp_writer(path: str) -> Any:
    import torch.distributed.checkpoint as dcp

    return dcp.FileSystemWriter(path, thread_count=DCP_THREADS)  # fsyncs each file


def dcp_save_sync(state: dict[str, Any], path: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=_dcp_writer(path))
    fsync_tree(path)  # and the folders (its files again: nothing left to flush)


def torchsnapshot_take_sync(state: dict[str, Any], path: str) -> None:
    from torchsnapshot import Snapshot, StateDict

    Snapshot.take(path, {k: StateDict(**v) for k, v in state.items()})
    fsync_tree(path)  # torchsnapshot's fs plugin does not fsync


def engine_load(url: str, target: dict[str, Any]) -> None:
    with CheckpointEngine(url, keep_last=None) as ckpt:
        ckpt.load(target)


def dcp_async_save(state: dict[str, Any], path: str) -> Future[Any]:
    import torch.distributed.checkpoint as dcp

    response = dcp.async_save(state, storage_writer=_dcp_writer(path))
    return response if isinstance(response, Future) else response.upload_completion


def _sharded_save_worker(rank: int, url: str, store_path: str, state: dict[str, Any]) -> None:
    """Rank ``rank`` of 2: hold the Shard(0) half of every tensor of ``state`` (shared memory,
    not copied) as a DTensor on a 1-D mesh of 2, and save it as step 1."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))

        def shard(t: torch.Tensor) -> torch.Tensor:
            local = torch.chunk(t, 2, dim=0)[rank]
            return DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False, shape=t.shape, stride=t.stride()
            )

        with CheckpointEngine(url, keep_last=None) as ckpt:
            ckpt.save(1, map_tensors(state, shard), blocking=True)
    finally:
        dist.destroy_process_group()


def save_two_rank_checkpoint(url: str, store_path: str, state: dict[str, Any]) -> float:
    """Spawn a 2-process gloo group on this host that saves ``state`` sharded; its seconds."""
    import torch.multiprocessing as tmp

    shared = map_tensors(state, lambda t: t.clone().share_memory_())
    return timed(
        lambda: tmp.start_processes(
            _sharded_save_worker, args=(url, store_path, shared), nprocs=2, start_method="spawn"
        )
    )
