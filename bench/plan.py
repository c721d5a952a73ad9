"""What the save plan costs at many ranks: ``build_plan``, which every rank runs at the first
save of a job run (and after a restart or a layout change), and what a save derives from it.

    python -m bench.plan [--ranks 1024,4096] [--params 50] [--reps 1]

On the synthetic dp x tp x pp inventories of ``bench.load_metadata`` (``--params`` parameters
per pipeline stage, about 3 objects each per rank), renamed per rank as the engine does. Timed
in one process, median of ``--reps``: ``build_plan``; one rank's writes (``plan.writes[rank]``,
what the saving rank stages); ``metadata_owners`` (every rank, once per plan); the keys of
every rank (``plan.keys_of``, what the coordinator checks each rank's record against).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from antifragile.engine._ranks import PerRank
from antifragile.engine.commit import metadata_owners
from antifragile.engine.plan import build_plan
from bench._args import at_least
from bench.load_metadata import _list, inventories, worlds


def run(world: int, params: int, reps: int) -> dict[str, float]:
    plan_inventories = PerRank(inventories(world, params), 0, sticky=["rng"]).plan_inventories()
    times: dict[str, list[float]] = {"build_s": [], "rank_writes_s": [], "owners_s": [],
                                     "all_keys_s": []}
    cells = 0
    for _ in range(reps):
        t0 = time.perf_counter()
        plan = build_plan(plan_inventories)
        t1 = time.perf_counter()
        plan.writes[world - 1]
        t2 = time.perf_counter()
        metadata_owners(plan, {f"doc{i}" for i in range(256)})
        t3 = time.perf_counter()
        cells = sum(len(plan.keys_of(rank)) for rank in range(world))
        t4 = time.perf_counter()
        for name, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            times[name].append(seconds)
    return {"world": world, "params": params, "cells": cells,
            **{name: statistics.median(values) for name, values in times.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.plan",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=worlds, default=[1024, 4096],
                        help="world sizes (multiples of 8, and of 64 from 64 on)")
    parser.add_argument("--params", type=_list, default=[50],
                        help="parameters per pipeline stage")
    parser.add_argument("--reps", type=at_least(1), default=1)
    args = parser.parse_args(argv)
    print(f"{'ranks':>6} {'params':>6} {'cells':>9} {'build_plan s':>12} {'rank writes s':>13} "
          f"{'owners s':>8} {'all keys s':>10}")
    for params in args.params:
        for world in args.ranks:
            r = run(world, params, args.reps)
            print(f"{r['world']:>6} {r['params']:>6} {r['cells']:>9} {r['build_s']:>12.3f} "
                  f"{r['rank_writes_s']:>13.3f} {r['owners_s']:>8.3f} {r['all_keys_s']:>10.3f}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
