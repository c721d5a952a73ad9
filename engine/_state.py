"""Walking a training state: tensors and DTensors become arrays, everything else JSON.

A state is a nested dict/list/tuple of tensors, DTensors, JSON-able values, and ``Stateful``
objects (``state_dict()`` / ``load_state_dict()``, the protocol DCP uses too). A path is the
``/``-joined chain of keys: ``model/layers.0.attn.wq.weight``. A container holding no tensor is
one JSON value: an optimizer's ``param_groups`` is stored as one attribute, not as hundreds.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch.distributed.tensor import DTensor

from ._paths import check_component
from .errors import CheckpointError

JSON = Any


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


@dataclass(slots=True)
class ValueSlot:
    """A JSON leaf and how to replace it in its container."""

    value: JSON
    assign: Callable[[JSON], None]


@dataclass(slots=True)
class FlatState:
    tensors: dict[str, torch.Tensor]
    values: dict[str, ValueSlot]
    statefuls: list[tuple[Stateful, dict[str, Any]]]


def _has_tensor(obj: object) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, dict):
        return any(_has_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_tensor(v) for v in obj)
    return isinstance(obj, Stateful)


def _check_json(value: object, path: str) -> JSON:
    try:
        json.dumps(value, allow_nan=True)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"state path {path!r}: {type(value).__name__} is neither a tensor nor JSON-able ({exc})"
        ) from None
    return value


def _key(key: object, path: str) -> str:
    if isinstance(key, bool) or not isinstance(key, (str, int)):
        raise CheckpointError(f"state path {path!r}: key {key!r} must be a str or an int")
    return check_component(str(key), where=f"state path {path!r}")


def _join(prefix: str, key: str) -> str:
    return f"{prefix}/{key}" if prefix else key


def flatten(state: object) -> FlatState:
    """Flatten ``state``; Stateful objects are replaced by their ``state_dict()``.

    Tensors in the result alias the caller's tensors (filling them loads in place).
    """
    flat = FlatState(tensors={}, values={}, statefuls=[])

    def unsupported(_: JSON, path: str = "") -> None:
        raise CheckpointError(f"state path {path!r}: cannot assign into a tuple")

    def walk(obj: object, path: str, assign: Callable[[JSON], None]) -> None:
        if isinstance(obj, torch.Tensor):
            if path in flat.tensors:
                raise CheckpointError(f"state path {path!r} appears twice")
            flat.tensors[path] = obj
        elif isinstance(obj, Stateful) and not isinstance(obj, (dict, list, tuple)):
            sd = obj.state_dict()
            flat.statefuls.append((obj, sd))
            walk(sd, path, assign)
        elif isinstance(obj, dict) and _has_tensor(obj):
            for key, value in obj.items():
                walk(value, _join(path, _key(key, path)), _setter(obj, key))
        elif isinstance(obj, (list, tuple)) and _has_tensor(obj):
            for index, value in enumerate(obj):
                setter = _setter(obj, index) if isinstance(obj, list) else unsupported
                walk(value, _join(path, str(index)), setter)
        else:
            if not path:
                raise CheckpointError("the state must be a dict, list or Stateful holding tensors")
            flat.values[path] = ValueSlot(_check_json(obj, path), assign)

    if not isinstance(state, (dict, list, tuple, Stateful)):
        raise CheckpointError(f"the state must be a dict, list or Stateful, not {type(state)}")
    walk(state, "", lambda _: None)
    return flat


def _setter(container: Any, key: object) -> Callable[[JSON], None]:
    def assign(value: JSON) -> None:
        container[key] = value

    return assign


def finish_load(flat: FlatState) -> None:
    """Hand the filled state dicts back to their Stateful owners, innermost first."""
    for obj, sd in reversed(flat.statefuls):
        obj.load_state_dict(sd)


def iter_local(tensor: torch.Tensor) -> torch.Tensor:
    """The process-local data of a tensor or DTensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def same_value(a: JSON, b: JSON) -> bool:
    """JSON equality that treats NaN as equal to NaN (a restored loss may be NaN)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)
