"""The benchmarks' training state: a GPT-like fp32 model and its Adam moments, of a chosen size,
the same values on every call."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

_OPTIM_MOMENTS = ("exp_avg", "exp_avg_sq")


def model_dim(size_bytes: float) -> int:
    """The width ``d`` whose state (see :func:`param_shapes`) is about ``size_bytes``."""
    d = math.sqrt(size_bytes / (3 * 4 * 40))  # 3 copies (param + 2 moments), fp32, 40 d^2 params
    return max(64, round(d / 64) * 64)


def param_shapes(d: int) -> list[tuple[str, tuple[int, ...]]]:
    """A 2-block GPT: a 16d-token embedding, fused qkv, output and MLP matrices, a final norm."""
    shapes: list[tuple[str, tuple[int, ...]]] = [("tok_emb.weight", (16 * d, d))]
    for i in range(2):
        shapes += [
            (f"layers.{i}.attn.wqkv.weight", (3 * d, d)),
            (f"layers.{i}.attn.wo.weight", (d, d)),
            (f"layers.{i}.mlp.w1.weight", (4 * d, d)),
            (f"layers.{i}.mlp.w2.weight", (d, 4 * d)),
        ]
    return [*shapes, ("norm.weight", (d,))]


def gpt_like_state(d: int, *, seed: int = 0) -> dict[str, Any]:
    """``{"model": {...}, "optim": {"exp_avg": {...}, "exp_avg_sq": {...}, "step": 0}}``,
    every tensor ``randn`` from its own seeded generator (the same values on every call)."""
    groups = ("model", *_OPTIM_MOMENTS)
    out: dict[str, dict[str, Any]] = {g: {} for g in groups}
    index = 0
    for group in groups:
        for name, shape in param_shapes(d):
            generator = torch.Generator().manual_seed(seed + index)
            out[group][name] = torch.randn(shape, generator=generator)
            index += 1
    optim = {m: out[m] for m in _OPTIM_MOMENTS}
    return {"model": out["model"], "optim": {**optim, "step": 0}}


def map_tensors(state: dict[str, Any], fn: Callable[[torch.Tensor], Any]) -> dict[str, Any]:
    """A copy of the nested dict ``state`` with ``fn`` applied to every tensor."""
    return {
        k: map_tensors(v, fn)
        if isinstance(v, dict)
        else fn(v)
        if isinstance(v, torch.Tensor)
        else v
        for k, v in state.items()
    }


def tensors_of(state: dict[str, Any]) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for value in state.values():
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, dict):
            found += tensors_of(value)
    return found


def state_nbytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(state))
