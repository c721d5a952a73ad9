"""chaos crashcheck: the crash model (pure), the recording proxy (real S3), the checker's
classification, and end to end on SeaweedFS: every crash state of our engine's save loads step
k or step k+1 bitwise, while a loader that trusts a step folder without its COMMIT is caught."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from antifragile.chaos.cli import main
from antifragile.chaos.crashcheck.check import Expected, classify, holds_intact
from antifragile.chaos.crashcheck.enumerate import apply, enumerate_states
from antifragile.chaos.crashcheck.record import Mutation
from antifragile.chaos.crashcheck.report import verdict
from tests._reports import undocumented

ROOT = Path(__file__).resolve().parents[1]


def _put(i: int, key: str, issued: float, acked: float, digest: str = "") -> Mutation:
    return Mutation(i, "put", key, issued, acked, digest=digest or f"d{i}", size=1)


# -- the crash model ---------------------------------------------------------------------------

def test_sequential_writes_leave_one_state_per_prefix_of_the_order() -> None:
    muts = [_put(0, "a", 0, 1), _put(1, "b", 2, 3), _put(2, "COMMIT", 4, 5)]
    e = enumerate_states({"old": "x"}, muts)
    assert len(e.states) == 4  # nothing, a, a+b, a+b+COMMIT
    assert e.max_in_flight == 1 and e.sampled_cuts == 0 and not e.capped
    assert sorted(len(s.objects) for s in e.states) == [1, 2, 3, 4]
    # COMMIT is never present without both objects it follows
    assert all({"a", "b"} <= set(s.objects) for s in e.states if "COMMIT" in s.objects)


def test_concurrent_writes_leave_every_subset() -> None:
    muts = [_put(i, f"k{i}", 0, 1 + i * 0.1) for i in range(4)] + [_put(4, "COMMIT", 2, 3)]
    e = enumerate_states({}, muts)
    assert len(e.states) == 2 ** 4 + 1
    assert e.max_in_flight == 4
    with_commit = [s for s in e.states if "COMMIT" in s.objects]
    assert len(with_commit) == 1 and len(with_commit[0].objects) == 5


def test_large_in_flight_sets_are_sampled_and_said_so() -> None:
    muts = [_put(i, f"k{i}", 0, 1) for i in range(10)]
    e = enumerate_states({}, muts, max_inflight_exhaustive=4, sample_per_cut=50, seed=3)
    assert e.sampled_cuts == 1
    assert 2 < len(e.states) <= 52
    again = enumerate_states({}, muts, max_inflight_exhaustive=4, sample_per_cut=50, seed=3)
    assert [s.objects for s in again.states] == [s.objects for s in e.states]  # seeded


def test_a_sampled_cut_counts_each_subset_once() -> None:
    """Seeded draws of an in-flight set repeat subsets (10 in flight: 1024 subsets, 2000
    draws); each repeat was counted as another crash point, so the report claimed more
    crashes visited than there were (here twice as many)."""
    muts = [_put(i, f"k{i}", 0, 1) for i in range(10)]
    e = enumerate_states({}, muts, max_inflight_exhaustive=4, sample_per_cut=2000, seed=1)
    assert e.sampled_cuts == 1
    # every subset of the middle cut leaves its own state; the cuts before and after the
    # writes leave the empty and the full one again
    assert e.crash_points == e.distinct + 2 == sum(s.cuts for s in e.states)
    assert e.distinct <= 2 ** 10


def test_max_states_caps_with_a_seeded_sample() -> None:
    muts = [_put(i, f"k{i}", 0, 1) for i in range(6)]
    e = enumerate_states({}, muts, max_states=10)
    assert e.capped and e.distinct == 64 and len(e.states) == 10
    sizes = [len(s.objects) for s in e.states]
    assert 0 in sizes and 6 in sizes  # the states before and after the save are always kept


def test_max_states_keeps_the_state_after_the_save_when_a_shorter_crash_reached_it_first(
        ) -> None:
    """The state after the save was taken to be the one with the most mutations applied; a
    save whose last mutation changes nothing (the delete of a temporary object) reaches its
    final state first with fewer applied than a state in the middle of the save."""
    muts = [_put(0, "a", 0, 1), _put(1, "tmp", 2, 3), Mutation(2, "delete", "tmp", 4, 5),
            _put(3, "b", 6, 7), Mutation(4, "delete", "b", 8, 9)]
    e = enumerate_states({}, muts, max_states=2)
    assert e.capped and e.distinct == 4
    assert [s.objects for s in e.states] == [{}, {"a": "d0"}]


def test_a_cap_of_one_state_checks_the_state_after_the_save() -> None:
    """``--max-states 1`` kept the state before the save (nothing changed yet) and dropped the
    one after it, which the verdict rests on: the run failed, its save "not loading new"."""
    muts = [_put(0, "a", 0, 1), _put(1, "COMMIT", 2, 3)]
    e = enumerate_states({}, muts, max_states=1)
    assert e.capped and [s.id for s in e.states] == [e.final]
    assert e.states[0].objects == {"a": "d0", "COMMIT": "d1"}


def test_deletes_copies_and_same_key_overlaps() -> None:
    base = {"old/a": "x", "old/COMMIT": "c", "tmp": "t"}
    muts = [Mutation(0, "delete", "old/COMMIT", 0, 1), Mutation(1, "delete", "old/a", 0, 1),
            Mutation(2, "copy", "meta", 2, 3, source="tmp"), _put(3, "meta", 2.5, 3.5)]
    assert apply(base, muts[:3]) == {"tmp": "t", "meta": "t"}
    e = enumerate_states(base, muts)
    assert e.same_key_overlaps == 1
    # the multi-object delete's keys vanish independently: COMMIT gone with data kept and
    # the other way round are both states
    assert any("old/COMMIT" not in s.objects and "old/a" in s.objects for s in e.states)
    assert any("old/COMMIT" in s.objects and "old/a" not in s.objects for s in e.states)


def test_a_copy_whose_source_is_written_while_it_runs_is_an_overlap() -> None:
    """A COPY reads its source: one in flight beside a write of that source may have copied
    the old or the new bytes, and the model (issue order) builds only one of the two states.
    Such a pair was not counted in ``same_key_overlaps`` (the keys differ), so the report
    said 0 overlaps, the model exact, while it had left a crash state out."""
    muts = [_put(0, "src", 0, 3, "v2"), Mutation(1, "copy", "dst", 1, 2, source="src")]
    e = enumerate_states({"src": "v1"}, muts)
    copied_old = {"src": "v2", "dst": "v1"}  # the copy read src before the PUT landed
    assert copied_old not in [s.objects for s in e.states]
    assert e.same_key_overlaps == 1
    # a copy issued once the write of its source was acknowledged reads it: no overlap
    after = [_put(0, "src", 0, 1, "v2"), Mutation(1, "copy", "dst", 2, 3, source="src")]
    assert enumerate_states({"src": "v1"}, after).same_key_overlaps == 0

def test_classification() -> None:
    exp = Expected(old_step=2, old_digest="o", new_step=3, new_digest="n", older={1: "p"})
    for intact in (True, False):
        assert classify({"step": 2, "digest": "o"}, exp, intact=intact) == "old"
        assert classify({"step": 3, "digest": "n"}, exp, intact=intact) == "new"
        # old data under the new step
        assert classify({"step": 3, "digest": "o"}, exp, intact=intact) == "torn"
        assert classify({"step": 2, "digest": "z"}, exp, intact=intact) == "torn"
        # rolled back past step 2
        assert classify({"step": 1, "digest": "p"}, exp, intact=intact) == "lost"
    # nothing loaded: a liveness failure while a checkpoint was intact, else step 2 is lost
    # (an error where neither step's folder survived was reported as refused)
    for result in ({"error": "CheckpointError: ..."}, {"nothing": "no committed step"}):
        assert classify(result, exp, intact=True) == "refused"
        assert classify(result, exp, intact=False) == "lost"


def test_a_committed_step_the_rule_skipped_is_not_a_pass(tmp_path: Path) -> None:
    """A save whose COMMIT lands before its data leaves crash states with a committed, torn
    step k+1; the engine's load skips it (with a StepSkippedWarning) and loads step k, which
    was classified ``old``: the check passed an engine that breaks its commit protocol
    (DESIGN 2.3: never a torn checkpoint among the committed ones). A step the rule took for
    a checkpoint and skipped makes the state torn."""
    import shutil

    from antifragile.chaos.crashcheck import engines

    url = str(tmp_path / "ckpt")
    engines.save("antifragile", url, 2)
    engines.save("antifragile", url, 3)
    step3 = tmp_path / "ckpt" / engines.step_name(3)
    shutil.rmtree(step3 / "model")  # COMMIT landed, the data did not
    assert (step3 / "COMMIT").exists()
    step, loaded, skipped = engines.load("antifragile", "engine", url)
    assert step == 2 and skipped  # the fallback itself works
    exp = Expected(old_step=2, old_digest=engines.digest(engines.make_state(2)),
                   new_step=3, new_digest=engines.digest(engines.make_state(3)))
    result = {"step": step, "digest": loaded, "skipped": skipped}
    assert classify(result, exp, intact=True) == "torn"
    assert classify({**result, "skipped": []}, exp, intact=True) == "old"


def test_a_step_is_intact_when_its_folder_is_as_its_save_left_it() -> None:
    base = {"step_000000002/COMMIT": "c", "step_000000002/w/c/0": "a", "step_000000001/x": "p"}
    assert holds_intact(base, base, 2) and holds_intact(base, base, 1)
    assert holds_intact({**base, "step_000000003/w/c/0": "n"}, base, 2)
    assert not holds_intact({k: v for k, v in base.items() if k != "step_000000002/COMMIT"},
                            base, 2)
    assert not holds_intact({**base, "step_000000002/w/c/0": "b"}, base, 2)  # overwritten
    assert not holds_intact({**base, "step_000000002/extra": "e"}, base, 2)
    assert not holds_intact(base, base, 3)  # no such folder: nothing to hold


def test_verdict_fails_on_the_documented_rule_only() -> None:
    def doc(rule: str, documented: bool, torn: int) -> dict[str, Any]:
        counts = {"old": 1, "new": 1, "refused": 0, "torn": torn, "lost": 0}
        return {"cases": [{"engine": "x", "ranks": 1, "case": "save", "rules": {
            rule: {"documented": documented, "counts": counts, "witnesses": {},
                   "final": "new"}}}]}

    assert verdict(doc("marker", True, 0)) == (True, [])
    ok, reasons = verdict(doc("marker", True, 2))
    assert not ok and "2 torn" in reasons[0]
    both = doc("marker", True, 0)
    both["cases"][0]["rules"].update(doc("newest-folder", False, 2)["cases"][0]["rules"])
    assert verdict(both) == (True, [])  # reported, not targeted


def test_a_case_without_its_documented_rule_does_not_pass() -> None:
    """The verdict is judged on the documented rule only; a case checked under other rules
    alone (``Settings(rules=("newest-folder",))`` through the Python API: the command line
    refuses it) passed with nothing judged, whatever its states loaded."""
    counts = {"old": 1, "new": 1, "refused": 0, "torn": 0, "lost": 0}
    doc = {"cases": [{"engine": "dcp", "ranks": 1, "case": "save", "rules": {
        "newest-folder": {"documented": False, "counts": counts, "witnesses": {},
                          "final": "new"}}}]}
    assert verdict(doc) == (False, ["dcp (1 ranks, save): the documented load rule was not "
                                    "checked (only newest-folder)"])


def test_a_report_of_a_run_that_stopped_before_a_case_does_not_pass() -> None:
    """The report is written after each case, so a run stopped by Ctrl-C or a failed saving
    job leaves one holding only the cases before it; its verdict was OK when those were (no
    case at all: OK too), although the cases asked for were never checked."""
    counts = {"old": 1, "new": 1, "refused": 0, "torn": 0, "lost": 0}
    save = {"engine": "x", "ranks": 1, "case": "save", "rules": {
        "marker": {"documented": True, "counts": counts, "witnesses": {}, "final": "new"}}}
    asked = {"cases": ["save", "overwrite"]}
    assert verdict({"settings": asked, "engine": "x", "cases": [save]}) == (
        False, ["x: case overwrite was not checked (the run stopped before it)"])
    assert not verdict({"settings": {"cases": ["save"]}, "engine": "x", "cases": []})[0]
    assert verdict({"settings": {"cases": ["save"]}, "engine": "x", "cases": [save]}) == (
        True, [])


# a checker that answers every state, but dies on state 1 (once: a process that ran out of
# memory on it) and hangs on state 2; it speaks the protocol of ``worker.py check``
_FAKE_CHECKER = """
import json, os, sys, time
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    task = json.loads(line)
    if task["id"] == 1:
        sys.stderr.write("MemoryError: out of memory\\n")
        sys.stderr.flush()
        os._exit(3)
    if task["id"] == 2:
        time.sleep(60)
    results = {r: {"step": 1, "digest": "o", "skipped": []} for r in task["rules"]}
    print(json.dumps({"id": task["id"], "results": results}), flush=True)
"""


def _fake_checkers(monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    from antifragile.chaos.crashcheck import check

    popen = subprocess.Popen

    def fake(args: list[str], **kwargs: Any) -> Any:
        assert args[1:4] == ["-m", "antifragile.chaos.crashcheck.worker", "check"], args
        return popen([sys.executable, "-c", _FAKE_CHECKER], **kwargs)

    monkeypatch.setattr(check.subprocess, "Popen", fake)
    monkeypatch.setattr(check, "STATE_TIMEOUT_S", 1.0, raising=False)


@pytest.mark.parametrize("bad", [1, 2], ids=["dies", "hangs"])
def test_a_checker_that_dies_or_hangs_leaves_its_state_unchecked_and_the_rest_go_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bad: int) -> None:
    """A checker process that died on a state raised out of the whole crashcheck run (every
    state checked so far lost), and one that hung (a load that never returned) hung the run
    for good. The state is now ``unchecked`` with the reason, the checker is replaced, and
    every other state is checked."""
    import threading

    from antifragile.chaos.crashcheck.check import CheckerPool

    _fake_checkers(monkeypatch)
    tasks = [{"id": i, "prefix": f"p/s{i}", "objects": {}, "rules": ["marker"]}
             for i in (0, bad, 3, 4, 5)]
    answers: dict[int, Any] = {}
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with CheckerPool(engine="dcp", bucket="b", bodies=tmp_path, env={},
                             workers=1) as pool:
                answers.update(pool.check(tasks))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(20)
    assert not thread.is_alive(), "the check still runs after 20 s: a hung checker hangs it"
    assert errors == []
    assert sorted(answers) == [0, bad, 3, 4, 5]
    exp = Expected(old_step=1, old_digest="o", new_step=2, new_digest="n")
    outcomes = {i: classify(a["results"]["marker"], exp, intact=True) for i, a in answers.items()}
    assert outcomes == {0: "old", bad: "unchecked", 3: "old", 4: "old", 5: "old"}
    reason = answers[bad]["unchecked"]
    if bad == 1:
        assert reason == ("the checker process exited (3) while checking it: MemoryError: "
                          "out of memory")
    else:
        assert reason == "the checker process answered nothing in 1 s (hung): killed"


# a checker a library of which prints a bare number on stdout while it checks state 1
_CHATTY_CHECKER = """
import json, sys
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    task = json.loads(line)
    if task["id"] == 1:
        print(42, flush=True)
    results = {r: {"step": 1, "digest": "o", "skipped": []} for r in task["rules"]}
    print(json.dumps({"id": task["id"], "results": results}), flush=True)
"""


def _four_states_checked_by(script: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                            ) -> dict[int, dict[str, Any]]:
    """The answers of a one-checker pool whose checker is ``script``, for states 0-3."""
    from antifragile.chaos.crashcheck import check
    from antifragile.chaos.crashcheck.check import CheckerPool

    popen = subprocess.Popen
    monkeypatch.setattr(check.subprocess, "Popen", lambda args, **kwargs: popen(
        [sys.executable, "-c", script], **kwargs))
    tasks = [{"id": i, "prefix": f"p/s{i}", "objects": {}, "rules": ["marker"]}
             for i in range(4)]
    with CheckerPool(engine="dcp", bucket="b", bodies=tmp_path, env={}, workers=1) as pool:
        return pool.check(tasks)


def test_a_checker_line_that_is_json_but_no_answer_leaves_its_state_unchecked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A line that parses as JSON but is no object (``42``) raised TypeError in the thread
    that drove the checker (``"results" not in 42``): the thread died, its state got no
    answer at all and vanished from the counts, and the states after it went unchecked
    although the checker still ran. It is a checker that said something unexpected: its
    state is unchecked with the reason, the checker replaced, the rest checked."""
    answers = _four_states_checked_by(_CHATTY_CHECKER, tmp_path, monkeypatch)
    assert sorted(answers) == [0, 1, 2, 3]
    assert answers[1]["unchecked"] == "a checker said 42"
    assert all("unchecked" not in answers[i] for i in (0, 2, 3)), answers

# a checker that answers state 1 under another state's id (0), then under none
_MISNAMING_CHECKER = """
import json, sys
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    task = json.loads(line)
    results = {r: {"step": 1, "digest": "o", "skipped": []} for r in task["rules"]}
    said = {1: {"id": 0}, 2: {}}.get(task["id"], {"id": task["id"]})
    print(json.dumps({**said, "results": results}), flush=True)
"""


def test_a_checker_answer_for_another_state_leaves_its_state_unchecked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An answer was filed under the id it named: one naming another state (0 for state 1)
    replaced that state's answer and left state 1 with none, so it vanished from the counts
    (the verdict judged the states that had answers); one naming no state raised KeyError in
    the thread driving the checker. Either is a checker that said something unexpected."""
    answers = _four_states_checked_by(_MISNAMING_CHECKER, tmp_path, monkeypatch)
    assert sorted(answers) == [0, 1, 2, 3]
    assert answers[1]["unchecked"].startswith("a checker answered state 0 for state 1"), answers
    assert answers[2]["unchecked"].startswith("a checker answered state None for state 2")
    assert all("unchecked" not in answers[i] for i in (0, 3)), answers


def test_a_checker_that_cannot_be_started_leaves_no_checker_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second checker's Popen raised (out of processes, of file handles): the OSError
    left the pool's constructor with the first checker still running, an orphan nobody would
    ever stop (and a traceback for the user)."""
    from antifragile.chaos.crashcheck import check

    popen = subprocess.Popen
    started: list[subprocess.Popen[str]] = []

    def fake(args: list[str], **kwargs: Any) -> Any:
        if started:
            raise OSError(11, "Resource temporarily unavailable")
        started.append(popen([sys.executable, "-c", "import time; time.sleep(30)"], **kwargs))
        return started[0]

    monkeypatch.setattr(check.subprocess, "Popen", fake)
    try:
        with pytest.raises(check.CheckerError, match="Resource temporarily unavailable"):
            check.CheckerPool(engine="dcp", bucket="b", bodies=tmp_path, env={}, workers=2)
        assert started[0].poll() is not None, "the first checker was left running"
    finally:
        if started[0].poll() is None:
            started[0].kill()
        started[0].wait()


# a checker that dies on its first state; its replacements start slowly
_DYING_CHECKER = """
import json, os, pathlib, sys, time
folder = pathlib.Path(sys.argv[1])
replacement = any(folder.glob("started-*"))
(folder / f"started-{os.getpid()}").touch()
if replacement:
    time.sleep(1.0)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    sys.exit(3)
"""


def test_a_pool_closed_while_it_checks_starts_no_checker_and_raises_in_no_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """chaos crashcheck stopped (SIGTERM, Ctrl-C) while a checker was being replaced: the
    pool's close went on with its threads still checking, the replacement took the next
    state and wrote it to the stdin close had shut (a ValueError in that thread), or was
    started while close listed the checkers ('dictionary changed size during iteration', a
    traceback for the user) and was never waited for. Once close has begun, no state is
    handed out and no checker started."""
    import threading

    from antifragile.chaos.crashcheck import check
    from antifragile.chaos.crashcheck.check import CheckerPool

    popen = subprocess.Popen
    monkeypatch.setattr(check.subprocess, "Popen", lambda args, **kwargs: popen(
        [sys.executable, "-c", _DYING_CHECKER, str(tmp_path)], **kwargs))
    raised: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args.exc_value))
    tasks = [{"id": i, "prefix": f"p/s{i}", "objects": {}, "rules": ["marker"]}
             for i in range(4)]
    pool = CheckerPool(engine="dcp", bucket="b", bodies=tmp_path, env={}, workers=1)
    checking = threading.Thread(target=pool.check, args=(tasks,), daemon=True)
    checking.start()
    deadline = time.monotonic() + 20
    while len(list(tmp_path.glob("started-*"))) < 2:  # the first died: replaced, slowly
        assert time.monotonic() < deadline, "the dead checker was not replaced"
        time.sleep(0.01)
    pool.close()
    checking.join(20)
    assert not checking.is_alive()
    assert raised == []
    assert len(list(tmp_path.glob("started-*"))) == 2, "a checker started after close"
    assert all(proc.poll() is not None for proc in pool.procs)


def test_unchecked_states_fail_the_verdict_with_their_reason() -> None:
    counts = {"old": 3, "new": 1, "refused": 0, "torn": 0, "lost": 0, "unchecked": 1}
    doc = {"cases": [{"engine": "x", "ranks": 1, "case": "save",
                      "unchecked": [{"state": 2, "reason": "the checker process exited (9)"}],
                      "rules": {"marker": {"documented": True, "counts": counts,
                                           "witnesses": {}, "final": "new"}}}]}
    assert verdict(doc) == (False, ["x (1 ranks, save, rule marker): 1 state(s) unchecked "
                                    "(the first: the checker process exited (9))"])


def test_a_save_that_never_lands_fails_the_verdict() -> None:
    """Every crash state loading step k passes only if the save, uninterrupted, loads step
    k+1: a save that raised, or whose COMMIT never made step k+1 loadable, leaves states that
    all load step k, each of them "old"."""
    from antifragile.chaos.crashcheck.pipeline import CaseResult, Settings, summarize
    from antifragile.chaos.crashcheck.record import Recording

    muts = [_put(0, "step_2/a", 0, 1), _put(1, "step_2/COMMIT", 2, 3)]
    e = enumerate_states({"step_1/COMMIT": "c"}, muts)
    exp = Expected(old_step=1, old_digest="o", new_step=2, new_digest="n")
    settings = Settings(engine="antifragile", ranks=1, cases=("save",))

    def doc(final: str, save_error: str | None, name: str = "save") -> dict[str, Any]:
        result = CaseResult(name, Recording(mutations=muts), {"step_1/COMMIT": "c"}, exp, e,
                            save_error=save_error,
                            save_refused="already committed" in (save_error or ""))
        after = max(e.states, key=lambda s: len(s.objects)).id
        result.outcomes["engine"] = {s.id: final if s.id == after else "old" for s in e.states}
        return {"cases": [summarize(settings, result)]}

    assert verdict(doc("new", None)) == (True, [])
    ok, reasons = verdict(doc("old", None))  # the save's COMMIT never made step 2 loadable
    assert not ok and "step 2" in reasons[0], reasons
    assert not verdict(doc("old", "rank 0: OSError: refused"))[0]  # the save itself failed
    # the one case where an engine may refuse the save: a committed step saved again
    assert verdict(doc("old", "rank 0: CheckpointCommittedError: step 2 is already committed",
                       "overwrite-committed"))[0]
    assert not verdict(doc("old", "rank 0: OSError: refused", "overwrite-committed"))[0]


def _summarized(outcomes: dict[int, str], *, name: str = "save",
                save_error: str | None = None, save_refused: bool = False) -> dict[str, Any]:
    """The report document of one case whose states (before, in the middle of and after a
    save of step 2) the documented rule classified as ``outcomes`` (state id -> outcome)."""
    from antifragile.chaos.crashcheck.pipeline import CaseResult, Settings, summarize
    from antifragile.chaos.crashcheck.record import Recording

    muts = [_put(0, "step_2/a", 0, 1), _put(1, "step_2/COMMIT", 2, 3)]
    e = enumerate_states({"step_1/COMMIT": "c"}, muts)
    exp = Expected(old_step=1, old_digest="o", new_step=2, new_digest="n")
    settings = Settings(engine="antifragile", ranks=1, cases=(name,))
    result = CaseResult(name, Recording(mutations=muts), {"step_1/COMMIT": "c"}, exp, e,
                        save_error=save_error, save_refused=save_refused)
    result.answers = {s.id: ({"id": s.id, "unchecked": "the checker process exited (9)"}
                             if outcomes[s.id] == "unchecked" else {"id": s.id})
                      for s in e.states}
    for s in e.states:  # what a checker answers for a torn state: another step's data
        if outcomes[s.id] == "torn":
            result.answers[s.id]["results"] = {
                "engine": {"step": 2, "digest": "neither", "skipped": [1]}}
    result.timings = {"record_s": 1.0, "save_s": 0.5, "enumerate_s": 0.1, "check_s": 2.0}
    result.outcomes["engine"] = outcomes
    return {"engine": "antifragile", "settings": {"cases": [name]},
            "cases": [summarize(settings, result)]}


def test_the_report_does_not_say_every_state_loaded_when_one_was_unchecked() -> None:
    """A state whose checker died has no witness (it has no outcome), so the markdown said
    "None: every state loaded step k or step k+1, bitwise" under a FAIL verdict for it."""
    from antifragile.chaos.crashcheck.report import markdown

    doc = _summarized({0: "old", 1: "unchecked", 2: "new"})
    assert not verdict(doc)[0]
    text = markdown(doc, has_plot=False)
    assert "every state loaded step k or step k+1" not in text, text
    assert "1 state(s) unchecked" in text.split("## Witnesses")[1], text
    clean = markdown(_summarized({0: "old", 1: "old", 2: "new"}), has_plot=False)
    assert "None: every state checked loaded step k or step k+1, bitwise." in clean


def test_the_report_says_the_engine_refused_the_save() -> None:
    """overwrite-committed passes when the engine refused the save (the states are then the
    bucket before it): the table showed "new 0" beside an OK verdict, and neither the markdown
    nor the HTML said that the save was refused, nor why (only crashcheck.json did)."""
    from antifragile.chaos.crashcheck.report import markdown, page

    why = "rank 0: CheckpointError: step 2 is committed"
    doc = _summarized({0: "old", 1: "old", 2: "old"}, name="overwrite-committed",
                      save_error=why, save_refused=True)
    assert verdict(doc) == (True, [])
    assert f"the save was refused ({why})" in markdown(doc, has_plot=False)
    assert f"the save was refused ({why})" in page(doc, None)
    assert "refused (" not in markdown(_summarized({0: "old", 1: "old", 2: "new"}),
                                       has_plot=False)


def test_every_field_of_a_case_in_crashcheck_json_is_in_reports_readme() -> None:
    """reports/README.md lists crashcheck.json's fields: a mutation's ``index`` and ``status``,
    ``expected``'s, ``timings``' and a witness's own fields were written but not listed there."""
    doc = _summarized({0: "old", 1: "torn", 2: "new"})
    case = doc["cases"][0]
    assert case["rules"]["engine"]["witnesses"]["torn"]["loaded"]["skipped"] == [1]
    assert case["timings"] and undocumented(doc) == []


def test_only_the_engines_refusal_of_a_committed_step_passes_as_a_refused_save() -> None:
    """overwrite-committed passed on any error of the save, taken for the engine's refusal: a
    save that crashed on a bug (a TypeError, a storage error) scored as if it had refused."""
    from antifragile.chaos.crashcheck.report import markdown

    why = "rank 0: TypeError: unsupported operand"
    doc = _summarized({0: "old", 1: "old", 2: "old"}, name="overwrite-committed",
                      save_error=why)
    ok, reasons = verdict(doc)
    assert not ok and why in reasons[0], reasons
    assert doc["cases"][0]["save_refused"] is False
    assert f"the save failed ({why})" in markdown(doc, has_plot=False)


def test_a_save_that_raised_fails_the_verdict_even_when_its_step_loads() -> None:
    """A save that raised (on any rank) passed when the state it left loaded step k+1: the
    error was in the case's line only, and ``lost`` went unjudged (step k+1 counts as
    committed only for a save without an error)."""
    why = "rank 1: TypeError: unsupported operand"
    for name in ("save", "overwrite-committed"):
        ok, reasons = verdict(_summarized({0: "old", 1: "old", 2: "new"}, name=name,
                                          save_error=why))
        assert not ok and why in reasons[0], reasons


def test_the_refusal_of_a_committed_step_is_recognised_per_engine(tmp_path: Path) -> None:
    """antifragile's refusal to save over a committed step (the error it documents) is a
    refusal; any other error, and any error of a peer (DCP and torchsnapshot write into a
    committed step: they have no such refusal), is not."""
    from antifragile.chaos.crashcheck import engines
    from antifragile.engine import CheckpointError, StorageError

    url = str(tmp_path / "ckpt")
    engines.save("antifragile", url, 2, attempt=1)
    with pytest.raises(CheckpointError) as refused:
        engines.save("antifragile", url, 2, attempt=0)
    assert engines.refuses_committed("antifragile", refused.value)
    for exc in (TypeError("bad"), StorageError("step 2: PUT failed"),
                CheckpointError("step 2: the save was abandoned")):
        assert not engines.refuses_committed("antifragile", exc)
    for peer in ("dcp", "torchsnapshot"):
        assert not engines.refuses_committed(peer, refused.value)


def test_the_marker_rule_falls_back_past_a_dcp_step_that_does_not_load(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DCP's load failures are CheckpointException, a BaseException: the trainer's fallback
    (``load_newest``) catches them and loads the next older marked step, and so must the
    checker's marker rule, else a peer is judged on a path its users do not take."""
    import fsspec
    from torch.distributed.checkpoint.api import CheckpointException

    from antifragile.chaos.crashcheck import engines

    for step in (1, 2):
        (tmp_path / engines.step_name(step)).mkdir()
        (tmp_path / engines.step_name(step) / ".metadata").write_bytes(b"m")

    def load_one(engine: str, folder: str) -> dict[str, Any]:
        if folder.endswith(engines.step_name(2)):
            raise CheckpointException("a torn step", {0: (OSError("short read"), None)})
        return engines.make_state(1)

    monkeypatch.setattr(engines, "_fs", lambda url: (fsspec.filesystem("file"), str(tmp_path)))
    monkeypatch.setattr(engines, "_load_one", load_one)
    step, loaded, skipped = engines.load("dcp", "marker", "s3://unused")
    assert (step, loaded) == (1, engines.digest(engines.make_state(1)))
    assert len(skipped) == 1 and "step 2: CheckpointException" in skipped[0], skipped


# -- the command line --------------------------------------------------------------------------

@pytest.mark.parametrize(("args", "says"), [
    (["--engine", "zfs"], "--engine 'zfs': unknown engine"),
    (["--engine", "dcp", "--ranks", "0"], "--ranks 0: a saving job needs at least 1 rank"),
    (["--engine", "dcp", "--case", "nope"], "--case 'nope': unknown case"),
    (["--engine", "dcp", "--rule", "engine"], "--rule 'engine': not a load rule of dcp"),
    (["--engine", "antifragile", "--rule", "newest-folder"],
     "--rule: the verdict is judged on antifragile's documented load rule, engine: give it too"),
    (["--engine", "dcp", "--endpoint-url", "https://s3.example"], "plain http://"),
    # not URLs: the error named a bucket of chaos's making (s3://crashcheck-<hex>), never the
    # option, and came after the report folder was made
    (["--engine", "dcp", "--endpoint-url", "http://[::1"],
     "--endpoint-url http://[::1: not an endpoint URL (give http://host:port)"),
    (["--engine", "dcp", "--endpoint-url", "http://127.0.0.1:abc"],
     "--endpoint-url http://127.0.0.1:abc: not an endpoint URL (give http://host:port)"),
    (["--engine", "dcp", "--endpoint-url", "http://:9000"],
     "--endpoint-url http://:9000: not an endpoint URL (give http://host:port)"),
    (["--engine", "dcp", "--latency-ms", "-5"], "--latency-ms -5.0: must be a finite number >= 0"),
    (["--engine", "dcp", "--latency-ms", "nan"], "--latency-ms nan: must be a finite number >= 0"),
    # each of the save's requests is held this long: 1e308 overflowed time.sleep in the proxy
    (["--engine", "dcp", "--latency-ms", "1e308"],
     "--latency-ms 1e+308: must be a finite number >= 0 and at most 1000"),
    (["--engine", "dcp", "--ranks", "100000"],
     "--ranks 100000 + --checkers 2: 100002 worker processes at once; this machine holds"),
    (["--engine", "dcp", "--max-inflight", "-1"], "--max-inflight -1: must be at least 0"),
    # accepted (chaos tune refuses it), and sampled as --seed 1 while reported as -1
    (["--engine", "dcp", "--seed", "-1"], "--seed -1: must be at least 0"),
    (["--engine", "dcp", "--checkers", "100000", "--endpoint-url", "http://127.0.0.1:9"],
     "--ranks 1 + --checkers 100000: 100001 worker processes at once; this machine holds"),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str], says: str) -> None:
    r = CliRunner().invoke(main, ["crashcheck", *args])
    assert r.exit_code == 2
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], r.output


def test_retention_with_case_runs_both_and_the_help_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--case save --retention`` checks save, then retention, while the help said that
    ``--retention`` checks retention "instead of the default cases" (and the README, that
    ``--retention`` means retention alone): the help now says what the command does."""
    from antifragile.chaos.crashcheck import run

    chosen: list[tuple[str, ...]] = []

    def ran(settings: Any, **kwargs: Any) -> None:
        chosen.append(settings.cases)
        raise SystemExit(0)

    monkeypatch.setattr(run, "crashcheck", ran)
    for args, cases in ((["--retention"], ("retention",)),
                        (["--case", "save", "--retention"], ("save", "retention"))):
        r = CliRunner().invoke(main, ["crashcheck", "--engine", "dcp", *args,
                                      "--endpoint-url", "http://127.0.0.1:9",
                                      "--out", str(tmp_path / "r")])
        assert r.exit_code == 0, r.output
        assert chosen.pop() == cases
    text = " ".join(CliRunner().invoke(main, ["crashcheck", "--help"]).output.split())
    assert ("--case retention. Alone it replaces the default cases; with --case it is "
            "checked after those cases.") in text, text


@pytest.mark.parametrize(("stop", "code"), [(KeyboardInterrupt(), 130), (SystemExit(143), 143)],
                         ids=["ctrl-c", "sigterm"])
def test_a_crashcheck_stopped_before_a_case_leaves_no_empty_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop: BaseException,
        code: int) -> None:
    """``timeout -s TERM 6 chaos crashcheck --engine antifragile --out DIR`` (stopped as the
    first case ran) left DIR behind, empty: no report, and a folder that claims one. Gone
    when this command made it; a folder the user made stays."""
    from antifragile.chaos.crashcheck import run

    def ran(*args: Any, **kwargs: Any) -> None:
        raise stop  # what infra.lifetime.stop_once raises in chaos for Ctrl-C, SIGTERM

    monkeypatch.setattr(run, "crashcheck", ran)
    ours, theirs = tmp_path / "made", tmp_path / "given"
    theirs.mkdir()
    for folder in (ours, theirs):
        r = CliRunner().invoke(main, ["crashcheck", "--engine", "dcp", "--endpoint-url",
                                      "http://127.0.0.1:9", "--out", str(folder)])
        assert r.exit_code == code, r.output
    assert not ours.exists()
    assert theirs.is_dir()


def test_max_inflight_has_an_upper_bound(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Every subset of an in-flight set up to ``--max-inflight`` is enumerated: 2^N per cut.
    Any N was taken, so ``--max-inflight 64`` ran on into a cut of 30 in-flight writes
    (2^30 subsets: hours, and memory for every distinct state) instead of sampling it."""
    from antifragile.chaos.crashcheck import run

    def ran(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("crashcheck ran with --max-inflight 64")

    monkeypatch.setattr(run, "crashcheck", ran)
    r = CliRunner().invoke(main, ["crashcheck", "--engine", "dcp", "--max-inflight", "64",
                                  "--endpoint-url", "http://127.0.0.1:9",
                                  "--out", str(tmp_path / "r")])
    assert r.exit_code == 2, r.output
    assert r.output.strip() == ("error: --max-inflight 64: at most 20 (an in-flight set that "
                                "size has all its 2^64 subsets enumerated, at each cut; larger "
                                "sets are sampled)"), r.output
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(("engine", "package", "extra"), [
    ("torchsnapshot", "torchsnapshot", "peers"), ("antifragile", "obstore", "s3"),
    ("dcp", "s3fs", "s3")])
def test_an_engine_whose_package_is_missing_is_one_line_and_exit_2(
        monkeypatch: pytest.MonkeyPatch, engine: str, package: str, extra: str) -> None:
    """The peers and the S3 clients are optional extras. Without one, the S3 endpoint and the
    checkers started, then the saving job died on the import and the command ended in a
    traceback ("the saving job failed ... No module named 'torchsnapshot'")."""
    monkeypatch.setitem(sys.modules, package, None)  # what an uninstalled package finds
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    r = CliRunner().invoke(main, ["crashcheck", "--engine", engine,
                                  "--endpoint-url", "http://127.0.0.1:9"])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and f"{package} is not installed" in lines[0], r.output
    assert f"antifragile[{extra}]" in lines[0], r.output


def test_the_saving_ranks_and_the_checkers_fit_the_machine_together(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker processes (each imports torch) start before the save is recorded and live
    through it: ranks and checkers are worker processes at the same time. Each was held to
    the machine's limit alone (two copies of one check), so --ranks 3 with the default 2
    checkers ran 5 where 4 fit."""
    from antifragile.chaos import scenario
    from antifragile.chaos.crashcheck import run

    def must_not_run(*_: object, **__: object) -> None:
        raise AssertionError("nothing may run")

    monkeypatch.setattr(scenario, "max_workers", lambda: 4)
    monkeypatch.setattr(run, "crashcheck", must_not_run)
    r = CliRunner().invoke(main, ["crashcheck", "--engine", "dcp", "--ranks", "3"])
    assert r.exit_code == 2, r.output
    assert r.output.strip().startswith("error: --ranks 3 + --checkers 2: 5 worker processes "
                                       "at once; this machine holds at most 4 ("), r.output


@pytest.mark.parametrize("command", [["crashcheck", "--engine", "dcp"], ["suite", "scenarios"],
                                     ["run", "scenarios/quickstart.yaml"]])
def test_an_empty_out_is_refused(command: list[str]) -> None:
    """``--out ""`` (an unset variable: ``--out "$OUT"``) wrote the suite's reports into the
    current folder, and a run's or a crashcheck's into the default folder, as if it were
    left out."""
    r = CliRunner().invoke(main, [*command, "--out", ""])
    assert r.exit_code == 2, r.output
    assert r.output.strip() == "error: --out: empty; leave the option out for the default " \
        "folder", r.output


def test_out_that_is_a_file_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "report"
    f.write_text("")
    r = CliRunner().invoke(main, ["crashcheck", "--engine", "dcp", "--out", str(f)])
    assert r.exit_code == 2 and r.output.strip() == f"error: --out {f}: is a file, not a folder"


def test_out_that_cannot_be_made_is_refused_before_anything_runs(tmp_path: Path) -> None:
    """It was a traceback once the first case's report was written, after the work."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    r = CliRunner().invoke(main, ["crashcheck", "--engine", "dcp", "--out",
                                  str(blocker / "report"), "--endpoint-url", "http://127.0.0.1:1"])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert r.output.strip() == (f"error: --out {blocker / 'report'}: cannot create the folder: "
                                "Not a directory")


def test_an_endpoint_that_is_not_a_url_is_one_line_and_exit_2(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """botocore's ValueError("Invalid endpoint: http://") was a traceback, exit 1."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    r = CliRunner().invoke(main, ["crashcheck", "--engine", "dcp", "--endpoint-url", "http://"])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and "--endpoint-url http://: not an endpoint URL" in lines[0], r.output


def test_unreachable_endpoint_is_one_line_and_exit_2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    began = time.monotonic()
    r = CliRunner().invoke(main, ["crashcheck", "--engine", "antifragile",
                                  "--endpoint-url", "http://127.0.0.1:9"])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and "http://127.0.0.1:9" in lines[0] and "cannot be reached" in lines[0]
    assert time.monotonic() - began < 30


def _no_endpoint(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``crashcheck.run`` with an endpoint that needs no server and a bucket check that passes:
    what a run then does is up to the test."""
    import contextlib

    from antifragile.chaos.crashcheck import run

    @contextlib.contextmanager
    def endpoint(url: str | None, progress: Any) -> Any:
        yield "http://127.0.0.1:9", {}, True

    monkeypatch.setattr(run, "s3_endpoint", endpoint)
    monkeypatch.setattr(run, "check_bucket", lambda *a, **k: None)
    return run


def test_a_checker_pool_that_cannot_start_is_one_line_and_exit_2(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checker that dies on start (a broken install: it imports torch and the engine) made
    the pool raise CheckerError, which ended the command in a traceback (exit 1, the exit of
    a failed verdict)."""
    from antifragile.chaos.crashcheck.check import CheckerError

    run = _no_endpoint(monkeypatch)

    class DeadCheckers:
        def __init__(self, **kwargs: Any) -> None:
            raise CheckerError("the checker process exited (1): ImportError: no torch")

    monkeypatch.setattr(run, "CheckerPool", DeadCheckers)
    out = tmp_path / "r"
    r = CliRunner().invoke(main, ["crashcheck", "--engine", "dcp", "--out", str(out),
                                  "--endpoint-url", "http://127.0.0.1:9"])
    assert isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.exit_code == 2, r.output
    assert r.output.strip() == ("error: the checker processes could not start: the checker "
                                "process exited (1): ImportError: no torch"), r.output
    assert not out.exists()  # nothing was written to it


class _NoCheckers:
    def __init__(self, **kwargs: Any) -> None:
        pass

    def __enter__(self) -> _NoCheckers:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def test_a_saving_job_that_fails_is_one_line_and_exit_2(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A saving job that died (here before its first line: an import it lacks) raised
    RuntimeError("the saving job failed ..."), which ended the command in a traceback (exit 1,
    the exit of a failed verdict) instead of saying which case failed and why."""
    from antifragile.chaos.crashcheck import pipeline

    run = _no_endpoint(monkeypatch)
    monkeypatch.setattr(run, "CheckerPool", _NoCheckers)
    real_popen = subprocess.Popen

    def dying_worker(args: list[str], **kwargs: Any) -> Any:
        return real_popen([sys.executable, "-c", "import sys; sys.exit('ImportError: no s3fs')"],
                          **kwargs)

    monkeypatch.setattr(pipeline.subprocess, "Popen", dying_worker)
    out = tmp_path / "r"
    r = CliRunner().invoke(main, ["crashcheck", "--engine", "dcp", "--case", "overwrite",
                                  "--out", str(out), "--endpoint-url", "http://127.0.0.1:9"])
    assert isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.exit_code == 2, r.output
    assert r.output.strip() == ("error: case overwrite: the saving job failed (exit 1): "
                                "ImportError: no s3fs"), r.output
    assert not out.exists()  # nothing was written to it


def test_a_saving_rank_that_never_exits_is_one_line_and_exit_2(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 said what it saved, but a rank then never exited (hung in its shutdown): the
    wait for it raised subprocess.TimeoutExpired, a traceback."""
    from antifragile.chaos.crashcheck import pipeline

    run = _no_endpoint(monkeypatch)
    monkeypatch.setattr(run, "CheckerPool", _NoCheckers)
    monkeypatch.setattr(pipeline, "_list", lambda client, bucket, prefix: [])
    monkeypatch.setattr(pipeline, "SAVE_EXIT_TIMEOUT_S", 0.5)
    worker = ("import json, sys, time\n"
              "print(json.dumps({'base': {'1/0': 'o'}}), flush=True)\n"
              "sys.stdin.readline()\n"
              "print(json.dumps({'saved': 'n', 'save_s': 0.1}), flush=True)\n"
              "time.sleep(60)\n")
    real_popen = subprocess.Popen

    def hanging_worker(args: list[str], **kwargs: Any) -> Any:
        return real_popen([sys.executable, "-c", worker], **kwargs)

    monkeypatch.setattr(pipeline.subprocess, "Popen", hanging_worker)
    began = time.monotonic()
    r = CliRunner().invoke(main, ["crashcheck", "--engine", "dcp", "--case", "save",
                                  "--out", str(tmp_path / "r"),
                                  "--endpoint-url", "http://127.0.0.1:9"])
    assert isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.exit_code == 2, r.output
    assert r.output.strip() == ("error: case save: the saving job failed: rank 0 did not "
                                "exit 0.5 s after the save (killed)"), r.output
    assert time.monotonic() - began < 30


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_every_ranks_save_error_reaches_the_report(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Of a 2-rank saving job only rank 0's error was said: a save that failed on rank 1 alone
    (here a TypeError) reported no error, and the case was scored as if the save had ended."""
    from antifragile.chaos.crashcheck import pipeline

    monkeypatch.setattr(pipeline, "_list", lambda client, bucket, prefix: [])
    script = ("import os, sys\n"
              "from antifragile.chaos.crashcheck import engines, worker\n"
              "def save(engine, url, step, *, attempt, **kwargs):\n"
              "    if (step, attempt) == (2, 0) and os.environ['RANK'] == '1':\n"
              "        raise TypeError('unsupported operand')\n"
              "engines.save = save\n"
              "worker.main(sys.argv[1:])\n")
    real_popen = subprocess.Popen

    def worker(args: list[str], **kwargs: Any) -> Any:  # the real worker, its save replaced
        return real_popen([sys.executable, "-c", script, *args[3:]], **kwargs)

    monkeypatch.setattr(pipeline.subprocess, "Popen", worker)
    settings = pipeline.Settings(engine="dcp", ranks=2, cases=("overwrite-committed",))
    *_, error, refused = pipeline.record_case(
        settings, pipeline.case("overwrite-committed"), endpoint_url="http://127.0.0.1:9",
        env={}, bucket="b", bodies=tmp_path, root="r/ckpt")
    assert error == "rank 1: TypeError: unsupported operand", error
    assert refused is False


def _run_in_thread(args: list[str], within_s: float) -> Any:
    """``chaos`` with ``args``, in a thread: a run that hangs fails the test, not hangs it."""
    import threading

    results: list[Any] = []
    thread = threading.Thread(target=lambda: results.append(CliRunner().invoke(main, args)),
                              daemon=True)
    thread.start()
    thread.join(within_s)
    assert not thread.is_alive(), f"the run still runs after {within_s:g} s: it hangs"
    return results[0]


@pytest.mark.parametrize("silent", [False, True], ids=["rank-1-dies", "rank-0-silent"])
def test_a_saving_rank_that_dies_or_says_nothing_before_its_first_line_is_one_line_and_exit_2(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, silent: bool) -> None:
    """Of a 2-rank saving job, rank 1 died before its first line (an import it lacks): rank 0
    waited for it (in the rendezvous) and the driver read rank 0's stdout with no timeout,
    so the run hung for good; so did a rank 0 that never said anything."""
    from antifragile.chaos.crashcheck import pipeline

    run = _no_endpoint(monkeypatch)
    monkeypatch.setattr(run, "CheckerPool", _NoCheckers)
    monkeypatch.setattr(pipeline, "SAVE_LINE_TIMEOUT_S", 1.0, raising=False)
    real_popen = subprocess.Popen

    def worker(args: list[str], **kwargs: Any) -> Any:
        if kwargs["env"]["RANK"] == "1" and not silent:
            code = "import sys; sys.exit('ImportError: no s3fs')"
        else:
            code = "import time; time.sleep(30)"  # in the rendezvous, or hung
        return real_popen([sys.executable, "-c", code], **kwargs)

    monkeypatch.setattr(pipeline.subprocess, "Popen", worker)
    began = time.monotonic()
    r = _run_in_thread(["crashcheck", "--engine", "dcp", "--case", "save", "--ranks", "2",
                        "--checkers", "1", "--out", str(tmp_path / "r"),
                        "--endpoint-url", "http://127.0.0.1:9"], 20)
    assert isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.exit_code == 2, r.output
    if silent:
        assert r.output.strip() == ("error: case save: the saving job failed: rank 0 said "
                                    "nothing in 1 s (killed)"), r.output
    else:
        assert r.output.strip() == ("error: case save: the saving job failed (rank 1, exit 1): "
                                    "ImportError: no s3fs"), r.output
    assert time.monotonic() - began < 20
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("said", ["Loading checkpoint shards...", "[1, 2]", '{"other": 1}'])
def test_a_saving_rank_that_prints_something_else_is_one_line_and_exit_2(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, said: str) -> None:
    """A line on rank 0's stdout that is not its JSON (a library printing there) raised a bare
    ValueError (json.loads) or a KeyError later: a traceback."""
    from antifragile.chaos.crashcheck import pipeline

    run = _no_endpoint(monkeypatch)
    monkeypatch.setattr(run, "CheckerPool", _NoCheckers)
    real_popen = subprocess.Popen

    def chatty_worker(args: list[str], **kwargs: Any) -> Any:
        code = f"import time; print({said!r}, flush=True); time.sleep(30)"
        return real_popen([sys.executable, "-c", code], **kwargs)

    monkeypatch.setattr(pipeline.subprocess, "Popen", chatty_worker)
    r = _run_in_thread(["crashcheck", "--engine", "dcp", "--case", "save",
                        "--out", str(tmp_path / "r"), "--endpoint-url", "http://127.0.0.1:9"],
                       20)
    assert isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.exit_code == 2, r.output
    assert r.output.strip() == (f"error: case save: the saving job failed: rank 0 printed "
                                f"{said!r}, not its base digests (killed)"), r.output


def test_a_saving_rank_that_writes_much_to_stderr_is_not_blocked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks' stderr was a pipe read only once the job had failed: 64 KiB of warnings
    blocked the rank in its write, and it was taken for silent (hung) instead of being
    heard."""
    from antifragile.chaos.crashcheck import pipeline

    run = _no_endpoint(monkeypatch)
    monkeypatch.setattr(run, "CheckerPool", _NoCheckers)
    monkeypatch.setattr(pipeline, "SAVE_LINE_TIMEOUT_S", 5.0)
    real_popen = subprocess.Popen

    def noisy_worker(args: list[str], **kwargs: Any) -> Any:
        code = ("import sys, time; sys.stderr.write('warning\\n' * 30000); sys.stderr.flush(); "
                "print('chatter', flush=True); time.sleep(30)")
        return real_popen([sys.executable, "-c", code], **kwargs)

    monkeypatch.setattr(pipeline.subprocess, "Popen", noisy_worker)
    r = _run_in_thread(["crashcheck", "--engine", "dcp", "--case", "save",
                        "--out", str(tmp_path / "r"), "--endpoint-url", "http://127.0.0.1:9"],
                       20)
    assert r.exit_code == 2, r.output
    assert "rank 0 printed 'chatter'" in r.output, r.output


def test_a_saving_rank_that_cannot_be_started_leaves_no_rank_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1's Popen raised: rank 0, started outside the try that kills the ranks, was left
    running (waiting for rank 1 for good), and the OSError was a traceback."""
    from antifragile.chaos.crashcheck import pipeline

    run = _no_endpoint(monkeypatch)
    monkeypatch.setattr(run, "CheckerPool", _NoCheckers)
    real_popen = subprocess.Popen
    started: list[subprocess.Popen[str]] = []

    def worker(args: list[str], **kwargs: Any) -> Any:
        if started:
            raise OSError(11, "Resource temporarily unavailable")
        started.append(real_popen([sys.executable, "-c", "import time; time.sleep(30)"],
                                  **kwargs))
        return started[0]

    monkeypatch.setattr(pipeline.subprocess, "Popen", worker)
    try:
        r = _run_in_thread(["crashcheck", "--engine", "dcp", "--case", "save", "--ranks", "2",
                            "--checkers", "1", "--out", str(tmp_path / "r"),
                            "--endpoint-url", "http://127.0.0.1:9"], 20)
        assert isinstance(r.exception, SystemExit), repr(r.exception)
        assert r.exit_code == 2, r.output
        assert r.output.strip() == ("error: case save: the saving job failed: rank 1 could "
                                    "not be started: [Errno 11] Resource temporarily "
                                    "unavailable"), r.output
        assert started[0].poll() is not None, "rank 0 was left running"
    finally:
        if started and started[0].poll() is None:
            started[0].kill()
        for proc in started:
            proc.wait()


@pytest.mark.parametrize("partial", [False, True], ids=["final", "after-a-case"])
def test_a_report_that_cannot_be_written_is_one_line_and_exit_2(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, partial: bool) -> None:
    """A full disk when the report was written (at the end, or after a case: the report of
    the cases so far) raised a traceback, and left crashcheck.md cut short."""
    import errno

    doc = {"engine": "dcp", "ranks": 1, "settings": {"cases": ["save"]}, "cases": []}

    def ran(settings: Any, **kwargs: Any) -> dict[str, Any]:
        if partial:
            kwargs["on_case"](doc)
        return doc

    real_write = Path.write_text

    def full_disk(self: Path, data: str, *args: Any, **kwargs: Any) -> int:
        if self.name.startswith("crashcheck.md"):
            real_write(self, data[:10], *args, **kwargs)  # what a write stopped midway leaves
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, data, *args, **kwargs)

    from antifragile.chaos.crashcheck import run

    monkeypatch.setattr(run, "crashcheck", ran)
    monkeypatch.setattr(Path, "write_text", full_disk)
    out = tmp_path / "r"
    r = CliRunner().invoke(main, ["crashcheck", "--engine", "dcp", "--case", "save",
                                  "--out", str(out), "--endpoint-url", "http://127.0.0.1:9"])
    assert isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.exit_code == 2, r.output
    assert r.output.strip() == (f"error: {out / 'crashcheck.md'}: cannot be written: No space "
                                "left on device"), r.output
    assert not out.exists()  # no report cut short, none in part: the folder made for it went


def test_crashcheck_help_does_not_import_torch() -> None:
    code = ("import sys\nfrom click.testing import CliRunner\n"
            "from antifragile.chaos.cli import main\n"
            "r = CliRunner().invoke(main, ['crashcheck', '--help'])\n"
            "print(r.exit_code, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ["0", "False"]


# -- the recording proxy in front of a scripted server --------------------------------------------

class _Scripted:
    """An HTTP server on loopback that answers every request with ``answer(method, path,
    body)`` (status, body): the answers a real server gives only in an outage."""

    def __init__(self, answer: Any) -> None:
        import http.server
        import threading

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _any(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                status, out = answer(self.command, self.path, body)
                self.send_response(status)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            do_GET = do_PUT = do_POST = do_DELETE = _any

            def log_message(self, *args: Any) -> None:
                return None

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def __enter__(self) -> _Scripted:
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def _send(proxy: Any, method: str, target: str, body: bytes = b"",
          headers: dict[str, str] | None = None) -> int:
    import http.client

    host, port = proxy.endpoint_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request(method, target, body=body, headers=headers or {})
        answer = conn.getresponse()
        answer.read()
        return answer.status
    finally:
        conn.close()


def test_the_recording_proxy_goes_on_accepting_after_a_failed_accept(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed ``accept()`` (EMFILE: the process out of file descriptors for a moment) ended
    the accept loop: every later request of the run went unanswered and unrecorded."""
    import errno
    import socket

    from antifragile.chaos.crashcheck.record import RecordingProxy

    create_server = socket.create_server

    class FailsOnce:
        def __init__(self) -> None:
            self.sock, self.failed = create_server(("127.0.0.1", 0)), False

        def accept(self) -> tuple[socket.socket, Any]:
            if not self.failed:
                self.failed = True
                raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
            return self.sock.accept()

        def __getattr__(self, name: str) -> Any:
            return getattr(self.sock, name)

    listener = FailsOnce()
    monkeypatch.setattr(socket, "create_server", lambda *a, **k: listener)
    with _Scripted(lambda method, path, body: (200, b"")) as server:
        proxy = RecordingProxy(server.url, bucket="b", root="r")
        monkeypatch.undo()
        with proxy:
            proxy.start()
            assert _send(proxy, "PUT", "/b/r/a", b"x") == 200
            rec = proxy.stop()
    assert listener.failed and [m.key for m in rec.mutations] == ["a"]


def test_a_multi_delete_records_only_the_keys_the_server_deleted() -> None:
    """A multi-object delete answers 200 with a per-key result: a key under ``<Error>`` was not
    deleted (and a quiet delete lists only those). The proxy recorded every key of the request
    as deleted, so the model built states without an object the storage still held."""
    from antifragile.chaos.crashcheck.record import RecordingProxy

    result = (b'<?xml version="1.0" encoding="UTF-8"?>\n<DeleteResult xmlns="http://s3.amazonaws'
              b'.com/doc/2006-03-01/"><Deleted><Key>r/a</Key></Deleted><Error><Key>r/b &amp; c'
              b'</Key><Code>InternalError</Code><Message>try again</Message></Error>'
              b'</DeleteResult>')
    request = (b'<Delete xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Object><Key>r/a</Key>'
               b'</Object><Object><Key>r/b &amp; c</Key></Object><Object><Key>r/&#233;</Key>'
               b'</Object><Quiet>false</Quiet></Delete>')
    with _Scripted(lambda method, path, body: (200, result)) as server, \
            RecordingProxy(server.url, bucket="b", root="r") as proxy:
        proxy.start()
        assert _send(proxy, "POST", "/b?delete", request) == 200
        rec = proxy.stop()
    assert [(m.kind, m.key) for m in rec.mutations] == [("delete", "a"), ("delete", "\u00e9")]


def test_a_completion_or_copy_answered_200_with_an_error_changes_nothing() -> None:
    """S3 answers a multipart completion and a copy 200 before it has done them (then keeps
    the connection alive with spaces), so a failure arrives as an ``<Error>`` body under a 200:
    the proxy recorded the object as written, and the model built states holding an object
    the storage never had (the client, told it failed, tries again)."""
    from antifragile.chaos.crashcheck.record import RecordingProxy

    late_error = (b'<?xml version="1.0" encoding="UTF-8"?>\n   \n<Error><Code>InternalError</Code>'
                  b'<Message>We encountered an internal error. Please try again.</Message>'
                  b'</Error>')

    def answer(method: str, path: str, body: bytes) -> tuple[int, bytes]:
        if path.endswith("?uploads"):
            return 200, (b"<InitiateMultipartUploadResult><Bucket>b</Bucket><Key>r/big</Key>"
                         b"<UploadId>u1</UploadId></InitiateMultipartUploadResult>")
        if "partNumber" in path:
            return 200, b""
        return 200, late_error

    with _Scripted(answer) as server, RecordingProxy(server.url, bucket="b", root="r") as proxy:
        proxy.start()
        assert _send(proxy, "POST", "/b/r/big?uploads") == 200
        assert _send(proxy, "PUT", "/b/r/big?partNumber=1&uploadId=u1", b"part") == 200
        done = b"<CompleteMultipartUpload><Part><PartNumber>1</PartNumber></Part>"
        assert _send(proxy, "POST", "/b/r/big?uploadId=u1",
                     done + b"</CompleteMultipartUpload>") == 200
        assert _send(proxy, "PUT", "/b/r/copy", headers={"x-amz-copy-source": "/b/r/big"}) == 200
        rec = proxy.stop()
    assert [m.kind for m in rec.mutations if m.visible] == []
    assert enumerate_states({}, rec.mutations).distinct == 1


def test_a_completion_sent_right_after_its_last_part_has_every_part(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The proxy kept a part's body only once the client had the part's answer: a thread
    that ran late (a busy machine) kept it after the client had sent the completion, which
    was then recorded with the part missing (an empty object here), so every crash state
    holding the object held bytes the storage never had."""
    from antifragile.chaos.crashcheck.record import RecordingProxy

    note = RecordingProxy._note

    def late(self: RecordingProxy, method: str, target: str, *args: Any) -> None:
        if "partNumber" in target:  # the part's thread descheduled once it had answered
            time.sleep(0.5)
        note(self, method, target, *args)

    monkeypatch.setattr(RecordingProxy, "_note", late)

    def answer(method: str, path: str, body: bytes) -> tuple[int, bytes]:
        if path.endswith("?uploads"):
            return 200, b"<InitiateMultipartUploadResult><UploadId>u1</UploadId>" \
                        b"</InitiateMultipartUploadResult>"
        return 200, b""

    with _Scripted(answer) as server, RecordingProxy(server.url, bucket="b", root="r") as proxy:
        proxy.start()
        assert _send(proxy, "POST", "/b/r/big?uploads") == 200
        assert _send(proxy, "PUT", "/b/r/big?partNumber=1&uploadId=u1", b"part") == 200
        assert _send(proxy, "POST", "/b/r/big?uploadId=u1", b"<CompleteMultipartUpload><Part>"
                     b"<PartNumber>1</PartNumber></Part></CompleteMultipartUpload>") == 200
        rec = proxy.stop()
    done = rec.mutations[-1]
    assert (done.kind, rec.bodies[done.digest or ""]) == ("multipart_complete", b"part")


def test_a_request_still_unanswered_when_the_recording_stops_is_not_dropped_silently(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``stop()`` waits a while for the requests the proxy still serves; past that wait it
    returned the recording without them and said nothing, so a write the storage may yet
    apply (its client gave up on it) was in no crash state. It now refuses the recording."""
    import socket
    import threading

    from antifragile.chaos.crashcheck import record
    from antifragile.chaos.crashcheck.record import RecordingProxy

    monkeypatch.setattr(record, "NOTE_WAIT_S", 0.5, raising=False)
    release = threading.Event()

    def answer(method: str, path: str, body: bytes) -> tuple[int, bytes]:
        release.wait(15)  # a storage that answers this write late
        return 200, b""

    with _Scripted(answer) as server, RecordingProxy(server.url, bucket="b", root="r") as proxy:
        try:
            proxy.start()
            with pytest.raises(socket.timeout):  # the client gives up on it
                _send_timeout(proxy, "PUT", "/b/r/a", b"x", timeout_s=0.3)
            try:
                rec = proxy.stop()
            except RuntimeError as exc:  # RecordingIncomplete
                assert "1 request(s) still unanswered" in str(exc), exc
            else:
                pytest.fail("stop() returned a recording without the write still unanswered: "
                            f"{rec.mutations}")
        finally:
            release.set()


@pytest.mark.parametrize("method", ["PUT", "DELETE"])
def test_a_write_whose_answer_never_came_back_is_not_dropped_silently(method: str) -> None:
    """The storage closed the connection after it had the whole request, without an answer
    (a crash, a restart, an idle timeout; or no answer in the proxy's 60 s socket timeout):
    the proxy gave up on the request and noted nothing, so ``stop()`` returned a recording
    without a write the storage may have applied. It now refuses the recording, as for a
    request still unanswered; a read that got no answer changes nothing and is no reason."""
    import http.client
    import socket
    import threading

    from antifragile.chaos.crashcheck.record import RecordingIncomplete, RecordingProxy

    upstream = socket.create_server(("127.0.0.1", 0))

    def drop_after_the_request() -> None:  # reads the whole request, then hangs up
        while True:
            try:
                conn = upstream.accept()[0]
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, _, body = data.partition(b"\r\n\r\n")
                length = int(next((line.split(b":")[1] for line in head.split(b"\r\n")
                                   if line.lower().startswith(b"content-length")), b"0"))
                while len(body) < length:
                    body += conn.recv(65536)

    threading.Thread(target=drop_after_the_request, daemon=True).start()
    port = upstream.getsockname()[1]
    try:
        with RecordingProxy(f"http://127.0.0.1:{port}", bucket="b", root="r") as proxy:
            proxy.start()
            for request in (("GET", "/b/r/a", b""), (method, "/b/r/a", b"x")):
                with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
                    _send(proxy, *request)
            with pytest.raises(RecordingIncomplete, match=f"{method} /b/r/a"):
                proxy.stop()
            proxy.start()  # a read alone without an answer leaves the recording complete
            with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
                _send(proxy, "GET", "/b/r/a")
            assert proxy.stop().mutations == []
    finally:
        upstream.close()


def _send_timeout(proxy: Any, method: str, target: str, body: bytes, *,
                  timeout_s: float) -> int:
    import http.client

    host, port = proxy.endpoint_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        conn.request(method, target, body=body)
        return conn.getresponse().status
    finally:
        conn.close()


# -- the recording proxy on a real S3 server ---------------------------------------------------

@pytest.mark.s3
@pytest.mark.parametrize("slow_note", [False, True], ids=["", "noted-after-the-answer"])
def test_proxy_records_puts_copies_deletes_and_multi_deletes(
        s3_bucket: tuple[str, dict[str, Any]], slow_note: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``slow_note``: the proxy notes a request a while after the client has its answer (as a
    busy machine may schedule it): ``stop()`` right after the last answer still has it."""
    import boto3

    from antifragile.chaos.crashcheck.record import RecordingProxy

    if slow_note:
        note = RecordingProxy._note

        def late(self: RecordingProxy, *args: Any) -> None:
            time.sleep(0.3)
            note(self, *args)

        monkeypatch.setattr(RecordingProxy, "_note", late)
    url, options = s3_bucket
    bucket = url.removeprefix("s3://").split("/")[0]
    with RecordingProxy(options["endpoint_url"], bucket=bucket, root="r",
                        latency_s=0.01) as proxy:
        client = boto3.client("s3", endpoint_url=proxy.endpoint_url, region_name="us-east-1",
                              aws_access_key_id=options["key"],
                              aws_secret_access_key=options["secret"])
        client.put_object(Bucket=bucket, Key="r/before", Body=b"not recorded")
        proxy.start()
        client.put_object(Bucket=bucket, Key="r/a", Body=b"alpha")
        client.put_object(Bucket=bucket, Key="elsewhere", Body=b"outside the root")
        client.copy_object(Bucket=bucket, Key="r/b", CopySource={"Bucket": bucket, "Key": "r/a"})
        client.get_object(Bucket=bucket, Key="r/b")["Body"].read()
        client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": "r/a"},
                                                                 {"Key": "r/before"}]})
        client.delete_object(Bucket=bucket, Key="r/b")
        rec = proxy.stop()
    got = [(m.kind, m.key) for m in rec.mutations]
    assert got == [("put", "a"), ("copy", "b"), ("delete", "a"), ("delete", "before"),
                   ("delete", "b")]
    put = rec.mutations[0]
    assert rec.bodies[put.digest or ""] == b"alpha" and put.size == 5
    assert all(m.issued_s + 0.01 <= m.acked_s for m in rec.mutations)
    assert rec.mutations[2].issued_s == rec.mutations[3].issued_s  # one request, two keys
    assert rec.requests >= 6


@pytest.mark.s3
def test_a_write_sent_after_an_answer_is_never_recorded_in_flight_beside_it(
        s3_bucket: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    """The proxy dated an acknowledgement after handing the answer back, so a proxy thread
    that ran late (a busy machine) dated it after a request the client sent once it had the
    answer: the two overlapped, and the crash model built states the client's order rules
    out (the marker written, the object it follows not)."""
    import boto3

    from antifragile.chaos.crashcheck.enumerate import enumerate_states
    from antifragile.chaos.crashcheck.record import RecordingProxy

    class LateAfterSend:  # the proxy thread descheduled right after the answer left
        def __init__(self, sock: Any) -> None:
            self.sock = sock

        def sendall(self, data: bytes) -> None:
            self.sock.sendall(data)
            time.sleep(0.3)

    forward = RecordingProxy._forward

    def late(self: RecordingProxy, client: Any, *args: Any) -> bool:
        return forward(self, LateAfterSend(client), *args)

    monkeypatch.setattr(RecordingProxy, "_forward", late)
    url, options = s3_bucket
    bucket = url.removeprefix("s3://").split("/")[0]
    with RecordingProxy(options["endpoint_url"], bucket=bucket, root="r") as proxy:
        data, marker = [boto3.client("s3", endpoint_url=proxy.endpoint_url,
                                     region_name="us-east-1", aws_access_key_id=options["key"],
                                     aws_secret_access_key=options["secret"])
                        for _ in range(2)]  # two connections, as a pool of writers has
        proxy.start()
        data.put_object(Bucket=bucket, Key="r/data", Body=b"data")
        marker.put_object(Bucket=bucket, Key="r/COMMIT", Body=b"marker")
        rec = proxy.stop()
    first, second = rec.mutations
    assert first.acked_s <= second.issued_s, (first, second)
    states = enumerate_states({}, rec.mutations).states
    assert all("data" in s.objects for s in states if "COMMIT" in s.objects)


@pytest.mark.s3
def test_proxy_records_a_multipart_upload_and_an_aborted_one_changes_nothing(
        s3_bucket: tuple[str, dict[str, Any]]) -> None:
    """An aborted multipart upload (``DELETE ?uploadId``, what a client sends when a part
    fails) leaves the object at its key as it was: it was recorded as a DELETE of the key."""
    import boto3

    from antifragile.chaos.crashcheck.enumerate import enumerate_states
    from antifragile.chaos.crashcheck.record import RecordingProxy

    url, options = s3_bucket
    bucket = url.removeprefix("s3://").split("/")[0]
    part = b"p" * (5 * 2**20)
    with RecordingProxy(options["endpoint_url"], bucket=bucket, root="r") as proxy:
        client = boto3.client("s3", endpoint_url=proxy.endpoint_url, region_name="us-east-1",
                              aws_access_key_id=options["key"],
                              aws_secret_access_key=options["secret"])
        client.put_object(Bucket=bucket, Key="r/kept", Body=b"committed")
        proxy.start()
        upload = client.create_multipart_upload(Bucket=bucket, Key="r/kept")["UploadId"]
        client.upload_part(Bucket=bucket, Key="r/kept", UploadId=upload, PartNumber=1,
                           Body=part)
        client.abort_multipart_upload(Bucket=bucket, Key="r/kept", UploadId=upload)
        upload = client.create_multipart_upload(Bucket=bucket, Key="r/big")["UploadId"]
        etags = [client.upload_part(Bucket=bucket, Key="r/big", UploadId=upload, PartNumber=n,
                                    Body=body)["ETag"] for n, body in ((1, part), (2, b"tail"))]
        client.complete_multipart_upload(
            Bucket=bucket, Key="r/big", UploadId=upload,
            MultipartUpload={"Parts": [{"PartNumber": n, "ETag": e}
                                       for n, e in enumerate(etags, 1)]})
        rec = proxy.stop()
        assert client.get_object(Bucket=bucket, Key="r/kept")["Body"].read() == b"committed"
    assert [m.kind for m in rec.mutations if m.visible] == ["multipart_complete"]
    done = rec.mutations[-1]
    assert (done.key, rec.bodies[done.digest or ""]) == ("big", part + b"tail")
    final = enumerate_states({"kept": "c"}, rec.mutations).states
    assert all(s.objects.get("kept") == "c" for s in final)


@pytest.mark.s3
def test_a_checker_rebuilds_each_object_as_recorded(
        s3_bucket: tuple[str, dict[str, Any]], tmp_path: Path) -> None:
    """A crash state is rebuilt under its prefix with exactly its keys, each holding its
    recorded body byte for byte: two bodies of one size swapped, one cut short, an empty one
    dropped or a key spelled otherwise would be loaded as if the save had left it."""
    import hashlib
    import random

    import boto3

    from antifragile.chaos.crashcheck.check import CheckerPool

    url, options = s3_bucket
    bucket = url.removeprefix("s3://").split("/")[0]
    rng = random.Random(7)
    bodies = {"a": rng.randbytes(4096), "b": rng.randbytes(4096), "c": rng.randbytes(1),
              "empty": b"", "big": rng.randbytes(3 * 2**20 + 5)}
    names = {}
    for label, data in bodies.items():
        names[label] = hashlib.sha256(data).hexdigest()
        (tmp_path / names[label]).write_bytes(data)
    objects = {"step_000000001/model/w00/c/0": "a", "step_000000001/model/w01/c/0": "b",
               "step_000000001/model/w01/zarr.json": "c", "step_000000001/COMMIT": "empty",
               "step_000000002/model/w00/c/0": "big", "step_000000002/x=1:2 a%2Fb+c": "a",
               "step_000000002/.metadata": "b"}
    task = {"id": 0, "prefix": "check/s00000",
            "objects": {key: names[label] for key, label in objects.items()}, "rules": []}
    env = {"AWS_ENDPOINT_URL": options["endpoint_url"], "AWS_ACCESS_KEY_ID": options["key"],
           "AWS_SECRET_ACCESS_KEY": options["secret"], "AWS_DEFAULT_REGION": "us-east-1"}
    with CheckerPool(engine="antifragile", bucket=bucket, bodies=tmp_path, env=env,
                     workers=1) as pool:
        (answer,) = pool.check([task]).values()
    assert "unchecked" not in answer, answer
    client = boto3.client("s3", endpoint_url=options["endpoint_url"], region_name="us-east-1",
                          aws_access_key_id=options["key"],
                          aws_secret_access_key=options["secret"])
    listed = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix="check/") for o in page.get("Contents", [])]
    assert sorted(listed) == sorted(f"check/s00000/{key}" for key in objects)
    for key, label in objects.items():
        got = client.get_object(Bucket=bucket, Key=f"check/s00000/{key}")["Body"].read()
        assert got == bodies[label], key


@pytest.mark.s3
def test_the_newest_folder_rule_reads_the_newest_folder_and_fails_as_a_serial_reader(
        s3_bucket: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    """antifragile's ``newest-folder`` rule (its arrays read concurrently) loads the newest
    step folder whatever it holds (COMMIT ignored), a missing chunk as zeros, and fails on the
    first array, in name order, whose metadata is missing: what a serial zarr reader does."""
    import boto3

    from antifragile.chaos.crashcheck import engines

    url, options = s3_bucket
    bucket, root = url.removeprefix("s3://").split("/", 1)
    monkeypatch.setenv("AWS_ENDPOINT_URL", options["endpoint_url"])
    engines.save("antifragile", url, 1)
    engines.save("antifragile", url, 2)
    client = boto3.client("s3", endpoint_url=options["endpoint_url"], region_name="us-east-1",
                          aws_access_key_id=options["key"],
                          aws_secret_access_key=options["secret"])
    step2 = f"{root}/{engines.step_name(2)}"
    client.delete_object(Bucket=bucket, Key=f"{step2}/COMMIT")
    assert engines.load("antifragile", "newest-folder", url) == (
        2, engines.digest(engines.make_state(2)), [])
    client.delete_object(Bucket=bucket, Key=f"{step2}/model/w05/c.0")
    torn = engines.make_state(2)
    torn["model"]["w05"].zero_()
    assert engines.load("antifragile", "newest-folder", url)[1] == engines.digest(torn)
    for name in ("w07", "w03"):
        client.delete_object(Bucket=bucket, Key=f"{step2}/model/{name}/zarr.json")
    with pytest.raises(KeyError, match="model/w03"):
        engines.load("antifragile", "newest-folder", url)
    assert engines.load("antifragile", "engine", url)[:2] == (
        1, engines.digest(engines.make_state(1)))


def _peer_saves(engine: str, url: str, endpoint_url: str, key: str, secret: str,
                steps: list[int]) -> None:
    """One rank of a peer's saving job, as ``worker save`` runs it (no process group given:
    the default one), through ``endpoint_url``; retention keeps the newest step."""
    from antifragile.chaos.crashcheck import engines

    os.environ.update({"AWS_ENDPOINT_URL": endpoint_url, "AWS_ENDPOINT_URL_S3": endpoint_url,
                       "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret,
                       "AWS_DEFAULT_REGION": "us-east-1"})
    for step in steps:
        engines.save(engine, url, step, keep_last=1)


@pytest.mark.s3
@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine", ["dcp", "torchsnapshot"])
def test_a_peers_retention_runs_on_rank_0_only(
        s3_bucket: tuple[str, dict[str, Any]], engine: str) -> None:
    """A peer trainer prunes on rank 0 after the commit (``trainer/ckpt_backends``). The
    saving job called the peer's save without a process group, which made every rank prune:
    the recording held each retention delete once per rank (overlapping deletes of one key,
    larger in-flight sets), not the save a peer's user runs."""
    from _dist import run_ranks

    from antifragile.chaos.crashcheck.record import RecordingProxy

    url, options = s3_bucket
    bucket = url.removeprefix("s3://").split("/")[0]
    with RecordingProxy(options["endpoint_url"], bucket=bucket, root="ckpt",
                        latency_s=0.02) as proxy:
        args = (url, proxy.endpoint_url, options["key"], options["secret"])
        run_ranks(2, _peer_saves, engine, *args, [1], timeout_s=240)
        proxy.start()
        run_ranks(2, _peer_saves, engine, *args, [2], timeout_s=240)
        rec = proxy.stop()
    deleted = [m.key for m in rec.mutations if m.kind == "delete"]
    assert any(k.startswith("step_000000001/") for k in deleted), deleted
    assert len(deleted) == len(set(deleted)), sorted(deleted)


@pytest.mark.s3
@pytest.mark.parametrize("fails", [False, True], ids=["ends", "fails"])
def test_crashcheck_deletes_the_bucket_it_made_on_a_users_endpoint(
        s3_bucket: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch,
        fails: bool) -> None:
    """On the user's endpoint (AWS_ENDPOINT_URL, --endpoint-url) crashcheck made a bucket of
    its own (``crashcheck-<random>``), filled it with the recorded saves and every rebuilt
    state, and left it there, run after run. It is emptied and deleted at the end, a failed
    run's too; nothing else on the endpoint is touched."""
    import boto3

    from antifragile.chaos.crashcheck import run
    from antifragile.chaos.crashcheck.pipeline import Settings

    users, options = s3_bucket
    client = boto3.client("s3", endpoint_url=options["endpoint_url"],
                          aws_access_key_id=options["key"],
                          aws_secret_access_key=options["secret"], region_name="us-east-1")
    users_bucket = users.removeprefix("s3://").split("/")[0]
    client.put_object(Bucket=users_bucket, Key="ckpt/mine", Body=b"x")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", options["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", options["secret"])
    made: list[str] = []

    class NoCheckers:
        def __init__(self, **kwargs: Any) -> None:
            made.append(kwargs["bucket"])

        def __enter__(self) -> NoCheckers:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

    def a_case(settings: Any, name: str, *, bucket: str, **kwargs: Any) -> Any:
        for key in ("antifragile-r1-save-x/ckpt/step_000000001/COMMIT",
                    "antifragile-r1-save-x-check/s00000/step_000000001/COMMIT"):
            client.put_object(Bucket=bucket, Key=key, Body=b"c")
        client.create_multipart_upload(Bucket=bucket, Key="antifragile-r1-save-x/ckpt/big")
        if fails:
            raise RuntimeError("the saving job failed")
        return None

    monkeypatch.setattr(run, "CheckerPool", NoCheckers)
    monkeypatch.setattr(run, "run_case", a_case)
    monkeypatch.setattr(run, "summarize", lambda settings, result: {})
    settings = Settings(engine="antifragile", ranks=1, cases=("save",))
    lines: list[str] = []
    if fails:
        with pytest.raises(RuntimeError, match="the saving job failed"):
            run.crashcheck(settings, endpoint_url=options["endpoint_url"], progress=lines.append)
    else:
        run.crashcheck(settings, endpoint_url=options["endpoint_url"], progress=lines.append)
    (bucket,) = made
    buckets = {b["Name"] for b in client.list_buckets()["Buckets"]}
    assert bucket not in buckets, lines
    assert users_bucket in buckets
    assert [o["Key"] for o in client.list_objects_v2(Bucket=users_bucket)["Contents"]] == [
        "ckpt/mine"]


# -- end to end ------------------------------------------------------------------------------

def _run(args: list[str], out: Path, s3: dict[str, Any]) -> tuple[int, dict[str, Any], str]:
    env_args = ["--endpoint-url", s3["endpoint_url"], "--out", str(out)]
    chaos = [sys.executable, "-c", "from antifragile.chaos.cli import main; main()"]
    proc = subprocess.run([*chaos, "crashcheck", *args, *env_args], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "AWS_ACCESS_KEY_ID": s3["key"],
                               "AWS_SECRET_ACCESS_KEY": s3["secret"]})
    doc = json.loads((out / "crashcheck.json").read_text()) if proc.returncode < 2 else {}
    return proc.returncode, doc, proc.stdout + proc.stderr


@pytest.mark.s3
@pytest.mark.multiproc
@pytest.mark.timeout(900)  # ~2 min on 2 idle cores; a shared, loaded machine takes longer
def test_small_antifragile_save_every_state_old_or_new(
        tmp_path: Path, s3_server: dict[str, Any]) -> None:
    """The default suite's configuration: one rank, hundreds of crash states."""
    rc, doc, output = _run(["--engine", "antifragile", "--case", "save", "--max-states", "150"],
                           tmp_path / "r", s3_server)
    assert rc == 0, output
    (case,) = doc["cases"]
    assert case["states"] == 150 and case["distinct_states"] > 150
    counts = case["rules"]["engine"]["counts"]
    assert counts["old"] > 0 and counts["new"] > 0, counts
    assert counts["old"] + counts["new"] == 150, case["rules"]["engine"]["witnesses"]
    assert case["max_in_flight"] > 1  # concurrency was seen, not a sequential trace
    for name in ("crashcheck.md", "crashcheck.html", "outcomes.png"):
        assert (tmp_path / "r" / name).stat().st_size > 0


@pytest.mark.s3
@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_a_loader_that_ignores_commit_is_caught(tmp_path: Path,
                                                s3_server: dict[str, Any]) -> None:
    """The verdict can fail: reading the newest step folder without its COMMIT (a plain zarr
    reader) loads the failed attempt's data or a half-written step: torn, or refused."""
    rc, doc, output = _run(["--engine", "antifragile", "--case", "overwrite", "--max-states",
                            "24", "--rule", "engine", "--rule", "newest-folder"],
                           tmp_path / "r", s3_server)
    assert rc == 0, output  # the documented rule is fine; the broken one is reported
    (case,) = doc["cases"]
    good = case["rules"]["engine"]["counts"]
    broken = case["rules"]["newest-folder"]["counts"]
    assert good["torn"] == good["refused"] == good["lost"] == 0
    assert broken["torn"] > 0, broken
    witness = case["rules"]["newest-folder"]["witnesses"]["torn"]
    assert "equal to neither" in witness["loaded"]["data"]
    assert "torn" in (tmp_path / "r" / "crashcheck.md").read_text()


def _big(engine_case: str, ranks: int, tmp_path: Path, s3: dict[str, Any]) -> None:
    rc, doc, output = _run(["--engine", "antifragile", "--ranks", str(ranks), "--case",
                            engine_case, "--max-states", "1000"], tmp_path / "r", s3)
    assert rc == 0, output
    (case,) = doc["cases"]
    assert case["states"] >= 1000, (case["states"], case["distinct_states"])
    counts = case["rules"]["engine"]["counts"]
    assert counts["refused"] == counts["torn"] == counts["lost"] == 0, counts


@pytest.mark.slow
@pytest.mark.s3
@pytest.mark.multiproc
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("engine_case", ["save", "retention"])
def test_antifragile_thousand_states_per_configuration(
        engine_case: str, ranks: int, tmp_path: Path, s3_server: dict[str, Any]) -> None:
    _big(engine_case, ranks, tmp_path, s3_server)


def test_a_repeated_case_or_rule_is_taken_once(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``--case save --case save`` checked the save case twice, and a repeated ``--rule
    engine`` loaded every state twice with the second answer replacing the first in the
    report: a repeated value is taken once, in the order first given."""
    from antifragile.chaos.crashcheck import run
    from antifragile.chaos.infra.s3 import S3SetupError

    seen: list[Any] = []

    def ran(settings: Any, **_: object) -> None:
        seen.append(settings)
        raise S3SetupError("stop here")

    monkeypatch.setattr(run, "crashcheck", ran)
    r = CliRunner().invoke(main, ["crashcheck", "--engine", "antifragile",
                                  "--case", "save", "--case", "overwrite", "--case", "save",
                                  "--rule", "engine", "--rule", "newest-folder",
                                  "--rule", "engine", "--endpoint-url", "http://127.0.0.1:9",
                                  "--out", str(tmp_path / "r")])
    assert r.exit_code == 2 and "stop here" in r.output, r.output
    assert seen[0].cases == ("save", "overwrite")
    assert seen[0].rules == ("engine", "newest-folder")


def test_the_markdown_escapes_html_in_the_save_error_and_the_reasons() -> None:
    """An S3 error is XML (``<Error><Code>SlowDown</Code>...``), an exception's text may hold
    ``<class '...'>``: crashcheck.md wrote them raw, so a Markdown viewer took them for tags
    and showed neither the code nor the class (crashcheck.html escaped them)."""
    from antifragile.chaos.crashcheck.report import markdown

    why = ("rank 0: StorageError: PUT step_2/COMMIT: <Error><Code>SlowDown</Code></Error> "
           "& <class 'OSError'>")
    doc = _summarized({0: "old", 1: "old", 2: "old"}, save_error=why)
    assert not verdict(doc)[0]  # not a case that may refuse: its reason names the error too
    text = markdown(doc, has_plot=False)
    shown = ("&lt;Error&gt;&lt;Code&gt;SlowDown&lt;/Code&gt;&lt;/Error&gt; &amp; "
             "&lt;class 'OSError'&gt;")
    assert "<Error>" not in text and "<class" not in text, text
    assert text.count(shown) == 2, text  # in the verdict's reason and in the case's line


def test_step_k_loaded_while_step_k_plus_1_is_committed_and_intact_is_lost(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the save's COMMIT has landed, with every object of step k+1 as the save left it
    (retention still deleting an older step), a load of step k passes over a committed
    checkpoint: a reader that never looked at it skips nothing and warns of nothing. Such a
    load was classified ``old``, so only the uncrashed state could fail that reader."""
    from antifragile.chaos.crashcheck import pipeline
    from antifragile.chaos.crashcheck.record import Recording

    s1, s2, s3 = "step_000000001", "step_000000002", "step_000000003"
    base = {f"{s1}/a": "p", f"{s1}/COMMIT": "c1", f"{s2}/a": "o", f"{s2}/COMMIT": "c2"}
    muts = [_put(0, f"{s3}/a", 0, 1), _put(1, f"{s3}/COMMIT", 2, 3),
            Mutation(2, "delete", f"{s1}/COMMIT", 4, 5), Mutation(3, "delete", f"{s1}/a", 6, 7)]
    exp = Expected(old_step=2, old_digest="o", new_step=3, new_digest="n", older={1: "p"})
    monkeypatch.setattr(pipeline, "record_case",
                        lambda *a, **k: (Recording(mutations=muts), base, exp, 0.1, None, False))
    final = apply(base, muts)

    class Loads:  # a reader that loads step 2 from every state but the uncrashed one
        def check(self, tasks: list[dict[str, Any]], progress: Any = None
                  ) -> dict[int, dict[str, Any]]:
            return {t["id"]: {"id": t["id"], "results": {"engine": (
                {"step": 3, "digest": "n", "skipped": []} if t["objects"] == final
                else {"step": 2, "digest": "o", "skipped": []})}} for t in tasks}

    settings = pipeline.Settings(engine="antifragile", ranks=1, cases=("retention",))
    result = pipeline.run_case(settings, "retention", endpoint_url="http://127.0.0.1:9",
                               env={}, bucket="b", bodies=tmp_path,
                               pool=Loads(),  # type: ignore[arg-type]
                               progress=lambda _: None)
    outcome = {len(s.applied): result.outcomes["engine"][s.id]
               for s in result.enumeration.states}
    assert outcome == {0: "old", 1: "old",  # step 3 not committed yet: step 2 is right
                       2: "lost", 3: "lost",  # step 3 committed and whole, not loaded
                       4: "new"}
