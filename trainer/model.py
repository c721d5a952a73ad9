"""A small GPT: token + position embedding, pre-norm blocks of causal attention + MLP, LM head.

Blocks live in a ``ModuleDict`` keyed by their index, so a pipeline stage that holds only
blocks 4-7 still names them ``layers.4...``: checkpoints from every layout line up.
Attention is written out (no fused kernel) so CPU results are bitwise reproducible, and the
head count is inferred from the projection's local width, so tensor parallelism (which shards
the heads) needs no special case.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelConfig:
    layers: int = 4
    d_model: int = 64
    heads: int = 4
    vocab: int = 256
    seq_len: int = 32
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        for name in ("layers", "d_model", "heads", "vocab", "seq_len", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by heads {self.heads}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, seq, -1, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.wq(x)), heads(self.wk(x)), heads(self.wv(x))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(causal, float("-inf"))
        out = scores.softmax(dim=-1) @ v
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=False)
        self.w2 = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """The whole model, or (after :func:`keep_stage`) one pipeline stage of it."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos_embeddings: nn.Embedding | None = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.layers)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(cfg.d_model)
        self.output: nn.Linear | None = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None and self.pos_embeddings is not None:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.tok_embeddings(x) + self.pos_embeddings(positions)
        for block in self.layers.values():
            x = block(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.output is not None:
            x = self.output(x)
        return x


def init_weights(model: GPT, seed: int) -> None:
    """Deterministic initialisation from ``seed``, independent of the parallel layout: every
    parameter is drawn from its own generator seeded by (seed, its name)."""
    for name, param in sorted(model.named_parameters()):
        gen = torch.Generator().manual_seed(_name_seed(seed, name))
        with torch.no_grad():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith("norm.bias"):
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)


def _name_seed(seed: int, name: str) -> int:
    import zlib

    return (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63


def keep_stage(model: GPT, stage: int, num_stages: int) -> GPT:
    """Drop everything outside pipeline stage ``stage`` (blocks split as evenly as possible)."""
    layer_ids = split_layers(model.cfg.layers, num_stages)[stage]
    for name in list(model.layers):
        if int(name) not in layer_ids:
            del model.layers[name]
    if stage != 0:
        model.tok_embeddings = None
        model.pos_embeddings = None
    if stage != num_stages - 1:
        model.norm = None
        model.output = None
    return model


def split_layers(num_layers: int, num_stages: int) -> list[range]:
    if num_layers < num_stages:
        raise ValueError(f"{num_layers} layers cannot fill {num_stages} pipeline stages")
    base, extra = divmod(num_layers, num_stages)
    bounds = [0]
    for s in range(num_stages):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return [range(bounds[s], bounds[s + 1]) for s in range(num_stages)]
