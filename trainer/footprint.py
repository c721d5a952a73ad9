"""A lower bound on the memory one training process needs, from its sizes alone.

A size no machine here can hold (``--seq-len 10**12``) ran until torch's allocator refused it,
a traceback in every rank (exit 1, which torchrun restarts) naming no option; one the machine
could nearly hold ended in an out-of-memory kill. ``too_large`` lets the configuration check
refuse it up front, naming the option. Arithmetic only (no torch): chaos may call it too.
"""

from __future__ import annotations

import contextlib

FLOAT_BYTES = 4  # the trainer's parameters and activations are float32


def min_process_bytes(*, layers: int, d_model: int, heads: int, vocab: int, seq_len: int,
                      mlp_ratio: int, micro_batch: int, tp: int, pp: int) -> dict[str, int]:
    """Never more than one process allocates, by the option that sizes it: its share of the
    weights, each counted once (no gradients, optimizer state or other activations), and one
    layer's attention scores for one micro-batch (``model.Attention``: micro-batch x heads x
    seq_len x seq_len), charged to ``seq_len`` or ``batch_size``, whichever is larger."""
    shards = tp * pp
    scores = micro_batch * max(heads // tp, 1) * seq_len * seq_len
    big = "seq_len" if seq_len >= micro_batch else "batch_size"
    parts = {"vocab": 2 * vocab * d_model // shards,  # the embedding and the output head
             "seq_len": seq_len * d_model // shards,  # the position embedding
             "d_model": layers * (4 + 2 * mlp_ratio) * d_model * d_model // shards,
             "batch_size": 0}
    parts[big] += scores
    return {k: FLOAT_BYTES * v for k, v in parts.items()}


def available_bytes() -> int | None:
    """Memory a process could have now: MemAvailable + SwapFree (``/proc/meminfo``); None
    where that is not known (not Linux)."""
    fields: dict[str, int] = {}
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            fields[key] = int(rest.split()[0]) * 1024  # kB
    if "MemAvailable" not in fields:
        return None
    return fields["MemAvailable"] + fields.get("SwapFree", 0)


def too_large(parts: dict[str, int], options: dict[str, tuple[str, int]],
              available: int | None) -> str | None:
    """Why sizes ``parts`` (``min_process_bytes``) cannot fit in ``available`` bytes, naming
    the option that needs the most (``options``: each size's option name and value, as the
    user gave it); None where they may."""
    need = sum(parts.values())
    if available is None or need <= available:
        return None
    named = {f"{options[k][0]} {options[k][1]}": v for k, v in parts.items()}
    option = max(named, key=lambda k: named[k])
    shown = ", ".join(f"{k}: {v:,}" for k, v in named.items() if v)
    return (f"{option}: needs at least {need:,} bytes in each process (weights and one "
            f"layer's attention scores, by option: {shown}), more than the {available:,} "
            "bytes of memory available here")
