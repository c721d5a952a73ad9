"""The save/commit/crash/load protocol against a model of what must be visible (hypothesis).

One CheckpointEngine, one process, a local folder. The model holds the committed steps, the
damaged ones (and which arrays), and the uncommitted step folders on disk (debris). After every
rule: ``steps()`` is the model's committed set, the folders on disk are committed + debris, each
intact step verifies and loads to exactly what was saved at it; each damaged one fails
``verify`` naming the damaged arrays, and loading it by number raises CheckpointCorruptError
naming the step and an array (it is never loaded silently). ``load()`` returns the newest
intact step, naming (and quarantining) each newer damaged one. After a save, at most
``keep_last`` steps are committed and the newest is kept; a save of a committed step leaves
its files untouched: refused with other content, a success with the content it holds.

Crashes are simulated, not performed: a SIGKILL per rule would be too slow here (the real ones
are in ``test_crash.py``). The ``crash`` rule writes the debris a crash in a given phase leaves,
built from the files of a real save of the same step into a scratch folder:

- ``staging``: nothing (no save has written anything before persist starts);
- ``object-writes``: any subset of the objects (shards and array ``zarr.json``, written
  concurrently), and one more torn (a prefix of its bytes under its final name, as a
  non-atomic write leaves it), no record, no COMMIT;
- ``record``: every object and the ``.ranks/0.json`` record, maybe the group ``zarr.json``;
- ``marker-write``: as ``record`` plus the group ``zarr.json``, then the COMMIT marker is
  written through the engine's own storage layer and the process "dies" at its first data
  write (``os.writev`` raises a BaseException nothing catches): what is on disk is what the
  storage implementation leaves when killed there;
- ``retention``: the step is fully committed, then retention has deleted some of the steps it
  deletes (in its order) and is killed inside the next one: COMMIT gone, some files gone.

Existing debris of the step stays (a crash overwrites files, it does not clean up).
"""

from __future__ import annotations

import atexit
import functools
import json
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from antifragile.engine import (
    CheckpointCommittedError,
    CheckpointCorruptError,
    CheckpointEngine,
    CheckpointError,
    CheckpointNotFoundError,
    PlanOptions,
)
from antifragile.engine.storage import open_storage

KEEP_LAST = 3
OPTIONS = PlanOptions(max_object_bytes=32)  # model/w: 3 shard objects, model/b: 1
STEPS = st.integers(0, 9)  # small: saves collide with committed steps and debris
PHASES = ("staging", "object-writes", "record", "marker-write", "retention")


def make_state(step: int) -> dict[str, Any]:
    return {
        "model": {
            "w": torch.arange(24, dtype=torch.float32).reshape(6, 4) + step,
            "b": torch.arange(3, dtype=torch.int64) * step,
        },
        "meta": {"step": step},
    }


def blank_state() -> dict[str, Any]:
    state = make_state(0)
    for tensor in state["model"].values():
        tensor.fill_(-1)
    state["meta"]["step"] = None
    return state


def assert_state(state: dict[str, Any], step: int) -> None:
    want = make_state(step)
    for name, tensor in want["model"].items():
        assert torch.equal(state["model"][name], tensor), (step, name)
    assert state["meta"] == want["meta"]


def names(step: int, text: str) -> bool:
    return re.search(rf"\bstep {step}\b", text) is not None


def step_name(step: int) -> str:
    return f"step_{step:09d}"


def array_of(key: str) -> str:
    return key.split("/c.")[0]


@functools.cache
def _scratch() -> CheckpointEngine:
    """Real saves of every step, made once per session: the source of crash debris."""
    folder = tempfile.mkdtemp(prefix="protocol-scratch-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return CheckpointEngine(folder, keep_last=None, plan_options=OPTIONS)


class _Killed(BaseException):
    """The process dies here: nothing in the engine may handle it."""


def snapshot(folder: Path) -> dict[str, bytes]:
    return {key: (folder / key).read_bytes() for key in files_under(folder)}


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


class SaveProtocol(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="protocol-"))
        self.root = self.tmp / "ckpt"
        self.root.mkdir()
        self.engine = self._open()
        self.scratch = _scratch()
        self.committed: set[int] = set()
        self.debris: set[int] = set()
        self.quarantined: set[int] = set()  # debris kept as evidence while inside the window
        self.damaged: dict[int, set[str]] = {}  # step -> keys of the objects damaged
        self.went_back_to: int | None = None  # the step the last load returned, until a save

    def _open(self) -> CheckpointEngine:
        return CheckpointEngine(str(self.root), keep_last=KEEP_LAST, plan_options=OPTIONS)

    def teardown(self) -> None:
        self.engine.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    # -- the model ------------------------------------------------------------------------------

    def _retention_victims(self, saved: int) -> list[int]:
        """What retention deletes after the commit of ``saved``, in its order (ascending):
        never ``saved`` nor a step newer than it (a save of this run may be in flight there,
        after a rollback); a quarantined step stays while it is newer than the oldest step
        kept."""
        keep = set(sorted(self.committed)[-KEEP_LAST:]) | {saved}
        return sorted(s for s in self.committed | self.debris if s not in keep and s < saved
                      and not (s in self.quarantined and s > min(keep)))

    def _gone(self, step: int) -> None:
        self.committed.discard(step)
        self.debris.discard(step)
        self.quarantined.discard(step)
        self.damaged.pop(step, None)

    def _quarantined(self, step: int) -> None:
        self._hidden(step)
        self.quarantined.add(step)

    def _hidden(self, step: int) -> None:
        self.committed.discard(step)
        self.damaged.pop(step, None)
        self.debris.add(step)

    def _committed(self, step: int) -> None:
        self.debris.discard(step)
        self.quarantined.discard(step)
        self.damaged.pop(step, None)
        self.committed.add(step)

    # -- rules ----------------------------------------------------------------------------------

    @rule(step=STEPS, same=st.booleans())
    def save(self, step: int, same: bool) -> None:
        """A blocking save commits, then retention runs; a committed step is never rewritten:
        saving it again succeeds, writing nothing, when it holds, intact, the state saved
        (a retry of a save whose answer was lost), and is refused otherwise."""
        if self.went_back_to is not None:
            # the first save after a load supersedes the committed steps newer than the step
            # loaded, before anything else (a rollback's abandoned run; kept as evidence),
            # unless it is past them all (committed since the load, by debris of a crash in
            # retention here: the engine's ``_supersede_abandoned`` leaves them)
            abandoned = [s for s in self.committed if s > self.went_back_to]
            if abandoned and max(abandoned) >= step:
                for old in abandoned:
                    self._quarantined(old)
            self.went_back_to = None
        newest = max(self.committed | {step})
        if step in self.committed:
            before = snapshot(self.root / step_name(step))
            refused = not same or step in self.damaged
            state = make_state(step if same else step + 100)
            if refused:
                with pytest.raises(CheckpointCommittedError,
                                   match=rf"step {step} is already committed"):
                    self.engine.save(step, state, blocking=True)
            else:
                self.engine.save(step, state, blocking=True)
            assert snapshot(self.root / step_name(step)) == before, "a committed step was touched"
            if refused:
                return
        else:
            self.engine.save(step, make_state(step), blocking=True)
        self._committed(step)
        for victim in self._retention_victims(step):
            self._gone(victim)
        visible = self.engine.steps()
        assert visible[-1] == newest and step in visible, visible
        assert len([s for s in visible if s <= step]) <= KEEP_LAST, visible

    @rule(data=st.data(), phase=st.sampled_from(PHASES))
    def crash(self, data: st.DataObject, phase: str) -> None:
        """Leave the debris of a save of an uncommitted step killed in ``phase``."""
        free = sorted(set(range(10)) - self.committed)
        if not free or phase == "staging":
            return
        step = data.draw(st.sampled_from(free), label="step")
        src = self._real_save(step)
        dst = self.root / step_name(step)
        objects = [
            k
            for k in files_under(src)
            if (k.endswith("/zarr.json") or "/c." in k) and not k.startswith(".")
        ]
        if phase == "object-writes":
            written = data.draw(st.lists(st.sampled_from(objects), unique=True), label="written")
            torn = data.draw(st.sampled_from(objects), label="torn")
            for key in written:
                _copy(src, dst, key)
            size = (src / torn).stat().st_size
            _copy(src, dst, torn, data.draw(st.integers(0, size - 1), label="torn at"))
        elif phase in ("record", "marker-write"):
            for key in [*objects, ".ranks/0.json"]:
                _copy(src, dst, key)
            if phase == "marker-write" or data.draw(st.booleans(), label="group doc"):
                _copy(src, dst, "zarr.json")
            if phase == "marker-write":
                self._killed_writing(f"{step_name(step)}/COMMIT", (src / "COMMIT").read_bytes())
        else:
            self._crash_in_retention(step, src, dst, data)
            return
        self.debris.add(step)

    def _crash_in_retention(self, step: int, src: Path, dst: Path, data: st.DataObject) -> None:
        for key in files_under(src):
            if key != "COMMIT":
                _copy(src, dst, key)
        _copy(src, dst, "COMMIT")  # the marker is written last
        self._committed(step)
        victims = self._retention_victims(step)
        done = data.draw(st.integers(0, len(victims)), label="deleted before the kill")
        for victim in victims[:done]:
            shutil.rmtree(self.root / step_name(victim))
            self._gone(victim)
        if done < len(victims):
            folder = self.root / step_name(victims[done])
            (folder / "COMMIT").unlink(missing_ok=True)
            files = files_under(folder)
            for key in (
                data.draw(st.lists(st.sampled_from(files), unique=True), label="rmtree")
                if files
                else []
            ):
                (folder / key).unlink()
            self._hidden(victims[done])
            if not (folder / "QUARANTINE").exists():  # the kill's rmtree took the note
                self.quarantined.discard(victims[done])

    def _real_save(self, step: int) -> Path:
        if step not in self.scratch.steps():
            self.scratch.save(step, make_state(step), blocking=True)
        return Path(self.scratch.url) / step_name(step)

    def _killed_writing(self, key: str, body: bytes) -> None:
        storage = open_storage(str(self.root), None)
        with mock.patch("os.writev", side_effect=_Killed), pytest.raises(_Killed):
            storage.write(key, [body])

    @precondition(lambda self: self.committed)
    @rule(data=st.data(), mode=st.sampled_from(["bitflip", "truncate", "delete"]))
    def corrupt(self, data: st.DataObject, mode: str) -> None:
        """Damage one shard object of a committed step."""
        step = data.draw(st.sampled_from(sorted(self.committed)), label="step")
        folder = self.root / step_name(step)
        manifest = json.loads((folder / "COMMIT").read_bytes())["manifest"]["keys"]
        keys = [  # each object is damaged at most once: a second bit flip could undo the first
            k
            for k in sorted(manifest)
            if "/c." in k
            and k not in self.damaged.get(step, set())
            and (mode == "delete" or (folder / k).stat().st_size > 0)
        ]
        if not keys:
            return
        key = data.draw(st.sampled_from(keys), label="object")
        path = folder / key
        if mode == "delete":
            path.unlink()
        elif mode == "truncate":
            size = path.stat().st_size
            with path.open("r+b") as f:
                f.truncate(data.draw(st.integers(0, size - 1), label="truncate at"))
        else:
            blob = bytearray(path.read_bytes())
            at = data.draw(st.integers(0, len(blob) - 1), label="byte")
            blob[at] ^= 1 << data.draw(st.integers(0, 7), label="bit")
            path.write_bytes(bytes(blob))
        self.damaged.setdefault(step, set()).add(key)

    @rule()
    def load_latest(self) -> None:
        """The newest intact step loads; newer damaged ones are named, skipped, quarantined."""
        skipped = []
        expected = None
        for step in sorted(self.committed, reverse=True):
            if step not in self.damaged:
                expected = step
                break
            skipped.append(step)
        target = blank_state()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if not self.committed and self.quarantined:  # not an empty root: nothing lost
                with pytest.raises(CheckpointCorruptError, match="quarantined") as info:
                    self.engine.load(target)
                assert str(sorted(self.quarantined)) in str(info.value), str(info.value)
            elif not self.committed:
                with pytest.raises(CheckpointNotFoundError):
                    self.engine.load(target)
            elif expected is None:
                with pytest.raises(CheckpointError) as info:
                    self.engine.load(target)
            else:
                assert self.engine.load(target) == expected
                assert_state(target, expected)
                self.went_back_to = expected
        messages = [str(w.message) for w in caught]
        assert all(issubclass(w.category, RuntimeWarning) for w in caught), messages
        tried_last = skipped[-1:] if expected is None else []
        warned = skipped[: len(skipped) - len(tried_last)]  # a step is skipped to try the next
        assert len(messages) == len(warned), messages
        for step, message in zip(warned, messages, strict=True):
            assert names(step, message), message
            assert any(a in message for a in self._bad_arrays(step)), message
        if tried_last:  # the error gives the newest step's damage and every step tried
            message = str(info.value)
            assert names(skipped[0], message), message
            assert any(a in message for a in self._bad_arrays(skipped[0])), message
            tried = re.search(r"tried[^\[]*\[([\d, ]*)\]", message)
            assert tried and {int(x) for x in tried.group(1).split(",")} == set(skipped), message
        for step in skipped:
            self._quarantined(step)

    @rule()
    def reopen(self) -> None:
        """A restarted process sees the same thing."""
        self.engine.close()
        self.engine = self._open()
        self.went_back_to = None

    # -- what must be visible -------------------------------------------------------------------

    @invariant()
    def visible_is_the_model(self) -> None:
        assert self.engine.steps() == sorted(self.committed)
        on_disk = {int(p.name[5:]) for p in self.root.glob("step_*")}
        assert on_disk == self.committed | self.debris

    @invariant()
    def committed_steps_are_what_was_saved(self) -> None:
        # these loads check, they are not the run's: a load of an older step followed by a
        # save is a rollback (the save supersedes the newer steps), which the rules make
        went_back_to = self.engine._went_back_to
        try:
            self._check_committed()
        finally:
            self.engine._went_back_to = went_back_to

    def _check_committed(self) -> None:
        for step in sorted(self.committed):
            report = self.engine.verify(step)
            if step in self.damaged:
                assert not report.ok
                assert self._bad_arrays(step) <= set(report.bad_arrays), report.summary()
                self._assert_load_fails(step)
                continue
            assert report.ok, report.summary()
            target = blank_state()
            assert self.engine.load(target, step=step) == step
            assert_state(target, step)

    def _assert_load_fails(self, step: int) -> None:
        """Loading a damaged step by number raises, naming the step and a damaged array."""
        with pytest.raises(CheckpointCorruptError) as info:
            self.engine.load(blank_state(), step=step)
        message = str(info.value)
        assert names(step, message), message
        assert any(a in message for a in self._bad_arrays(step)), message

    def _bad_arrays(self, step: int) -> set[str]:
        return {array_of(key) for key in self.damaged[step]}


def _copy(src: Path, dst: Path, key: str, nbytes: int | None = None) -> None:
    (dst / key).parent.mkdir(parents=True, exist_ok=True)
    data = (src / key).read_bytes()
    (dst / key).write_bytes(data if nbytes is None else data[:nbytes])


SaveProtocol.TestCase.settings = settings(
    max_examples=25,
    stateful_step_count=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestSaveProtocol = SaveProtocol.TestCase


class TestSaveProtocolLonger(SaveProtocol.TestCase):
    """The same machine, longer runs and more of them (nightly)."""

    pytestmark = pytest.mark.slow
    settings = settings(
        max_examples=300,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
