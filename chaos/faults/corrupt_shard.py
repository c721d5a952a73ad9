"""``corrupt_shard``: damage one stored shard object of a committed checkpoint.

``bitflip`` flips one bit of the object's data, ``truncate`` cuts it in half, ``delete``
removes it. The object is picked with the scenario's seeded generator. Done directly to the
storage, as a failing disk or an operator would; the engine finds out when it reads.

With a peer engine under test (``checkpoint.engine: dcp | torchsnapshot``, or recognised by its
commit marker in the checkpoint folder) the damaged object is one of that engine's data files
(DCP ``__<rank>_<i>.distcp``, torchsnapshot's tensor files). Neither keeps checksums, so a
flipped bit inside tensor bytes may load silently; the injection says so, and the checker's
comparison with the reference run is what catches it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, StrictInt

from antifragile.chaos.faults.base import FaultBase, Injection, Target, shown


def _checkpoint_input(value: Any) -> Any:
    if value == "latest" or (isinstance(value, int) and not isinstance(value, bool)
                             and value >= 1):
        return value
    raise ValueError(f"{shown(value)} is not a checkpoint: name one by its step (>= 1), or latest")


class CorruptShard(FaultBase):
    kind: Literal["corrupt_shard"]
    ends_attempt: ClassVar[bool] = False  # training goes on; the stored data is hit
    #: the step of the committed checkpoint to damage, or the newest one when the fault fires
    checkpoint: Annotated[Literal["latest"] | StrictInt,
                          BeforeValidator(_checkpoint_input)] = "latest"
    mode: Literal["bitflip", "truncate", "delete"] = "bitflip"

    def check_checkpoints(self, every_steps: int, steps: int) -> tuple[str, str] | None:
        problem = super().check_checkpoints(every_steps, steps)
        if problem is not None:
            return problem
        step = self.checkpoint
        if not isinstance(step, int):  # latest: whichever is newest when the fault fires
            fires = self.trigger_step(every_steps)
            if fires is not None and fires < every_steps:
                return "checkpoint", (f"latest: no checkpoint is saved yet when the fault "
                                      f"fires (at step {fires}; the built-in trainer saves its "
                                      f"first at step {every_steps}, checkpoint.every_steps)")
            return None
        if step > steps:
            return "checkpoint", f"step {step} is after the last step ({steps})"
        if step == steps:
            return "checkpoint", (f"step {step} is the last step's checkpoint, saved when no "
                                  "fault can fire any more")
        if step % every_steps:
            return "checkpoint", (f"the built-in trainer saves every {every_steps} steps "
                                  f"(checkpoint.every_steps): step {step} is never saved")
        fires = self.trigger_step(every_steps)
        if fires is not None and step > fires:
            return "checkpoint", (f"step {step} is not saved yet when the fault fires (at "
                                  f"step {fires})")
        return None

    def inject(self, target: Target, step: int | None) -> Injection:
        from antifragile.engine._paths import step_dir
        from antifragile.engine.commit import committed_steps, read_marker
        from antifragile.engine.load import split_cell_key
        from antifragile.engine.storage import open_storage

        peer = _peer_engine(target.ckpt_url, target.ckpt_engine)
        if peer is not None:
            return self._inject_peer(peer, target, step)
        storage = open_storage(target.ckpt_url)
        steps = committed_steps(storage)
        if self.checkpoint == "latest" or self.checkpoint not in steps:
            # the step named may be the save still in flight
            steps = _settled(storage, target.staged)
        chosen = steps[-1] if steps and self.checkpoint == "latest" else self.checkpoint
        if not steps or chosen not in steps:
            return Injection(self.kind, time.time(), step=step,
                             missed="no committed checkpoint to corrupt" if
                             self.checkpoint == "latest" else
                             f"no committed checkpoint {self.checkpoint} to corrupt")
        assert isinstance(chosen, int)
        manifest = read_marker(storage, chosen)[1].objects
        shards = sorted(k for k, (n, _) in manifest.items()  # of arrays, not of scalars
                        if n > 0 and (split_cell_key(k) or ("", ()))[1])
        if not shards:  # a state of 0-d tensors and JSON values
            return Injection(self.kind, time.time(), step=step,
                             missed=f"checkpoint {chosen} has no array shard to corrupt")
        picked = target.rng.choice(shards)
        for key in [picked, *(k for k in shards if k != picked)]:
            if self._damage(storage, f"{step_dir(chosen)}/{key}", target):
                storage.sync()
                return Injection(self.kind, time.time(), step=step, detail={
                    "checkpoint_step": chosen, "object": key, "mode": self.mode})
        return Injection(self.kind, time.time(), step=step,
                         missed=f"checkpoint {chosen} has no shard left that {self.mode} can "
                                "damage (earlier faults deleted or emptied them)")

    def _damage(self, storage: Any, path: str, target: Target) -> bool:
        """Damage the object at ``path``; False if it is gone or empty (an earlier fault's
        work), where this mode changes nothing: a delete of what is deleted, a truncate of
        nothing, were recorded as made, and a bitflip of a deleted object failed. The seeded
        pick comes first; another shard of the step is damaged in its place."""
        if self.mode == "delete":
            if not storage.exists(path):
                return False
            storage.delete(path)
            return True
        try:
            data = bytearray(storage.read(path))
        except FileNotFoundError:
            return False
        if not data:
            return False
        if self.mode == "bitflip":
            bit = target.rng.randrange(len(data) * 8)
            data[bit // 8] ^= 1 << (bit % 8)
        else:
            del data[len(data) // 2:]
        storage.write(path, [bytes(data)])
        return True

    def _inject_peer(self, engine: str, target: Target, step: int | None) -> Injection:
        from antifragile.trainer.ckpt_backends import committed_steps as committed_steps_of
        from antifragile.trainer.ckpt_backends import data_files

        steps = committed_steps_of(engine, target.ckpt_url)
        if self.checkpoint == "latest" or self.checkpoint not in steps:
            steps = _settled_peer(engine, target.ckpt_url)
        chosen = steps[-1] if steps and self.checkpoint == "latest" else self.checkpoint
        if not steps or chosen not in steps:
            return Injection(self.kind, time.time(), step=step,
                             missed=f"no committed {engine} checkpoint {self.checkpoint} "
                                    "to corrupt")
        assert isinstance(chosen, int)
        files = [p for p in data_files(engine, target.ckpt_url, chosen) if p.stat().st_size]
        if not files:
            return Injection(self.kind, time.time(), step=step,
                             missed=f"{engine} checkpoint {chosen} has no data file")
        path = target.rng.choice(files)
        if self.mode == "delete":
            path.unlink()
        else:
            data = bytearray(path.read_bytes())
            if self.mode == "bitflip":
                bit = target.rng.randrange(len(data) * 8)
                data[bit // 8] ^= 1 << (bit % 8)
            else:
                del data[len(data) // 2:]
            with open(path, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        root = Path(target.ckpt_url.removeprefix("file://"))
        detail = {"checkpoint_step": chosen, "object": str(path.relative_to(root)),
                  "mode": self.mode, "engine": engine}
        if self.mode == "bitflip":
            detail["note"] = (f"{engine} keeps no checksums: a flip inside tensor bytes loads "
                              "silently; only the comparison with the reference can catch it")
        return Injection(self.kind, time.time(), step=step, detail=detail)


def _peer_engine(url: str, engine: str) -> str | None:
    """``dcp`` or ``torchsnapshot`` when the scenario's ``engine`` is one, or when the
    checkpoints at ``url`` carry that engine's commit marker; None for ours (or remote
    storage, where the peers are not run). The scenario says so first: before the run's first
    commit there is no marker to tell the peer's folders from ours."""
    from antifragile.trainer.ckpt_backends import committed_steps as committed_steps_of

    if "://" in url and not url.startswith("file://"):
        return None
    if engine != "antifragile":
        return engine
    for engine in ("dcp", "torchsnapshot"):
        if committed_steps_of(engine, url):
            return engine
    return None


SETTLE_S = 30.0  # how long a save in flight is waited for, to commit or fail


def _settled(storage: Any, staged: frozenset[int] = frozenset()) -> list[int]:
    """The committed steps once no save is in flight: ``latest`` is the newest checkpoint the
    job has when the fault fires, and a save of the step before the pause point may still be
    persisting there (it commits a moment later: damaging the one before it, which no restore
    then reads, would be a fault without effect). A step folder newer than the newest commit,
    or a step of ``staged`` (a save whose writers may not have written anything yet), neither
    aborted nor quarantined, is waited for, at most ``SETTLE_S`` (debris of a killed save
    never commits)."""
    from antifragile.engine._paths import ABORT, QUARANTINE, step_dir
    from antifragile.engine.commit import step_dirs

    def look() -> tuple[list[int], list[int]]:
        every, committed = step_dirs(storage)
        newest = committed[-1] if committed else 0
        return committed, [step for step in sorted(set(every) | staged)  # markers looked up
                           if step > newest and not any(  # for the newer alone
                               storage.exists(f"{step_dir(step)}/{marker}")
                               for marker in (ABORT, QUARANTINE))]

    return _wait_settled(look)


def _settled_peer(engine: str, url: str) -> list[int]:
    """``_settled`` for a peer engine: its committed steps once no step folder is newer than
    the newest commit marker. A peer leaves no abort marker, so a killed save's folder is
    waited for the whole ``SETTLE_S`` (a restart removes it)."""
    from antifragile.trainer.ckpt_backends import committed_steps as committed_steps_of
    from antifragile.trainer.ckpt_backends.base import local_root, step_folders

    def look() -> tuple[list[int], list[int]]:
        return committed_steps_of(engine, url), list(step_folders(local_root(url)))

    return _wait_settled(look)


def _wait_settled(look: Callable[[], tuple[list[int], list[int]]]) -> list[int]:
    """The committed steps ``look`` gives, once none of the steps it gives as possibly in
    flight is newer than the newest of them, or ``SETTLE_S`` passed."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        committed, pending = look()
        newest = committed[-1] if committed else 0
        if time.monotonic() > deadline or not any(step > newest for step in pending):
            return committed
        time.sleep(0.05)
