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

from antifragile.engine import CheckpointCorruptError, CheckpointEngine, PlanOptions

Storage = tuple[str, dict[str, Any] | None]

# 64 x 16 float32 = 4 KiB in 4 shard objects of 16 rows, each of 4 inner chunks of 4 rows
PLAN = PlanOptions(max_object_bytes=1024, inner_chunk_bytes=256)
SHARD = "model/w/c/1/0"
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
    "array-metadata": (
        lambda raw: raw.flip_bit(2, "model/w/zarr.json", 40),
        "model/w/zarr.json",
        "model/w",
    ),
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


def test_damage_outside_what_the_target_reads_is_caught_by_verify(
    two_steps: tuple[CheckpointEngine, Raw],
) -> None:
    engine, raw = two_steps
    raw.flip_bit(2, "model/b/c/0", 3)
    target = {"model": {"w": torch.zeros(64, 16)}}
    assert engine.load(target, step=2) == 2
    assert torch.equal(target["model"]["w"], state_of(2)["model"]["w"])
    report = engine.verify(2)
    assert not report.ok and report.bad_arrays == ["model/b"]
    assert [p.key for p in report.problems] == ["model/b/c/0"]


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


def test_verify_names_the_array_whose_path_has_a_c_component(storage: Storage) -> None:
    url, options = storage
    with CheckpointEngine(url, storage_options=options) as engine:
        engine.save(1, {"model": {"c": {"w": torch.randn(4, 4)}}}, blocking=True)
        raw = Raw.open(storage)
        raw.flip_bit(1, "model/c/w/c/0/0", 5)
        report = engine.verify(1)
    assert not report.ok
    assert report.bad_arrays == ["model/c/w"]
