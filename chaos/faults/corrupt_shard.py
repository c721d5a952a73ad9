"""``corrupt_shard``: damage one stored shard object of a committed checkpoint.

``bitflip`` flips one bit of the object's data, ``truncate`` cuts it in half, ``delete``
removes it. The object is picked with the scenario's seeded generator. Done directly to the
storage, as a failing disk or an operator would; the engine finds out when it reads.
"""

from __future__ import annotations

import time
from typing import Literal

from chaos.faults.base import FaultBase, Injection, Target
from engine._paths import step_dir
from engine.commit import committed_steps, read_commit
from engine.storage import open_storage


class CorruptShard(FaultBase):
    kind: Literal["corrupt_shard"]
    checkpoint: Literal["latest"] | int = "latest"
    mode: Literal["bitflip", "truncate", "delete"] = "bitflip"

    def inject(self, target: Target, step: int | None) -> Injection:
        storage = open_storage(target.ckpt_url)
        steps = committed_steps(storage)
        chosen = steps[-1] if steps and self.checkpoint == "latest" else self.checkpoint
        if not steps or chosen not in steps:
            return Injection(self.kind, time.time(), step=step,
                             skipped=f"no committed checkpoint {self.checkpoint} to corrupt")
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
