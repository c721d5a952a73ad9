"""Reading a ``chaos run`` report in tests."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

#: where every field of report.json, summary.json and crashcheck.json is described
REPORTS_README = Path(__file__).parents[1] / "reports" / "README.md"
#: the validated scenario (its fields are the scenario format's) and maps keyed by data (a
#: step): their keys are not looked up
_NOT_FIELDS = frozenset({"scenario", "committed_verified"})


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


def undocumented(value: Any, path: str = "") -> list[str]:
    """The paths of the keys in ``value`` (dicts in lists in dicts...) that reports/README.md
    names in no code span, alone or as a part of a dotted path (`key`, `baseline.key`,
    `rules.<rule>.key`, `key[]`)."""
    text = REPORTS_README.read_text(encoding="utf-8")
    part = r"[\w<>\[\]-]+"
    found: list[str] = []
    if isinstance(value, dict):
        for key, inner in value.items():
            where = f"{path}.{key}" if path else key
            if not re.search(rf"`\.?(?:{part}\.)*{re.escape(key)}(?:\[\])?(?:\.{part})*`", text):
                found.append(where)
            if key not in _NOT_FIELDS:
                found += undocumented(inner, where)
    elif isinstance(value, list):
        for item in value:
            found += undocumented(item, f"{path}[]")
    return sorted(set(found))
