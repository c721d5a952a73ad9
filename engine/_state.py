"""Walking a training state: tensors and DTensors become arrays, everything else JSON.

A state is a nested dict/list/tuple of tensors, DTensors, ``bytes``, JSON-able values, and
``Stateful`` objects (``state_dict()`` / ``load_state_dict()``, the protocol DCP uses too),
including ``nn.Module`` and ``Optimizer`` objects themselves. A path is the ``/``-joined chain of
keys: ``model/layers.0.attn.wq.weight``. A container holding no tensor is one JSON value: an
optimizer's ``param_groups`` is stored as one attribute, not as hundreds.

What comes back, exactly (the engine's load semantics):

- Tensors are filled in place. A target container holding tensors is filled entry by entry:
  it may name a subset of what was saved (the rest is not added); an entry it names that the
  checkpoint lacks is a ``CheckpointMismatchError``.
- A target entry holding no tensor (a JSON value, ``bytes``, an empty container such as a
  fresh optimizer's ``state_dict()["state"]``) takes what was saved at its path, whole: a JSON
  value, bytes, or the saved sub-tree rebuilt with its saved container and key types (int keys
  stay ints, tuples stay tuples; its tensors come back as whole plain CPU tensors).
- ``Stateful`` objects are never replaced in their container: each gets ``load_state_dict``
  with the loaded values, innermost first, siblings in order. ``nn.Module`` and ``Optimizer``
  objects go through torch's distributed state-dict helpers (``get_model_state_dict``,
  ``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)`` and the ``set_``
  counterparts), so they are keyed by parameter name (FQN) whatever the wrapping (DDP, FSDP2,
  DTensor) and an optimizer that never stepped resumes; see ``_objects``.
- ``bytes`` / ``bytearray`` are stored as raw uint8 arrays, checksummed like any tensor, and
  come back as the type that was saved (a subclass such as ``numpy.bytes_`` as ``bytes``, or
  as the target's own type where it holds one). Nothing is ever unpickled.
- JSON values keep their types: tuples, int dict keys and non-finite floats are recorded in a
  per-rank type record (the value at ``.types``, a name no state key can take) and restored on
  load. A non-finite float (a loss gone NaN, an ``inf`` best-metric sentinel) is stored as the
  str of its JSON token (``"NaN"``, ``"Infinity"``, ``"-Infinity"``), since zarr metadata must
  be JSON (RFC 8259 has no such tokens), and its 8 bytes are recorded (a NaN's sign and
  payload too); a str that reads the same is not recorded, so it stays a str. A key
  that JSON cannot round-trip (float, None, bool, an int beside the same key as a str) is
  refused at save, naming the path.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeGuard, runtime_checkable

import torch
from torch.distributed.tensor import DTensor

from ._paths import check_component
from .errors import CheckpointError

JSON = Any
TYPES_PATH = ".types"  # the type record; check_component refuses names starting with "."


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


# JSON leaves and containers: never Stateful, and checked by exact type first because a
# runtime Protocol check costs tens of microseconds (hundreds of them per save add up)
_SCALARS = frozenset({str, int, float, bool, type(None)})
_PLAIN = _SCALARS | {dict, list, tuple}
# an int this wide has fewer decimal digits than any ``sys.get_int_max_str_digits()`` (at
# least 640); a wider one may have no JSON text, so it is checked like any other value
_SHORT_INT_BITS = 2000


def _plain_scalar(value: object) -> bool:
    """A JSON leaf that needs no check nor description (an int short enough that JSON can
    write it; a finite float: JSON has no text for the others)."""
    if type(value) is int:
        return value.bit_length() <= _SHORT_INT_BITS
    if type(value) is float:
        return math.isfinite(value)
    return type(value) in _SCALARS


def is_stateful(obj: object) -> TypeGuard[Stateful]:
    """An object with ``state_dict()`` / ``load_state_dict()`` that is not a container."""
    return type(obj) not in _PLAIN and isinstance(obj, Stateful) and not isinstance(
        obj, (dict, list, tuple))


@dataclass(slots=True)
class ValueSlot:
    """A leaf that load replaces (a JSON value, bytes) and how to replace it in its container."""

    value: JSON
    assign: Callable[[JSON], None]


@dataclass(slots=True)
class FlatState:
    """A state flattened by path.

    ``tensors`` alias the caller's tensors (filling them loads in place); on save they also
    hold a uint8 copy of every ``bytes`` leaf, whose slot is in ``binary``. ``finishers`` run
    after a load's values are assigned (Stateful objects, tuples), innermost first.
    ``optional`` maps target paths that may be absent from a checkpoint (an optimizer's
    per-parameter state) to the callback told that they are; ``types`` is the type record.
    ``undo`` reverts what flattening a load target changed in it (a fresh optimizer's
    initialized state); a load that fails runs it.
    """

    tensors: dict[str, torch.Tensor]
    values: dict[str, ValueSlot]
    binary: dict[str, ValueSlot] = field(default_factory=dict)
    finishers: list[Callable[[], None]] = field(default_factory=list)
    optional: dict[str, Callable[[list[str]], None]] = field(default_factory=dict)
    undo: list[Callable[[], None]] = field(default_factory=list)
    types: dict[str, dict[str, Any]] = field(default_factory=lambda: {
        "containers": {}, "values": {}, "bytes": {}})


def _has_tensor(obj: object, inside: set[int] | None = None) -> bool:
    """Whether ``obj`` is walked entry by entry (else it is one JSON value). ``inside``: the
    containers being looked into; one met again (a container inside itself) adds nothing,
    so a cycle ends here (``flatten`` refuses it, naming where)."""
    if isinstance(obj, (torch.Tensor, bytes, bytearray)):
        return True
    if isinstance(obj, (dict, list, tuple)):
        inside = set() if inside is None else inside
        if id(obj) in inside:
            return False
        inside.add(id(obj))
        found = any(_has_tensor(v, inside) for v in (obj.values() if isinstance(obj, dict)
                                                      else obj))
        inside.discard(id(obj))
        return found
    return is_stateful(obj)


# str keys already found to be valid names on storage: a state's keys repeat at every save,
# and checking each again (and formatting where it was for the error) is ~8 us a key
_VALID_NAMES: set[str] = set()
_VALID_NAMES_MAX = 1 << 16


def _key_name(key: str | int) -> str:
    """A key's name, on storage and as JSON writes it: a subclass (an Enum with a str or int
    mixin) by its value, not by its ``str()``: ``Layer.ENCODER`` is no int a load could turn
    back into the key it records, and ``Split.TRAIN`` is no key that ``Split.TRAIN`` (equal
    to ``"train"``) or ``"train"`` finds."""
    return str.__str__(key) if isinstance(key, str) else int.__repr__(key)


def _key(key: object, path: str) -> str:
    if type(key) is str and key in _VALID_NAMES:
        return key
    if isinstance(key, bool) or not isinstance(key, (str, int)):
        raise CheckpointError(f"state path {path!r}: key {key!r} must be a str or an int")
    name = check_component(_key_name(key), where=f"a key under state path {path!r}" if path
                           else "a key at the state's top level", saving=True)
    if type(key) is str and len(_VALID_NAMES) < _VALID_NAMES_MAX:
        _VALID_NAMES.add(name)
    return name


def _join(prefix: str, key: str) -> str:
    return f"{prefix}/{key}" if prefix else key


def _check_keys(obj: dict[Any, Any], path: str) -> list[str]:
    """The int keys of a dict, by ``_key_name``, after checking that every key round-trips."""
    ints = []
    for key in obj:
        if isinstance(key, bool) or not isinstance(key, (str, int)):
            raise CheckpointError(f"state path {path!r}: key {key!r} ({type(key).__name__}) "
                                  "cannot round-trip; keys must be str or int")
        if isinstance(key, int):
            try:
                name = _key_name(key)
            except ValueError as exc:  # more digits than sys.get_int_max_str_digits()
                raise CheckpointError(f"state path {path!r}: an int key of {key.bit_length()} "
                                      f"bits has no decimal name ({exc})") from None
            if name in obj:
                raise CheckpointError(f"state path {path!r}: keys {key!r} and {name!r} "
                                      "would be the same name on storage")
            ints.append(name)
    return ints


def describe(value: object, path: str) -> JSON:
    """What JSON loses of ``value`` (tuples, int keys, non-finite floats), or None when it
    round-trips as is.

    ``["d", int_keys, {key: child}]``, ``["t", {index: child}]``, ``["l", {index: child}]``
    list only the children that need a description; ``["f", hex]`` is a non-finite float's 8
    bytes (little-endian): ``stored_values`` writes it as a str, ``_restore.restore`` gives
    these bytes back. Format 3 wrote non-finite floats bare (not JSON) and described only a
    NaN with other bits than JSON's own.
    """
    if isinstance(value, float):
        return None if math.isfinite(value) else ["f", struct.pack("<d", value).hex()]
    if isinstance(value, dict):
        ints = _check_keys(value, path)
        children = {_key_name(k): d for k, v in value.items()
                    if (d := describe(v, _join(path, _key_name(k)))) is not None}
        return ["d", ints, children] if ints or children else None
    if isinstance(value, (list, tuple)):
        children = {str(i): d for i, v in enumerate(value)
                    if (d := describe(v, _join(path, str(i)))) is not None}
        if isinstance(value, tuple):
            return ["t", children]
        return ["l", children] if children else None
    return None


def stored_values(values: dict[str, JSON]) -> dict[str, JSON]:
    """``values`` as the step's documents store them: a JSON copy (the caller may mutate its
    state once ``save`` returns) in which each non-finite float is the str of its JSON token.
    ``flatten`` describes every one of them in the type record, so a load gives the float
    back and a str that reads the same stays a str."""
    text = json.dumps(values, allow_nan=True)
    stored: dict[str, JSON] = json.loads(text, parse_constant=str)
    return stored


def _check_json(value: object, path: str) -> JSON:
    if _plain_scalar(value):
        return value
    try:
        json.dumps(value, allow_nan=True)
    except (TypeError, ValueError) as exc:
        path, value, reason = _first_refused(value, path, exc)
        kind = type(value)  # numpy.bool, not "bool" (which reads as Python's, JSON-able)
        name = kind.__qualname__ if kind.__module__ == "builtins" else \
            f"{kind.__module__}.{kind.__qualname__}"
        raise CheckpointError(
            f"state path {path!r}: {name} is neither a tensor nor JSON-able ({reason})") from None
    return value


def _first_refused(value: object, path: str, exc: Exception
                   ) -> tuple[str, object, Exception]:
    """The innermost entry of a value that JSON refused (``exc``), its path and JSON's error
    for it: a numpy scalar among a train state's metrics is named by its own path, not by
    the dict's. A key that cannot be a name is refused here, naming its dict. A container
    inside itself is named where it holds itself (JSON's "Circular reference")."""
    seen: set[int] = set()  # the containers on the path: one met again is the cycle
    while isinstance(value, (dict, list, tuple)) and id(value) not in seen:
        seen.add(id(value))
        if isinstance(value, dict):
            _check_keys(value, path)
            entries = [(_key_name(k), v) for k, v in value.items()]
        else:
            entries = [(str(i), v) for i, v in enumerate(value)]
        for name, entry in entries:
            try:
                json.dumps(entry, allow_nan=True)
            except (TypeError, ValueError) as entry_exc:
                value, path, exc = entry, _join(path, name), entry_exc
                break
        else:
            break
    return path, value, exc


def _setter(container: Any, key: object) -> Callable[[JSON], None]:
    def assign(value: JSON) -> None:
        container[key] = value

    return assign


def _read_only(path: str) -> Callable[[JSON], None]:
    def refuse(_: JSON) -> None:
        raise CheckpointError(f"state path {path!r}: cannot assign into a tuple given as the "
                              "whole state")

    return refuse


def _rebuild(saved: tuple[Any, ...], items: list[Any], assign: Callable[[JSON], None]) -> None:
    """Put the tuple back with the items a load assigned; unchanged when every item is still
    the same object (tensors filled in place), so a tuple in a tuple given as the whole state
    needs no assignment. A named tuple is rebuilt as its own type (its fields stay)."""
    if any(new is not old for new, old in zip(items, saved)):
        kind = type(saved)
        assign(kind._make(items) if hasattr(kind, "_make") else tuple(items))


def flatten(state: object, *, loading: bool = False) -> FlatState:
    """Flatten ``state``; Stateful objects are replaced by their ``state_dict()``.

    Tensors in the result alias the caller's tensors (filling them loads in place).
    ``loading``: the state is a load target (an optimizer object gets its state initialized,
    see ``_objects``).
    """
    from . import _objects

    flat = FlatState(tensors={}, values={})
    models = _objects.find_models(state)
    inside: dict[int, str] = {}  # id -> path of each container being walked
    walking = [""]  # the path walked last: where a state nested too deeply ran out of stack

    def enter(obj: object, path: str) -> None:
        """Refuse a container inside itself: walked on, it would recurse until Python's
        recursion limit, an error naming no key."""
        if id(obj) in inside:
            also = f"at {inside[id(obj)]!r}" if inside[id(obj)] else "the whole state"
            raise CheckpointError(f"state path {path!r}: this {type(obj).__name__} is inside "
                                  f"itself (it is also {also}); a state must be a tree")
        inside[id(obj)] = path

    def walk(obj: object, path: str, assign: Callable[[JSON], None], entries: bool = False
             ) -> None:
        """``entries``: walk a container entry by entry even if it holds no tensor."""
        entries = entries or not path
        walking[0] = path
        if path and _plain_scalar(obj):  # most leaves: nothing else to check
            flat.values[path] = ValueSlot(obj, assign)
        elif isinstance(obj, torch.Tensor):
            if path in flat.tensors:
                raise CheckpointError(f"state path {path!r} appears twice")
            flat.tensors[path] = obj
        elif isinstance(obj, (bytes, bytearray)):
            # the kind a load gives back (a subclass, numpy.bytes_, is recorded as its base:
            # a load refuses other names); the slot keeps the target's own value for its type
            flat.binary[path] = ValueSlot(obj, assign)
            flat.types["bytes"][path] = "bytearray" if isinstance(obj, bytearray) else "bytes"
            flat.tensors[path] = torch.frombuffer(bytearray(obj), dtype=torch.uint8) if obj \
                else torch.empty(0, dtype=torch.uint8)
        elif _objects.is_object(obj):
            adapter = _objects.adapter(obj, path, models, loading)
            flat.undo.append(adapter.undo)
            walk_stateful(adapter, path, entries=True)
            adapter.claim_optional(flat.optional, path)
        elif is_stateful(obj):
            walk_stateful(obj, path)
        elif isinstance(obj, dict) and (entries or _has_tensor(obj)):
            enter(obj, path)
            ints = _check_keys(obj, path)
            if ints:
                flat.types["containers"][path] = ["d", ints]
            for key, value in obj.items():
                walk(value, _join(path, _key(key, path)), _setter(obj, key))
            del inside[id(obj)]
        elif isinstance(obj, list) and (entries or _has_tensor(obj)):
            enter(obj, path)
            flat.types["containers"][path] = ["l"]
            for index, value in enumerate(obj):
                walk(value, _join(path, str(index)), _setter(obj, index))
            del inside[id(obj)]
        elif isinstance(obj, tuple) and (entries or _has_tensor(obj)):
            enter(obj, path)
            flat.types["containers"][path] = ["t"]
            items = list(obj)  # load assigns into this copy, then the tuple is rebuilt
            for index, value in enumerate(obj):
                item_path = _join(path, str(index))
                walk(value, item_path, _setter(items, index) if path else _read_only(item_path))
            del inside[id(obj)]
            flat.finishers.append(lambda: _rebuild(obj, items, assign))
        else:
            if not path:
                raise CheckpointError("the state must be a dict, list or Stateful holding tensors")
            flat.values[path] = ValueSlot(_check_json(obj, path), assign)
            desc = describe(obj, path)
            if desc is not None:
                flat.types["values"][path] = desc

    def walk_stateful(obj: Stateful, path: str, entries: bool = False) -> None:
        try:
            holder = [obj.state_dict()]
        except Exception as exc:
            raise CheckpointError(f"{path or 'the state'}: {type(obj).__name__}.state_dict() "
                                  f"raised {type(exc).__name__}: {exc}") from exc
        if not path and not isinstance(holder[0], (dict, list, tuple)) \
                and not is_stateful(holder[0]):
            # one value as the whole state: a tensor would be stored under an empty name,
            # committed, and refused by every load
            raise CheckpointError(f"the state: {type(obj).__name__}.state_dict() returned "
                                  f"{type(holder[0]).__name__}; a Stateful given as the whole "
                                  "state must return a dict (or list) of its entries")
        walk(holder[0], path, _setter(holder, 0), entries)

        def finish() -> None:
            try:
                obj.load_state_dict(holder[0])
            except Exception as exc:
                raise CheckpointError(f"{path or 'the state'}: {type(obj).__name__}."
                                      f"load_state_dict() refused the loaded state: "
                                      f"{type(exc).__name__}: {exc}") from exc

        flat.finishers.append(finish)

    if not isinstance(state, (dict, list, tuple, Stateful)):
        raise CheckpointError(f"the state must be a dict, list or Stateful, not {type(state)}")
    try:
        walk(state, "", lambda _: None)
    except RecursionError:
        undo_load(flat)
        raise CheckpointError(
            f"state path {walking[0]!r}: the state is nested too deeply to walk (Python's "
            f"recursion limit, {sys.getrecursionlimit()} frames, ran out at or under it)") from None
    except BaseException:
        undo_load(flat)
        raise
    flat.types["containers"].pop("", None)
    flat.values[TYPES_PATH] = ValueSlot(flat.types, lambda _: None)
    return flat


def undo_load(flat: FlatState) -> None:
    """What flattening a load target changed in it, reverted (``FlatState.undo``)."""
    for undo in flat.undo:
        undo()


def finish_load(flat: FlatState, values: dict[str, Any]) -> None:
    """Assign the loaded values and bytes, then hand the filled state dicts back to their
    Stateful owners (and rebuild tuples), innermost first."""
    for path, value in values.items():
        slot = flat.values.get(path)
        if slot is None:
            binary = flat.binary[path]
            binary.assign(_like(binary.value, value))
        else:
            slot.assign(_like(slot.value, value))
    for finish in flat.finishers:
        finish()


def _like(target: Any, value: Any) -> Any:
    """``value`` as JSON gives it back, in the type of the target's own value where that is a
    subclass of it (a numpy float, an IntEnum, an OrderedDict, a defaultdict with its
    factory, a named tuple), inside containers too: a load keeps the caller's types as it
    keeps its tensors. Otherwise (no such value, another type, a constructor that refuses it)
    as saved."""
    kind = type(target)
    if kind is bool or not isinstance(target, type(value)):  # bool(5) would lose the 5
        return value
    if kind is type(value) and not isinstance(value, (dict, list, tuple)):
        return value
    try:
        if isinstance(value, dict):
            entries = {k: _like(target.get(k), v) for k, v in value.items()}
            if isinstance(target, defaultdict):  # its constructor takes the factory first
                return kind(target.default_factory, entries)
            return entries if kind is dict else kind(entries)
        if isinstance(value, (list, tuple)):
            items = [_like(t, v) for t, v in zip(target, value)] + list(value[len(target):])
            return kind._make(items) if hasattr(kind, "_make") else kind(items)
        return kind(value)
    except Exception:  # a subclass we cannot build: the value as saved
        return value


def iter_local(tensor: torch.Tensor) -> torch.Tensor:
    """The process-local data of a tensor or DTensor (its local tensor itself: ``to_local()``
    goes through an autograd function, ~50 us, and the engine only reads and fills data)."""
    if isinstance(tensor, DTensor):
        local = getattr(tensor, "_local_tensor", None)
        return local if isinstance(local, torch.Tensor) else tensor.to_local()
    return tensor


def storage_short(tensor: torch.Tensor) -> bool:
    """Whether a strided tensor's shape and strides reach past the end of its storage: its
    memory was freed or shrunk under it (``untyped_storage().resize_(0)``, as FSDP does to the
    parameters it reshards). Reading or filling it would crash the process (torch's own
    ``clone()`` does)."""
    if tensor.layout != torch.strided or tensor.is_nested or tensor.is_meta or not tensor.numel():
        return False
    reach = tensor.storage_offset() + sum((n - 1) * s for n, s in zip(tensor.shape,
                                                                     tensor.stride()))
    return (reach + 1) * tensor.element_size() > tensor.untyped_storage().nbytes()


def state_signature(flat: FlatState) -> tuple[Any, ...]:
    """What a rank's inventory is made of, cheap to build and compare: each tensor's path,
    dtype, shape, layout and whether it is a meta tensor or one whose storage is too short
    (all refused by the inventory's check), a DTensor's mesh, placements and local shape; the
    value paths. Equal signatures
    give equal inventories (the meshes compare by content, by identity first). A nested
    tensor, whose ``shape`` raises, has none: the inventory's check refuses it by path."""
    tensors: list[tuple[Any, ...]] = []
    for path, t in flat.tensors.items():
        if t.is_nested:
            tensors.append((path, t.dtype, None, t.layout, t.is_meta))
        elif isinstance(t, DTensor):
            local = iter_local(t)
            tensors.append((path, t.dtype, tuple(t.shape), t.device_mesh, tuple(t.placements),
                            tuple(local.shape), local.layout, local.is_meta,
                            storage_short(local)))
        else:
            tensors.append((path, t.dtype, tuple(t.shape), t.layout, t.is_meta,
                            storage_short(t)))
    return tuple(tensors), tuple(sorted(flat.values))


def same_value(a: JSON, b: JSON) -> bool:
    """Exact JSON equality: the same type at every level (``True`` is not ``1``, ``1`` is not
    ``1.0``), floats by their bits (``-0.0`` is not ``0.0``; a NaN equals itself: a restored
    loss may be NaN), dict keys in the same order (a load restores that order).
    Without recursion: a type record nests twice as deep as its value, and a value that
    ``flatten`` took must not fail the save later, in the coordinator, naming nothing."""
    pairs = [(a, b)]
    while pairs:
        a, b = pairs.pop()
        if type(a) is not type(b):
            return False
        if isinstance(a, float):
            if struct.pack("<d", a) != struct.pack("<d", b):
                return False
        elif isinstance(a, dict):
            if list(a) != list(b):
                return False
            pairs.extend((v, b[k]) for k, v in a.items())
        elif isinstance(a, (list, tuple)):
            if len(a) != len(b):
                return False
            pairs.extend(zip(a, b))
        elif a != b:
            return False
    return True
