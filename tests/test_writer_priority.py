"""The engine's writer threads yield the CPU while a save's staging copy runs, then get their
niceness back; where the process could not get it back, they are left alone."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from antifragile.engine import CheckpointEngine, stage
from antifragile.engine import _priority as priority


def writer_niceness() -> dict[int, int]:
    return {t.native_id: os.getpriority(os.PRIO_PROCESS, t.native_id)
            for t in threading.enumerate() if t.name.startswith("ckpt-io") and t.native_id}


def niceness_during_copies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                           ) -> tuple[dict[int, int], list[dict[int, int]], dict[int, int]]:
    """(writers' niceness before a save, at each cell copy of it, after it committed); a
    writer the pool started during the save counts as at this thread's niceness before."""
    state = {"a": torch.randn(64, 64), "b": torch.randn(64, 64)}
    seen: list[dict[int, int]] = []
    real = stage._copy_cell

    def watched(*args: Any, **kwargs: Any) -> None:
        seen.append(writer_niceness())
        real(*args, **kwargs)

    with CheckpointEngine(str(tmp_path), keep_last=None) as ckpt:
        ckpt.save(1, state, blocking=True)  # the writer threads now exist
        before = writer_niceness()
        monkeypatch.setattr(stage, "_copy_cell", watched)
        ckpt.save(2, state, blocking=True)
        after = writer_niceness()
    assert before and seen
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    return {tid: before.get(tid, mine) for tid in after}, seen, after


@pytest.mark.skipif(not priority.may_raise_priority(),
                    reason="this process may not raise a thread's priority back "
                           "(no CAP_SYS_NICE, RLIMIT_NICE too low)")
def test_writers_yield_during_the_staging_copy_and_get_their_niceness_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before, seen, after = niceness_during_copies(tmp_path, monkeypatch)
    for during in seen:  # threads the pool started during the copy yield too
        assert all(nice == max(before[tid], priority.YIELD_NICE) for tid, nice in during.items())
    assert after == before


def test_writers_are_left_alone_where_their_niceness_could_not_be_restored(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(priority, "may_raise_priority", lambda: False)
    before, seen, after = niceness_during_copies(tmp_path, monkeypatch)
    assert all(nice == before[tid] for during in seen for tid, nice in during.items())
    assert after == before


def test_the_probe_restores_its_own_thread() -> None:
    # the answer is cached; the probe ran on a thread of its own, never on the caller's
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    priority.may_raise_priority.cache_clear()
    priority.may_raise_priority()
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
