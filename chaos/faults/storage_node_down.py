"""``storage_node_down``: one SeaweedFS volume server dies (or freezes) for ``duration_s``.

The S3 store is the SeaweedFS cluster ``chaos run`` started (``chaos/infra/seaweedfs.py``); the
fault is made to it from outside, like a storage host failing under the gateway: ``kill``
SIGKILLs the volume server and starts it again (same port and folder, so what it held comes
back) after ``duration_s``; ``stop`` SIGSTOPs it (connections stay open, nothing answers) and
SIGCONTs it. Objects on that server cannot be read meanwhile (the gateway answers 500, or, when
stopped, not at all) and writes may land on it. Expected: saves in flight either commit intact
or fail their handle, never a torn commit; training goes on; later saves commit; a restore
afterwards is bitwise equal.

``server``: the volume server's index, or ``busiest`` (the one holding the most bytes when the
fault fires, so that the fault hits the checkpoints). The injection's ``detail`` is completed
when the server is back (``ended_t``, the new pid) or could not be brought back (``error``).
"""

from __future__ import annotations

import logging
import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field, StrictInt

from antifragile.chaos.faults.base import FaultBase, Injection, Seconds, Target, shown
from antifragile.chaos.infra.seaweedfs import VOLUME_SERVERS
from antifragile.chaos.infra.weed import SeaweedError, VolumeDown

log = logging.getLogger(__name__)


def _server_input(value: Any) -> Any:
    if value == "busiest" or (isinstance(value, int) and not isinstance(value, bool)
                              and value >= 0):
        return value
    raise ValueError(f"{shown(value)} is not a volume server: give its index (>= 0) or busiest")


class StorageNodeDown(FaultBase):
    kind: Literal["storage_node_down"]
    ends_attempt: ClassVar[bool] = False  # training goes on; the stored data is hit
    duration_s: Annotated[Seconds, Field(gt=0)] = 10.0
    mode: Literal["kill", "stop"] = "kill"
    server: Annotated[StrictInt | Literal["busiest"], BeforeValidator(_server_input)] = "busiest"

    def check_storage(self, url: str | None) -> tuple[str, str] | None:
        if not (url or "").startswith("s3://"):
            where = (f"checkpoint.url is the local folder {url!r}" if url
                     else "checkpoint.url is not set (a folder in the run directory)")
            return "kind", ("storage_node_down stops a volume server of the SeaweedFS cluster "
                            f"chaos starts for S3, but {where}: set checkpoint.url: "
                            "s3://bucket/prefix (and leave AWS_ENDPOINT_URL unset)")
        if isinstance(self.server, int) and self.server >= VOLUME_SERVERS:
            return "server", (f"the SeaweedFS cluster chaos starts for S3 has {VOLUME_SERVERS} "
                              f"volume servers (0..{VOLUME_SERVERS - 1}), not {self.server}")
        return None

    def inject(self, target: Target, step: int | None) -> Injection:
        cluster = target.storage_cluster
        if cluster is None:
            reason = target.storage_cluster_unavailable or \
                "S3 is not a SeaweedFS cluster started by chaos: no volume server to stop"
            return Injection(self.kind, time.time(), step=step, skipped=reason)
        if isinstance(self.server, int) and self.server >= cluster.volumes:
            return Injection(self.kind, time.time(), step=step, skipped=(
                f"server {self.server}: the cluster has {cluster.volumes} volume servers"))
        try:
            index = cluster.busiest_volume() if self.server == "busiest" else self.server
            pid = (cluster.kill_volume(index) if self.mode == "kill"
                   else cluster.pause_volume(index))
        except VolumeDown as exc:  # already down (another fault's, not ended yet)
            return Injection(self.kind, time.time(), step=step, missed=f"{exc}: it was down "
                             "when this fault was due", detail={"mode": self.mode,
                                                                "server": self.server})
        except SeaweedError as exc:  # up, but the fault did not take (it did not stop)
            return Injection(self.kind, time.time(), step=step, missed=str(exc),
                             detail={"mode": self.mode, "server": self.server})
        injection = Injection(self.kind, time.time(), step=step, detail={
            "mode": self.mode, "duration_s": self.duration_s, "server": index, "pid": pid,
            "ended_t": None, "restarted_pid": None, "error": None})

        def end(on_time: bool) -> None:
            try:
                if self.mode == "kill":
                    restarted = cluster.restart_volume(index)
                else:
                    cluster.resume_volume(index)
            except Exception as exc:
                if on_time:
                    injection.detail["error"] = f"{type(exc).__name__}: {exc}"
                else:  # the run had ended: its report says the server was still down
                    log.warning("storage_node_down: volume server %s not brought back at the "
                                "end of the run: %s: %s", index, type(exc).__name__, exc)
            else:
                if on_time and self.mode == "kill":
                    injection.detail["restarted_pid"] = restarted
            if on_time:
                injection.detail["ended_t"] = time.time()

        target.endings.after(self.duration_s, end)
        return injection
