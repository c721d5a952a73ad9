"""Reading one committed step into a load target (``CheckpointEngine.load`` tries the steps,
this reads one), and a whole step into fresh tensors (``CheckpointEngine.read``)."""

from __future__ import annotations

import logging
import math
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass
from typing import Any

import torch

from ._dtypes import as_bytes
from ._memory import MemoryCopy
from ._restore import Sources, check_attributes, read_values
from ._state import FlatState, iter_local
from .errors import CheckpointMismatchError
from .load import StepReader, StoredTensor
from .plan import HeldBox, local_boxes
from .storage import Storage

log = logging.getLogger("antifragile.engine")


@dataclass
class Filled:
    """What a step gave the target: the JSON values (and bytes, and rebuilt sub-trees) to hand
    to the state's objects, the nonce of the save read, and where the tensors' bytes came
    from."""

    values: dict[str, Any]
    nonce: int
    storage_bytes: int
    memory_bytes: int


def _raise_first(futures: list[Future[None]]) -> None:
    wait(futures)
    for future in futures:
        error = future.exception()
        if error is not None:
            raise error


def _whole(stored: StoredTensor) -> tuple[torch.Tensor, HeldBox]:
    """A fresh tensor for all of ``stored`` and the box that covers it (a plain tensor's one
    box, as ``local_boxes`` gives it)."""
    tensor = torch.empty(stored.shape, dtype=stored.dtype)
    (box,) = local_boxes(tensor, path=stored.path)
    return tensor, box


def _memory_of(local: torch.Tensor) -> tuple[Any, ...]:
    """What makes two tensors one memory (tied weights: two state paths, one tensor)."""
    return (local.device, local.untyped_storage().data_ptr(), local.storage_offset(),
            tuple(local.shape), tuple(local.stride()), local.dtype)


def _shared(locals_: list[torch.Tensor]) -> list[list[int]]:
    """For each tensor, the earlier ones whose span of memory meets its own (so they may share
    elements: tied weights, a slice of another target, a transpose), by index. One sort and a
    sweep: a state of thousands of tensors in one flat buffer, side by side, shares none."""
    spans = []
    for i, local in enumerate(locals_):
        if local.numel():
            start = local.data_ptr()
            end = start + local.element_size() * (1 + sum(
                (n - 1) * s for n, s in zip(local.shape, local.stride())))
            spans.append(((local.device, local.untyped_storage().data_ptr()), start, end, i))
    spans.sort(key=lambda span: (str(span[0][0]), span[0][1], span[1]))
    earlier: list[list[int]] = [[] for _ in locals_]
    active: list[tuple[Any, int, int, int]] = []  # spans met so far that reach past the start
    for span in spans:
        active = [a for a in active if a[0] == span[0] and a[2] > span[1]]
        for other in active:
            first, later = sorted((other[3], span[3]))
            earlier[later].append(first)
        active.append(span)
    return [sorted(found) for found in earlier]


def _check_tied(step: int, paths: list[str], locals_: list[torch.Tensor],
                tied: list[tuple[int, torch.Tensor, list[int]]]) -> None:
    """Fill the targets that were read apart (``tied``: a target's index, what was read for
    it, the earlier targets whose memory it shares) and check that every one of them holds
    what the step holds for it: targets that share memory must agree on the elements they
    share. One tensor at two paths is compared as it is (no write); a target that shares
    part of another's memory (a slice, a transpose) is written, and then every target
    involved must still hold what was read for it."""
    def mismatch(first: int, later: int) -> CheckpointMismatchError:
        return CheckpointMismatchError(
            f"step {step}: target tensors {paths[first]!r} and {paths[later]!r} share memory "
            "(tied), and the step holds different data for them (saved untied); load into "
            "separate tensors")

    apart = {index for index, _, _ in tied}
    written = []
    for index, read, shares in tied:
        if len(shares) == 1 and _memory_of(locals_[shares[0]]) == _memory_of(locals_[index]):
            if not torch.equal(as_bytes(read), as_bytes(locals_[index].contiguous())):
                raise mismatch(shares[0], index)
        else:
            written.append((index, read, shares))
    # the targets read in place that the written ones share memory with, as they were read
    kept = {other: as_bytes(locals_[other].clone(memory_format=torch.contiguous_format))
            for _, _, shares in written for other in shares if other not in apart}
    for index, read, _ in written:
        locals_[index].copy_(read)
    for index, read, shares in written:  # one written later over it
        if not torch.equal(as_bytes(locals_[index].contiguous()), as_bytes(read)):
            raise mismatch(index, next((i for i, _, s in written if index in s), shares[0]))
    for other, was in kept.items():
        if not torch.equal(as_bytes(locals_[other].contiguous()), was):
            raise mismatch(other, next(i for i, _, s in written if other in s))


def fill_step(storage: Storage, step: int, flat: FlatState, rank: int, pool: Executor,
              memory: MemoryCopy | None = None, reader: StepReader | None = None) -> Filled:
    """Check the step against the target, read every array's metadata (concurrently), plan
    every read (coverage checked), then run the reads and wait for all of them: no read of a
    step that failed can still be running when the next step is tried. ``memory``: see
    ``CheckpointEngine.load``; ``reader``: the step opened already (else opened here)."""
    reader = reader or StepReader(storage, step)
    sources = Sources(reader, flat, rank)
    targets = []
    for path, tensor in flat.tensors.items():
        if path not in sources.fill:
            continue  # bytes, or state the checkpoint rightly lacks: see Sources
        stored = reader.tensors[sources.fill[path]]
        if stored.dtype != tensor.dtype:
            raise CheckpointMismatchError(
                f"step {step}, tensor {path!r}: stored dtype {stored.dtype}, target "
                f"dtype {tensor.dtype} (load into a matching tensor, then convert)")
        if stored.shape != tuple(tensor.shape):
            raise CheckpointMismatchError(
                f"step {step}, tensor {path!r}: stored shape {list(stored.shape)}, "
                f"target shape {list(tensor.shape)}")
        targets.append((path, tensor, stored))
    in_memory = _from_memory(memory, reader, targets)
    reader.load_arrays([stored for _, _, stored in targets if stored.path not in in_memory]
                       + [reader.tensors[name] for name in sorted(sources.whole)], pool)
    reads = []
    whole: dict[str, torch.Tensor] = {}
    locals_ = [iter_local(tensor) for _, tensor, _ in targets]
    tied: list[tuple[int, torch.Tensor, list[int]]] = []  # see _check_tied
    from_memory: list[tuple[str, torch.Tensor]] = []  # (stored path, where its copy goes)
    from_storage: list[torch.Tensor] = []
    with torch.no_grad():
        for index, ((path, tensor, stored), local, shares) in enumerate(
                zip(targets, locals_, _shared(locals_))):
            into = local
            if shares:  # read apart: two reads into one memory fail each other's crc32c
                into = torch.empty(local.shape, dtype=local.dtype, device=local.device)
                tied.append((index, into, shares))
            if stored.path in in_memory:  # filled once the reads are done, tied ones apart too
                from_memory.append((stored.path, into))
                continue
            from_storage.append(local)
            for box in local_boxes(tensor, path=path, target=True):
                region = into[tuple(slice(o, o + n)
                                    for o, n in zip(box.local_offset, box.shape))]
                reads += reader.read_box(stored, box, region)
        for name in sorted(sources.whole):
            whole[name], box = _whole(reader.tensors[name])
            reads += reader.read_box(reader.tensors[name], box, whole[name])
    _raise_first([pool.submit(read) for read in reads])
    memory_bytes = 0
    for stored_path, into in from_memory:
        assert memory is not None
        memory_bytes += memory.fill(stored_path, into)
    with torch.no_grad():
        _check_tied(step, [path for path, _, _ in targets], locals_, tied)
    storage_bytes = sum(math.prod(t.shape) * t.element_size() for t in from_storage)
    return Filled(sources.values(whole), int(reader.commit["nonce"]), storage_bytes,
                  memory_bytes)


def _from_memory(memory: MemoryCopy | None, reader: StepReader,
                 targets: list[tuple[str, torch.Tensor, Any]]) -> dict[str, torch.Tensor]:
    """The targets ``memory`` fills (stored path -> target tensor): all of them when it holds
    this very save of the step and its bytes match the manifest, else none."""
    if memory is None or memory.step != reader.step or \
            memory.nonce != int(reader.commit["nonce"]):
        return {}
    covered = {stored.path: tensor for _, tensor, stored in targets
               if memory.covers(stored.path, tensor)}
    if len(covered) != len(targets):
        return {}  # another layout: read everything (one source keeps the load simple)
    unusable = memory.check(reader.manifest.crcs, set(covered))
    if unusable is not None:
        log.warning("step %d: the copy in memory is not used: %s; reading the step from "
                    "storage", reader.step, unusable)
        return {}
    return covered


def read_whole(storage: Storage, step: int, pool: Executor) -> dict[str, Any]:
    """Every tensor of ``step`` as a whole plain CPU tensor, and every JSON value, keyed by
    state path, and the type record (``TYPES_PATH``, which no state path can be): what a
    load makes of the JSON values, containers and bytes (tuples, int keys, bytes or
    bytearray), without which two checkpoints that load differently would read the same.
    What was saved per rank (it differed between ranks) is keyed by ``rank_array``, one entry
    per rank that saved a copy, for values as for tensors: the lowest rank's copy alone would
    hide the others from a comparison of two checkpoints."""
    reader = StepReader(storage, step)
    # the type records as a load checks them: a record that does not fit its values (not an
    # object, a description of another type) must not give the stored str of a float back
    check_attributes(reader)
    out: dict[str, Any] = {}
    with reader.unless_gone():  # a step deleted meanwhile is not damaged
        reader.load_arrays(list(reader.tensors.values()), pool)
        reads = []
        for path, stored in reader.tensors.items():
            out[path], box = _whole(stored)
            reads += reader.read_box(stored, box, out[path])
        _raise_first([pool.submit(read) for read in reads])
    return {**read_values(reader), **out}
