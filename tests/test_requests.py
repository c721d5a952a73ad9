"""Request economy: what a save and a load cost in storage requests, and that waiting for a
commit polls with one request per round, backing off.

Counts come from the engine's own figures (``handle.requests``, ``engine.last_load_requests``:
requests made through the Storage interface) and, on S3, from the HTTP requests s3fs sends
(counted with a botocore event hook), so a request the interface hides (a HEAD before a GET)
shows up too.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _dist import run_ranks

from antifragile.engine import CheckpointEngine
from antifragile.engine import commit as commit_module
from antifragile.engine.commit import read_commit, read_marker

Storage = tuple[str, dict[str, Any] | None]
TENSORS = 200


def state_of(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {"model": {f"t{i}": torch.randn(8, 8, generator=gen) for i in range(TENSORS)},
            "step": seed}


@contextlib.contextmanager
def wire_count(options: dict[str, Any] | None) -> Iterator[tuple[dict[str, Any] | None, Any]]:
    """On S3, a counting proxy in front of the endpoint: ``(options through it, take)`` where
    ``take()`` returns the HTTP requests sent since the last call, so a request the Storage
    interface hides (a HEAD before a GET, a listing's second page) shows up too. Locally
    ``(None, lambda: 0)``."""
    if not options:
        yield None, lambda: 0
        return
    from antifragile.chaos.infra.proxy import FaultProxy

    with FaultProxy.in_front_of(options["endpoint_url"]) as proxy:
        last = [proxy.snapshot()]

        def take() -> int:
            now = proxy.snapshot()
            count, last[0] = now.since(last[0]).requests, now
            return count

        yield {**options, "endpoint_url": proxy.endpoint_url}, take


def test_requests_per_save_and_per_load_are_bounded(storage: Storage) -> None:
    """200 tensors: a save costs about one request per object it writes, a load one per
    object it reads, plus a handful (COMMIT, group metadata, listing, records)."""
    url, options = storage
    with wire_count(options) as (proxied, http), \
            CheckpointEngine(url, storage_options=proxied or options, keep_last=1) as engine:
        http()
        handle = engine.save(1, state_of(1), blocking=True)
        objects = len(read_marker(engine.storage, 1)[1].objects)
        assert objects == 2 * TENSORS + 2  # cells, array docs, model/zarr.json, zarr.json
        assert handle.requests["total"] <= objects + 10, handle.requests
        save_http = http()
        assert not options or objects <= save_http <= objects + 12, (save_http, handle.requests)

        engine.save(2, state_of(2), blocking=True)  # retention deletes step 1
        http()
        target = state_of(-1)
        assert engine.load(target) == 2
        assert torch.equal(target["model"]["t7"], state_of(2)["model"]["t7"])
        load = engine.last_load_requests
        reads = TENSORS + 2  # COMMIT, zarr.json (its index holds each array's layout), cells
        assert load["total"] <= reads + 3, load  # + listing the steps
        load_http = http()
        assert not options or reads <= load_http <= reads + 4, (load_http, load)


def test_the_requests_of_a_save_do_not_grow_with_the_steps_retention_deleted(
        storage: Storage) -> None:
    """An object store may keep a deleted step's folders listed for minutes (SeaweedFS removes
    empty folders one level per cleanup cycle): retention must not check, delete and list
    every such ghost again at every save, or a save's requests grow with the run's length."""
    url, options = storage
    totals, wire = [], []
    with wire_count(options) as (proxied, http), \
            CheckpointEngine(url, storage_options=proxied or options, keep_last=1) as engine:
        for step in range(1, 9):
            http()
            totals.append(engine.save(step, state_of(step), blocking=True).requests["total"])
            wire.append(http())
    # from the third save on: one deletion, and the folders of the one before seen empty once
    assert max(totals[2:]) <= totals[2] + 1, totals
    assert max(wire[2:]) <= wire[2] + 1, wire


class _ChangedWhileWalked(set):  # type: ignore[type-arg]
    """The engine's set of ghost steps, changed by another of its threads (a save of a step
    seen empty discards it) while ``step_dirs`` walks it."""

    def __iter__(self) -> Iterator[int]:
        walk = super().__iter__()
        step = next(walk)
        self.discard(step)  # the other thread, between two steps of the walk
        yield step
        yield from walk


def test_the_ghost_steps_changed_by_another_thread_do_not_fail_a_listing(tmp_path: Any) -> None:
    """Retention, loads and saves share the engine's set of steps listed with nothing in them;
    ``step_dirs`` walked that set itself, so a save's discard on another thread ended the walk
    with "Set changed size during iteration" (a retention, or a load's listing, failed)."""
    from antifragile.engine.storage import open_storage

    with CheckpointEngine(str(tmp_path / "ckpt")) as engine:
        for step in (1, 2, 3):
            engine.save(step, {"w": torch.ones(2)}, blocking=True)
    ghosts = _ChangedWhileWalked({1, 2})
    every, committed = commit_module.step_dirs(open_storage(str(tmp_path / "ckpt")), ghosts)
    assert every == [3] and committed == [3]


def test_the_requests_of_a_save_that_keeps_every_step_do_not_grow_with_the_steps_kept(
        storage: Storage) -> None:
    """``keep_last=None`` deletes no committed step, yet retention looked up the COMMIT of
    every step folder at every save: the n-th save made n more requests than the first."""
    url, options = storage
    totals = []
    with CheckpointEngine(url, storage_options=options, keep_last=None) as engine:
        for step in range(1, 9):
            totals.append(engine.save(step, {"w": torch.ones(4)}, blocking=True)
                          .requests["total"])
        assert engine.steps() == list(range(1, 9))
    assert max(totals[2:]) <= totals[2] + 1, totals

class _MetadataBarrier:
    """Holds the first read of array metadata until a second one is in flight at the same
    time: a reader that reads metadata one at a time never brings a second one, so the barrier
    breaks (after its timeout) and ``serial`` says so."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.barrier = threading.Barrier(2, timeout=10)
        self.met = 0
        self.serial = False
        self._lock = threading.Lock()

    def read(self, key: str, start: int = 0, end: int | None = None) -> Any:
        if key.endswith("/zarr.json") and "/model/" in key:
            with self._lock:
                first = self.met < 2
                self.met += 1
            if first:
                try:
                    self.barrier.wait()
                except threading.BrokenBarrierError:
                    self.serial = True
        return self.inner.read(key, start, end)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_load_reads_no_array_document_and_verify_reads_them_concurrently(
        tmp_path: Any) -> None:
    url = str(tmp_path / "ckpt")
    with CheckpointEngine(url) as engine:
        engine.save(1, state_of(1), blocking=True)
        barrier = _MetadataBarrier(engine.storage.inner)
        engine.storage.inner = barrier
        target = state_of(-1)
        assert engine.load(target, step=1) == 1
        assert barrier.met == 0, "a load read array documents the group's index describes"
        assert torch.equal(target["model"]["t199"], state_of(1)["model"]["t199"])
        assert engine.verify(1).ok
        assert barrier.met == TENSORS + 1  # model/zarr.json too, each read once
        assert not barrier.serial, "array metadata was read one object at a time"


class _PollCounter:
    """A step folder in which COMMIT appears after ``rounds`` listings; counts every request."""

    def __init__(self, inner: Any, rounds: int) -> None:
        self.inner, self.rounds = inner, rounds
        self.calls: collections.Counter[str] = collections.Counter()
        self.marker: bytes | None = None

    def list_dir(self, prefix: str) -> list[str]:
        self.calls["list"] += 1
        names = self.inner.list_dir(prefix)
        return names if self.calls["list"] > self.rounds else [n for n in names if n != "COMMIT"]

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if callable(attr):
            def counted(*args: Any, **kwargs: Any) -> Any:
                self.calls[name] += 1
                return attr(*args, **kwargs)
            return counted
        return attr


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[float]]:
    slept: list[float] = []
    monkeypatch.setattr(commit_module.time, "sleep", slept.append)
    yield slept


def _wait_for_a_commit(tmp_path: Any, *, world_size: int, rounds: int = 40) -> _PollCounter:
    """A rank of ``world_size`` waiting for a COMMIT that its polls see only after ``rounds``."""
    with CheckpointEngine(str(tmp_path / "ckpt")) as engine:
        engine.save(1, {"w": torch.ones(2)}, blocking=True)
        nonce = read_commit(engine.storage, 1)["nonce"]
        polled = _PollCounter(engine.storage, rounds=rounds)
        commit_module.wait_for_commit(polled, step=1, nonce=nonce, deadline=float("inf"),
                                      world_size=world_size)
    return polled


def test_waiting_for_a_commit_is_one_request_per_round_with_backoff(
    tmp_path: Any, sleeps: list[float]
) -> None:
    polled = _wait_for_a_commit(tmp_path, world_size=1000)
    assert polled.calls == {"list": 41, "read": 1}, polled.calls  # then COMMIT is read once
    assert len(sleeps) == 41  # a pause before every look: the first could never find it
    assert all(b >= a * 0.7 for a, b in itertools.pairwise(sleeps)), sleeps  # backs off
    assert sleeps[-1] >= 1.0, "1000 ranks poll at most every ~2 s, not every 0.5 s"


def test_a_small_job_sees_a_commit_within_tens_of_milliseconds(tmp_path: Any,
                                                                sleeps: list[float]) -> None:
    """2 ranks: polls back off only to 50 ms (not 0.5 s). A rank that saw the COMMIT up to 50%
    of the persist time late kept its save busy, and the next save (5 steps of 60 ms later in
    the transformers example) was skipped although the commit had long been written."""
    _wait_for_a_commit(tmp_path, world_size=2)
    assert max(sleeps) <= 0.05 * 1.1, sleeps
    # the whole job polls one prefix at most ~1,000 times a second: world / cap
    delays = commit_module._poll_delays(200)
    assert 200 / max(next(delays) for _ in range(100)) <= 1000 * 1.1


class _KeyReads:
    """The bytes read of each key, through the engine's storage."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.read_bytes: dict[str, int] = collections.Counter()

    def read(self, key: str, start: int = 0, end: int | None = None) -> Any:
        data = self.inner.read(key, start, end)
        self.read_bytes[key] += len(data)
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _load_counting_documents(url: str) -> dict[str, int]:
    """Every rank loads the step the test saved; the bytes it read of its COMMIT and of its
    group document."""
    target = state_of(0)
    with CheckpointEngine(url) as engine:
        reads = _KeyReads(engine.storage.inner)
        engine.storage.inner = reads
        assert engine.load(target) == 1
    assert torch.equal(target["model"]["t3"], state_of(1)["model"]["t3"])
    return {name: reads.read_bytes[f"step_000000001/{name}"] for name in ("COMMIT", "zarr.json")}


@pytest.mark.multiproc
def test_a_load_reads_the_commit_and_group_document_once_not_on_every_rank(tmp_path: Any
                                                                          ) -> None:
    """A COMMIT lists every object of the step (~100 bytes each): ~30 MB at 4,096 ranks of
    50 objects, ~160 MB of 300, and every rank read it whole, and the group document, at
    every load: W ranks read W times that from one object (~670 GB at 4,096 x 300;
    ``python -m bench.load_metadata``). Rank 0 reads them now and the others get their
    bytes from it; each other rank reads only the COMMIT's head (64 KiB at most), for the
    nonce of the save its own storage holds."""
    url = str(tmp_path / "ckpt")
    big = {"model": {f"t{i}": torch.randn(2, 2) for i in range(TENSORS * 5)}, "step": 0}
    with CheckpointEngine(url) as engine:
        engine.save(1, {**state_of(1), "extra": big}, blocking=True)
        commit_bytes = len(engine.storage.read("step_000000001/COMMIT"))
    assert commit_bytes > 2**16, commit_bytes  # longer than the head a rank reads
    reads = run_ranks(3, _load_counting_documents, url, timeout_s=120)
    assert reads[0]["COMMIT"] == commit_bytes and reads[0]["zarr.json"] > 0, reads
    for other in reads[1:]:
        assert other == {"COMMIT": 2**16, "zarr.json": 0}, reads
