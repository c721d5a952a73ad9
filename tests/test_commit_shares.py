"""Who writes the zarr metadata documents of a save: spread over the ranks so that no rank
writes many more objects than another (on S3 a save costs one request per object, and a
coordinator that wrote every document was the slowest rank of each save)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from antifragile.engine import CheckpointEngine
from antifragile.engine import commit as commit_module
from antifragile.engine.commit import metadata_owners, metadata_share

owners_of = metadata_owners


@dataclass
class FakePlan:
    world_size: int
    shards: dict[int, set[str]] = field(default_factory=dict)

    def keys_of(self, rank: int) -> set[str]:
        return self.shards.get(rank, set())

    def count_of(self, rank: int) -> int:
        return len(self.keys_of(rank))


DOCS = {f"model/t{i}/zarr.json": b"{}" for i in range(75)} | {"model/zarr.json": b"{}"}


def test_documents_even_out_the_objects_per_rank() -> None:
    plan = FakePlan(2, {0: {f"model/t{i}/c.0" for i in range(40)},
                        1: {f"model/t{i}/c.0" for i in range(40, 75)}})
    owners = metadata_owners(plan, DOCS)
    per_rank = [len(plan.keys_of(r)) + sum(o == r for o in owners.values()) for r in range(2)]
    assert sorted(owners) == sorted(DOCS)
    assert abs(per_rank[0] - per_rank[1]) <= 1, per_rank
    shares = [metadata_share(owners, DOCS, r) for r in range(2)]
    assert set(shares[0]).isdisjoint(shares[1]) and set(shares[0]) | set(shares[1]) == set(DOCS)


def test_every_rank_computes_the_same_owners_and_one_rank_writes_all() -> None:
    plan = FakePlan(4, {r: {f"s{r}/{i}" for i in range(r * 3)} for r in range(4)})
    assert metadata_owners(plan, DOCS) == metadata_owners(plan, list(reversed(DOCS)))
    alone = FakePlan(1, {0: {"a/c.0"}})
    assert set(metadata_share(metadata_owners(alone, DOCS), DOCS, 0)) == set(DOCS)


def test_the_shares_are_computed_once_per_plan_not_at_every_save(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank computed the owners of every document at every save (and the coordinator
    twice): ~57 ms at 4,096 ranks, ~230 ms at 16,384, for the same answer until a replan."""
    calls: list[int] = []

    def counted(plan: Any, keys: Any) -> dict[str, int]:
        calls.append(plan.world_size)
        return owners_of(plan, keys)

    monkeypatch.setattr(commit_module, "metadata_owners", counted)
    with CheckpointEngine(str(tmp_path), keep_last=None) as engine:
        for step in range(1, 4):
            engine.save(step, {"w": torch.full((4,), float(step)), "b": torch.zeros(2)}).wait()
        assert len(calls) == 1, calls
        engine.save(4, {"w": torch.ones(4), "c": torch.ones(3)}).wait()  # a new plan
        assert len(calls) == 2, calls
    with CheckpointEngine(str(tmp_path)) as engine:
        state = {"w": torch.zeros(4), "c": torch.zeros(3)}
        engine.load(state, 4)
    assert state["c"].tolist() == [1.0, 1.0, 1.0]
