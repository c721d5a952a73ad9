"""The two recovery modes end to end under ``chaos run``: restart (torchrun restarts the
group) and in_process (survivors re-form it with a warm spare), for kills and hangs (process
and thread), each checked for detection, recovery and bitwise equality. Slow: the nightly
suite runs them; the default suite has the trainer-level in-process test
(``test_trainer_faults``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from antifragile.chaos.run.pipeline import run
from antifragile.chaos.scenario import parse_scenario
from tests._reports import check_restored

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

TRAINER = {"parallel": {"dp": 2, "tp": 1, "pp": 1}, "steps": 20, "batch_size": 8,
           "model": {"layers": 2, "d_model": 32, "heads": 4, "vocab": 64, "seq_len": 16},
           "collective_timeout_s": 30, "hang_timeout_s": 2}


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("reference-cache")


def _run_all(tmp_path: Path, name: str, faults: list[dict[str, Any]], **trainer: Any
             ) -> list[dict[str, Any]]:
    doc = {"name": name, "seed": 3, "trainer": {**TRAINER, **trainer},
           "checkpoint": {"every_steps": 4, "keep_last": 3}, "faults": faults,
           "expect": {"bitwise_equal_to_reference": True}}
    outcome = run(parse_scenario(doc), tmp_path / name, progress=lambda _: None)
    assert outcome.passed, outcome.report["verdict"]
    assert outcome.report["verdict"]["bitwise_equal"] is True
    for timings in outcome.report["faults"]:
        assert timings["injected_step"] == 10
        check_restored(outcome.report, timings, saved=(4, 8))
        for key in ("detect_s", "restart_s", "restore_s", "recompute_s", "recovery_s"):
            assert timings[key] is not None and timings[key] >= 0, key
    return list(outcome.report["faults"])


def _run(tmp_path: Path, name: str, fault: dict[str, Any], **trainer: Any) -> dict[str, Any]:
    (timings,) = _run_all(tmp_path, name, [fault], **trainer)
    return timings


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["restart", "in_process"])
def test_kill(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    monkeypatch.setenv("ANTIFRAGILE_CACHE", str(cache))
    t = _run(tmp_path, f"kill-{mode}", {"kind": "kill_rank", "rank": 1, "at_step": 10},
             recovery=mode)
    assert t["recovery_mode"] == mode and t["fallback"] is None
    if mode == "in_process":  # nothing restarted: the group is back in well under a second
        assert t["restart_s"] < 1.0, t


@pytest.mark.timeout(900)
@pytest.mark.parametrize("recovery", ["restart", "in_process"])
@pytest.mark.parametrize("hang", ["process", "thread"])
def test_hang(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, recovery: str,
              hang: str) -> None:
    """hang_timeout_s 2: found within the timeout + 1 s, by the hung rank's supervisor."""
    monkeypatch.setenv("ANTIFRAGILE_CACHE", str(cache))
    t = _run(tmp_path, f"hang-{hang}-{recovery}", {"kind": "hang_rank", "rank": 1,
                                                   "at_step": 10, "duration_s": 60,
                                                   "mode": hang}, recovery=recovery)
    assert t["detect_s"] <= 2.0 + 1.0, t
    assert t["recovery_mode"] == recovery and "found it hung (stopped" in t["effect"]


@pytest.mark.timeout(900)
def test_in_process_without_a_spare_falls_back_to_a_restart(
        tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANTIFRAGILE_CACHE", str(cache))
    t = _run(tmp_path, "no-spare", {"kind": "kill_rank", "rank": 0, "at_step": 10},
             recovery="in_process", spares=0)
    assert t["recovery_mode"] == "restart"
    assert "1 rank(s) lost and 0 spare(s) left" in (t["fallback"] or ""), t


@pytest.mark.timeout(900)
def test_a_crash_loop_is_handed_to_a_restart_after_three_in_process_recoveries(
        tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 is killed at step 10 every time the job gets there (``on_pass`` 1-4), a failure
    that recurs where it happened. Three in-process re-formations that get no further than
    step 10, then the fourth failure goes to torchrun's restart (whose --max-restarts bounds a
    loop that goes on), and the run still ends bitwise equal."""
    monkeypatch.setenv("ANTIFRAGILE_CACHE", str(cache))
    faults = [{"kind": "kill_rank", "rank": 1, "at_step": 10, "on_pass": n} for n in range(1, 5)]
    timings = _run_all(tmp_path, "crash-loop", faults, recovery="in_process")
    assert [t["recovery_mode"] for t in timings] == ["in_process"] * 3 + ["restart"], timings
    assert "3 failures in a row got no further than step 10" in (timings[3]["fallback"] or "")
    assert all(t["fallback"] is None for t in timings[:3]), timings
