"""Which torchrun slots play ranks at a fresh start, and which start as spares.

Pure and torch-free: the trainer places its ranks with it, and ``chaos`` validates a scenario
with it (which ranks a lost host takes with it) without importing torch.
"""

from __future__ import annotations


def first_slots(slots: int, world_size: int, local_slots: int) -> list[int]:
    """The torchrun slots that play ranks 0..world-1 at a fresh start (the others start as
    spares): on each host (``local_slots`` consecutive slots, torchrun's LOCAL_WORLD_SIZE) its
    first world/hosts, so the ranks spread over the hosts as in a launch without spares, and
    every host keeps spares of its own. One host: slots 0..world-1."""
    hosts = slots // local_slots if local_slots and slots % local_slots == 0 else 1
    if hosts == 1 or world_size % hosts:
        return list(range(world_size))
    return [h * local_slots + i for h in range(hosts) for i in range(world_size // hosts)]
