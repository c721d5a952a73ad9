"""``chaos suite``: run every scenario of a folder, in order, each into its own report folder.

This is what the nightly CI runs. A suite never stops at the first problem: a failed scenario, an
invalid scenario file, a run that could not be made (no verdict: its reason) or a runner that
crashes (its traceback in ``error.txt``) each become a failed entry and the next scenario
runs. Layout of ``OUT``: ``summary.json``, ``summary.html``, and one ``chaos run`` report folder
per scenario, ``OUT/<scenario name>/``.
"""

from __future__ import annotations

import contextlib
import shutil
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import TYPE_CHECKING, Any

from antifragile.chaos.scenario import Scenario, ScenarioError, load_scenario
from antifragile.chaos.suite.summary import SuiteError, failed_entry, load_baseline, summarize

if TYPE_CHECKING:
    from antifragile.chaos.run.pipeline import RunStatus

#: what shows a folder is a run's: its report, a crashed runner's error, or the torchrun log
#: of a run cut short (a ``run/`` or ``ckpt/`` alone may be anybody's: the folder is deleted
#: whole before the scenario runs there, as ``chaos run --out`` refuses such a folder)
_RUN_MARKERS = ("report.json", "error.txt", "run/torchrun.log")
_SUITE_FILES = ("summary.json", "summary.html")  # written into OUT beside the run folders
_HTML_MARK = b"<title>chaos suite: "  # in the head of every summary.html a suite writes


@dataclass(slots=True)
class Planned:
    """One scenario file of the suite: the validated scenario, or why it is invalid."""

    file: Path
    scenario: Scenario | None = None
    error: str | None = None

    @property
    def name(self) -> str:
        return self.scenario.name if self.scenario else self.file.stem


def discover(folder: Path, patterns: Sequence[str] = ("*",)) -> list[Path]:
    """Every ``*.yaml``/``*.yml`` under ``folder`` (recursively) whose name or stem matches
    one of ``patterns`` (globs); a link of that name that leads nowhere (its target gone, or a
    loop) too: the suite fails it as unreadable rather than leave it out."""
    try:
        is_dir, exists = folder.is_dir(), folder.exists()
    except OSError as exc:  # a name too long to look up
        raise SuiteError(f"{folder}: {exc.strerror or exc}") from None
    if exists and not is_dir:
        raise SuiteError(f"{folder} is a file, not a folder of scenarios (chaos run takes one "
                         "scenario)")
    if not is_dir:
        raise SuiteError(f"{folder}: no such folder")
    patterns = list(patterns) or ["*"]
    files = sorted(p for p in folder.rglob("*")
                   if (p.is_file() or (p.is_symlink() and not p.exists()))
                   and p.suffix in (".yaml", ".yml") and _matches(p, patterns))
    if not files:
        matching = f" matching {' or '.join(map(repr, patterns))}" if patterns != ["*"] else ""
        raise SuiteError(f"{folder}: no scenario files (*.yaml){matching}")
    return files


def _matches(path: Path, patterns: Sequence[str]) -> bool:
    return any(fnmatch(path.name, g) or fnmatch(path.stem, g) for g in patterns)


def matching_baselines(baselines: list[tuple[str, dict[str, Any]]], patterns: Sequence[str]
                       ) -> list[tuple[str, dict[str, Any]]]:
    """Each baseline with only the scenarios ``patterns`` selects (by file, as ``discover``;
    by name where an entry has none): a suite run on some of its scenarios has not lost the
    others."""
    if not patterns:
        return baselines
    return [(name, {**doc, "scenarios": [e for e in doc["scenarios"] if _matches(
                Path(str(e.get("file") or e["name"])), patterns)]}) for name, doc in baselines]


def plan(files: list[Path], out: Path) -> list[Planned]:
    """Validate every file; refuse duplicate names (an invalid file's entry is named after
    the file: a summary and its comparison with a baseline are keyed by name) and output
    folders and summary files that are not ours."""
    for name in _SUITE_FILES:
        if (out / name).exists() and not _suite_wrote(out / name):
            raise SuiteError(f"{out / name}: exists and is not a summary chaos suite wrote; "
                             "not replacing it (choose another --out)")
    planned = []
    for file in files:
        try:
            planned.append(Planned(file, scenario=load_scenario(file)))
        except ScenarioError as exc:
            planned.append(Planned(file, error=str(exc)))
    seen: dict[str, Path] = {}
    for p in planned:
        if p.name in seen:
            named = "" if p.scenario else " (it is invalid: listed under its file's name)"
            raise SuiteError(f"{p.file}: scenario name {p.name!r} is already used by "
                             f"{seen[p.name]}; names must be unique in a suite{named}")
        seen[p.name] = p.file
        if p.name in _SUITE_FILES:  # its report folder would stand where the summary goes
            raise SuiteError(f"{p.file}: scenario name {p.name!r} is the suite's own "
                             f"{p.name} in the output folder; rename the scenario")
        if p.scenario is None:
            continue
        folder = out / p.name
        try:  # a file there is no run folder either
            foreign = folder.exists() and (not folder.is_dir() or (
                any(folder.iterdir()) and not any((folder / m).is_file() for m in _RUN_MARKERS)))
        except OSError as exc:  # a folder it may not look into
            raise SuiteError(f"{folder}: {exc.strerror or exc}") from None
        if foreign:
            raise SuiteError(f"{folder}: exists and is not a chaos run folder; "
                             f"not replacing it (choose another --out)")
    return planned


def _suite_wrote(path: Path) -> bool:
    """Whether ``path`` is a summary an earlier suite wrote (``run_suite`` removes those):
    a summary.json that loads as a baseline, a summary.html with the suite's title."""
    try:
        if path.name == "summary.json":
            load_baseline(path)
            return True
        with open(path, "rb") as f:
            return _HTML_MARK in f.read(4096)
    except (SuiteError, OSError):  # a folder, a file it may not read, anything else
        return False


class SuiteInterrupted(Exception):
    """Ctrl-C or SIGTERM (the ``__cause__``, to be raised again once the summary is written)
    stopped the suite: ``entries`` has one for every planned scenario, the one it stopped and
    those it never ran failed."""

    def __init__(self, entries: list[dict[str, Any]]) -> None:
        super().__init__("the suite was stopped")
        self.entries = entries


def _fresh(folder: Path) -> None:
    """Clear a previous run's folder: old checkpoints would be resumed from."""
    if folder.exists():
        shutil.rmtree(folder)


def run_suite(planned: list[Planned], out: Path, *, reference: bool = True,
              progress: Callable[[str], None] = print,
              status: Callable[[RunStatus], None] | None = None) -> list[dict[str, Any]]:
    """Run every planned scenario into ``out/<name>/``, in order; one entry each. Raises
    SuiteInterrupted, with every entry, when Ctrl-C or SIGTERM stops it."""
    from antifragile.chaos.infra.s3 import StorageSetupError
    from antifragile.chaos.run.pipeline import run  # torch: only once a suite runs
    from antifragile.chaos.run.runner import ChaosRunError

    out.mkdir(parents=True, exist_ok=True)
    for name in _SUITE_FILES:  # an earlier suite's, saying ok, must not outlive a killed one
        with contextlib.suppress(OSError):  # one that cannot go fails to be written, exit 2
            (out / name).unlink()
    entries = []
    for i, p in enumerate(planned, 1):
        head = f"[{i}/{len(planned)}] {p.name} ({p.file})"
        if p.scenario is None:
            progress(f"{head}: INVALID")
            entries.append(failed_entry(p.name, str(p.file), p.error or "invalid scenario"))
            continue
        progress(head)
        folder = out / p.name
        started = time.monotonic()
        try:  # the old folder's deletion too: a stop while it waits is a stop of this scenario
            _fresh(folder)
            outcome = run(p.scenario, folder, reference=reference, progress=progress,
                          status=status)
        except (ChaosRunError, StorageSetupError) as exc:  # no verdict, refused storage
            entry = failed_entry(p.name, str(p.file), str(exc))  # meant for the user as is
            entry["wall_s"] = time.monotonic() - started
        except Exception as exc:  # a crashed runner fails this scenario, not the suite
            reason = f"the runner crashed: {type(exc).__name__}: {exc}"
            error: str | None = f"{p.name}/error.txt"
            try:  # a runner that failed on the file system (a full disk) may leave no room
                folder.mkdir(parents=True, exist_ok=True)
                (folder / "error.txt").write_text(traceback.format_exc(), encoding="utf-8")
            except OSError as unwritten:
                reason += f" (its traceback could not be written: {unwritten})"
                error = None
            entry = failed_entry(p.name, str(p.file), reason, error=error)
            entry["wall_s"] = time.monotonic() - started
        except (KeyboardInterrupt, SystemExit) as stop:  # SystemExit: SIGTERM (stop_once)
            entry = failed_entry(p.name, str(p.file),
                                 "interrupted: the suite was stopped while it ran")
            entry["wall_s"] = time.monotonic() - started
            entries.append(entry)
            entries += [failed_entry(q.name, str(q.file), q.error or "not run: the suite was "
                                     "stopped before it") for q in planned[i:]]
            raise SuiteInterrupted(entries) from stop
        else:
            entry = summarize(p.name, str(p.file), outcome.report, f"{p.name}/report.json")
        progress(f"{head}: {entry['verdict'].upper()} in {time.monotonic() - started:.0f} s")
        entries.append(entry)
    return entries


