"""Who writes the zarr metadata documents of a save: spread over the ranks so that no rank
writes many more objects than another (on S3 a save costs one request per object, and a
coordinator that wrote every document was the slowest rank of each save)."""

from __future__ import annotations

from dataclasses import dataclass, field

from antifragile.engine.commit import metadata_owners, metadata_share


@dataclass
class FakePlan:
    world_size: int
    shards: dict[int, set[str]] = field(default_factory=dict)

    def keys_of(self, rank: int) -> set[str]:
        return self.shards.get(rank, set())


DOCS = {f"model/t{i}/zarr.json": b"{}" for i in range(75)} | {"model/zarr.json": b"{}"}


def test_documents_even_out_the_objects_per_rank() -> None:
    plan = FakePlan(2, {0: {f"model/t{i}/c.0" for i in range(40)},
                        1: {f"model/t{i}/c.0" for i in range(40, 75)}})
    owners = metadata_owners(plan, DOCS)
    per_rank = [len(plan.keys_of(r)) + sum(o == r for o in owners.values()) for r in range(2)]
    assert sorted(owners) == sorted(DOCS)
    assert abs(per_rank[0] - per_rank[1]) <= 1, per_rank
    shares = [metadata_share(plan, DOCS, r) for r in range(2)]
    assert set(shares[0]).isdisjoint(shares[1]) and set(shares[0]) | set(shares[1]) == set(DOCS)


def test_every_rank_computes_the_same_owners_and_one_rank_writes_all() -> None:
    plan = FakePlan(4, {r: {f"s{r}/{i}" for i in range(r * 3)} for r in range(4)})
    assert metadata_owners(plan, DOCS) == metadata_owners(plan, list(reversed(DOCS)))
    alone = FakePlan(1, {0: {"a/c.0"}})
    assert set(metadata_share(alone, DOCS, 0)) == set(DOCS)
