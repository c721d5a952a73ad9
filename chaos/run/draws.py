"""What a scenario's ``seed`` fixes: the random choices of its faults, each fault's from
generators of its own.

One generator for all of them made those choices depend on timing: an ``mtbf_s`` arrival that
comes while the job is down is drawn again, and how many are depends on how long the job takes
to come back, so every draw after them (which rank a ``rank: random`` fault hits, which object
a ``corrupt_shard`` damages, another fault's arrivals) differed from run to run with the same
seed. Here a fault's arrivals are one sequence of their own, and each firing of a fault picks
its targets from a generator of its own: the k-th firing of fault i picks the same targets in
every run with the seed (of the same candidates: the same ranks, the same stored objects),
whatever came before it. Its arrival times, and so how many times an ``mtbf_s`` fault fires,
still depend on the run.
"""

from __future__ import annotations

import random


class Draws:
    """The random draws of one run's faults (one per run: it counts each fault's firings)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._arrivals: dict[int, random.Random] = {}
        self._firings: dict[int, int] = {}

    def arrivals(self, index: int) -> random.Random:
        """The generator of fault ``index``'s ``mtbf_s`` arrivals: each draw, a redraw too,
        takes the next of its sequence."""
        if index not in self._arrivals:
            self._arrivals[index] = random.Random(f"{self.seed}:{index}:arrivals")
        return self._arrivals[index]

    def targets(self, index: int) -> random.Random:
        """A generator for the target picks of fault ``index``'s next firing (a save-phase
        fault's ``rank: random``, picked when the pause plan is made, is its first)."""
        firing = self._firings.get(index, 0)
        self._firings[index] = firing + 1
        return random.Random(f"{self.seed}:{index}:targets:{firing}")
