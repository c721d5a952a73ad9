"""Fault kinds: one module each, registered here. Adding a kind = a module + a line below."""

from __future__ import annotations

from antifragile.chaos.faults.base import FaultBase, Injection, Target
from antifragile.chaos.faults.corrupt_shard import CorruptShard
from antifragile.chaos.faults.crash_during_save import CrashDuringSave
from antifragile.chaos.faults.disk_full import DiskFull
from antifragile.chaos.faults.drop_link import DropLink
from antifragile.chaos.faults.hang_rank import HangRank
from antifragile.chaos.faults.host_down import HostDown
from antifragile.chaos.faults.kill_rank import KillRank
from antifragile.chaos.faults.storage_node_down import StorageNodeDown
from antifragile.chaos.faults.storage_outage import StorageOutage

FAULT_CONFIGS: dict[str, type[FaultBase]] = {
    "kill_rank": KillRank,
    "hang_rank": HangRank,
    "crash_during_save": CrashDuringSave,
    "corrupt_shard": CorruptShard,
    "drop_link": DropLink,
    "host_down": HostDown,
    "storage_outage": StorageOutage,
    "storage_node_down": StorageNodeDown,
    "disk_full": DiskFull,
}
FaultConfig = (KillRank | HangRank | CrashDuringSave | CorruptShard | StorageOutage | DropLink
               | StorageNodeDown | HostDown | DiskFull)

__all__ = ["FAULT_CONFIGS", "FaultBase", "FaultConfig", "Injection", "Target"]
