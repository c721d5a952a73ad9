"""Two saves of one step (two jobs writing one URL, or a generation that did not learn that its
predecessor committed): exactly one COMMIT is ever written, and the one written first is never
replaced. A COMMIT is an atomic create (``Storage.create``): a local hard link of a fsynced
temporary file, S3's conditional PUT (``If-None-Match: *``); storage that has neither looks
first and writes (check-then-write), and says so."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from antifragile.engine import (
    CheckpointCommittedError,
    CheckpointEngine,
    ObjectExistsError,
)
from antifragile.engine.storage import RetryingStorage, open_storage
from antifragile.engine.storage import _base as storage_base

STEP_COMMIT = "step_000000005/COMMIT"


class _LandsBetween:
    """Another save's COMMIT of the same step lands just as this save writes its own: after
    any look-up this save made, before its write reaches storage (both passed the check)."""

    def __init__(self, inner: Any, foreign: bytes) -> None:
        self.inner, self.foreign = inner, foreign

    def _land(self, key: str) -> None:
        if key == STEP_COMMIT:
            self.inner.write(STEP_COMMIT, [self.foreign], durable=True)

    def write(self, key: str, parts: Sequence[Any], **kwargs: Any) -> None:
        self._land(key)
        self.inner.write(key, parts, **kwargs)

    def create(self, key: str, parts: Sequence[Any]) -> None:
        self._land(key)
        self.inner.create(key, parts)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_commit_racing_another_saves_commit_of_its_step_never_replaces_it(
        storage: tuple[str, Any]) -> None:
    """The other save's COMMIT lands between this save's look-up and its write: the look-up
    said "not committed", and the write replaced the other COMMIT (a reader that had loaded
    the first checkpoint found another one under the same step). Now this save fails, naming
    the step, and the first COMMIT's bytes are unchanged."""
    url, options = storage
    with CheckpointEngine(f"{url}-other", storage_options=options) as other:
        other.save(5, {"w": torch.ones(3)}, blocking=True)
        foreign = other.storage.read(STEP_COMMIT)
    with CheckpointEngine(url, storage_options=options) as engine:
        engine.storage.inner = _LandsBetween(engine.storage.inner, bytes(foreign))
        with pytest.raises(CheckpointCommittedError, match=r"step 5 was committed by another save.*"
                                                  r"its COMMIT is not overwritten"):
            engine.save(5, {"w": torch.zeros(3)}, blocking=True)
    assert open_storage(url, options).read(STEP_COMMIT) == foreign


def _race(s: Any, key: str, writers: int) -> tuple[list[bytes], list[bytes]]:
    """``writers`` threads create ``key`` at once, each with its own bytes: (the bytes whose
    create succeeded, those refused as existing); any other outcome fails the test."""
    barrier = threading.Barrier(writers)
    won: list[bytes] = []
    refused: list[bytes] = []
    failed: list[BaseException] = []

    def racer(body: bytes) -> None:
        barrier.wait()
        try:
            s.create(key, [body])
            won.append(body)
        except ObjectExistsError:
            refused.append(body)
        except BaseException as exc:  # reported below
            failed.append(exc)

    threads = [threading.Thread(target=racer, args=(f"writer {i}".encode(),))
               for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failed, failed
    return won, refused


def test_creates_of_one_key_racing_leave_exactly_one_winner(storage: tuple[str, Any]) -> None:
    """Four threads create each key at once, each with its own bytes: one create succeeds,
    the others raise ObjectExistsError, and the object holds the winner's bytes."""
    url, options = storage
    s = open_storage(url, options)
    for round_ in range(5):
        key = f"step_{round_}/COMMIT"
        won, refused = _race(s, key, 4)
        assert len(won) == 1 and len(refused) == 3, (won, refused)
        assert s.read(key) == won[0]


def test_a_create_of_a_key_that_exists_is_refused_and_changes_nothing(
        storage: tuple[str, Any]) -> None:
    url, options = storage
    s = open_storage(url, options)
    s.create("step_1/COMMIT", [b"first", b"|", b"save"])
    with pytest.raises(ObjectExistsError, match="step_1/COMMIT"):
        s.create("step_1/COMMIT", [b"second save"])
    assert s.read("step_1/COMMIT") == b"first|save"
    assert s.list_dir("step_1") == ["COMMIT"]  # no temporary file left beside it


class _AnswerLost:
    """The first create of ``key`` reaches storage, its answer does not (a connection reset
    after the request went through). ``before``: instead, another writer's object lands under
    ``key`` and this request never reaches storage (its answer is lost all the same)."""

    def __init__(self, inner: Any, key: str, before: bytes | None = None) -> None:
        self.inner, self.key, self.before, self.lost = inner, key, before, False

    def create(self, key: str, parts: Sequence[Any]) -> None:
        if key != self.key or self.lost:
            storage_base.create(self.inner, key, parts)
            return
        self.lost = True
        if self.before is None:
            storage_base.create(self.inner, key, parts)
        else:  # another writer's object lands; this request never reaches storage
            self.inner.write(key, [self.before])
        raise ConnectionResetError("connection reset, the answer never came")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture
def no_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(storage_base.time, "sleep", lambda s: None)


def test_a_create_retried_after_its_answer_was_lost_is_its_own_write(
        storage: tuple[str, Any], no_sleep: None) -> None:
    """The first try landed, its answer was lost; the retry finds the key taken. The object
    holds exactly the bytes this create sent (a COMMIT names its save's nonce), so it is this
    create's own write: success, not "committed by another save"."""
    url, options = storage
    s = open_storage(url, options)
    s.inner = _AnswerLost(s.inner, "step_2/COMMIT")
    s.create("step_2/COMMIT", [b"this ", b"save"])
    assert s.read("step_2/COMMIT") == b"this save"


def test_a_create_retried_after_a_lost_answer_still_refuses_another_writers_object(
        storage: tuple[str, Any], no_sleep: None) -> None:
    """The verdict can fail: the first try did not land (another writer's object was there
    first) and its answer was lost; the retry finds other bytes under the key: refused."""
    url, options = storage
    s = open_storage(url, options)
    s.inner = _AnswerLost(s.inner, "step_3/COMMIT", before=b"another save")
    with pytest.raises(ObjectExistsError, match="step_3/COMMIT"):
        s.create("step_3/COMMIT", [b"this save"])
    assert s.read("step_3/COMMIT") == b"another save"


class _NoCreate:
    """A storage with only the basic interface (no ``create``): a user's own, or a backend
    that cannot write only-if-absent."""

    url = "fake://root"

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.calls: list[str] = []

    def write(self, key: str, parts: Any, *, durable: bool = False, late: Any = None) -> None:
        self.calls.append(f"write {key} durable={durable}")
        self.objects[key] = b"".join(parts)

    def exists(self, key: str) -> bool:
        self.calls.append(f"exists {key}")
        return key in self.objects

    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        return self.objects[key][start:end]


def test_a_storage_without_create_falls_back_to_look_then_write() -> None:
    s = RetryingStorage(_NoCreate())  # type: ignore[arg-type]
    s.create("k", [b"one"])
    with pytest.raises(ObjectExistsError, match="k"):
        s.create("k", [b"two"])
    assert s.inner.objects == {"k": b"one"}  # type: ignore[attr-defined]
    assert s.inner.calls == ["exists k", "write k durable=True", "exists k"]  # type: ignore[attr-defined]


def test_an_fsspec_storage_falls_back_to_look_then_write() -> None:
    s = open_storage("memory://commit-race-fallback")
    s.create("step_1/COMMIT", [b"one"])
    with pytest.raises(ObjectExistsError):
        s.create("step_1/COMMIT", [b"two"])
    assert s.read("step_1/COMMIT") == b"one"


@pytest.mark.s3
def test_s3_that_refuses_conditional_puts_falls_back_and_says_so_once(
        s3_bucket: tuple[str, Any], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """An S3 server that answers a conditional PUT 501 NotImplemented (older S3-compatible
    stores): creates still work, by a look-up then a plain PUT, and a warning says once that
    two concurrent saves of one step are then not told apart."""
    import obstore
    from obstore.exceptions import GenericError

    real_put = obstore.put
    refused: list[str] = []

    def put(store: Any, path: str, data: Any, **kwargs: Any) -> Any:
        if kwargs.get("mode") == "create":
            refused.append(path)
            raise GenericError(
                f"Error performing PUT {path} - Server returned non-2xx status code: 501 Not "
                "Implemented: <Error><Code>NotImplemented</Code><Message>A header you provided "
                "implies functionality that is not implemented</Message></Error>")
        return real_put(store, path, data, **kwargs)

    monkeypatch.setattr(obstore, "put", put)
    url, options = s3_bucket
    s = open_storage(url, options)
    with caplog.at_level(logging.WARNING, logger="antifragile.engine.storage"):
        s.create("step_1/COMMIT", [b"one"])
        s.create("step_2/COMMIT", [b"two"])
        with pytest.raises(ObjectExistsError):
            s.create("step_1/COMMIT", [b"three"])
    assert refused == ["step_1/COMMIT"]  # asked once, then not again
    assert s.read("step_1/COMMIT") == b"one" and s.read("step_2/COMMIT") == b"two"
    warnings = [r for r in caplog.records if "conditional" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]


def test_a_local_file_system_without_hard_links_falls_back_and_says_so_once(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """link(2) refused with EPERM (vfat, some FUSE and SMB mounts): creates look, then
    rename, still refuse a key that exists, leave no temporary file, and warn once."""
    import errno
    import os

    def no_link(src: str, dst: str) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_link)
    s = open_storage(str(tmp_path / "ckpt"))
    with caplog.at_level(logging.WARNING, logger="antifragile.engine.storage"):
        s.create("step_1/COMMIT", [b"one"])
        s.create("step_2/COMMIT", [b"two"])
        with pytest.raises(ObjectExistsError):
            s.create("step_1/COMMIT", [b"three"])
    assert s.read("step_1/COMMIT") == b"one" and s.read("step_2/COMMIT") == b"two"
    assert s.list_dir("step_1") == ["COMMIT"]
    assert len([r for r in caplog.records if "hard links" in r.getMessage()]) == 1


def test_a_local_link_answered_eexist_after_it_made_the_link_is_this_creates_own(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """On NFS link(2) is not idempotent: a LINK whose answer was lost is sent again, and the
    server answers the resend EEXIST although the first one made the link (open(2) says to
    check the temporary file's link count then). The name is this create's own file: it was
    refused as taken, so rank 0 failed its save as "committed by another save" while its
    own COMMIT was the visible one (the other ranks reported the step committed). A name
    held by another file is still refused."""
    import errno
    import os

    real_link = os.link

    def link_then_eexist(src: str, dst: str) -> None:
        real_link(src, dst)  # refuses a name that is taken, as link(2) does
        raise FileExistsError(errno.EEXIST, "File exists", dst)

    monkeypatch.setattr(os, "link", link_then_eexist)
    s = open_storage(str(tmp_path / "ckpt"))
    s.create("step_1/COMMIT", [b"this ", b"save"])
    assert s.read("step_1/COMMIT") == b"this save"
    assert s.list_dir("step_1") == ["COMMIT"]  # no temporary file left beside it
    with pytest.raises(ObjectExistsError, match="step_1/COMMIT"):
        s.create("step_1/COMMIT", [b"another save"])
    assert s.read("step_1/COMMIT") == b"this save"
    assert s.list_dir("step_1") == ["COMMIT"]
