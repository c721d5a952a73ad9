"""Damage to a committed step, made from outside the engine with raw file and object operations.

For each kind of damage, on every backend: ``verify`` reports the array and the object key,
``load(step=N)`` raises CheckpointCorruptError naming the step and the array, and ``load()``
falls back to the newest older intact step with a warning, loads its data, and quarantines the
damaged step so that it can be saved again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import fsspec
import pytest
import torch

from antifragile.engine import (
    CheckpointCorruptError,
    CheckpointEngine,
    CheckpointError,
    CheckpointNotFoundError,
    PlanOptions,
)

Storage = tuple[str, dict[str, Any] | None]

# 64 x 16 float32 = 4 KiB in 4 shard objects of 16 rows, each of 4 inner chunks of 4 rows
PLAN = PlanOptions(max_object_bytes=1024, inner_chunk_bytes=256)
SHARD = "model/w/c.1.0"
INDEX_NBYTES = 4 * 16 + 4


@dataclass(slots=True)
class Raw:
    """Bytes of one checkpoint root, read and written behind the engine's back."""

    fs: Any
    root: str

    @classmethod
    def open(cls, storage: Storage) -> Raw:
        url, options = storage
        extra = {"skip_instance_cache": True, "use_listings_cache": False} if options else {}
        fs, root = fsspec.core.url_to_fs(url, **(options or {}), **extra)
        return cls(fs, root)

    def path(self, step: int, key: str) -> str:
        return f"{self.root}/step_{step:09d}/{key}"

    def read(self, step: int, key: str) -> bytes:
        return bytes(self.fs.cat_file(self.path(step, key)))

    def write(self, step: int, key: str, data: bytes) -> None:
        self.fs.pipe_file(self.path(step, key), data)

    def delete(self, step: int, key: str) -> None:
        self.fs.rm_file(self.path(step, key))

    def flip_bit(self, step: int, key: str, offset: int, bit: int = 2) -> None:
        data = bytearray(self.read(step, key))
        data[offset] ^= 1 << bit
        self.write(step, key, bytes(data))


def state_of(step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)
    return {
        "model": {
            "w": torch.randn(64, 16, generator=gen),
            "b": torch.randn(16, generator=gen).bfloat16(),
        },
        "step": step,
    }


def blank() -> dict[str, Any]:
    return {
        "model": {"w": torch.zeros(64, 16), "b": torch.zeros(16, dtype=torch.bfloat16)},
        "step": -1,
    }


@pytest.fixture
def two_steps(storage: Storage) -> Iterator[tuple[CheckpointEngine, Raw]]:
    """Steps 1 and 2 committed; the tests damage step 2."""
    url, options = storage
    with CheckpointEngine(
        url, storage_options=options, keep_last=None, plan_options=PLAN
    ) as engine:
        for step in (1, 2):
            engine.save(step, state_of(step), blocking=True)
        raw = Raw.open(storage)
        assert len(raw.read(2, SHARD)) == 16 * 16 * 4 + 4 * 4 + INDEX_NBYTES
        yield engine, raw


def _truncate(raw: Raw) -> None:
    data = raw.read(2, SHARD)
    raw.write(2, SHARD, data[: len(data) // 2])


DAMAGE: dict[str, tuple[Callable[[Raw], None], str, str | None]] = {
    # name: (damage, object key verify must name, array it must name)
    "data-bit": (lambda raw: raw.flip_bit(2, SHARD, 100), SHARD, "model/w"),
    "chunk-crc-bit": (
        lambda raw: raw.flip_bit(2, SHARD, 16 * 16 * 4 + 15, bit=7),
        SHARD,
        "model/w",
    ),
    "index-bit": (lambda raw: raw.flip_bit(2, SHARD, -INDEX_NBYTES + 3, bit=0), SHARD, "model/w"),
    "truncated": (_truncate, SHARD, "model/w"),
    "deleted": (lambda raw: raw.delete(2, SHARD), SHARD, "model/w"),
    "group-metadata": (lambda raw: raw.flip_bit(2, "zarr.json", 40), "zarr.json", None),
    "commit-marker": (
        lambda raw: raw.write(2, "COMMIT", raw.read(2, "COMMIT")[:-7]),
        "COMMIT",
        None,
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_step_is_reported_refused_and_skipped(
    two_steps: tuple[CheckpointEngine, Raw], damage: str
) -> None:
    engine, raw = two_steps
    make, key, array = DAMAGE[damage]
    make(raw)

    report = engine.verify(2)
    assert not report.ok
    assert key in {p.key for p in report.problems}, report.summary()
    assert report.bad_arrays == ([array] if array else [])
    assert engine.verify(1).ok

    with pytest.raises(CheckpointCorruptError, match="step 2") as caught:
        engine.load(blank(), step=2)
    assert array is None or array in str(caught.value)
    assert engine.steps() == [1, 2], "an explicit step is reported, not quarantined"

    target = blank()
    with pytest.warns(RuntimeWarning, match="step 2 skipped"):
        assert engine.load(target) == 1
    expected = state_of(1)
    assert torch.equal(target["model"]["w"], expected["model"]["w"])
    assert torch.equal(target["model"]["b"], expected["model"]["b"])
    assert target["step"] == 1
    assert engine.steps() == [1], "the damaged step is quarantined"

    engine.save(2, state_of(22), blocking=True)
    assert engine.verify(2).ok
    assert engine.load(target) == 2
    assert torch.equal(target["model"]["w"], state_of(22)["model"]["w"])



def _load_latest(url: str) -> tuple[int, str, bool]:
    """On each rank: the step the newest load got, its warnings, and whether the model is it."""
    import warnings

    target = blank()
    with CheckpointEngine(url, keep_last=None, plan_options=PLAN) as engine, \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = engine.load(target)
    return (step, " | ".join(str(w.message) for w in caught),
            torch.equal(target["model"]["w"], state_of(step)["model"]["w"]))


@pytest.mark.multiproc
@pytest.mark.parametrize("damage", ["commit-marker", "group-metadata"])
def test_a_step_whose_shared_documents_are_damaged_is_skipped_by_every_rank(
        tmp_path: Any, damage: str) -> None:
    """Rank 0 reads the COMMIT and the group document for every rank: damage there is rank
    0's finding, which every rank raises as its own (the step skipped together); another
    rank's own re-read confirms it before the step is quarantined."""
    from _dist import run_ranks

    url = str(tmp_path / "ckpt")
    with CheckpointEngine(url, keep_last=None, plan_options=PLAN) as engine:
        for step in (1, 2):
            engine.save(step, state_of(step), blocking=True)
    make, key, _ = DAMAGE[damage]
    make(Raw.open((url, None)))
    outcomes = run_ranks(2, _load_latest, url, timeout_s=120)
    for step, warned, equal in outcomes:
        assert step == 1 and equal, outcomes
        assert "step 2 skipped" in warned and key in warned, outcomes
        assert "quarantined; confirmed by rank 1" in warned, outcomes

def test_verify_of_a_step_that_is_not_committed_raises_not_found_instead_of_damage(
    tmp_path: Any,
) -> None:
    """A step never saved, deleted by retention, or only begun (a folder without COMMIT) has
    nothing to verify: a typo in a step number is not damage."""
    with CheckpointEngine(str(tmp_path), keep_last=1, plan_options=PLAN) as engine:
        for step in (1, 2):
            engine.save(step, state_of(step), blocking=True)
        (tmp_path / "step_000000003").mkdir()
        for step in (1, 3, 99):
            with pytest.raises(CheckpointNotFoundError, match=rf"step {step} is not committed"):
                engine.verify(step)
        assert engine.verify(2).ok


@pytest.mark.parametrize("step", [-1, "2", 2.0, True, 2**62])
def test_verify_of_a_step_that_cannot_be_one_is_refused_not_reported_as_damage(
    tmp_path: Any, step: Any,
) -> None:
    """A step that is not a non-negative int below 2**62 is the caller's mistake, refused as
    save and load refuse it: not a report of a damaged COMMIT."""
    with CheckpointEngine(str(tmp_path), plan_options=PLAN) as engine:
        engine.save(2, state_of(2), blocking=True)
        with pytest.raises(CheckpointError, match=r"step must be") as raised:
            engine.verify(step)
        assert not isinstance(raised.value, CheckpointCorruptError)


@pytest.mark.parametrize("blocked", ["model/w/c.1.0", "COMMIT", "zarr.json"])
def test_a_storage_failure_while_verifying_is_raised_not_reported_as_damage(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, blocked: str,
) -> None:
    """Storage refusing a read (a 403, an outage past the retries) says nothing about the
    data: verify reported the object as damaged and ``chaos ckpt verify`` exited 1 (DAMAGED)
    for an intact step, which an operator may then delete."""
    from antifragile.engine.errors import StorageError

    with CheckpointEngine(str(tmp_path), plan_options=PLAN) as engine:
        engine.save(2, state_of(2), blocking=True)
        inner = engine.storage.inner
        read = inner.read

        def refusing(key: str, *args: Any, **kwargs: Any) -> Any:
            if key.startswith(f"step_000000002/{blocked}"):
                raise PermissionError(f"403 Forbidden: {key}")
            return read(key, *args, **kwargs)

        monkeypatch.setattr(inner, "read", refusing)
        with pytest.raises(StorageError, match="403 Forbidden"):
            engine.verify(2)
        monkeypatch.undo()
        assert engine.verify(2).ok


def test_a_damaged_array_document_is_reported_by_verify_and_not_used_by_load(
    two_steps: tuple[CheckpointEngine, Raw],
) -> None:
    """A load takes each array's layout from the group's index (checked against the COMMIT
    manifest), not from the array's own zarr.json, which is there for other zarr readers: a
    damaged one is reported by verify, and refusing the intact data would lose a checkpoint."""
    engine, raw = two_steps
    raw.flip_bit(2, "model/w/zarr.json", 40)
    report = engine.verify(2)
    assert not report.ok and report.bad_arrays == ["model/w"]
    assert [p.key for p in report.problems] == ["model/w/zarr.json"]
    target = blank()
    assert engine.load(target) == 2
    assert torch.equal(target["model"]["w"], state_of(2)["model"]["w"])
    assert engine.steps() == [1, 2]


def test_damage_outside_what_the_target_reads_is_caught_by_verify(
    two_steps: tuple[CheckpointEngine, Raw],
) -> None:
    engine, raw = two_steps
    raw.flip_bit(2, "model/b/c.0", 3)
    target = {"model": {"w": torch.zeros(64, 16)}}
    assert engine.load(target, step=2) == 2
    assert torch.equal(target["model"]["w"], state_of(2)["model"]["w"])
    report = engine.verify(2)
    assert not report.ok and report.bad_arrays == ["model/b"]
    assert [p.key for p in report.problems] == ["model/b/c.0"]


def _forged_entry(raw: Raw, step: int, key: str) -> None:
    """The COMMIT of ``step``, resealed, with ``key``'s digest off by one: a consistent
    document whose entry for ``key`` is not this save's."""
    from _forge import edit_commit

    def edit(commit: dict[str, Any]) -> None:
        commit["objects"][key][1] ^= 1

    edit_commit(lambda: raw.read(step, "COMMIT"), edit,
                lambda data: raw.write(step, "COMMIT", data))


def test_a_load_checks_the_manifest_entries_of_what_it_reads_and_verify_checks_all(
    two_steps: tuple[CheckpointEngine, Raw], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A COMMIT lists every object of the step (~100 bytes each: 160 MB at 4,096 ranks of 300
    objects); checking every entry's digest was half of every rank's load. A load checks the
    entries it uses; verify and ``chaos ckpt inspect`` check them all."""
    from antifragile.engine import _format

    engine, raw = two_steps
    _forged_entry(raw, 2, "model/b/c.0")
    checked: list[str] = []
    digest = _format.object_digest

    def counting(nonce: int, key: str, nbytes: int, crcs: Any) -> int:
        checked.append(key)
        return digest(nonce, key, nbytes, crcs)

    monkeypatch.setattr(_format, "object_digest", counting)
    target = {"model": {"w": torch.zeros(64, 16)}}
    assert engine.load(target, step=2) == 2  # model/b is not read: its entry is not used
    assert torch.equal(target["model"]["w"], state_of(2)["model"]["w"])
    assert "model/b/c.0" not in checked and f"{SHARD}" in checked
    with pytest.raises(CheckpointCorruptError, match=r"step 2.*model/b/c\.0.*digest"):
        engine.load(blank(), step=2)
    report = engine.verify(2)
    assert not report.ok and [p.key for p in report.problems] == ["COMMIT"]
    assert "model/b/c.0" in report.problems[0].reason


def test_every_step_damaged_raises_and_quarantines_all(
    two_steps: tuple[CheckpointEngine, Raw],
) -> None:
    engine, raw = two_steps
    for step in (1, 2):
        raw.flip_bit(step, SHARD, 7)
    with (
        pytest.warns(RuntimeWarning, match="step 2 skipped, trying step 1"),
        pytest.raises(CheckpointCorruptError, match=r"step 2.*model/w"),
    ):
        engine.load(blank())
    assert engine.steps() == []


def test_a_root_whose_every_step_was_quarantined_is_not_an_empty_one(
    two_steps: tuple[CheckpointEngine, Raw],
) -> None:
    """The next job (or the next attempt, after the first one's load quarantined them all) may
    not take "nothing committed" for a fresh root: a trainer that starts over when nothing is
    committed would silently retrain from step 0."""
    engine, raw = two_steps
    for step in (1, 2):
        raw.flip_bit(step, SHARD, 7)
    with pytest.warns(RuntimeWarning), pytest.raises(CheckpointCorruptError):
        engine.load(blank())
    assert engine.steps() == []  # what is committed: nothing
    with pytest.raises(CheckpointCorruptError, match=r"steps \[1, 2\] .*quarantined"):
        engine.agreed_steps()
    with pytest.raises(CheckpointCorruptError, match=r"steps \[1, 2\] .*quarantined"):
        engine.load(blank())


def test_verify_names_the_array_whose_path_has_a_c_component(storage: Storage) -> None:
    url, options = storage
    with CheckpointEngine(url, storage_options=options) as engine:
        engine.save(1, {"model": {"c": {"w": torch.randn(4, 4)}}}, blocking=True)
        raw = Raw.open(storage)
        raw.flip_bit(1, "model/c/w/c.0.0", 5)
        report = engine.verify(1)
    assert not report.ok
    assert report.bad_arrays == ["model/c/w"]


# -- substitution: a stale, foreign or swapped object of the right size ------------------------
# Each object below is a valid zarr shard (its own crc32c checks pass); only the manifest can
# tell that it is not the object this save wrote.


def _copy_object(raw: Raw, src: tuple[int, str], dst: tuple[int, str]) -> None:
    data = raw.read(*src)
    assert len(data) == len(raw.read(*dst)), "the substitute must have the right size"
    raw.write(dst[0], dst[1], data)


def _assert_refused(engine: CheckpointEngine, step: int, key: str, array: str,
                    target: dict[str, Any]) -> None:
    report = engine.verify(step)
    assert not report.ok, report.summary()
    assert key in {p.key for p in report.problems}, report.summary()
    assert report.bad_arrays == [array], report.summary()
    with pytest.raises(CheckpointCorruptError, match=rf"step {step}\b.*{array}"):
        engine.load(target, step=step)


def test_stale_object_from_another_step_is_refused(storage: Storage) -> None:
    """The issue's repro: step 10's shard copied over step 20's (a late write from a dead
    writer, two jobs at one URL)."""
    url, options = storage
    states = {s: {"w": torch.randn(16, 8, generator=torch.Generator().manual_seed(s))}
              for s in (10, 20)}
    with CheckpointEngine(url, storage_options=options, keep_last=None) as engine:
        for step, state in states.items():
            engine.save(step, state, blocking=True)
        raw = Raw.open(storage)
        _copy_object(raw, (10, "w/c.0.0"), (20, "w/c.0.0"))
        _assert_refused(engine, 20, "w/c.0.0", "w", {"w": torch.zeros(16, 8)})
        target = {"w": torch.zeros(16, 8)}
        with pytest.warns(RuntimeWarning, match="step 20 skipped"):
            assert engine.load(target) == 10
        assert torch.equal(target["w"], states[10]["w"])


def test_object_of_another_array_of_the_same_size_is_refused(storage: Storage) -> None:
    url, options = storage
    gen = torch.Generator().manual_seed(0)
    state = {"a": torch.randn(16, 8, generator=gen), "b": torch.randn(16, 8, generator=gen)}
    with CheckpointEngine(url, storage_options=options) as engine:
        engine.save(1, state, blocking=True)
        raw = Raw.open(storage)
        _copy_object(raw, (1, "a/c.0.0"), (1, "b/c.0.0"))
        _assert_refused(engine, 1, "b/c.0.0", "b", {"a": torch.zeros(16, 8),
                                                   "b": torch.zeros(16, 8)})


def test_two_same_size_objects_swapped_are_refused(storage: Storage) -> None:
    """Rows of an uneven tensor (7 rows in objects of 2: three of the same size, then one
    short) whose objects trade places: each passes its own checks, the rows come back in the
    wrong order unless the manifest binds each object to its key."""
    url, options = storage
    w = torch.randn(7, 4)
    with CheckpointEngine(url, storage_options=options,
                          plan_options=PlanOptions(max_object_bytes=32)) as engine:
        engine.save(1, {"w": w}, blocking=True)
        raw = Raw.open(storage)
        first, second = raw.read(1, "w/c.0.0"), raw.read(1, "w/c.1.0")
        assert len(first) == len(second) and first != second
        raw.write(1, "w/c.0.0", second)
        raw.write(1, "w/c.1.0", first)
        report = engine.verify(1)
        assert {p.key for p in report.problems} == {"w/c.0.0", "w/c.1.0"}, report.summary()
        with pytest.raises(CheckpointCorruptError, match=r"step 1\b.*w/c\.[01]\.0"):
            engine.load({"w": torch.zeros(7, 4)}, step=1)


def _load_half(url: str, options: dict[str, Any] | None, step: int) -> str:
    """On each of 2 ranks: load rows [8r, 8r + 8) of a 16 x 8 tensor (a partial read of the
    saved object: 4 of its 8 inner chunks). Returns the outcome."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    target = {"w": distribute_tensor(torch.zeros(16, 8), mesh, [Shard(0)])}
    with CheckpointEngine(url, storage_options=options) as engine:
        try:
            engine.load(target, step=step)
        except CheckpointCorruptError as exc:
            return f"refused: {exc}"
    return "loaded"


@pytest.mark.multiproc
def test_partial_reads_check_the_manifest_too(storage: Storage) -> None:
    """Resharded loads read only some inner chunks of an object: they must refuse a stale
    object as well, on every rank."""
    from _dist import run_ranks

    url, options = storage
    plan = PlanOptions(inner_chunk_bytes=64)  # 16 x 8 float32: one object of 8 inner chunks
    with CheckpointEngine(url, storage_options=options, keep_last=None,
                          plan_options=plan) as engine:
        for step in (10, 20):
            gen = torch.Generator().manual_seed(step)
            engine.save(step, {"w": torch.randn(16, 8, generator=gen)}, blocking=True)
    raw = Raw.open(storage)
    _copy_object(raw, (10, "w/c.0.0"), (20, "w/c.0.0"))
    outcomes = run_ranks(2, _load_half, url, options, 20)
    assert all(o.startswith("refused") and "step 20" in o and "w/c.0.0" in o
               for o in outcomes), outcomes
    assert run_ranks(2, _load_half, url, options, 10) == ["loaded", "loaded"]


def test_commit_marker_with_a_flipped_byte_is_refused(storage: Storage) -> None:
    """A COMMIT that still parses, with one digit changed (its byte count): it carries a
    checksum of its own, checked before use."""
    url, options = storage
    with CheckpointEngine(url, storage_options=options, keep_last=None) as engine:
        engine.save(1, state_of(1), blocking=True)
        engine.save(2, state_of(2), blocking=True)
        raw = Raw.open(storage)
        marker = raw.read(2, "COMMIT")
        at = marker.index(b'"nbytes": ') + len(b'"nbytes": ')
        raw.write(2, "COMMIT", marker[:at] + bytes([marker[at] ^ 1]) + marker[at + 1:])
        assert engine.verify(1).ok
        report = engine.verify(2)
        assert not report.ok and "COMMIT" in {p.key for p in report.problems}
        with pytest.raises(CheckpointCorruptError, match=r"step 2\b.*COMMIT.*checksum"):
            engine.load(blank(), step=2)
        with pytest.warns(RuntimeWarning, match="step 2 skipped"):
            assert engine.load(blank()) == 1


class _FlipInRecords:
    """A storage that damages rank records in flight: ``"step": 7`` becomes ``"step": 6``
    (one bit), leaving valid JSON. Everything else passes through."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.flipped = 0

    def write(self, key: str, parts: Any, **kwargs: Any) -> None:
        if "/.ranks/" in key:
            data = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
            damaged = data.replace(b'"step": 7', b'"step": 6')
            self.flipped += damaged != data
            parts = [damaged]
        self.inner.write(key, parts, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_rank_record_with_a_flipped_byte_fails_the_save(storage: Storage) -> None:
    """The coordinator builds COMMIT from the records: a damaged one must not be committed
    (here it would store the value ``step: 6`` for a save of 7)."""
    url, options = storage
    with CheckpointEngine(url, storage_options=options) as engine:
        flipping = _FlipInRecords(engine.storage.inner)
        engine.storage.inner = flipping
        handle = engine.save(7, {"w": torch.ones(4), "step": 7})
        with pytest.raises(CheckpointError, match=r"step 7.*rank 0.*record.*checksum"):
            handle.wait()
        assert flipping.flipped == 1
        assert engine.steps() == []


# -- quarantine: agreed, and the manifest kept as evidence -------------------------------------


def test_quarantine_keeps_the_manifest_so_verify_still_explains_the_damage(
    storage: Storage,
) -> None:
    """COMMIT is moved aside (to QUARANTINE, with the reason), not destroyed: `chaos ckpt ls`
    names the quarantined step and why, `chaos ckpt verify` still reads it against its manifest,
    also after the next save has run retention."""
    from click.testing import CliRunner

    from antifragile.chaos.cli import main

    url, options = storage
    with CheckpointEngine(url, storage_options=options, keep_last=2, plan_options=PLAN) as engine:
        for step in (1, 2):
            engine.save(step, state_of(step), blocking=True)
        raw = Raw.open(storage)
        raw.flip_bit(2, SHARD, 100)
        with pytest.warns(RuntimeWarning, match="step 2 skipped"):
            assert engine.load(blank()) == 1
        assert engine.steps() == [1]
        engine.save(3, state_of(3), blocking=True)  # retention runs, the evidence stays
        assert engine.steps() == [1, 3]
    flags = ["--endpoint-url", options["endpoint_url"]] if options else []
    runner = CliRunner()
    listing = runner.invoke(main, ["ckpt", "ls", url, *flags])
    assert listing.exit_code == 0, listing.output
    line = next(x for x in listing.output.splitlines() if x.split()[:1] == ["2"])
    assert "quarantined" in line and SHARD in line, listing.output
    report = runner.invoke(main, ["ckpt", "verify", url, "--step", "2", *flags])
    assert report.exit_code == 1, report.output
    assert "QUARANTINED" in report.output and "DAMAGED" in report.output
    assert SHARD in report.output and "model/w" in report.output
    everything = runner.invoke(main, ["ckpt", "verify", url, *flags])
    assert everything.exit_code == 0, everything.output  # what load can see is intact
    assert "step 2: QUARANTINED" in everything.output


def test_verify_names_a_damaged_quarantine_note_not_the_commit(
    two_steps: tuple[CheckpointEngine, Raw],
) -> None:
    """A quarantined step whose QUARANTINE note is damaged: verify's problem named COMMIT,
    an object that is not there, instead of the note that is damaged."""
    engine, raw = two_steps
    raw.flip_bit(2, SHARD, 100)
    with pytest.warns(RuntimeWarning, match="step 2 skipped"):
        assert engine.load(blank()) == 1
    raw.flip_bit(2, "QUARANTINE", 20)
    report = engine.verify(2)
    assert not report.ok
    assert [p.key for p in report.problems] == ["QUARANTINE"], report.problems


def test_a_quarantined_step_saved_again_keeps_the_evidence_of_its_damage(
    storage: Storage,
) -> None:
    """Training resumes from step 1 and saves step 2 again: the new save clears the damaged
    folder, and with it the QUARANTINE note that was the only record of what was damaged and
    why. The note is also kept outside the step folders, and `chaos ckpt ls` lists it."""
    from click.testing import CliRunner

    from antifragile.chaos.cli import main

    url, options = storage
    with CheckpointEngine(url, storage_options=options, keep_last=2, plan_options=PLAN) as engine:
        for step in (1, 2):
            engine.save(step, state_of(step), blocking=True)
        Raw.open(storage).flip_bit(2, SHARD, 100)
        with pytest.warns(RuntimeWarning, match="step 2 skipped"):
            assert engine.load(blank()) == 1
        engine.save(2, state_of(2), blocking=True)  # training went on and saved step 2 again
        assert engine.steps() == [1, 2] and engine.verify(2).ok
    flags = ["--endpoint-url", options["endpoint_url"]] if options else []
    listing = CliRunner().invoke(main, ["ckpt", "ls", url, *flags])
    assert listing.exit_code == 0, listing.output
    earlier = [x for x in listing.output.splitlines() if "quarantined earlier" in x]
    assert len(earlier) == 1 and earlier[0].split()[0] == "2" and SHARD in earlier[0], \
        listing.output


def test_retention_that_keeps_every_step_keeps_every_quarantined_one(storage: Storage) -> None:
    """With ``keep_last=None`` no committed step is ever deleted, and a quarantined step stays
    as long as a committed step of its age would. A fresh engine (the job restarted after a
    load found steps 1 and 2 damaged) deleted both as debris older than its first save."""
    url, options = storage
    kwargs: dict[str, Any] = {"storage_options": options, "keep_last": None, "plan_options": PLAN}
    with CheckpointEngine(url, **kwargs) as engine:
        for step in (1, 2):
            engine.save(step, state_of(step), blocking=True)
        raw = Raw.open(storage)
        for step in (1, 2):
            raw.flip_bit(step, SHARD, 100)
        with pytest.warns(RuntimeWarning, match="step 2 skipped"), \
                pytest.raises(CheckpointCorruptError):
            engine.load(blank())
    with CheckpointEngine(url, **kwargs) as engine:
        engine.save(3, state_of(3), blocking=True)
        assert engine.steps() == [3]
        for step in (1, 2):
            report = engine.verify(step)
            assert report.quarantined is not None and [p.key for p in report.problems] == [SHARD]


class _FailingQuarantine:
    """Storage that refuses to delete step 2's COMMIT (a 403 on DELETE, an outage): the
    quarantine fails after its note was written."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def delete(self, key: str) -> None:
        if key.endswith("step_000000002/COMMIT"):
            from antifragile.engine.errors import StorageError

            raise StorageError(f"{key}: access denied")
        self.inner.delete(key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _RetiredWhileRead:
    """Storage on which retention (another save's, beside this load) deletes step 2 while the
    load reads it: its COMMIT first, then its objects."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def read(self, key: str, start: int = 0, end: int | None = None) -> Any:
        if key.endswith(f"step_000000002/{SHARD}"):
            self.inner.delete("step_000000002/COMMIT")
            self.inner.delete(f"step_000000002/{SHARD}")
        return self.inner.read(key, start, end)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _two_steps_on(url: str) -> CheckpointEngine:
    engine = CheckpointEngine(url, keep_last=None, plan_options=PLAN)
    for step in (1, 2):
        engine.save(step, state_of(step), blocking=True)
    return engine


def test_the_skip_warning_does_not_say_quarantined_of_a_step_whose_quarantine_failed(
    tmp_path: Any,
) -> None:
    """The warning said "(quarantined; confirmed by rank 0)" of a step whose quarantine failed
    (its COMMIT could not be deleted): it stays visible and is tried again at the next load."""
    from antifragile.engine.quarantine import quarantine_log

    url = str(tmp_path / "ckpt")
    with _two_steps_on(url) as engine:
        Raw.open((url, None)).flip_bit(2, SHARD, 100)
        engine.storage.inner = _FailingQuarantine(engine.storage.inner)
        with pytest.warns(RuntimeWarning, match="step 2 skipped") as caught:
            assert engine.load(blank()) == 1
        message = str(caught[0].message)
        assert "(quarantined" not in message, message
        assert "quarantining it failed (it stays visible" in message, message
        assert engine.steps() == [1, 2]
        assert [step for step, _ in quarantine_log(engine.storage)[0]] == [2]


def test_the_skip_warning_does_not_say_intact_of_an_object_it_could_not_re_read(
    tmp_path: Any,
) -> None:
    """Retention beside the load deleted step 2 while it was read: the confirming re-read
    could not be made (the COMMIT was gone), and the warning said the object was "re-read
    intact". Then it said the damage was not confirmed; now the load sees that the step went
    away (its COMMIT is gone), says so, and tries no re-read (see test_reader_beside_writer)."""
    url = str(tmp_path / "ckpt")
    with _two_steps_on(url) as engine:
        engine.storage.inner = _RetiredWhileRead(engine.storage.inner)
        with pytest.warns(RuntimeWarning, match="step 2 skipped") as caught:
            assert engine.load(blank()) == 1
        message = str(caught[0].message)
        assert "intact" not in message, message
        assert "step 2 was deleted while it was read" in message, message
        assert "damage" not in message and "re-read" not in message, message
        assert engine.steps() == [1]


RANK_1_SHARD = "model/w/c.3.0"  # rows 48-63: read by rank 1 only when 2 ranks hold Shard(0)


def _load_with_a_bad_link_on_rank_1(url: str) -> tuple[int, list[str]]:
    """Each rank loads rows of model/w; rank 1's storage hands it damaged bytes once (a bad NIC
    or DRAM on that node): the object on storage is intact."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    class BadLink:
        def __init__(self, inner: Any) -> None:
            self.inner, self.flipped = inner, False

        def read(self, key: str, start: int = 0, end: int | None = None) -> Any:
            data = self.inner.read(key, start, end)
            if key.endswith(f"step_000000002/{RANK_1_SHARD}") and not self.flipped:
                self.flipped = True
                data = bytearray(data)
                data[0] ^= 1
            return data

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    mesh = init_device_mesh("cpu", (2,))
    target = blank()
    target["model"]["w"] = distribute_tensor(torch.zeros(64, 16), mesh, [Shard(0)])
    with CheckpointEngine(url, plan_options=PLAN) as engine:
        if torch.distributed.get_rank() == 1:
            engine.storage.inner = BadLink(engine.storage.inner)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loaded = engine.load(target)
        return loaded, [str(w.message) for w in caught]


@pytest.mark.multiproc
def test_damage_seen_by_one_rank_is_confirmed_before_quarantine(tmp_path: Any) -> None:
    """Rank 1 sees step 2's object damaged, rank 0 re-reads it intact: the step is skipped for
    this load (every rank agrees) but not quarantined on one rank's view. Damage that is on
    storage is confirmed by the other rank and quarantined."""
    from _dist import RankGroup

    url = str(tmp_path / "ckpt")
    with CheckpointEngine(url, keep_last=None, plan_options=PLAN) as engine:
        for step in (1, 2):
            engine.save(step, state_of(step), blocking=True)
    with RankGroup(2) as ranks:
        outcomes = ranks.run(_load_with_a_bad_link_on_rank_1, url)
        assert [step for step, _ in outcomes] == [1, 1], outcomes
        assert all("not confirmed" in " ".join(w) for _, w in outcomes), outcomes
        with CheckpointEngine(url) as engine:
            assert engine.steps() == [1, 2] and engine.verify(2).ok

        Raw.open((url, None)).flip_bit(2, RANK_1_SHARD, 100)
        outcomes = ranks.run(_load_with_a_bad_link_on_rank_1, url)
        assert [step for step, _ in outcomes] == [1, 1], outcomes
    with CheckpointEngine(url) as engine:
        assert engine.steps() == [1]


def test_a_quarantine_overtaken_by_a_new_save_of_its_step_leaves_the_new_commit(
        tmp_path: Any) -> None:
    """A quarantine reads the damaged COMMIT, writes its notes, then deletes COMMIT: it
    deleted whatever COMMIT was there by then, so a save of the step that committed in
    between (another generation's, after the step was hidden once already) was hidden too,
    its data left as an uncommitted folder that retention deletes."""
    from antifragile.engine.quarantine import quarantine
    from antifragile.engine.storage import open_storage

    url = str(tmp_path / "ckpt")
    with CheckpointEngine(url, plan_options=PLAN) as engine:
        engine.save(2, state_of(2), blocking=True)
    storage, raw = open_storage(url), Raw.open((url, None))
    stale = raw.read(2, "COMMIT")
    with CheckpointEngine(url, plan_options=PLAN) as engine:
        engine.save(3, state_of(3), blocking=True)
    new = raw.read(3, "COMMIT")  # what a new save of step 2 commits: other bytes

    class Overtaken:  # the new save commits between the quarantine's notes and its delete
        def __getattr__(self, name: str) -> Any:
            return getattr(storage, name)

        committed = False

        def sync(self) -> None:
            storage.sync()
            if not self.committed:
                self.committed = True
                raw.write(2, "COMMIT", new)

    assert stale != new
    quarantine(Overtaken(), 2, "damaged", reports={0: "damaged"}, confirmed_by=0)  # type: ignore[arg-type]
    assert raw.read(2, "COMMIT") == new


class _SavedAgainBeforeQuarantine:
    """Storage on which step 2 is saved again (another generation, after another reader had
    hidden it) between the confirming re-read and the quarantine: the fourth read of step 2's
    COMMIT (the load's, the load's look whether the step is still the save it opened, the
    confirmer's, then the quarantine's) finds ``new`` there."""

    def __init__(self, inner: Any, new: bytes) -> None:
        self.inner, self.new, self.commit_reads = inner, new, 0

    def read(self, key: str, start: int = 0, end: int | None = None) -> Any:
        if key.endswith("step_000000002/COMMIT"):
            self.commit_reads += 1
            if self.commit_reads == 4:
                self.inner.write(key, [self.new], durable=True)
        return self.inner.read(key, start, end)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_quarantine_hides_only_the_save_whose_damage_was_confirmed(tmp_path: Any) -> None:
    """The quarantine took whatever COMMIT was there when it began for the damaged one: a save
    of the step that committed after the damage was confirmed was hidden in its place."""
    other = str(tmp_path / "other")
    with CheckpointEngine(other, plan_options=PLAN) as engine:
        engine.save(2, state_of(2), blocking=True)
    new = Raw.open((other, None)).read(2, "COMMIT")  # another save of step 2: another nonce
    url = str(tmp_path / "ckpt")
    with _two_steps_on(url) as engine:
        raw = Raw.open((url, None))
        raw.flip_bit(2, SHARD, 100)
        engine.storage.inner = _SavedAgainBeforeQuarantine(engine.storage.inner, new)
        with pytest.warns(RuntimeWarning, match="step 2 skipped"):
            assert engine.load(blank()) == 1
        assert raw.read(2, "COMMIT") == new, "the new save of step 2 was hidden"


def test_a_step_another_process_deleted_is_saved_anew(storage: Storage) -> None:
    """Rank 0 remembers the steps it committed; another process (an operator, ``chaos ckpt``)
    deleted one of them, and training, gone back to before it, saves it again. The save must
    write the step anew, not take it for a resave of a committed step and refuse it as
    unreadable: nothing of it is left to compare with."""
    url, options = storage
    with CheckpointEngine(url, storage_options=options, keep_last=3, plan_options=PLAN) as engine:
        for step in (1, 2):
            engine.save(step, state_of(step), blocking=True)
        raw = Raw.open(storage)
        raw.fs.rm(f"{raw.root}/step_{2:09d}", recursive=True)
        engine.save(2, state_of(2), blocking=True)
        assert engine.steps() == [1, 2] and engine.verify(2).ok


def test_a_quarantined_step_is_saved_anew_even_where_storage_cannot_say_it_is_gone(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A load quarantined step 2 and training saves step 2 again: rank 0 knows the step is
    unfinished now, so the save clears its folder and writes it anew. It used to keep the step
    among those known committed, and the save took the path of a resave (compare with the
    COMMIT, write nothing) and was refused as unreadable. The look for a known step's COMMIT
    (a step another process deleted) also sends such a save on, but only where storage
    answers it: here its first look goes unanswered, and the quarantine alone must decide."""
    from antifragile.engine._paths import COMMIT, step_dir

    storage: Storage = (str(tmp_path / "ckpt"), None)
    with CheckpointEngine(storage[0], keep_last=2, plan_options=PLAN) as engine:
        for step in (1, 2):
            engine.save(step, state_of(step), blocking=True)
        Raw.open(storage).flip_bit(2, SHARD, 100)
        with pytest.warns(RuntimeWarning, match="step 2 skipped"):
            assert engine.load(blank()) == 1
        exists, asked = engine.storage.exists, []

        def unanswered(key: str) -> bool:  # the first look for step 2's COMMIT goes unanswered
            if key == f"{step_dir(2)}/{COMMIT}" and not asked:
                asked.append(key)
                raise CheckpointError(f"exists {key}: storage does not answer")
            return exists(key)

        monkeypatch.setattr(engine.storage, "exists", unanswered)
        engine.save(2, state_of(2), blocking=True)
        monkeypatch.undo()
        assert engine.steps() == [1, 2] and engine.verify(2).ok
