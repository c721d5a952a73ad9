"""Deterministic token data with a resumable cursor.

The sample at global index ``i`` is a pure function of (seed, i), so a run resumed at cursor
``c`` sees exactly the batches an uninterrupted run would. Synthetic samples are arithmetic
progressions modulo the vocabulary (random start and stride): learnable, so the loss falls.
A file-backed dataset reads windows of a flat token file (``.npy`` of integer ids).
"""

from __future__ import annotations

import functools
import os
import tokenize
import zlib
from dataclasses import dataclass

import numpy as np
import torch


def _sample_seed(seed: int, index: int) -> int:
    return zlib.crc32(f"{seed}:{index}".encode())


def open_tokens(path: str, seq_len: int, vocab: int) -> np.ndarray:
    """The token file at ``path``, memory-mapped, once it is known to serve samples of
    ``seq_len + 1`` ids below ``vocab``; ``ValueError`` (``OSError`` where it cannot be read)
    naming the file and what is wrong with it. Each version of a file is checked (read whole)
    once per process and those it forks: the command line checks it, and every generation's
    training process, forked from that one, reuses the checked map."""
    st = os.stat(path)
    return _checked_tokens(path, st.st_ino, st.st_size, st.st_mtime_ns, seq_len, vocab)


@functools.lru_cache(maxsize=4)
def _checked_tokens(path: str, _ino: int, _size: int, _mtime_ns: int, seq_len: int,
                    vocab: int) -> np.ndarray:
    try:
        tokens = np.load(path, mmap_mode="r")
    except ValueError as exc:  # pickled data, not a .npy
        raise ValueError(f"{path}: {exc}") from None
    except EOFError:  # numpy's answer for a file of no bytes
        raise ValueError(f"{path}: empty file, not a .npy of token ids") from None
    except (tokenize.TokenError, OverflowError) as exc:
        # a damaged header numpy does not wrap in ValueError: one cut short inside its dict
        # (its tokenizer's TokenError), a shape beyond any array (the map's size overflows)
        raise ValueError(f"{path}: malformed .npy header ({exc})") from None
    if not isinstance(tokens, np.ndarray):
        raise ValueError(f"{path}: not a .npy file (a 1-D integer token array)")
    # kind i/u, not np.integer: numpy counts timedelta64 (kind m) among its integer types
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise ValueError(f"{path}: expected a 1-D integer token array")
    if len(tokens) < seq_len + 1:
        raise ValueError(f"{path}: {len(tokens)} tokens, need at least {seq_len + 1} "
                         "(one sample)")
    if int(tokens.max()) >= vocab or int(tokens.min()) < 0:
        raise ValueError(f"{path}: token ids outside [0, {vocab})")
    return tokens


def tokens_digest(path: str, seq_len: int, vocab: int) -> str:
    """What the token file at ``path`` holds, in a few words: the crc32 of its ids as stored
    and their dtype (a resume on a file of other ids would train on other batches). Computed
    once per version of the file and process, like the check of ``open_tokens``."""
    st = os.stat(path)
    return _digest(path, st.st_ino, st.st_size, st.st_mtime_ns, seq_len, vocab)


@functools.lru_cache(maxsize=4)
def _digest(path: str, ino: int, size: int, mtime_ns: int, seq_len: int, vocab: int) -> str:
    tokens = _checked_tokens(path, ino, size, mtime_ns, seq_len, vocab)
    crc, step = 0, 1 << 24  # ids per crc32 call: a bounded buffer of a large map
    for start in range(0, len(tokens), step):
        crc = zlib.crc32(np.ascontiguousarray(tokens[start:start + step]).data, crc)
    return f"crc32 0x{crc:08x} of {len(tokens)} {tokens.dtype} ids"


@dataclass(slots=True)
class TokenData:
    seq_len: int
    vocab: int
    seed: int
    path: str | None = None
    _tokens: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.path is not None:
            self._tokens = open_tokens(self.path, self.seq_len, self.vocab)

    def sample(self, index: int) -> torch.Tensor:
        """Sample ``index``: ``seq_len + 1`` token ids (inputs and shifted targets)."""
        gen = torch.Generator().manual_seed(_sample_seed(self.seed, index))
        if self._tokens is not None:
            start = int(torch.randint(len(self._tokens) - self.seq_len, (1,), generator=gen))
            window = self._tokens[start:start + self.seq_len + 1]
            # a copy: of int64 ids, asarray gave a view of the read-only map (torch warned in
            # every process, and the sample aliased the file)
            return torch.from_numpy(np.array(window, dtype=np.int64))
        start = int(torch.randint(self.vocab, (1,), generator=gen))
        stride = int(torch.randint(1, 8, (1,), generator=gen))
        return (start + stride * torch.arange(self.seq_len + 1)) % self.vocab

    def batch(self, cursor: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch of samples [cursor, cursor + batch_size): (inputs, targets)."""
        rows = torch.stack([self.sample(cursor + i) for i in range(batch_size)])
        return rows[:, :-1], rows[:, 1:]
