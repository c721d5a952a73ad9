"""Plain tensors that differ between ranks are saved per rank, never collapsed to one copy.

A plain (non-DTensor) tensor held by several ranks is taken for a replica: one copy is written,
its objects spread among the holders. Nothing guarantees that the copies agree:
``torch.get_rng_state()``, a sampler offset, a data loader's ``bytes`` differ by rank. So:

- when the plan is built (the state's structure changed), holders whose copies differ in
  dtype or shape make that path per rank;
- on every save, each rank digests every plain tensor it holds that several ranks hold (crc32c
  of its bytes on CPU; word sums computed on the accelerator for device tensors, one copy of two
  ints per tensor back to the host) and the ranks agree on them with one all-reduce of two int64
  per tensor over the engine's gloo group: copies whose digests differ make that path per rank.

A per-rank path stays per rank for the rest of the engine's life (values change every step; a
plan that flipped back and forth would be rebuilt at every save). Holder ``r`` writes the array
``<path>/rank_<r>`` (a name no state key can collide with: ``<path>`` is a tensor), and the
step's attributes record ``per_rank: {path: [holder ranks]}``. Loading gives every rank its own
copy; a rank that saved none (more ranks than saved) gets the lowest saved rank's copy, with a
RuntimeWarning naming the paths (``_restore``).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from typing import Any

import crc32c
import torch
from torch.distributed.tensor import DTensor

from ._dtypes import as_bytes
from .errors import CheckpointError
from .plan import inventory as plan_inventory

_ABSENT = -(2**63)  # a rank that does not hold the tensor: below every digest and its negation
_MASK = 2**62 - 1


def rank_array(path: str, rank: int) -> str:
    """The tensor path under which ``rank``'s copy of per-rank ``path`` is stored."""
    return f"{path}/rank_{rank}"


def inventory(tensors: dict[str, torch.Tensor], values: Iterable[str]) -> dict[str, Any]:
    """The plan's inventory plus which tensors are plain (candidates for per-rank)."""
    inv = plan_inventory(tensors, values)
    inv["plain"] = sorted(p for p, t in tensors.items() if not isinstance(t, DTensor))
    return inv


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return as_bytes(tensor.detach().resolve_conj().resolve_neg().contiguous())


def digests(tensors: list[torch.Tensor]) -> list[int]:
    """A digest in [0, 2**62) of each tensor's bytes: crc32c on the host; on an accelerator two
    position-weighted word sums computed there, so only 16 bytes per tensor move."""
    out = [0] * len(tensors)
    sums: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for i, tensor in enumerate(tensors):
        raw = _bytes_of(tensor)
        if raw.device.type == "cpu":
            data = raw.numpy()  # no copy: crc32c reads the buffer
            out[i] = crc32c.crc32c(data) if raw.numel() else 0  # type: ignore[arg-type]
        else:
            sums.setdefault(raw.device, []).append((i, _device_sums(raw)))
    for parts in sums.values():
        host = torch.stack([s for _, s in parts]).cpu().tolist()
        for (i, _), (total, odd) in zip(parts, host):
            out[i] = crc32c.crc32c(struct.pack("<qq", total, odd))
    return [d & _MASK for d in out]


_SUM_BLOCK = 1 << 22  # words per step: the int64 temporaries stay at 64 MiB


def _device_sums(raw: torch.Tensor) -> torch.Tensor:
    """Two sums of the words, each weighted by a function of the word's position (``i + 1``
    and a multiplicative hash of ``i``; int64, wrapping): a value that moved changes both,
    which plain sums did not see (shuffled indices have the sum of the sorted ones)."""
    words = raw
    if raw.numel() % 4 == 0:
        # a view as int32 must start on the 4-byte grid: a slice of a buffer (a float16
        # ``buf[1:9]``) may not, and is summed from an aligned copy of the same bytes
        words = (raw if raw.storage_offset() % 4 == 0 else raw.clone()).view(torch.int32)
    out = torch.zeros(2, dtype=torch.int64, device=raw.device)
    for start in range(0, words.numel(), _SUM_BLOCK):
        block = words[start:start + _SUM_BLOCK].to(torch.int64)
        i = torch.arange(start, start + block.numel(), dtype=torch.int64, device=raw.device)
        out[0] += (block * (i + 1)).sum()
        out[1] += (block * (((i * 2654435761) & 0x7FFFFFFF) | 1)).sum()
    return out


class PerRank:
    """Which plain tensors are saved per rank, from every rank's inventory (same on all ranks).

    ``agree`` is collective (every rank calls it with the same plan); the rest is local.
    """

    def __init__(self, inventories: list[dict[str, Any]], rank: int,
                 sticky: Iterable[str] = ()) -> None:
        self.rank = rank
        self.inventories = inventories
        plain: dict[str, list[int]] = {}
        dtensor: set[str] = set()
        for r, inv in enumerate(inventories):
            marked = set(inv.get("plain", []))
            for path in inv["tensors"]:
                (plain.setdefault(path, []).append(r) if path in marked else dtensor.add(path))
        self.holders = {p: rs for p, rs in plain.items() if p not in dtensor}
        self.paths = {p for p in sticky if p in self.holders}
        for path, ranks in self.holders.items():
            entries = {(inventories[r]["tensors"][path]["dtype"],
                        tuple(inventories[r]["tensors"][path]["shape"])) for r in ranks}
            if len(entries) > 1:
                self.paths.add(path)
        self._check_names()

    def _candidates(self) -> list[str]:
        return sorted(p for p, ranks in self.holders.items()
                      if len(ranks) > 1 and p not in self.paths)

    def agree(self, tensors: dict[str, torch.Tensor],
              all_max: Callable[[list[int]], list[int]]) -> bool:
        """Digest the replicated plain tensors; True when some now differ (they become per
        rank, and the plan must be rebuilt)."""
        if not self._candidates():
            return False
        return self.settle(all_max(self.local_digests(tensors)))

    def local_digests(self, tensors: dict[str, torch.Tensor] | None) -> list[int]:
        """This rank's part of ``agree``'s all-reduce (a save folds it into its first one):
        the digest of each candidate it holds and their negations; ``None``: placeholders (a
        rank whose state was refused, or that knows the result will not be used). The same
        length on every rank."""
        candidates = self._candidates()
        held = [p for p in candidates if tensors is not None and p in tensors]
        mine = dict(zip(held, digests([tensors[p] for p in held]))) if tensors else {}
        local = [mine.get(p, _ABSENT) for p in candidates]
        return local + [-d if d != _ABSENT else _ABSENT for d in local]

    def settle(self, agreed: list[int]) -> bool:
        """``agree`` once ``local_digests`` were all-reduced (MAX): True when copies differ."""
        candidates = self._candidates()
        n = len(candidates)
        differing = {p for i, p in enumerate(candidates) if agreed[i] != -agreed[n + i]}
        self.paths |= differing
        self._check_names()
        return bool(differing)

    def _check_names(self) -> None:
        """No rank holds a name under a per-rank path (``<path>/rank_<r>`` is how it is
        stored). One pass over the names every rank holds, each looked up at each of its
        ``/``: going over them once per per-rank path took 0.17 s at 4,096 ranks with one."""
        if not self.paths:
            return
        names: set[str] = set()
        for inv in self.inventories:
            names.update(inv["tensors"], inv["values"])
        for name in sorted(names):
            cut = name.find("/")
            while cut != -1:
                if name[:cut] in self.paths:
                    raise CheckpointError(
                        f"state path {name[:cut]!r} differs between ranks and is saved per "
                        f"rank, but another rank holds {name!r} under it")
                cut = name.find("/", cut + 1)

    def rename(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's tensors under their stored names."""
        return {(rank_array(p, self.rank) if p in self.paths else p): t
                for p, t in tensors.items()}

    def plan_inventories(self) -> list[dict[str, Any]]:
        """Every rank's inventory with per-rank paths renamed, for ``build_plan``."""
        if not self.paths:
            return self.inventories
        # the entries are shared, not copied: a deep copy of 1,024 ranks' inventories took
        # longer than the plan built from them (4.8 s), on every rank
        return [{**inv, "tensors": {(rank_array(p, r) if p in self.paths else p): entry
                                    for p, entry in inv["tensors"].items()}}
                for r, inv in enumerate(self.inventories)]

    def index(self) -> dict[str, list[int]]:
        """What the step's attributes record: per-rank path -> the ranks that saved a copy."""
        return {p: self.holders[p] for p in sorted(self.paths)}
