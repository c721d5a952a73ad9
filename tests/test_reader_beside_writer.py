"""A reader beside a training job: a second engine (an evaluation job, ``chaos ckpt verify``)
reads a root while the job's engine saves into it, and the job's retention deletes, or its
rollback's save supersedes, the very step being read. The reader gets that step whole and
checked, or a CheckpointNotFoundError naming it and saying it went away meanwhile: never
"damaged" (a missing object of a step that is being deleted is not damage), and never a
quarantine of a step nothing is wrong with.

Deterministic: the job's save runs from inside the reader's first read of a shard object,
after the reader opened the step (read its COMMIT and group document)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from antifragile.engine import (
    CheckpointEngine,
    CheckpointNotFoundError,
    PlanOptions,
    StepSkippedWarning,
)
from antifragile.engine.quarantine import quarantined_steps

# several shard objects per tensor, so that a read is under way when the step goes
PLAN = PlanOptions(max_object_bytes=1024, inner_chunk_bytes=256)


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 16, generator=g), "step": step}


def _target() -> dict[str, Any]:
    return {"w": torch.zeros(64, 16), "step": -1}


class _Meanwhile:
    """The reader's storage: ``action`` runs once, at the first read of a shard object of
    ``step`` (its COMMIT and group document are read by then)."""

    def __init__(self, inner: Any, step: int, action: Callable[[], None]) -> None:
        self.inner, self.action, self.prefix = inner, action, f"step_{step:09d}/w/c"
        self.done = False

    def _maybe(self, key: str) -> None:
        if not self.done and key.startswith(self.prefix):
            self.done = True
            self.action()

    def read(self, key: str, *args: Any, **kwargs: Any) -> Any:
        self._maybe(key)
        return self.inner.read(key, *args, **kwargs)

    def read_into(self, key: str, start: int, buffers: Sequence[Any]) -> int:
        self._maybe(key)
        return self.inner.read_into(key, start, buffers)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _job(root: Path, keep_last: int) -> CheckpointEngine:
    job = CheckpointEngine(str(root), keep_last=keep_last, plan_options=PLAN)
    job.save(1, _state(1), blocking=True)
    return job


def _reader(root: Path, step: int, action: Callable[[], None]) -> CheckpointEngine:
    reader = CheckpointEngine(str(root), keep_last=None)
    reader.storage = _Meanwhile(reader.storage, step, action)  # type: ignore[assignment]
    return reader


def test_a_step_retention_deletes_while_it_is_loaded_is_not_found_not_damaged(
        tmp_path: Path) -> None:
    """The job saves step 2 with keep_last=1 while an evaluation loads step 1: the load
    said step 1 was damaged (CheckpointCorruptError, "object is missing"). Now it says
    step 1 was deleted while it was read."""
    with _job(tmp_path, keep_last=1) as job, _reader(
            tmp_path, 1, lambda: job.save(2, _state(2), blocking=True)) as reader:
        with pytest.raises(CheckpointNotFoundError, match=r"step 1 was deleted while"):
            reader.load(_target(), step=1)
        assert job.steps() == [2]


def test_the_newest_step_deleted_while_loaded_falls_back_to_the_step_that_replaced_it(
        tmp_path: Path) -> None:
    """``load()`` with no step: the newest step goes while it is read. The load goes on to
    the step committed since, whose data it returns bit for bit, and its warning says the
    step was deleted meanwhile, not that it was damaged (and no quarantine is tried)."""
    with _job(tmp_path, keep_last=1) as job, _reader(
            tmp_path, 1, lambda: job.save(2, _state(2), blocking=True)) as reader:
        target = _target()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert reader.load(target) == 2
        assert torch.equal(target["w"], _state(2)["w"]) and target["step"] == 2
        skipped = [str(w.message) for w in caught if w.category is StepSkippedWarning]
        assert len(skipped) == 1 and "step 1 was deleted while" in skipped[0], skipped
        assert "missing" not in skipped[0] and "re-read" not in skipped[0], skipped


def test_verify_of_a_step_deleted_meanwhile_is_not_found_not_a_damage_report(
        tmp_path: Path) -> None:
    """``chaos ckpt verify`` beside a training job: the step it verifies is deleted by the
    job's retention. It reported the step DAMAGED (every shard "missing"); now it raises
    CheckpointNotFoundError naming the step, as for a step that is not there at all."""
    with (_job(tmp_path, keep_last=1) as job,
          _reader(tmp_path, 1, lambda: job.save(2, _state(2), blocking=True)) as reader,
          pytest.raises(CheckpointNotFoundError, match=r"step 1 was deleted while")):
        reader.verify(1)


def test_read_of_a_step_deleted_meanwhile_is_not_found_not_damaged(tmp_path: Path) -> None:
    """``read`` (``chaos ckpt inspect``) of a step the job's retention deletes meanwhile."""
    with (_job(tmp_path, keep_last=1) as job,
          _reader(tmp_path, 1, lambda: job.save(2, _state(2), blocking=True)) as reader,
          pytest.raises(CheckpointNotFoundError, match=r"step 1 was deleted while")):
        reader.read(1)


def test_a_superseded_step_saved_again_while_it_is_loaded_is_not_found_not_damaged(
        tmp_path: Path) -> None:
    """The job went back to step 1 (a load) and saves step 2 again: its save supersedes the
    old step 2 and clears its folder while the reader reads it. The reader's load of step 2
    says it was quarantined (superseded) while read, not that it was damaged; and the job's
    new step 2 stays committed and loads."""
    with _job(tmp_path, keep_last=3) as job:
        job.save(2, _state(2), blocking=True)
        job.load(_target(), step=1)

        def resave() -> None:
            job.save(2, {"w": torch.full((64, 16), 7.0), "step": 2}, blocking=True)

        with (_reader(tmp_path, 2, resave) as reader,
              pytest.raises(CheckpointNotFoundError, match=r"step 2 was (quarantined|saved "
                            r"again) while")):
            reader.load(_target(), step=2)
        target = _target()
        assert job.load(target) == 2 and bool((target["w"] == 7.0).all())


class _RetiredBeforeNote:
    """The reader's storage: the job's save (whose retention deletes step 1) runs just before
    the reader writes step 1's QUARANTINE note, after it read step 1's COMMIT to move it."""

    def __init__(self, inner: Any, job: CheckpointEngine) -> None:
        self.inner, self.job, self.done = inner, job, False

    def write(self, key: str, parts: Sequence[Any], **kwargs: Any) -> None:
        if not self.done and key == "step_000000001/QUARANTINE":
            self.done = True
            self.job.save(2, _state(2), blocking=True)
        self.inner.write(key, parts, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_damaged_step_retention_deletes_while_a_reader_quarantines_it_stays_deleted(
        tmp_path: Path) -> None:
    """A reader finds step 1 damaged and quarantines it; the job's retention deletes step 1
    between the quarantine's read of the COMMIT and its note. The note made step 1's folder
    again (a folder of one QUARANTINE note, listed as a quarantined step whose every object
    is missing), and the reader's warning said "quarantined". Now the note is taken back (an
    empty folder may stay: debris, which the next retention removes), and the warning says
    the step went away instead; the quarantine log keeps the note (the damage was
    confirmed)."""
    with _job(tmp_path, keep_last=1) as job:
        shard = tmp_path / "step_000000001" / "w" / "c.1.0"
        data = bytearray(shard.read_bytes())
        data[100] ^= 1
        shard.write_bytes(bytes(data))
        with CheckpointEngine(str(tmp_path), keep_last=None, plan_options=PLAN) as reader:
            reader.storage = _RetiredBeforeNote(reader.storage, job)  # type: ignore[assignment]
            target = _target()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                assert reader.load(target) == 2
        assert torch.equal(target["w"], _state(2)["w"])
        skipped = [str(w.message) for w in caught if w.category is StepSkippedWarning]
        assert len(skipped) == 1 and "(quarantined" not in skipped[0], skipped
        assert "deleted" in skipped[0], skipped
        assert not (tmp_path / "step_000000001" / "QUARANTINE").exists()
        assert quarantined_steps(job.storage) == [] and job.steps() == [2]
        assert [name.split(".")[0] for name in os.listdir(tmp_path / "quarantined")] == [
            "step_000000001"]
