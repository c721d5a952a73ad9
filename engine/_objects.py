"""``nn.Module`` and ``Optimizer`` objects in a state, through torch's distributed state-dict
helpers, as DCP users do.

``{"model": model, "optim": optimizer}`` is saved as ``model/<fqn>`` and the flattened
optimizer state ``optim/state.<fqn>.<name>`` / ``optim/param_groups.<fqn>.<key>``
(``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)``): keyed by parameter
name, so it loads whatever the wrapping (plain, DDP, FSDP2 / DTensor) on either side, and into
the ``state_dict()`` of a plain model. An optimizer needs its model in the same state (found by
parameter identity) to name its parameters.

Optimizer state exactly as saved:

- Saving never initializes a caller's optimizer: one that has not stepped is saved with its
  ``param_groups`` and no per-parameter state, and keeps having none.
- Loading initializes the target optimizer's state the way DCP does (a step with zero grads
  and lr 0, so its DTensors have the parameters' layout), fills it from the checkpoint, and
  then drops the state of every parameter that had none when saved (a never-stepped optimizer,
  a parameter that never had a gradient): the optimizer ends with the saved state, not with
  zeros the save never held. A parameter with part of its state saved is a mismatch.
- A load that fails (a target the step does not fit, a step that does not load) gives a
  freshly built optimizer back without the state that initialization made (``undo``): a run
  that starts over when its checkpoint does not fit must not take its first step with the
  state (AdamW: step 1, zero moments) of a second.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .errors import CheckpointError

OptionalHook = Callable[[list[str]], None]


def is_object(obj: object) -> bool:
    return isinstance(obj, (nn.Module, torch.optim.Optimizer))


def find_models(state: object) -> list[nn.Module]:
    """The modules in ``state``'s containers (not inside other Stateful objects)."""
    found: list[nn.Module] = []
    seen: set[int] = set()  # a container inside itself is looked into once (flatten refuses it)
    # depth first, in order, without recursion: a state nested past Python's recursion limit
    # is refused by flatten's walk, which names where
    stack = [state]
    while stack:
        obj = stack.pop()
        if isinstance(obj, nn.Module):
            found.append(obj)
        elif isinstance(obj, (dict, list, tuple)) and id(obj) not in seen:
            seen.add(id(obj))
            stack.extend(reversed(list(obj.values() if isinstance(obj, dict) else obj)))
    return found


def _options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def _params(optim: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for group in optim.param_groups:
        yield from group["params"]


class ModelState:
    """A module as a Stateful: ``get_model_state_dict`` / ``set_model_state_dict``."""

    def __init__(self, model: nn.Module, path: str, loading: bool) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model, options=_options())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.model, state_dict, options=_options())

    def claim_optional(self, optional: dict[str, OptionalHook], path: str) -> None:
        pass

    def undo(self) -> None:
        """Nothing to undo: reading a module's state dict changes nothing."""


class OptimizerState:
    """An optimizer as a Stateful, keyed by FQN through its model (see the module docstring)."""

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer, path: str,
                 loading: bool) -> None:
        self.model, self.optim, self.path, self.loading = model, optim, path, loading
        self._by_fqn: dict[str, list[str]] = {}  # fqn -> its state keys in the target
        self._unsaved: set[str] = set()  # fqns whose state the checkpoint does not hold
        self._initialized = False  # a load target whose state DCP's helper created

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        if self.loading or self.optim.state:
            self._initialized = self.loading and not self.optim.state
            state = get_optimizer_state_dict(self.model, self.optim, options=_options())
        else:
            state = self._without_initializing(get_optimizer_state_dict)
        fqns = sorted(self._fqns(), key=len, reverse=True)
        for key in state:
            if key.startswith("state."):
                fqn = next((f for f in fqns if key.startswith(f"state.{f}.")), key)
                self._by_fqn.setdefault(fqn, []).append(key)
        return state

    def _without_initializing(self, get: Callable[..., dict[str, Any]]) -> dict[str, Any]:
        """DCP's helper steps a never-stepped optimizer (zero grads, lr 0) to create its state;
        a parameter with a gradient tells it not to, so saving leaves the optimizer as it was."""
        params = [p for p in _params(self.optim)]
        if not params or any(p.grad is not None for p in params):
            return get(self.model, self.optim, options=_options())
        first = params[0]
        first.grad = torch.zeros_like(first)
        try:
            return get(self.model, self.optim, options=_options())
        finally:
            first.grad = None

    def _fqns(self) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import _get_fqns

        out: dict[str, torch.Tensor] = {}
        for name, param in self.model.named_parameters():
            for fqn in _get_fqns(self.model, name):
                out[fqn] = param
        return out

    def undo(self) -> None:
        """A load that failed: an optimizer that had no state when the load began has none
        again (its step with zero grads and lr 0 changed nothing else: the parameters, lr and
        grads are as they were)."""
        if self._initialized:
            self.optim.state.clear()

    def claim_optional(self, optional: dict[str, OptionalHook], path: str) -> None:
        for keys in self._by_fqn.values():
            for key in keys:
                optional[f"{path}/{key}"] = self._missing

    def _missing(self, paths: list[str]) -> None:
        """The checkpoint lacks ``paths`` (this optimizer's state keys): fine for all of a
        parameter's state (it had none when saved), a mismatch for part of it."""
        keys = {p.removeprefix(f"{self.path}/") for p in paths}
        self._unsaved = set()  # called once per step tried
        for fqn, expected in self._by_fqn.items():
            lacking = [k for k in expected if k in keys]
            if lacking and len(lacking) < len(expected):
                raise CheckpointError(
                    f"state path {self.path!r}: the checkpoint holds part of the optimizer "
                    f"state of parameter {fqn!r} (it lacks {lacking})")
            if lacking:
                self._unsaved.add(fqn)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.optim, state_dict, options=_options())
        if self._unsaved:
            by_fqn = self._fqns()
            for fqn in self._unsaved:
                self.optim.state.pop(by_fqn[fqn], None)
        for param in [p for p, state in self.optim.state.items() if not state]:
            del self.optim.state[param]  # DCP's loader leaves {} for parameters without state


def adapter(obj: object, path: str, models: list[nn.Module], loading: bool
            ) -> ModelState | OptimizerState:
    """The Stateful that stands for a module or an optimizer at ``path``."""
    if isinstance(obj, nn.Module):
        return ModelState(obj, path, loading)
    assert isinstance(obj, torch.optim.Optimizer)
    wanted = {id(p) for p in _params(obj)}
    for model in models:
        if wanted <= {id(p) for p in model.parameters()}:
            return OptimizerState(model, obj, path, loading)
    raise CheckpointError(
        f"state path {path!r}: an Optimizer is stored by parameter name, so its model must be "
        f"in the same state (e.g. {{'model': model, 'optim': optimizer}}); or pass "
        f"optimizer.state_dict() instead")
