"""``disk_full``: the checkpoints' file system has no free space for ``duration_s``.

The checkpoints go to a tmpfs of ``volume_mib`` that chaos mounts for the run
(``chaos/infra/volume.py``); the fault is made from outside the trainer, like another job
filling a shared disk: chaos grows a file over the free space and keeps taking what is freed
meanwhile, then deletes it. Every write of a save then fails with ENOSPC. Expected: the saves
during the fault fail their handle (never a torn or half-visible step), training goes on, the
committed steps stay intact, and the first save after the fault commits.

The injection's ``detail`` is completed when the fault ends (``ended_t``, ``filled_bytes``).
"""

from __future__ import annotations

import time
from typing import Annotated, ClassVar, Literal

from pydantic import Field, StrictInt

from antifragile.chaos.faults.base import FaultBase, Injection, Seconds, Target, memory_mib


class DiskFull(FaultBase):
    kind: Literal["disk_full"]
    ends_attempt: ClassVar[bool] = False  # training goes on; the stored data is hit
    duration_s: Annotated[Seconds, Field(gt=0)] = 10.0
    volume_mib: Annotated[StrictInt, Field(ge=16, le=1 << 20)] = 256

    def check_storage(self, url: str | None) -> tuple[str, str] | None:
        if self.volume_mib > memory_mib() // 2:
            return "volume_mib", (f"{self.volume_mib} MiB: the tmpfs is held in memory once "
                                  f"filled, and this machine has {memory_mib()} MiB (at most "
                                  "half of it)")
        if url is not None:
            return "kind", (f"disk_full fills a file system that chaos mounts for the run's "
                            f"checkpoints, never one it does not own, but checkpoint.url is "
                            f"{url!r}: leave it unset")
        return None

    def inject(self, target: Target, step: int | None) -> Injection:
        from antifragile.chaos.infra.volume import Fill

        if target.volume is None:
            reason = target.volume_unavailable or "no checkpoint volume mounted by chaos"
            return Injection(self.kind, time.time(), step=step, skipped=reason)
        injection = Injection(self.kind, time.time(), step=step, detail={
            "duration_s": self.duration_s, "volume_mib": target.volume.size_bytes >> 20,
            "ended_t": None})

        def end(on_time: bool) -> None:
            fill.stop()
            if on_time:
                injection.detail.update(ended_t=time.time(), filled_bytes=fill.filled_bytes,
                                        error=fill.error)

        fill = Fill(target.volume)  # its thread runs from here: its end is registered at once
        target.endings.after(self.duration_s, end)
        injection.t = fill.full_t  # the fault landed once the disk was full, not as it began
        injection.detail.setdefault("filled_bytes", fill.filled_bytes)  # unless its end
        injection.detail.setdefault("error", fill.error)  # came first (a short duration_s)
        return injection
