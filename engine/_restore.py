"""Where each entry of a load target comes from in a committed step, and what it becomes.

The semantics are those of ``_state`` (its docstring): tensors the target holds are filled in
place from the stored array of the same path (or, for a tensor saved per rank, this rank's
copy); ``bytes`` and entries holding no tensor are replaced by what was saved at their path: a
JSON value with its types restored, bytes, or the saved sub-tree rebuilt. Everything read from
the step's attributes is validated; a malformed type record or per-rank index is corruption.

World-size change policy: a value or tensor that was saved per rank (JSON values that differed
between ranks, plain tensors that differed) is loaded by each rank from its own copy; a rank
that saved no copy (more ranks than saved, or a rank that held none) gets the lowest saved
rank's copy, and one RuntimeWarning per load names the rank and every such path.
"""

from __future__ import annotations

import json
import math
import struct
import warnings
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ._paths import is_index
from ._ranks import rank_array
from ._state import TYPES_PATH, FlatState
from .errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from .load import StepReader

_Leaf = tuple[str, Any, Any]  # ("tensor" | "bytes" | "value", source, description)


class Sources:
    """The sources of one target in one step, for this rank. Raises CheckpointMismatchError
    for an entry the target names that the step lacks."""

    def __init__(self, reader: StepReader, flat: FlatState, rank: int) -> None:
        self.reader, self.rank, self.step = reader, rank, reader.step
        self.per_rank = self._per_rank_index(reader.attrs.get("per_rank"))
        self.borrowed: list[tuple[str, int]] = []  # (path, the rank whose copy it gets)
        self._described: dict[str, Any] | None = None  # the lowest rank's description, by path
        found, types = self._saved_value(TYPES_PATH, record=False)
        self.types = self._check_types(types) if found else None
        self.fill: dict[str, str] = {}  # target tensor path -> stored tensor path
        self.whole: set[str] = set()  # stored tensor paths read whole
        self._leaves: dict[str, _Leaf | dict[str, Any]] = {}  # target path -> what it gets
        missing: dict[Any, list[str]] = {hook: [] for hook in flat.optional.values()}
        for path, tensor in flat.tensors.items():
            if path in flat.binary:
                continue
            source = self._tensor_source(path, tensor)
            if source is not None:
                self.fill[path] = source
            elif path in flat.optional:
                missing.setdefault(flat.optional[path], []).append(path)
            else:
                raise CheckpointMismatchError(f"step {self.step} has no tensor {path!r}")
        for path in flat.binary:
            source = self._tensor_source(path, None)
            # bytes hold no tensor: where none were saved, the entry takes the value or
            # sub-tree saved at its path, as a JSON value of the target does
            leaf = (self._bytes_leaf(path, source) if source is not None
                    else self._value_leaf(path))
            if leaf is None:
                raise CheckpointMismatchError(f"step {self.step} has no bytes {path!r}")
            self._leaves[path] = leaf
        for path in flat.values:
            if path == TYPES_PATH:
                continue
            leaf = self._value_leaf(path)
            if leaf is not None:
                self._leaves[path] = leaf
            elif path in flat.optional:
                missing.setdefault(flat.optional[path], []).append(path)
            else:
                raise CheckpointMismatchError(f"step {self.step} has no value {path!r}")
        for hook, paths in missing.items():
            try:
                hook(paths)
            except CheckpointError as exc:
                raise CheckpointMismatchError(f"step {self.step}: {exc}") from None

    # -- what the step's attributes say ------------------------------------------------------

    def _per_rank_index(self, index: object) -> dict[str, list[int]]:
        if index is None:
            return {}
        if not isinstance(index, dict) or not all(
                isinstance(ranks, list) and ranks
                and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks)
                for ranks in index.values()):
            raise CheckpointCorruptError(f"step {self.step}: malformed per-rank index")
        return index

    def _check_types(self, types: object) -> dict[str, dict[str, Any]]:
        if not isinstance(types, dict) or not all(
                isinstance(types.get(k), dict) for k in ("containers", "values", "bytes")):
            raise CheckpointCorruptError(f"step {self.step}: malformed type record")
        return types

    def _saved_value(self, path: str, record: bool = True) -> tuple[bool, Any]:
        by_rank = self.reader.values_by_rank.get(path)
        if by_rank:
            if str(self.rank) in by_rank:
                return True, by_rank[str(self.rank)]
            if not all(isinstance(r, str) and is_index(r) for r in by_rank):
                raise CheckpointCorruptError(f"step {self.step}: malformed per-rank values of "
                                             f"{path!r}")
            lowest = min(by_rank, key=int)
            if record:
                self.borrowed.append((path, int(lowest)))
            return True, by_rank[lowest]
        if path in self.reader.values:
            return True, self.reader.values[path]
        return False, None

    def _description(self, path: str) -> Any:
        """The type description of the value saved at ``path`` (found by ``_saved_value``),
        from the record of a rank that saved it: a copy borrowed from another rank by that
        rank's record; a value this rank's record does not describe (saved by other ranks
        only) by the lowest rank's record that does. The coordinator keeps per rank a value
        whose descriptions differ, so a shared value has one (format 4 stores a non-finite
        float as a str: without its description, a rank got the str)."""
        by_rank = self.reader.values_by_rank.get(path)
        if by_rank and str(self.rank) not in by_rank:
            return self._descriptions(min(by_rank, key=int)).get(path)
        own = self.types["values"].get(path) if self.types else None
        if own is not None or by_rank:
            return own
        if self._described is None:  # once per load: a step may have thousands of records
            records = self.reader.values_by_rank.get(TYPES_PATH) or {}
            self._described = {}
            for rank in sorted((r for r in records if is_index(r)), key=int, reverse=True):
                self._described.update(self._descriptions(rank))
        return self._described.get(path)

    def _descriptions(self, rank: str) -> dict[str, Any]:
        """The value descriptions of ``rank``'s type record ({} in a step without any)."""
        records = self.reader.values_by_rank.get(TYPES_PATH) or {}
        types = records[rank] if rank in records else self.reader.values.get(TYPES_PATH)
        return {} if types is None else self._check_types(types)["values"]

    def _tensor_source(self, path: str, target: torch.Tensor | None) -> str | None:
        holders = self.per_rank.get(path)
        if holders is None:
            return path if path in self.reader.tensors else None
        if isinstance(target, DTensor):
            raise CheckpointMismatchError(f"step {self.step}, tensor {path!r}: saved per rank "
                                          "(it differed between ranks); load it into a plain "
                                          "tensor")
        source_rank = self.rank if self.rank in holders else min(holders)
        if source_rank != self.rank:
            self.borrowed.append((path, source_rank))
        name = rank_array(path, source_rank)
        if name not in self.reader.tensors:
            raise CheckpointCorruptError(f"step {self.step}: per-rank tensor {name!r} is not "
                                         "in the tensor index")
        return name

    # -- leaves ------------------------------------------------------------------------------

    def _bytes_leaf(self, path: str, source: str) -> _Leaf:
        stored = self.reader.tensors[source]
        kind = (self.types or {}).get("bytes", {}).get(path)
        if stored.dtype != torch.uint8 or len(stored.shape) != 1 or (
                self.types is not None and kind not in ("bytes", "bytearray")):
            raise CheckpointMismatchError(f"step {self.step}: {path!r} was not saved as bytes")
        self.whole.add(source)
        return ("bytes", source, kind)

    def _value_leaf(self, path: str) -> _Leaf | dict[str, Any] | None:
        found, value = self._saved_value(path)
        if found:
            return ("value", value, self._description(path))
        # a tensor or bytes saved at the path itself (a fresh object holds None where a used
        # one holds its generator state or cursor)
        source = (self._tensor_source(path, None) if path in self.per_rank
                  else path if path in self.reader.tensors else None)
        if source is not None:
            if path in (self.types["bytes"] if self.types else ()):
                return self._bytes_leaf(path, source)
            self.whole.add(source)
            return ("tensor", source, None)
        subtree = self._subtree(path)
        return subtree if subtree is not None else self._inside_value(path)

    def _inside_value(self, path: str) -> _Leaf | None:
        """The part at ``path`` of a JSON value saved whole at an ancestor of it (a container
        that held no tensor nor bytes when saved, which the target walks entry by entry as it
        holds bytes now), with its type description; None if there is none."""
        parts = path.split("/")
        for cut in range(len(parts) - 1, 0, -1):
            ancestor = "/".join(parts[:cut])
            found, value = self._saved_value(ancestor)
            if not found:
                continue
            desc = self._description(ancestor)
            for name in parts[cut:]:
                if isinstance(value, dict) and name in value:
                    value = value[name]
                elif isinstance(value, list) and is_index(name) and int(name) < len(value):
                    value = value[int(name)]
                else:
                    return None
                children = desc[-1] if isinstance(desc, list) and desc else None
                desc = children.get(name) if isinstance(children, dict) else None
            return ("value", value, desc)
        return None

    def _subtree(self, path: str) -> dict[str, Any] | None:
        """The saved entries under ``path`` as a nested dict of leaves, or None if none."""
        prefix = f"{path}/"
        leaves: dict[str, _Leaf] = {}
        for name in self.reader.tensors:
            parent = name.rsplit("/", 1)[0]
            if name.startswith(prefix) and parent not in self.per_rank:
                leaves[name] = ("tensor", name, None)
        for name in self.per_rank:
            if name.startswith(prefix):
                source = self._tensor_source(name, None)
                assert source is not None
                leaves[name] = ("tensor", source, None)
        for name in self.types["bytes"] if self.types else ():
            if name in leaves:
                leaves[name] = self._bytes_leaf(name, leaves[name][1])
        for name in (*self.reader.values, *self.reader.values_by_rank):
            if name.startswith(prefix) and name not in leaves:
                leaf = self._value_leaf(name)
                assert leaf is not None
                leaves[name] = leaf  # type: ignore[assignment]
        if not leaves:
            return None
        if self.types is None:
            raise CheckpointMismatchError(
                f"step {self.step} has no value {path!r}, only entries under it, and was "
                "written before type records: load it into a target that names them")
        for leaf in leaves.values():
            if leaf[0] == "tensor":
                self.whole.add(leaf[1])
        tree: dict[str, Any] = {}
        for name, leaf in leaves.items():
            node = tree
            parts = name[len(prefix):].split("/")
            for part in parts[:-1]:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    raise CheckpointCorruptError(f"step {self.step}: {name!r} lies under a leaf")
            node[parts[-1]] = leaf
        return tree

    # -- after the tensors are read ----------------------------------------------------------

    def values(self, whole: dict[str, torch.Tensor]) -> dict[str, Any]:
        """What each replaced entry of the target gets (``whole``: the tensors read whole)."""
        if self.borrowed:
            listed = ", ".join(f"{p!r} from rank {r}" for p, r in self.borrowed)
            warnings.warn(f"step {self.step}: rank {self.rank} saved no copy of values that were "
                          f"saved per rank; it loads another rank's copy: {listed}",
                          RuntimeWarning, stacklevel=4)
        return {path: self._build(leaf, path, whole) for path, leaf in self._leaves.items()}

    def _build(self, leaf: _Leaf | dict[str, Any], path: str,
               whole: dict[str, torch.Tensor]) -> Any:
        if isinstance(leaf, dict):
            built = {key: self._build(child, f"{path}/{key}", whole)
                     for key, child in leaf.items()}
            return self._container(built, path)
        kind, source, desc = leaf
        if kind == "tensor":
            return whole[source]
        if kind == "bytes":
            data = whole[source].numpy().tobytes()
            return bytearray(data) if desc == "bytearray" else data
        try:
            return restore(source, desc)
        except (AttributeError, KeyError, TypeError, ValueError, IndexError) as exc:
            raise CheckpointCorruptError(f"step {self.step}: the type record of {path!r} does "
                                         f"not fit its value ({exc})") from None

    def _container(self, built: dict[str, Any], path: str) -> Any:
        kind = (self.types or {}).get("containers", {}).get(path)
        try:
            if kind is None:
                return dict(sorted(built.items()))
            if kind[0] in ("l", "t"):
                items = [built[str(i)] for i in range(len(built))]
                return items if kind[0] == "l" else tuple(items)
            if kind[0] == "d":
                ints = set(kind[1])
                keyed = {(int(k) if k in ints else k): v for k, v in built.items()}
                ordered: list[int | str] = sorted(k for k in keyed if isinstance(k, int))
                ordered += sorted(k for k in keyed if isinstance(k, str))
                return {k: keyed[k] for k in ordered}
        except (AttributeError, KeyError, TypeError, ValueError, IndexError):
            pass
        raise CheckpointCorruptError(f"step {self.step}: the type record of {path!r} does not "
                                     "fit the saved entries")


def check_attributes(reader: StepReader) -> None:
    """What a load refuses in the step's attributes whatever its target (``verify``'s check):
    the per-rank index and the arrays it names, the ranks of per-rank values, and every
    rank's type record, each description fitting the value that rank loads. Raises
    CheckpointCorruptError naming the first problem."""
    ranks = {0} | {int(r) for by_rank in reader.values_by_rank.values()
                   for r in by_rank if isinstance(r, str) and is_index(r)}
    for rank in sorted(ranks):
        sources = Sources(reader, FlatState({}, {}), rank)
        for path, holders in sources.per_rank.items():
            missing = [r for r in holders if rank_array(path, r) not in reader.tensors]
            if missing:
                raise CheckpointCorruptError(f"step {reader.step}: per-rank tensor "
                                             f"{rank_array(path, missing[0])!r} is not in the "
                                             "tensor index")
        for path in reader.values_by_rank:
            sources._saved_value(path, record=False)  # its ranks are checked
        for path, desc in (sources.types or {}).get("values", {}).items():
            found, value = sources._saved_value(path, record=False)
            if found:
                sources._build(("value", value, desc), path, {})


def restore(value: Any, desc: Any) -> Any:
    """Undo what JSON did to a value, by its description (``_state.describe``)."""
    if desc is None:
        return value
    tag = desc[0]
    if tag == "d":
        ints, children = set(desc[1]), desc[2]
        if not isinstance(value, dict):
            raise TypeError(f"expected an object, got {type(value).__name__}")
        return {(int(k) if k in ints else k): restore(v, children.get(k))
                for k, v in value.items()}
    if tag in ("l", "t"):
        children = desc[1]
        if not isinstance(value, list):
            raise TypeError(f"expected an array, got {type(value).__name__}")
        items = [restore(v, children.get(str(i))) for i, v in enumerate(value)]
        return tuple(items) if tag == "t" else items
    if tag == "f":
        bits = bytes.fromhex(desc[1])
        saved = struct.unpack("<d", bits)[0] if len(bits) == 8 else 0.0
        if isinstance(value, str):  # format 4: the float's JSON token, as a str
            fits = value == json.dumps(saved)
        else:  # format 3: a NaN written bare, described where its bits are not JSON's own
            fits = isinstance(value, float) and value != value and saved != saved
        if not fits or math.isfinite(saved):
            raise ValueError(f"{desc[1]!r} does not describe the float saved ({value!r})")
        return saved
    raise ValueError(f"unknown type tag {tag!r}")


def read_values(reader: StepReader) -> dict[str, Any]:
    """The step's JSON values as ``read`` gives them (``_fill.read_whole``): as JSON holds
    them, but for their non-finite floats (stored as str since format 4), given back by the
    description a load of the value takes (``Sources._description``); a value saved per rank
    once per rank that saved it, keyed ``rank_array(path, rank)``."""
    sources: dict[int, Sources] = {}

    def value(path: str, stored: Any, rank: int) -> Any:
        if rank not in sources:
            sources[rank] = Sources(reader, FlatState({}, {}), rank)
        try:
            return restore_floats(stored, sources[rank]._description(path))
        except (AttributeError, KeyError, TypeError, ValueError, IndexError) as exc:
            raise CheckpointCorruptError(f"step {reader.step}: the type record of {path!r} "
                                         f"does not fit its value ({exc})") from None

    values = {p: value(p, v, 0) for p, v in reader.values.items()
              if p not in reader.values_by_rank}
    for path, by_rank in reader.values_by_rank.items():
        if not all(is_index(r) for r in by_rank):
            raise CheckpointCorruptError(f"step {reader.step}: malformed per-rank values of "
                                         f"{path!r}")
        values.update((rank_array(path, int(r)), value(path, v, int(r)))
                      for r, v in by_rank.items())
    return values


def restore_floats(value: Any, desc: Any) -> Any:
    """``value`` with its non-finite floats given back, and nothing else undone (lists stay
    lists, int keys str): the JSON value as format 3 stored it, for ``read``."""
    if not isinstance(desc, list) or not desc:
        return value
    if desc[0] == "f":
        return restore(value, desc)
    children = desc[-1]
    if not isinstance(children, dict):
        raise TypeError(f"children of a {desc[0]!r} description: not an object")
    if isinstance(value, dict):
        return {k: restore_floats(v, children.get(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [restore_floats(v, children.get(str(i))) for i, v in enumerate(value)]
    return value
