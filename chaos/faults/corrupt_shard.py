"""``corrupt_shard``: damage one stored shard object of a committed checkpoint.

``bitflip`` flips one bit of the object's data, ``truncate`` cuts it in half, ``delete``
removes it. The object is picked with the scenario's seeded generator. Done directly to the
storage, as a failing disk or an operator would; the engine finds out when it reads.

With a peer engine under test (``checkpoint.engine: dcp | torchsnapshot``, recognised by its
commit marker in the checkpoint folder) the damaged object is one of that engine's data files
(DCP ``__<rank>_<i>.distcp``, torchsnapshot's tensor files). Neither keeps checksums, so a
flipped bit inside tensor bytes may load silently; the injection says so, and the checker's
comparison with the reference run is what catches it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Literal

from antifragile.chaos.faults.base import FaultBase, Injection, Target


class CorruptShard(FaultBase):
    kind: Literal["corrupt_shard"]
    checkpoint: Literal["latest"] | int = "latest"
    mode: Literal["bitflip", "truncate", "delete"] = "bitflip"

    def inject(self, target: Target, step: int | None) -> Injection:
        from antifragile.engine._paths import step_dir
        from antifragile.engine.commit import committed_steps, read_commit
        from antifragile.engine.storage import open_storage

        peer = _peer_engine(target.ckpt_url)
        if peer is not None:
            return self._inject_peer(peer, target, step)
        storage = open_storage(target.ckpt_url)
        steps = committed_steps(storage)
        chosen = steps[-1] if steps and self.checkpoint == "latest" else self.checkpoint
        if not steps or chosen not in steps:
            return Injection(self.kind, time.time(), step=step,
                             missed=f"no committed checkpoint {self.checkpoint} to corrupt")
        assert isinstance(chosen, int)
        manifest = read_commit(storage, chosen)["objects"]
        shards = sorted(k for k, (n, _) in manifest.items() if "/c/" in k and n > 0)
        key = target.rng.choice(shards)
        path = f"{step_dir(chosen)}/{key}"
        if self.mode == "delete":
            storage.delete(path)
        else:
            data = bytearray(storage.read(path))
            if self.mode == "bitflip":
                bit = target.rng.randrange(len(data) * 8)
                data[bit // 8] ^= 1 << (bit % 8)
            else:
                del data[len(data) // 2:]
            storage.write(path, [bytes(data)])
        storage.sync()
        return Injection(self.kind, time.time(), step=step,
                         detail={"checkpoint_step": chosen, "object": key, "mode": self.mode})

    def _inject_peer(self, engine: str, target: Target, step: int | None) -> Injection:
        from antifragile.trainer.ckpt_backends import committed_steps as committed_steps_of
        from antifragile.trainer.ckpt_backends import data_files

        steps = committed_steps_of(engine, target.ckpt_url)
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


def _peer_engine(url: str) -> str | None:
    """``dcp`` or ``torchsnapshot`` when the checkpoints at ``url`` carry that engine's commit
    marker; None for ours (or remote storage, where the peers are not run)."""
    from antifragile.trainer.ckpt_backends import committed_steps as committed_steps_of

    if "://" in url and not url.startswith("file://"):
        return None
    for engine in ("dcp", "torchsnapshot"):
        if committed_steps_of(engine, url):
            return engine
    return None
