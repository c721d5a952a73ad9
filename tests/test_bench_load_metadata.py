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
        # rank 0 reads the COMMIT and the group's zarr.json whole, every other rank the
        # COMMIT's head (all of it below 64 KiB); each read both whole before
        whole = row["commit_bytes"] + row["group_zarr_json_bytes"]
        head = min(row["commit_bytes"], 2**16)
        assert row["job_bytes_read"] == whole + (row["world"] - 1) * head
        assert row["job_bytes_read_every_rank_whole"] == row["world"] * whole
        assert row["rank_load_metadata_s"] > 0
