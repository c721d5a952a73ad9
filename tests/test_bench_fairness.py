"""The benchmarks time the engine and its peers under the same conditions: what one side's
figure includes (a barrier, a window of steps), the other's includes too. Fast: no disk-sized
states, at most one in-process gloo rank."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist


def test_save_cost_times_the_engine_save_without_the_barrier_before_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A barrier that takes 0.2 s is no part of the engine's save() return, as none is of DCP's
    async_save return: each figure starts after the ranks met (so do both persists)."""
    from bench import save_cost

    barrier_s = 0.2
    real_barrier = dist.barrier

    def slow_barrier(*args: object, **kwargs: object) -> object:
        time.sleep(barrier_s)
        return real_barrier(*args, **kwargs)

    monkeypatch.setattr(dist, "barrier", slow_barrier)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    threads = torch.get_num_threads()
    try:
        save_cost._worker(0, 1, port, str(tmp_path), 1, str(tmp_path))
    finally:
        torch.set_num_threads(threads)
    times = json.loads((tmp_path / "rank0.json").read_text())["times"]
    assert max(times["engine_return"]) < barrier_s, times
    assert max(times["dcp_async_return"]) < barrier_s, times
