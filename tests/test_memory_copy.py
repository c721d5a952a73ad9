"""The last committed save, kept in host memory (``keep_in_memory``), restores a rank's state
with no storage reads for its tensors; a damaged or outdated copy is never used; ``abandon``
stops a save that cannot commit without waiting for its deadline."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import RankGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from antifragile.engine import CheckpointEngine, CheckpointError, CheckpointMismatchError
from antifragile.engine.plan import PlanOptions


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _state(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 16, generator=gen), "b": torch.randn(16, generator=gen),
                      "e": torch.randn(0, 4, generator=gen)},
            "step": seed}


def test_memory_restores_the_committed_step_without_reading_its_tensors(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    saved = _state(10)
    with CheckpointEngine(url, keep_in_memory=True) as engine:
        engine.save(10, saved, blocking=True)
        memory = engine.memory_copy()
        assert memory is not None and memory.step == 10
        target = _state(99)  # other values everywhere
        with CheckpointEngine(url) as fresh:  # a new engine (a re-formed group), same layout
            assert fresh.load(target, memory=memory) == 10
            nbytes = sum(t.numel() * t.element_size() for t in saved["model"].values())
            assert fresh.last_load_sources == {"memory_bytes": nbytes, "storage_bytes": 0}
    for name, tensor in saved["model"].items():
        assert torch.equal(_bits(tensor), _bits(target["model"][name])), name
    assert target["step"] == 10


def test_a_damaged_memory_copy_is_not_used(tmp_path: Path,
                                           caplog: pytest.LogCaptureFixture) -> None:
    url = str(tmp_path / "ckpt")
    saved = _state(10)
    with CheckpointEngine(url, keep_in_memory=True) as engine:
        engine.save(10, saved, blocking=True)
        memory = engine.memory_copy()
        assert memory is not None
        (_, buf), *_ = memory.regions["model/w"]
        _bits(buf)[3] ^= 0x40  # a flipped bit in host memory
        target = _state(99)
        loader = CheckpointEngine(url)
        loader.load(target, memory=memory)
    assert "does not match its COMMIT manifest" in caplog.text
    assert loader.last_load_sources["memory_bytes"] == 0
    assert torch.equal(_bits(target["model"]["w"]), _bits(saved["model"]["w"]))


def test_a_damaged_copy_of_a_misaligned_chunk_is_not_used(tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """Each inner chunk of a cell is followed by its 4-byte CRC, so the second chunk of a float64
    tensor starts off its dtype's alignment and is staged as raw bytes. The copy used to clone
    those bytes when the save committed and restore from the clone, which no check covers: a
    bit flipped in the clone was loaded."""
    url = str(tmp_path / "ckpt")
    gen = torch.Generator().manual_seed(1)
    saved = {"w": torch.randn(64, 16, dtype=torch.float64, generator=gen),
             "v": torch.randint(-2**60, 2**60, (1024,), generator=gen)}  # 1-D int64
    options = PlanOptions(inner_chunk_bytes=16 * 8 * 8)  # 8 rows per inner chunk: 8 chunks
    with CheckpointEngine(url, keep_in_memory=True, plan_options=options) as engine:
        engine.save(10, saved, blocking=True)
        memory = engine.memory_copy()
        assert memory is not None
        target = {name: torch.zeros_like(t) for name, t in saved.items()}
        with CheckpointEngine(url, plan_options=options) as loader:  # intact: from memory
            loader.load(target, memory=memory)
            assert loader.last_load_sources["storage_bytes"] == 0
        for name, tensor in saved.items():
            assert torch.equal(_bits(target[name]), _bits(tensor)), name
        _, (_, second), *_ = memory.regions["w"]
        _bits(second)[3] ^= 0x40  # a flipped bit in what the restore copies from
        target = {name: torch.zeros_like(t) for name, t in saved.items()}
        loader = CheckpointEngine(url, plan_options=options)
        loader.load(target, memory=memory)
    assert torch.equal(_bits(target["w"]), _bits(saved["w"]))
    assert "does not match its COMMIT manifest" in caplog.text
    assert loader.last_load_sources["memory_bytes"] == 0


def test_a_copy_of_another_save_or_an_uncommitted_one_is_not_used(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    with CheckpointEngine(url, keep_in_memory=True, keep_last=None) as engine:
        engine.save(10, _state(10), blocking=True)
        old = engine.memory_copy()
        engine.save(20, _state(20), blocking=True)
        assert old is not None and engine.memory_copy().step == 20  # type: ignore[union-attr]
        target = _state(99)
        loader = CheckpointEngine(url)
        assert loader.load(target, memory=old) == 20  # the copy is of step 10: storage
        assert loader.last_load_sources["memory_bytes"] == 0
        assert torch.equal(_bits(target["model"]["w"]), _bits(_state(20)["model"]["w"]))
        gate = threading.Event()
        slow = CheckpointEngine(url, keep_in_memory=True, keep_last=None,
                                on_phase=lambda step, phase: gate.wait(30))
        slow.save(30, _state(30))  # staged over the buffers, not committed
        assert slow.memory_copy() is None
        gate.set()
        slow.close()
        assert slow.memory_copy() is not None and slow.memory_copy().step == 30  # type: ignore[union-attr]


def test_phases_are_reported_in_order_on_the_save_thread(tmp_path: Path) -> None:
    seen: list[tuple[int, str, str]] = []
    with CheckpointEngine(str(tmp_path / "ckpt"), on_phase=lambda step, phase: seen.append(
            (step, phase, threading.current_thread().name))) as engine:
        engine.save(7, _state(7), blocking=True)
    assert [(s, p) for s, p, _ in seen] == [(7, "persisting"), (7, "written"), (7, "recorded"),
                                            (7, "committing")]
    assert all(name == "ckpt-save-7" for *_, name in seen)


@pytest.fixture(scope="module")
def ranks() -> Iterator[RankGroup]:
    with RankGroup(2, timeout_s=180) as group:
        yield group


def _replicas_and_shards(url: str) -> list[Any]:
    """Each rank saves a Shard(0) tensor and a replicated one (written by one rank only), then
    restores both from its own memory copy into fresh targets, through a second engine."""
    mesh = DeviceMesh("cpu", torch.arange(2))
    gen = torch.Generator().manual_seed(3)
    full_s, full_r = torch.randn(8, 4, generator=gen), torch.randn(6, 6, generator=gen)

    def state(scale: float) -> dict[str, Any]:
        return {"s": distribute_tensor(full_s * scale, mesh, [Shard(0)]),
                "r": distribute_tensor(full_r * scale, mesh, [Replicate()])}

    saved = state(1.0)
    with CheckpointEngine(url, keep_in_memory=True) as engine:
        engine.save(5, saved, blocking=True)
        memory = engine.memory_copy()
    target = state(-1.0)
    second = CheckpointEngine(url)
    second.load(target, memory=memory)
    sources = dict(second.last_load_sources)
    second.close()
    same = all(torch.equal(_bits(saved[k].to_local()), _bits(target[k].to_local()))
               for k in saved)
    return [dist.get_rank(), same, sources]


@pytest.mark.multiproc
def test_replicas_another_rank_writes_are_kept_too(ranks: RankGroup, tmp_path: Path) -> None:
    for rank, same, sources in ranks.run(_replicas_and_shards, str(tmp_path / "ckpt")):
        assert same, f"rank {rank}"
        assert sources["storage_bytes"] == 0 and sources["memory_bytes"] == (4 * 4 + 36) * 4


def _abandon_a_save_nobody_can_commit(url: str) -> list[Any]:
    """Rank 1 holds its save before it writes; rank 0's coordinator waits for its record.
    Abandoning rank 0's engine fails that save at once, not at the commit deadline."""
    hold = threading.Event()
    on_phase = (lambda step, phase: hold.wait(60)) if dist.get_rank() == 1 else None
    engine = CheckpointEngine(url, commit_timeout_s=600, on_phase=on_phase)
    handle = engine.save(1, {"w": torch.ones(4) * dist.get_rank()})
    dist.barrier()
    if dist.get_rank() == 0:
        time.sleep(0.3)
        t0 = time.monotonic()
        engine.abandon()
        try:
            handle.wait(30)
            failed = ""
        except CheckpointError as exc:
            failed = str(exc)
        waited = time.monotonic() - t0
    else:
        failed, waited = "held", 0.0
    dist.barrier()
    hold.set()
    if dist.get_rank() == 1:
        engine.close()
    return [failed, waited]


@pytest.mark.multiproc
def test_abandon_fails_a_save_in_flight_at_once(ranks: RankGroup, tmp_path: Path) -> None:
    (failed, waited), _ = ranks.run(_abandon_a_save_nobody_can_commit, str(tmp_path / "ck"))
    assert "abandoned" in failed and waited < 5.0, (failed, waited)


def test_an_abandoned_engine_leaves_no_thread_behind(tmp_path: Path) -> None:
    """A survivor abandons its engine at every in-process re-formation: the engine's threads
    end (its save threads sat idle forever before, one more per re-formation)."""
    before = set(threading.enumerate())
    engine = CheckpointEngine(str(tmp_path / "ckpt"), keep_in_memory=True)
    for step in (1, 2):
        engine.save(step, _state(step)).wait()
    engine.abandon()
    assert engine.memory_copy() is not None  # what a re-formation restores from
    deadline = time.monotonic() + 5.0
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not [t.name for t in set(threading.enumerate()) - before]


def _shadow_damaged_or_outdated(url: str) -> list[Any]:
    """The replica another rank writes lives in this rank's shadow buffer: a flipped bit in
    it, or a copy used after a newer save staged over the same buffers, was loaded silently
    (only the cells a rank owns were checked against the manifest)."""
    mesh = DeviceMesh("cpu", torch.arange(2))
    full = torch.randn(6, 6, generator=torch.Generator().manual_seed(4))
    saved = {"r": distribute_tensor(full, mesh, [Replicate()])}
    engine = CheckpointEngine(url, keep_in_memory=True, keep_last=None)
    engine.save(5, saved, blocking=True)
    memory = engine.memory_copy()
    assert memory is not None and memory.staging is not None
    flipped = list(memory.staging.shadows)
    for path in flipped:
        _bits(memory.staging.shadows[path])[5] ^= 0x10
    out = []
    for _ in range(2):
        target = {"r": distribute_tensor(full * -1.0, mesh, [Replicate()])}
        with CheckpointEngine(url) as loader:
            loader.load(target, step=5, memory=memory)
        out.append(torch.equal(_bits(target["r"].to_local()), _bits(full)))
        for path in flipped:  # undone; then a newer save stages over the buffers
            _bits(memory.staging.shadows[path])[5] ^= 0x10
        flipped = []
        engine.save(6, {"r": distribute_tensor(full * 2.0, mesh, [Replicate()])}, blocking=True)
    engine.close()
    return [dist.get_rank(), bool(memory.staging.shadows), *out]


@pytest.mark.multiproc
def test_a_damaged_or_outdated_replica_in_memory_is_not_used(ranks: RankGroup,
                                                            tmp_path: Path) -> None:
    results = ranks.run(_shadow_damaged_or_outdated, str(tmp_path / "ckpt"))
    assert any(shadowed for _, shadowed, *_ in results)  # one rank holds the replica as a shadow
    for rank, _, after_flip, after_newer_save in results:
        assert after_flip, f"rank {rank}: a flipped bit in its replica was loaded"
        assert after_newer_save, f"rank {rank}: a newer save's values loaded as step 5"


def _restored_from(memory: Any, url: str, step: int) -> tuple[dict[str, Any], dict[str, int]]:
    target = _state(99)
    with CheckpointEngine(url) as fresh:
        assert fresh.load(target, step=step, memory=memory) == step
        return target, dict(fresh.last_load_sources)


@pytest.mark.parametrize("defer_staging", [False, True])
def test_the_copy_survives_a_save_in_flight(tmp_path: Path, defer_staging: bool) -> None:
    """A save used to stage over the buffers of the last committed one and withdraw the copy:
    an async save persists for a good part of the interval between saves, and a failure
    then found no copy in memory (a survivor of the goodput run restored from storage). The
    buffers are now two, used in turn: while step 2 persists the copy is step 1's, whole;
    once step 3 has staged over step 1's buffers, a copy of step 1 kept since is refused."""
    url = str(tmp_path / "ckpt")
    gate = threading.Event()
    hold = {2}
    with CheckpointEngine(url, keep_in_memory=True, keep_last=None,
                          on_phase=lambda step, phase: step in hold and gate.wait(30)) as engine:
        engine.save(1, _state(1), blocking=True)
        first = engine.memory_copy()
        assert first is not None and first.step == 1
        handle = engine.save(2, _state(2), defer_staging=defer_staging)
        try:
            handle.staged.wait(30)
            assert engine.memory_copy() is first
            target, sources = _restored_from(first, url, 1)
            assert sources["storage_bytes"] == 0 and sources["memory_bytes"] > 0
            assert torch.equal(_bits(target["model"]["w"]), _bits(_state(1)["model"]["w"]))
        finally:
            gate.set()
        handle.wait(30)
        assert engine.memory_copy().step == 2  # type: ignore[union-attr]
        engine.save(3, _state(3), blocking=True)  # into step 1's buffers
        target, sources = _restored_from(first, url, 1)
        assert sources["memory_bytes"] == 0, "a copy whose buffers were staged over was used"
        assert torch.equal(_bits(target["model"]["w"]), _bits(_state(1)["model"]["w"]))


def test_an_abandoned_save_released_later_leaves_the_next_generations_record_alone(
        tmp_path: Path) -> None:
    """A save held in a phase hook (a chaos pause point) when its engine is abandoned, and
    released only once the next generation saves the same step: it wrote its error record
    over the new save's record of the same rank, whose coordinator then took it for another
    attempt's and waited for a record until the commit deadline (the new save failed)."""
    url = str(tmp_path / "ckpt")
    held, release = threading.Event(), threading.Event()

    def hold_written(step: int, phase: str) -> None:
        if phase == "written":
            held.set()
            release.wait(60)

    stale = CheckpointEngine(url, on_phase=hold_written)
    stale_handle = stale.save(3, _state(3))
    assert held.wait(30)
    stale.abandon()

    def release_stale(step: int, phase: str) -> None:
        if phase == "recorded":  # this save's record is written: the stale save goes on now
            release.set()
            with pytest.raises(CheckpointError, match="abandoned"):
                stale_handle.wait(30)

    with CheckpointEngine(url, on_phase=release_stale, commit_timeout_s=3.0) as engine:
        engine.save(3, _state(3), blocking=True)
        assert engine.steps() == [3] and engine.verify(3).ok


def test_an_abandoned_save_reaches_no_further_phase_hook(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save abandoned while it writes (its process group failed) calls no phase hook after
    that: the trainer's hook holds a save at a chaos pause point of that step and phase, and
    the abandoned save held there took (and passed) the point meant for the next generation's
    save of the step, setting the shared progress to PAUSED and then TRAINING meanwhile."""
    monkeypatch.setattr("antifragile.engine.engine.ABANDON_WAIT_S", 0.5)  # the write hangs
    url = str(tmp_path / "ckpt")
    phases: list[str] = []
    engine = CheckpointEngine(url, on_phase=lambda step, phase: phases.append(phase))
    writing, release = threading.Event(), threading.Event()
    inner = engine.storage

    class RecordGate:
        def write(self, key: str, parts: Any, **kwargs: Any) -> None:
            if "/.ranks/" in key:
                writing.set()
                release.wait(60)
            inner.write(key, parts, **kwargs)

        def __getattr__(self, name: str) -> Any:
            return getattr(inner, name)

    engine.storage = RecordGate()  # type: ignore[assignment]
    handle = engine.save(4, _state(4))
    assert writing.wait(30)
    engine.abandon()
    release.set()
    with pytest.raises(CheckpointError, match="abandoned"):
        handle.wait(30)
    assert phases == ["persisting", "written"]


def _restore_into_another_layout_of_the_same_local_shape(url: str) -> list[Any]:
    """Saved Shard(0) on the mesh [0, 1], loaded with the copy into Shard(0) on the mesh
    [1, 0]: each rank's local shape is the same (4, 4), its rows are the other half."""
    full = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    saved = {"w": distribute_tensor(full, DeviceMesh("cpu", torch.arange(2)), [Shard(0)])}
    with CheckpointEngine(url, keep_in_memory=True) as engine:
        engine.save(5, saved, blocking=True)
        memory = engine.memory_copy()
    flipped = DeviceMesh("cpu", torch.tensor([1, 0]))
    target = {"w": distribute_tensor(torch.zeros(8, 4), flipped, [Shard(0)])}
    with CheckpointEngine(url) as loader:
        loader.load(target, memory=memory)
    expected = full.chunk(2)[1 - dist.get_rank()]
    return [dist.get_rank(), torch.equal(_bits(target["w"].to_local()), _bits(expected))]


@pytest.mark.multiproc
def test_a_copy_of_another_layout_with_the_same_local_shape_is_not_used(
        ranks: RankGroup, tmp_path: Path) -> None:
    for rank, same in ranks.run(_restore_into_another_layout_of_the_same_local_shape,
                                str(tmp_path / "ckpt")):
        assert same, f"rank {rank}: loaded the rows it held at the save, not its new ones"


def _fallback_past_the_step_in_memory(url: str) -> list[Any]:
    """Rank 0 holds step 2 in memory; rank 1 (a spare: no copy) finds its object of step 2
    damaged, so every rank loads step 1, from storage. Rank 0's sources still counted the
    bytes it had filled from memory for step 2: the restore was reported (restore_end,
    chaos's restore_memory_bytes) as partly from memory when none of step 1 came from it."""
    mesh = DeviceMesh("cpu", torch.arange(2))
    full = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))

    def state(scale: float) -> dict[str, Any]:
        return {"s": distribute_tensor(full * scale, mesh, [Shard(0)])}

    with CheckpointEngine(url, keep_in_memory=True, keep_last=None) as engine:
        engine.save(1, state(1.0), blocking=True)
        engine.save(2, state(2.0), blocking=True)
        memory = engine.memory_copy()
    dist.barrier()
    if dist.get_rank() == 1:
        cell = Path(url) / "step_000000002" / "s" / "c.1.0"  # rank 1's rows
        data = bytearray(cell.read_bytes())
        data[0] ^= 0x01
        cell.write_bytes(bytes(data))
    dist.barrier()
    target = state(-1.0)
    with pytest.warns(RuntimeWarning), CheckpointEngine(url) as loader:
        step = loader.load(target, memory=memory if dist.get_rank() == 0 else None)
        sources = dict(loader.last_load_sources)
    same = torch.equal(_bits(target["s"].to_local()), _bits(state(1.0)["s"].to_local()))
    return [dist.get_rank(), step, same, sources]


@pytest.mark.multiproc
def test_a_load_that_falls_back_past_the_step_in_memory_reports_storage_only(
        ranks: RankGroup, tmp_path: Path) -> None:
    for rank, step, same, sources in ranks.run(_fallback_past_the_step_in_memory,
                                               str(tmp_path / "ckpt")):
        assert step == 1 and same, f"rank {rank}"
        assert sources == {"memory_bytes": 0, "storage_bytes": 16 * 4}, f"rank {rank}: {sources}"


def test_tied_targets_refuse_a_copy_of_untied_tensors_as_storage_does(tmp_path: Path) -> None:
    """Two target entries that are one tensor (tied embedding and head) take a step that holds
    the same data for both, from memory as from storage; a step saved untied is a mismatch
    either way. From memory it loaded the second entry's data into both silently, while the
    same load from storage refused it."""
    url = str(tmp_path / "ckpt")
    tied = torch.randn(64, 32)
    emb, head = torch.randn(64, 32), torch.randn(64, 32)
    with CheckpointEngine(url, keep_in_memory=True, keep_last=None) as engine:
        engine.save(1, {"emb": tied, "head": tied}, blocking=True)
        shared = torch.zeros(64, 32)
        with CheckpointEngine(url) as loader:
            assert loader.load({"emb": shared, "head": shared}, memory=engine.memory_copy()) == 1
            assert loader.last_load_sources["storage_bytes"] == 0
        assert torch.equal(shared, tied)
        engine.save(2, {"emb": emb, "head": head}, blocking=True)
        with CheckpointEngine(url) as loader, pytest.raises(
                CheckpointMismatchError, match=r"step 2.*'emb' and 'head'.*memory"):
            loader.load({"emb": shared, "head": shared}, step=2, memory=engine.memory_copy())


class _SlowWrites:
    """``inner`` (an engine's storage) whose writes of keys containing ``part`` take up to
    ``slow_s`` (until ``release``): a write already in storage when the engine is abandoned."""

    def __init__(self, inner: Any, part: str, slow_s: float) -> None:
        self.inner, self.url, self.part, self.slow_s = inner, inner.url, part, slow_s
        self.writing, self.release = threading.Event(), threading.Event()

    def write(self, key: str, parts: Any, **kwargs: Any) -> None:
        if self.part in key:
            self.writing.set()
            self.release.wait(self.slow_s)
        self.inner.write(key, parts, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_write_in_flight_at_abandon_does_not_land_in_the_next_generations_step(
        tmp_path: Path) -> None:
    """A shard object the abandoned engine was writing (its pool thread was already in
    storage: ``abandon`` cancels only queued writes) landed after the next generation had
    saved and committed the same step, over its object: the committed step no longer
    verified (the manifest's CRCs are of the new object) and a load fell back to an older
    step. ``abandon`` now waits (bounded) for the writes already in storage, and no write
    of the engine begins after it."""
    url = str(tmp_path / "ckpt")
    with CheckpointEngine(url) as first:
        first.save(3, _state(3), blocking=True)
    stale = CheckpointEngine(url)
    slow = _SlowWrites(stale.storage, "/model/w/", slow_s=2.0)
    stale.storage = slow  # type: ignore[assignment]
    stale_handle = stale.save(5, _state(5))
    assert slow.writing.wait(30)
    stale.abandon()
    with CheckpointEngine(url) as engine:  # the next generation saves step 5 again
        engine.save(5, _state(50), blocking=True)
        slow.release.set()  # a write still in storage lands now
        with pytest.raises(CheckpointError):
            stale_handle.wait(30)
        assert engine.steps() == [3, 5]
        report = engine.verify(5)
        assert report.ok, report
        target = _state(99)
        assert engine.load(target) == 5
    assert torch.equal(_bits(target["model"]["w"]), _bits(_state(50)["model"]["w"]))


def test_an_abandoned_saves_late_commit_runs_no_retention_over_the_next_generation(
        tmp_path: Path) -> None:
    """The abandoned engine's coordinator was already writing the COMMIT of step 6 (every
    record was in, the check for abandon passed) when its engine was abandoned; the next
    generation restored step 2 and saved step 4. The COMMIT landed then, and the abandoned
    save's retention deleted step 4's folder as debris older than step 6 while step 4 was
    committing: step 4 was committed with nothing in it. ``abandon`` now waits for the
    COMMIT in storage, and the abandoned engine deletes nothing after it."""
    url = str(tmp_path / "ckpt")
    stale = CheckpointEngine(url, keep_last=2)
    stale.save(2, _state(2), blocking=True)
    slow = _SlowWrites(stale.storage, "step_000000006/COMMIT", slow_s=2.0)
    stale.storage = slow  # type: ignore[assignment]
    stale_handle = stale.save(6, _state(6))
    assert slow.writing.wait(30)
    stale.abandon()

    def committing(step: int, phase: str) -> None:
        if phase == "committing":  # step 4's records are in: the stale COMMIT lands now
            slow.release.set()
            stale_handle.wait(30)  # with its retention

    with CheckpointEngine(url, keep_last=2, on_phase=committing) as engine:
        engine.save(4, _state(4), blocking=True)
        for step in engine.steps():
            report = engine.verify(step)
            assert report.ok, (step, report)
        assert 4 in engine.steps()


def test_abandon_waits_for_a_write_that_does_not_return_only_so_long(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A write stuck on storage that does not answer holds ``abandon`` (and with it the
    recovery) for ``ABANDON_WAIT_S`` at most, and is named in a warning."""
    monkeypatch.setattr("antifragile.engine.engine.ABANDON_WAIT_S", 0.5)
    stale = CheckpointEngine(str(tmp_path / "ckpt"))
    slow = _SlowWrites(stale.storage, "/model/w/", slow_s=60.0)
    stale.storage = slow  # type: ignore[assignment]
    handle = stale.save(5, _state(5))
    assert slow.writing.wait(30)
    t0 = time.monotonic()
    stale.abandon()
    waited = time.monotonic() - t0
    slow.release.set()
    assert 0.4 < waited < 5.0, waited
    assert "model/w/" in caplog.text and "still in storage" in caplog.text
    with pytest.raises(CheckpointError):
        handle.wait(30)
