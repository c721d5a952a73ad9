"""``storage_outage``: S3 fails for ``duration_s``, made by the fault proxy in front of it.

The trainer reaches S3 only through the proxy (chaos/s3.py), so the outage is done outside the
trainer, on the wire: ``error`` answers every request ``503 Service Unavailable``, ``latency``
holds each request back ``latency_s``, ``blackhole`` accepts and never answers, then severs
those connections when the outage ends. Expected: training goes on (saves are asynchronous and
retried), saves during the outage are delayed or fail, later ones commit.

The injection's ``detail`` is completed when the outage ends, with the proxy's counts for it.
"""

from __future__ import annotations

import time
from typing import Annotated, ClassVar, Literal

from pydantic import Field

from antifragile.chaos.faults.base import FaultBase, Injection, Seconds, Target

_PROXY_KIND = {"error": "http503", "latency": "latency", "blackhole": "blackhole"}


class StorageOutage(FaultBase):
    kind: Literal["storage_outage"]
    ends_attempt: ClassVar[bool] = False  # training goes on; the stored data is hit
    duration_s: Annotated[Seconds, Field(gt=0)] = 10.0
    mode: Literal["error", "latency", "blackhole"] = "error"
    latency_s: Annotated[Seconds, Field(gt=0)] = 2.0

    def check(self, dims: tuple[int, int, int], steps: int, checkpoints: int
              ) -> tuple[str, str] | None:
        if self.mode != "latency" and "latency_s" in self.model_fields_set:
            return "latency_s", (f"only mode latency holds requests back; mode {self.mode} "
                                 "ignores it")
        return super().check(dims, steps, checkpoints)

    def check_storage(self, url: str | None) -> tuple[str, str] | None:
        if not (url or "").startswith("s3://"):
            where = (f"checkpoint.url is the local folder {url!r}" if url
                     else "checkpoint.url is not set (a folder in the run directory)")
            return "kind", (f"storage_outage acts on S3 (a proxy in front of the endpoint), but "
                            f"{where}: set checkpoint.url: s3://bucket/prefix")
        return None

    def inject(self, target: Target, step: int | None) -> Injection:
        proxy = target.storage_proxy
        if proxy is None:
            reason = target.storage_proxy_unavailable or "no fault proxy in front of S3"
            return Injection(self.kind, time.time(), step=step, skipped=reason)
        if proxy.faulting:  # another outage, not ended yet: this one would cut it short
            return Injection(self.kind, time.time(), step=step, detail={"mode": self.mode},
                             missed="S3 was out already (another storage_outage, not ended "
                                    "yet) when this fault was due")
        before = proxy.snapshot()
        token = proxy.fault(_PROXY_KIND[self.mode], latency_s=self.latency_s)
        injection = Injection(self.kind, time.time(), step=step, detail={
            "mode": self.mode, "duration_s": self.duration_s,
            "latency_s": self.latency_s if self.mode == "latency" else None,
            "ended_t": None})

        def end(on_time: bool) -> None:
            proxy.heal(token)
            if on_time:
                during = proxy.snapshot().since(before)
                injection.detail.update(ended_t=time.time(), requests_faulted=during.faulted,
                                        connections_passed=during.passed,
                                        requests_delayed=during.delayed)

        target.endings.after(self.duration_s, end)
        return injection
