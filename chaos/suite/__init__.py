"""``chaos suite``: every scenario of a folder, a summary, and regressions against a baseline.

``runner`` discovers, validates and runs the scenarios; ``summary`` builds ``summary.json``,
``summary.html`` and the table, and compares with a previous summary.
"""

from antifragile.chaos.suite.runner import (
    Planned,
    SuiteInterrupted,
    discover,
    matching_baselines,
    plan,
    run_suite,
)
from antifragile.chaos.suite.summary import (
    FORMAT,
    MAX_BASELINE_BYTES,
    SuiteError,
    Tolerances,
    build,
    compare,
    compare_many,
    exit_code,
    failed_entry,
    format_table,
    load_baseline,
    load_baselines,
    summarize,
    write_html,
    write_json,
)

__all__ = [
    "FORMAT",
    "MAX_BASELINE_BYTES",
    "Planned",
    "SuiteError",
    "SuiteInterrupted",
    "Tolerances",
    "build",
    "compare",
    "compare_many",
    "discover",
    "exit_code",
    "failed_entry",
    "format_table",
    "load_baseline",
    "load_baselines",
    "matching_baselines",
    "plan",
    "run_suite",
    "summarize",
    "write_html",
    "write_json",
]
