"""Reading a ``chaos run`` report in tests."""

from __future__ import annotations

from typing import Any


def committed_before(report: dict[str, Any], t: float) -> int:
    """The newest step any rank had seen commit by Unix time ``t`` (0: none)."""
    timeline = report["timeline"]
    cutoff_s = t - timeline["started_t"]
    return max((c["step"] for w in timeline["workers"] for c in w["checkpoints"]
                if c["committed_s"] is not None and c["committed_s"] <= cutoff_s), default=0)


def check_restored(report: dict[str, Any], fault: dict[str, Any], saved: tuple[int, ...]) -> int:
    """Assert that ``fault``'s recovery restored one of the steps ``saved`` before it, none older
    than the newest a rank had seen commit by the injection (an async save may still be in
    flight when the fault lands: then the one before it is the right one), and that the steps
    since were trained again. Returns the step restored."""
    restored = fault["restored_step"]
    known = committed_before(report, fault["injected_t"])
    assert restored in saved and restored >= known, (fault, known)
    assert fault["lost_steps"] == fault["injected_step"] - restored, fault
    return int(restored)
