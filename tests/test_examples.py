"""The shipped examples are real clients (a transformers GPT-2 with DDP and our engine; plain
FSDP2 with torch.distributed.checkpoint): each survives its scenario's kill under ``chaos run``
and ends bit-identical to its fault-free reference, read back through its engine's reader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from antifragile.chaos.cli import main
from antifragile.chaos.scenario import SCENARIOS

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


@pytest.mark.parametrize(("scenario", "killed_after", "restored"), [
    # asynchronous saves: the save of step 15 may still be in flight 2 steps later
    ("hf-gpt2-kill.yaml", 17, (15, 10)),
    ("fsdp2-dcp-kill.yaml", 23, (20,)),  # blocking DCP saves
])
def test_example_survives_a_kill_bitwise(scenario: str, killed_after: int,
                                         restored: tuple[int, ...], tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANTIFRAGILE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["run", str(SCENARIOS / "examples" / scenario),
                                       "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["verdict"] == {"verdict": "pass", "reasons": [], "bitwise_equal": True}
    (fault,) = report["faults"]
    assert fault["kind"] == "kill_rank" and fault["injected_step"] == killed_after
    newest = max(c["step"] for c in report["checkpoints"]
                 if c["committed"] and c["attempt"] == 0 and c["step"] <= killed_after)
    assert fault["restored_step"] == newest and newest in restored, report["checkpoints"]
    assert fault["lost_steps"] == killed_after - newest
    assert fault["recovery_s"] is not None and report["not_measured"] == []
    assert report["run"]["final_step"] == report["run"]["expected_step"] == 40
    committed = [c for c in report["checkpoints"] if c["committed"]]
    assert committed and all(c["bytes"] and c["persist_s"] is not None for c in committed
                             if "restored_by" not in c)  # known only by its restore
