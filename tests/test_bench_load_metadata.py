"""``bench.load_metadata`` runs in one process, in seconds at small sizes: not slow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def test_load_metadata_benchmark_prints_what_every_rank_reads(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]
                                                              ) -> None:
    from bench import load_metadata

    out = tmp_path / "load.json"
    assert load_metadata.main(["--worlds", "8,64", "--objects", "12", "--reps", "1",
                               "--json", str(out)]) == 0
    assert "job reads" in capsys.readouterr().out
    small, large = json.loads(out.read_text())
    assert [small["world"], large["world"]] == [8, 64]
    assert large["commit_bytes"] > 4 * small["commit_bytes"]  # every rank's objects listed
    for row in (small, large):
        assert row["objects_per_rank"] >= 12
        # each rank reads the COMMIT and the group's zarr.json whole, and nothing else
        assert row["rank_bytes_read"] == row["commit_bytes"] + row["group_zarr_json_bytes"]
        assert row["job_bytes_read"] == row["world"] * row["rank_bytes_read"]
        assert row["rank_load_metadata_s"] > 0
