"""Reports: the timeline built from trainer events, the PNG plots, the self-contained HTML, and
that a real headless Chromium renders the HTML's plots (DevTools protocol over a pipe)."""

from __future__ import annotations

import fcntl
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from PIL import Image

from antifragile.chaos.faults import Injection
from antifragile.chaos.observe import checker, figures, measure
from antifragile.chaos.observe.record import RunRecord
from antifragile.chaos.report import document as report
from antifragile.chaos.report import plots
from antifragile.chaos.scenario import parse_scenario
from antifragile.chaos.suite import summary
from tests._reports import undocumented

T0 = 1_700_000_000.0
WORLD = 4  # dp=2, pp=2: ranks 2 and 3 are the last stage, the ones that report a loss
SCENARIO = {
    "name": "synthetic", "seed": 1,
    "description": "A <script>alert('x')</script> & friends: hung, corrupted, killed.",
    "trainer": {"parallel": {"dp": 2, "tp": 1, "pp": 2}, "steps": 12, "batch_size": 8,
                "model": {"layers": 2, "d_model": 32, "heads": 4, "vocab": 64, "seq_len": 16}},
    "checkpoint": {"every_steps": 2, "keep_last": 3},
    "faults": [{"kind": "hang_rank", "rank": 2, "at_step": 3, "duration_s": 4},
               {"kind": "corrupt_shard", "at_step": 7, "checkpoint": "latest"},
               {"kind": "kill_rank", "rank": 1, "at_step": 8}],
    # No reference run in a synthetic record: bitwise equality cannot be claimed.
    "expect": {"bitwise_equal_to_reference": False, "max_recovery_s": 60, "max_lost_steps": 4},
}


def _loss(step: int) -> float:
    return 5.0 - 0.1 * step + 0.03 * (step % 3)


class _Job:
    """Writes the events the trainer writes (trainer/train.py, trainer/checkpoint.py), with the
    times a real 4-rank run would have: start, restore, steps, checkpoints, hangs, exit."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.injections: list[Injection] = []
        self.attempt_ends: dict[int, float] = {}

    def emit(self, t: float, rank: int, attempt: int, event: str, **fields: Any) -> None:
        self.events.append({"t": t, "rank": rank, "attempt": attempt, "event": event, **fields})

    def start(self, t: float, attempt: int, restore: int | None = None,
              skipped: int | None = None) -> float:
        for r in range(WORLD):
            self.emit(t + 0.01 * r, r, attempt, "start", pid=1000 + 10 * attempt + r,
                      world_size=WORLD, dp=2, tp=1, pp=2)
            if restore is not None:
                self.emit(t + 0.1, r, attempt, "restore_begin")
                if skipped is not None:
                    self.emit(t + 0.2, r, attempt, "restore_skipped",
                              reason=f"checkpoint step {skipped} skipped, trying step {restore}: "
                                     "crc32c mismatch")
                self.emit(t + 0.4, r, attempt, "restore_end", step=restore, seconds=0.3)
        return t + 0.5

    def steps(self, t: float, attempt: int, first: int, last: int,
              ranks: range = range(WORLD), failing: frozenset[int] = frozenset()) -> float:
        for step in range(first, last + 1):
            t += 0.5
            for r in ranks:
                self.emit(t, r, attempt, "step_end", step=step,
                          loss=_loss(step) if r >= 2 else None, seconds=0.45)
                if step % 2 == 0 and step in failing:
                    self.emit(t + 0.01, r, attempt, "ckpt_failed", step=step,
                              error=f"step {step} skipped: the save of step {step - 2} "
                                    "is still persisting")
                elif step % 2 == 0:
                    self.emit(t + 0.01, r, attempt, "ckpt_staged", step=step,
                              stall_s=0.01 + r / 1e3)
                    self.emit(t + 0.4, r, attempt, "ckpt_committed", step=step, bytes=4_000_000,
                              rank_bytes=1_000_000, persist_s=0.3 + r / 100)
        return t


def synthetic_record() -> RunRecord:
    """Attempt 0 hangs at step 3 (rank 2 SIGSTOPped, its supervisor kills it); attempt 1
    restores step 2, the latest checkpoint (6) is corrupted at step 7 and rank 1 is killed at
    step 8 (its checkpoint 8 was refused); attempt 2 skips the damaged step 6, restores 4, and
    finishes, its checkpoint 10 failing to commit."""
    job = _Job()
    t = job.steps(job.start(T0 + 5.0, 0), 0, 1, 3)
    hang = t + 0.05
    job.injections.append(Injection("hang_rank", hang, step=3, rank=2, fault_index=0,
                                    detail={"pid": 1002, "duration_s": 4.0}))
    job.emit(hang + 2.0, 2, 0, "hang_detected", by="supervisor", slot=2, how="stopped",
             thread_state="T", stall_s=2.0, timeout_s=2.0)
    job.emit(hang + 2.0, 2, 0, "rank_died", by="supervisor", slot=2, how="signal 9", hung=True)
    for r in (0, 1, 3):
        job.emit(hang + 2.1, r, 0, "exit", code=1, error="RuntimeError: connection closed")
    job.attempt_ends[0] = hang + 2.3
    t = job.steps(job.start(hang + 5.3, 1, restore=2), 1, 3, 7)
    job.injections.append(Injection("corrupt_shard", t + 0.05, step=7, fault_index=1,
                                    detail={"checkpoint_step": 6, "object": "model/x/c.0",
                                            "mode": "bitflip"}))
    t = job.steps(t, 1, 8, 8, failing=frozenset({8}))
    kill = t + 0.05
    job.injections.append(Injection("kill_rank", kill, step=8, rank=1, fault_index=2,
                                    detail={"pid": 1011}))
    for r in (0, 2, 3):
        job.emit(kill + 0.5, r, 1, "exit", code=1, error="RuntimeError: peer closed")
    job.attempt_ends[1] = kill + 0.6
    t = job.start(kill + 3.6, 2, restore=4, skipped=6)
    t = job.steps(t, 2, 5, 9)
    for r in range(WORLD):
        job.emit(t + 0.5, r, 2, "step_end", step=10, loss=_loss(10) if r >= 2 else None,
                 seconds=0.45)
        job.emit(t + 0.51, r, 2, "ckpt_staged", step=10, stall_s=0.012)
        job.emit(t + 1.4, r, 2, "ckpt_failed", step=10,
                 error="commit of step 10 timed out: missing ranks [3] <tmp>")
    t = job.steps(t + 0.5, 2, 11, 12)
    for r in range(WORLD):
        job.emit(t + 0.45, r, 2, "exit", code=0)
    job.attempt_ends[2] = t + 0.5
    job.events.sort(key=lambda e: e["t"])
    return RunRecord(0, T0, t + 0.6, job.events, job.injections, job.attempt_ends)


def build_doc(record: RunRecord) -> dict[str, Any]:
    """The document ``chaos.run.run`` builds, by the same functions (no checkpoint to compare)."""
    s = parse_scenario(SCENARIO)
    timings = [measure.fault_timings(record, i) for i in record.injections]
    verdict = checker.judge(s, returncode=record.returncode, timings=timings, final_step=12,
                            faulty_url="unused", reference_url=None, final_committed=True)
    return {
        "scenario": s.model_dump(by_alias=True, mode="json"),
        "environment": report.environment(),
        "run": {"wall_s": record.wall_s, "goodput": figures.goodput(record), "attempts": 3,
                "final_step": 12, "returncode": 0, "checkpoint_url": "/tmp/<ckpt>",
                "reference_url": None},
        "faults": measure.as_dicts(timings),
        "checkpoints": figures.checkpoints(record),
        "losses": figures.losses(record),
        "verdict": checker.summary(verdict),
        "timeline": report.timeline(record),
        "reference_losses": [{"step": s, "loss": _loss(s)} for s in range(1, 13)],
    }


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    return build_doc(synthetic_record())


@pytest.fixture(scope="module")
def rendered(doc: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
             ) -> tuple[Path, list[plots.Plot]]:
    out = tmp_path_factory.mktemp("report")
    return out, report.write_report(out, doc)


def _worker(doc: dict[str, Any], attempt: int, rank: int) -> dict[str, Any]:
    (w,) = [w for w in doc["timeline"]["workers"] if (w["attempt"], w["rank"]) == (attempt, rank)]
    return w


def test_timeline_has_one_span_per_rank_and_attempt(doc: dict[str, Any]) -> None:
    tl = doc["timeline"]
    assert tl["started_t"] == T0 and tl["wall_s"] == pytest.approx(doc["run"]["wall_s"], abs=1e-3)
    assert [(w["attempt"], w["rank"]) for w in tl["workers"]] == [
        (a, r) for a in range(3) for r in range(WORLD)]
    assert [a["attempt"] for a in tl["attempts"]] == [0, 1, 2]
    assert all(0 < a["ended_s"] <= tl["wall_s"] for a in tl["attempts"])
    for w in tl["workers"]:  # times are seconds since the run started, in order
        assert 0 < w["start_s"] <= (w["first_step_s"] or w["start_s"]) <= tl["wall_s"]
    json.dumps(doc, allow_nan=False)


def test_timeline_spans_follow_the_events(doc: dict[str, Any]) -> None:
    hung, peer = _worker(doc, 0, 2), _worker(doc, 0, 0)
    assert hung["last_step"] == 3 and hung["exit_code"] == "signal 9"
    assert hung["hang_detected_s"] == hung["exit_s"], "its supervisor killed it on detection"
    assert peer["exit_code"] == 1 and peer["hang_detected_s"] is None
    assert peer["restore_begin_s"] is None and peer["first_step"] == 1
    killed = _worker(doc, 1, 1)
    assert (killed["restored_step"], killed["first_step"], killed["last_step"]) == (2, 3, 8)
    assert killed["exit_code"] is None and killed["steps"] == 6
    assert killed["restore_begin_s"] < killed["restore_end_s"] < killed["first_step_s"]
    by_step = {c["step"]: c for c in _worker(doc, 1, 0)["checkpoints"]}
    assert sorted(by_step) == [4, 6, 8]
    assert by_step[4]["stall_s"] == 0.01 and by_step[4]["persist_s"] == 0.3
    assert by_step[4]["staged_s"] < by_step[4]["committed_s"]
    assert by_step[8]["staged_s"] is None and "still persisting" in by_step[8]["error"]
    last = _worker(doc, 2, 3)
    assert (last["restored_step"], last["first_step"], last["last_step"], last["exit_code"]) \
        == (4, 5, 12, 0)
    failed = {c["step"]: c for c in last["checkpoints"]}[10]
    assert failed["staged_s"] is not None and failed["committed_s"] is None and failed["failed_s"]
    hang, corrupt, kill = doc["timeline"]["injections"]
    assert (hang["kind"], hang["attempt"], hang["rank"], hang["duration_s"]) == \
        ("hang_rank", 0, 2, 4.0)
    assert (corrupt["attempt"], corrupt["rank"], kill["attempt"], kill["rank"]) == (1, None, 1, 1)
    assert kill["t_s"] == pytest.approx(doc["faults"][2]["injected_t"] - T0, abs=1e-3)


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def _count_color(path: Path, rgb: tuple[int, int, int], tol: int = 12) -> int:
    with Image.open(path) as img:
        pixels = np.asarray(img.convert("RGB"), dtype=np.int16)
    return int((np.abs(pixels - np.array(rgb)) <= tol).all(axis=-1).sum())


def _rgb(hex_color: str) -> tuple[int, int, int]:
    return tuple(int(hex_color[i:i + 2], 16) for i in (1, 3, 5))  # type: ignore[return-value]


def test_plots_are_png_files_of_the_promised_size(doc: dict[str, Any],
                                                  rendered: tuple[Path, list[plots.Plot]]) -> None:
    out, figures = rendered
    assert [p.name for p in figures] == ["loss.png", "timeline.png", "checkpoints.png"]
    for p in figures:
        assert p.error is None, p.error
        data = (out / p.name).read_bytes()
        assert data == p.png
        assert _png_size(data) == plots.figure_size_px(p.name, doc)
        with Image.open(out / p.name) as img:
            img.verify()
    assert plots.figure_size_px("timeline.png", doc)[1] > plots.figure_size_px(
        "timeline.png", {"scenario": {"trainer": {"parallel": {"dp": 1}}}})[1]


def test_plots_mark_faults_recoveries_and_failed_checkpoints(
        rendered: tuple[Path, list[plots.Plot]]) -> None:
    out, _ = rendered
    red, green = _rgb(plots.FAULT_COLOR), _rgb(plots.RECOVERY_COLOR)
    assert _count_color(out / "loss.png", red) > 150, "fault injection lines"
    assert _count_color(out / "loss.png", green) > 150, "restored-step lines"
    for attempt in range(3):
        assert _count_color(out / "loss.png", _rgb(plots.ATTEMPT_COLORS[attempt])) > 100
    assert _count_color(out / "timeline.png", red) > 100, "fault markers, failed checkpoint"
    assert _count_color(out / "checkpoints.png", red) > 100, "the failed checkpoint of step 10"


def test_a_plot_that_fails_costs_only_itself(doc: dict[str, Any], tmp_path: Path) -> None:
    broken = {**doc, "timeline": {"workers": [{"attempt": 0}]}}  # no rank: cannot be drawn
    figures = report.write_report(tmp_path, broken)
    errors = {p.name: p.error for p in figures}
    assert errors["loss.png"] is None and errors["checkpoints.png"] is None
    assert errors["timeline.png"] and errors["timeline.png"].startswith("KeyError: 'rank'")
    assert not (tmp_path / "timeline.png").exists() and (tmp_path / "loss.png").exists()
    page = (tmp_path / "report.html").read_text()
    assert "timeline.png could not be drawn" in page and "KeyError" in page
    assert page.count("<img ") == 2
    assert "timeline.png could not be drawn: KeyError" in (tmp_path / "report.md").read_text()
    assert json.loads((tmp_path / "report.json").read_text())["verdict"] == doc["verdict"]


def test_html_is_self_contained_and_escaped(doc: dict[str, Any],
                                            rendered: tuple[Path, list[plots.Plot]]) -> None:
    out, figures = rendered
    page = (out / "report.html").read_text()
    links = re.findall(r'(?:src|href)\s*=\s*["\']?([^"\' >]*)', page, flags=re.I)
    assert len(links) == 3 and all(u.startswith("data:image/png;base64,") for u in links)
    assert "<script" not in page.lower().replace("&lt;script", "")
    assert "@import" not in page and "url(" not in page
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; friends" in page
    assert "missing ranks [3] &lt;tmp&gt;" in page and "/tmp/&lt;ckpt&gt;" in page
    assert "Content-Security-Policy" in page
    for p in figures:
        assert f'alt="{p.alt}"' in page
    for heading in ("Run", "Faults", "Checkpoints", "Plots", "Environment", "Scenario"):
        assert f"<h2>{heading}</h2>" in page
    for f in doc["faults"]:  # every timing field is in the faults table
        for key in ("detect_s", "restart_s", "restore_s", "recompute_s", "recovery_s"):
            if f[key] is not None:
                assert f"<td>{f[key]:.3f}</td>" in page
    assert doc["verdict"]["verdict"].upper() in page
    md = (out / "report.md").read_text()
    assert all(f"]({p.name})" in md for p in figures) and "[report.html](report.html)" in md


def test_goodput_reads_the_same_everywhere_in_the_report(doc: dict[str, Any],
                                                         tmp_path: Path) -> None:
    """report.md wrote the run's goodput with two decimals and the reference's with three
    ("goodput 0.53 (95.7% of the fault-free run's 0.558)"), and report.html wrote both as
    percentages: one goodput formatter, the same figures in both files."""
    run = {**doc["run"], "goodput": 0.53371, "reference_goodput": 0.55806,
           "goodput_vs_reference": 0.53371 / 0.55806}
    report.write_markdown(tmp_path, {**doc, "run": run})
    report.write_html(tmp_path, {**doc, "run": run}, [])
    md = (tmp_path / "report.md").read_text()
    assert "goodput 53.4% (95.6% of the fault-free run's 55.8%)" in md, md
    page = (tmp_path / "report.html").read_text()
    assert all(f"<td>{share}</td>" in page for share in ("53.4%", "55.8%", "95.6%")), page


def test_a_fault_note_of_several_lines_stays_one_row_of_the_markdown_table(
        doc: dict[str, Any], tmp_path: Path) -> None:
    """A volume server that did not come back has its log's last lines in the fault's effect;
    the line breaks ended the markdown table in the middle of that row."""
    effect = ("the volume server did not come back: volume server 1 did not come back within "
              "30 s; log /x/volume1.log:\n    I1205 starting | port 8081\n    F1205 bind: in use")
    faults = [{**doc["faults"][0], "skipped": None, "effect": effect}, *doc["faults"][1:]]
    report.write_markdown(tmp_path, {**doc, "faults": faults})
    md = (tmp_path / "report.md").read_text().split("## Faults\n\n", 1)[1]
    table = md.split("\n\n", 1)[0].splitlines()
    assert len(table) == 2 + len(faults)
    assert all(row.startswith("|") and row.count("|") == 14 for row in table), table
    assert table[2].endswith("within 30 s; log /x/volume1.log: I1205 starting / port 8081 "
                             "F1205 bind: in use |")


def test_the_markdown_escapes_html_in_the_description_reasons_and_fault_notes(
        doc: dict[str, Any], tmp_path: Path) -> None:
    """report.md carried the scenario's description, the verdict's reasons and a fault's note
    (error messages, log lines) as they are: a Markdown viewer rendered the description's
    <script> as HTML and dropped a "<tmp>" from an error as an unknown tag, while report.html
    showed both as text."""
    effect = "commit timed out: missing ranks [3] <tmp> & more"
    faults = [{**doc["faults"][0], "skipped": None, "effect": effect}, *doc["faults"][1:]]
    verdict = {**doc["verdict"], "reasons": ["storage did not come back: <Response [503]>"]}
    failed = plots.Plot("loss.png", "loss", error="TypeError: <lambda>() missing 1 argument\n")
    report.write_markdown(tmp_path, {**doc, "faults": faults, "verdict": verdict}, [failed])
    md = (tmp_path / "report.md").read_text()
    assert "<script>" not in md and "<tmp>" not in md and "<Response" not in md, md
    assert "loss.png could not be drawn: TypeError: &lt;lambda&gt;() missing 1 argument" in md
    assert "A &lt;script&gt;alert('x')&lt;/script&gt; &amp; friends" in md
    assert "- storage did not come back: &lt;Response [503]&gt;\n" in md
    assert "missing ranks [3] &lt;tmp&gt; &amp; more |" in md


def test_a_verdict_reason_of_several_lines_stays_one_item_of_the_markdown_list(
        doc: dict[str, Any], tmp_path: Path) -> None:
    """A volume server that did not come back fails the verdict with its log's last lines
    in the reason; report.md wrote them as they were, so a log line of "====" made the
    reason above it a heading and one of "- ..." a list item of its own."""
    reason = ("storage_node_down at step 5: storage did not come back: volume server 1 did "
              "not come back within 30 s; log /x/volume1.log:\n====\n- F1205 bind: in use")
    verdict = {**doc["verdict"], "verdict": "fail", "reasons": [reason, "second"]}
    md = report.write_markdown(tmp_path, {**doc, "verdict": verdict}).read_text()
    assert ("- storage_node_down at step 5: storage did not come back: volume server 1 did "
            "not come back within 30 s; log /x/volume1.log: ==== - F1205 bind: in use\n"
            "- second\n") in md, md
    assert "\n====" not in md and "\n- F1205" not in md


def test_the_html_marks_red_only_the_faults_that_fail_the_verdict(
        doc: dict[str, Any], tmp_path: Path) -> None:
    """A recovery the next fault cut short, or one a script's events cannot time, has a
    restored step and no recovery time: report.html drew its row red, as for a job that came
    back and never caught up, under a PASS banner (report.md says "interrupted by the next
    fault"; the verdict holds neither against the run)."""
    made = {**doc["faults"][0], "skipped": None, "missed": None, "effect_observed": True,
            "ended_attempt": 0, "restored_step": 4, "recovery_s": None, "recompute_s": None,
            "interrupted_by_t": None, "unmeasured": None}
    faults = [{**made, "interrupted_by_t": made["injected_t"] + 5.0},
              {**made, "unmeasured": "recompute, recovery and lost steps: no step reported"},
              made]  # came back, never got back to its step: the verdict fails it
    report.write_html(tmp_path, {**doc, "faults": faults}, [])
    page = (tmp_path / "report.html").read_text()
    table = page.split("<h2>Faults</h2>", 1)[1].split("</table>", 1)[0]
    rows = re.findall(r"<tr(?: class=\"(\w+)\")?><td>", table)
    assert rows == ["", "", "bad"], rows


def test_a_scenario_whose_faults_never_fired_is_not_said_to_have_none(
        doc: dict[str, Any], tmp_path: Path) -> None:
    """A fault whose trigger was never reached has no entry in ``faults``: report.html then
    said "No faults in this scenario." of a scenario that has them (the verdict fails it as
    never injected) and report.md showed an empty table."""
    scenario_faults = doc["scenario"]["faults"]
    assert scenario_faults
    never = {**doc, "faults": []}
    report.write_html(tmp_path, never, [])
    page = (tmp_path / "report.html").read_text()
    n = len(scenario_faults)
    said = f"No fault was injected; the scenario has {n} (see the verdict)."
    assert said in page and "No faults in this scenario." not in page
    md = report.write_markdown(tmp_path, never).read_text()
    assert f"## Faults\n\n{said}\n" in md, md
    none = {**never, "scenario": {**doc["scenario"], "faults": []}}
    report.write_html(tmp_path, none, [])
    assert "No faults in this scenario." in (tmp_path / "report.html").read_text()
    assert "## Faults\n\nNo faults in this scenario.\n" in report.write_markdown(
        tmp_path, none).read_text()


def test_the_markdown_shows_a_stall_of_milliseconds_as_what_it_is(
        doc: dict[str, Any], tmp_path: Path) -> None:
    """A staging stall is a few milliseconds on a small state; two decimals wrote every one
    of them as 0.00 s in report.md, while report.json held 0.004."""
    first = {**doc["checkpoints"][0], "stall_s": 0.0042, "slowdown_s": 0.031}
    cost = {"stall_s": 0.0042, "slowdown_s": 0.031, "share_of_step_time": 0.002}
    report.write_markdown(tmp_path, {**doc, "checkpoints": [first, *doc["checkpoints"][1:]],
                                     "run": {**doc["run"], "checkpoint_cost": cost}})
    md = (tmp_path / "report.md").read_text()
    table = md.split("## Checkpoints\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    cells = [c.strip() for c in table[2].split("|")[1:-1]]
    assert cells[2:5] == ["0.0042", f"{first['persist_s']:.2f}", "0.031"], cells
    assert "cost the training loop 0.0042 s of stall and 0.031 s of slower steps" in md


def test_the_html_shows_a_small_measured_figure_as_what_it_is(
        doc: dict[str, Any], tmp_path: Path) -> None:
    """Three decimals wrote a checkpoint written at 65 KiB/s (S3 with a volume server down:
    6.3e-05 GiB/s) and a sub-millisecond stall as 0.000 in report.html's checkpoints table,
    while report.json held what was measured."""
    first = {**doc["checkpoints"][0], "stall_s": 0.00042, "throughput_gib_s": 6.3e-05}
    report.write_html(tmp_path, {**doc, "checkpoints": [first, *doc["checkpoints"][1:]]}, [])
    page = (tmp_path / "report.html").read_text()
    table = page.split("<h2>Checkpoints</h2>", 1)[1].split("</table>", 1)[0]
    row = table.split("<tbody><tr>", 1)[1].split("</tr>", 1)[0]
    cells = re.findall(r"<td>(.*?)</td>", row)
    assert cells[2] == "0.00042" and cells[6] == "6.3e-05", cells


def test_the_html_run_table_shows_a_checkpoint_stall_of_milliseconds_as_what_it_is(
        doc: dict[str, Any], tmp_path: Path) -> None:
    """The run table's checkpoint cost kept two decimals after report.md stopped doing so:
    a 4.2 ms stall read "0.00 s" in report.html while report.md and report.json held 0.0042."""
    cost = {"stall_s": 0.0042, "slowdown_s": 0.031, "share_of_step_time": 0.002}
    report.write_html(tmp_path, {**doc, "run": {**doc["run"], "checkpoint_cost": cost}}, [])
    page = (tmp_path / "report.html").read_text()
    row = page.split("<td>checkpoints&#x27; cost to the loop", 1)[1].split("</tr>", 1)[0]
    assert "<td>0.0042 s + 0.031 s = 0.2% of the steps&#x27; time</td>" in row, row


def test_a_checkpoint_cost_share_below_a_tenth_of_a_percent_is_not_zero(
        doc: dict[str, Any], tmp_path: Path) -> None:
    """A 2 ms stall a save on second-long steps is 0.03% of the steps' time: one decimal of a
    percent wrote it as 0.0% in report.md and report.html (as if checkpoints were free),
    while report.json held 0.0003."""
    cost = {"stall_s": 0.002, "slowdown_s": 0.0, "share_of_step_time": 0.0003}
    changed = {**doc, "run": {**doc["run"], "checkpoint_cost": cost}}
    report.write_markdown(tmp_path, changed)
    report.write_html(tmp_path, changed, [])
    assert "(0.03% of the steps' time)" in (tmp_path / "report.md").read_text()
    assert "= 0.03% of the steps&#x27; time</td>" in (tmp_path / "report.html").read_text()


def test_the_timeline_of_a_command_trainer_has_a_row_for_every_rank() -> None:
    """A command trainer's scenario has ``nproc_per_node``, no ``parallel``: its timeline was
    drawn for one rank, so ranks 1.. and a fault on them fell outside the plot."""
    from matplotlib.figure import Figure

    trainer = {"command": ["python", "train.py"], "nproc_per_node": 4, "nodes": 1}
    workers = [{"attempt": 0, "rank": r, "start_s": 1.0, "last_step_s": 9.0, "exit_s": 10.0,
                "exit_code": 0, "checkpoints": []} for r in range(4)]
    doc = {"scenario": {"name": "script", "trainer": trainer}, "run": {"wall_s": 11.0},
           "timeline": {"wall_s": 11.0, "attempts": [{"attempt": 0, "ended_s": 10.5}],
                        "workers": workers,
                        "injections": [{"kind": "kill_rank", "t_s": 5.0, "rank": 3,
                                        "attempt": 0}]}}
    assert plots.figure_size_px("timeline.png", doc) == plots.figure_size_px(
        "timeline.png", {"scenario": {"trainer": {"parallel": {"dp": 4}}}})
    fig = Figure()
    plots._draw_timeline(fig, doc)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"rank {r}" for r in range(4)]
    low, high = sorted(ax.get_ylim())
    assert low < 3 < high, "rank 3's row (and its kill) is in view"


def test_the_checkpoint_plot_shows_no_stall_for_a_save_that_was_never_staged() -> None:
    """A save refused before staging (the previous one still persisting) has no stall: the
    report's tables show "-", but checkpoints.png labelled its bar "0 ms", a stall measured
    as nothing."""
    from matplotlib.figure import Figure

    cks = [{"attempt": 0, "step": 5, "stall_s": 0.004, "persist_s": 0.3, "bytes": 10,
            "committed": True},
           {"attempt": 0, "step": 10, "stall_s": None, "persist_s": None, "bytes": None,
            "committed": False, "error": "step 10 skipped: the save of step 5 is still "
                                         "persisting"}]
    fig = Figure()
    plots._draw_checkpoints(fig, {"scenario": {"name": "busy"}, "checkpoints": cks})
    stall_ax = fig.axes[0]
    assert [t.get_text() for t in stall_ax.texts] == ["4 ms", "-"]


def test_the_checkpoint_plot_labels_a_sub_millisecond_save_with_what_was_measured() -> None:
    """A save of a small state stalls the loop for a fraction of a millisecond and persists in
    a few: checkpoints.png labelled them "0 ms" and "0.00 s", the labels of a save that cost
    nothing, while report.md and report.html show 0.00042 and 0.0031."""
    from matplotlib.figure import Figure

    cks = [{"attempt": 0, "step": 5, "stall_s": 0.00042, "persist_s": 0.0031, "bytes": 10,
            "committed": True},
           {"attempt": 0, "step": 10, "stall_s": 0.012, "persist_s": 0.25, "bytes": 10,
            "committed": True}]
    fig = Figure()
    plots._draw_checkpoints(fig, {"scenario": {"name": "small"}, "checkpoints": cks})
    stall_ax, persist_ax = fig.axes[:2]
    assert [t.get_text() for t in stall_ax.texts] == ["0.42 ms", "12 ms"]
    assert [t.get_text() for t in persist_ax.texts] == ["0.0031 s", "0.25 s"]


def test_the_checkpoint_plot_marks_the_final_save_as_the_jobs_shutdown() -> None:
    """The run's final blocking save waits for its whole persist: the report's tables mark it
    "N (final)" and the checkpoints' cost and the suite's stall leave it out, but
    checkpoints.png drew it as one more stall of training, most often the tallest bar."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    cks = [{"attempt": 0, "step": 5, "stall_s": 0.012, "persist_s": 0.08, "bytes": 10,
            "committed": True},
           {"attempt": 0, "step": 10, "stall_s": 0.11, "persist_s": 0.06, "bytes": 10,
            "committed": True, "final": True}]
    fig = Figure()
    plots._draw_checkpoints(fig, {"scenario": {"name": "s"}, "checkpoints": cks})
    stall_ax, persist_ax = fig.axes[:2]
    assert [t.get_text() for t in persist_ax.get_xticklabels()] == ["5", "10 (final)"]
    bars = [p for p in stall_ax.patches if isinstance(p, Rectangle)]
    assert bars[0].get_facecolor() != bars[1].get_facecolor()
    legend = [t.get_text() for t in stall_ax.get_legend().get_texts()]
    assert "final save (the job's shutdown, not a stall of training)" in legend, legend


def test_the_loss_plot_says_never_caught_up_only_of_a_job_that_did_not() -> None:
    """A recovery the next fault cut short passes the verdict, and one a script's events
    cannot time is not measured; loss.png labelled both "never caught up", the words of a job
    that came back and never got back to the fault's step (a failed verdict)."""
    from matplotlib.figure import Figure

    made = {"kind": "kill_rank", "injected_step": 12, "rank": 1, "skipped": None,
            "missed": None, "restored_step": 10, "recovery_s": None, "interrupted_by_t": None,
            "unmeasured": None}
    faults = [{**made, "interrupted_by_t": 1e9}, {**made, "unmeasured": "recovery: no steps"},
              made, {**made, "recovery_s": 3.86}]
    fig = Figure()
    plots._draw_loss(fig, {"scenario": {"name": "s"}, "faults": faults, "losses": []})
    restored = [t.get_text() for t in fig.axes[0].texts if t.get_text().startswith("restored")]
    assert restored == ["restored step 10; interrupted by the next fault",
                        "restored step 10; recovery not measured",
                        "restored step 10; never caught up",
                        "restored step 10; caught up after 3.9 s"], restored


def test_a_host_down_is_drawn_on_every_rank_it_took() -> None:
    """``host_down`` kills every rank of its host; the timeline's injection carried only the
    first (the injection's ``rank``), so the plot drew the host's other ranks training on, as
    if alive, until the attempt ended."""
    from matplotlib.figure import Figure

    events = [{"t": T0 + 1.0, "rank": r, "attempt": 0, "event": "start", "pid": 100 + r}
              for r in range(4)]
    down = Injection("host_down", T0 + 5.0, step=4, rank=2, fault_index=0,
                     detail={"node": 1, "ranks": [2, 3], "pid": 102, "lost_node": 1})
    tl = report.timeline(RunRecord(0, T0, T0 + 12.0, events, [down], {0: T0 + 8.0}))
    assert tl["injections"][0]["ranks"] == [2, 3]
    doc = {"scenario": {"name": "host", "trainer": {"parallel": {"dp": 4}}},
           "run": {"wall_s": 12.0}, "timeline": tl}
    fig = Figure()
    plots._draw_timeline(fig, doc)
    dead = [c for c in fig.axes[0].collections if c.get_hatch() == ".."]
    rows = {round(float(np.mean(p.vertices[:, 1]))) for c in dead for p in c.get_paths()}
    assert rows == {2, 3}, "both ranks of the lost host are drawn dead from the fault on"


def test_a_hang_of_the_training_thread_is_not_called_a_sigstop() -> None:
    """``hang_rank`` ``mode: thread`` holds only the training thread (ptrace), the process's
    other threads running on; timeline.png's legend called every hang "hung (SIGSTOP)"."""
    from matplotlib.figure import Figure

    events = [{"t": T0 + 1.0, "rank": r, "attempt": 0, "event": "start", "pid": 100 + r}
              for r in range(2)]
    hangs = [Injection("hang_rank", T0 + 3.0, step=2, rank=0, fault_index=0,
                       detail={"pid": 100, "duration_s": 2.0, "mode": "thread"}),
             Injection("hang_rank", T0 + 6.0, step=4, rank=1, fault_index=1,
                       detail={"pid": 101, "duration_s": 2.0, "mode": "process"})]
    tl = report.timeline(RunRecord(0, T0, T0 + 12.0, events, hangs, {0: T0 + 11.0}))
    for hangs_shown, legend in ((tl["injections"][:1], ["training thread held (ptrace)"]),
                                (tl["injections"], ["training thread held (ptrace)",
                                                    "hung (SIGSTOP)"])):
        fig = Figure()
        plots._draw_timeline(fig, {"scenario": {"name": "hang", "trainer": {
            "parallel": {"dp": 2}}}, "run": {"wall_s": 12.0},
            "timeline": {**tl, "injections": hangs_shown}})
        labels = [t.get_text() for t in fig.legends[0].get_texts()]
        assert [x for x in labels if "hung" in x or "held" in x] == legend, labels


def test_a_fault_that_was_not_made_is_not_said_to_have_caused_no_restart(
        tmp_path: Path) -> None:
    """A missed fault (its rank had exited when it was due) had the recovery "none (caused no
    restart)" in report.md and report.html, the words for a made fault the job rode through."""
    record = synthetic_record()
    record.injections[2] = Injection("kill_rank", record.injections[2].t, step=8, rank=1,
                                     fault_index=2, detail={"pid": 1011},
                                     missed="rank 1 (pid 1011) had already exited")
    doc = build_doc(record)
    report.write_markdown(tmp_path, doc)
    report.write_html(tmp_path, doc, [])
    md = (tmp_path / "report.md").read_text()
    (row,) = [line for line in md.splitlines() if line.startswith("| kill_rank |")]
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[9] == "-" and cells[12].startswith("not made: rank 1"), cells
    page = (tmp_path / "report.html").read_text()
    (html_row,) = re.findall(r"<tr[^>]*><td>kill_rank</td>.*?</tr>", page)
    assert "caused no restart" not in html_row, html_row


def test_report_json_is_strict_json_when_a_figure_is_not_finite(
        doc: dict[str, Any], tmp_path: Path) -> None:
    """A diverged loss (NaN) was written bare into report.json, which jq, browsers and
    other strict readers refuse: a non-finite number is written as null."""
    report.write_json(tmp_path, {**doc, "loss": float("nan"), "ratio": [float("-inf"), 2.0]})

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    written = json.loads((tmp_path / "report.json").read_text(), parse_constant=refuse)
    assert written["loss"] is None and written["ratio"] == [None, 2.0]


def test_storage_credentials_of_the_scenario_are_not_written_into_the_report(
        doc: dict[str, Any], tmp_path: Path) -> None:
    """``checkpoint.storage_options`` secret and token were copied as given into report.json
    and report.html (which CI uploads); the access key and endpoint stay, to say which."""
    options = {"endpoint_url": "http://store:8333", "key": "AKIDPUBLIC",
               "secret": "wJalrXUtnFEMI-SECRET", "token": "FwoGZX-SESSION-TOKEN"}
    s = doc["scenario"]
    secret = {**doc, "scenario": {**s, "checkpoint": {**s["checkpoint"], "url": "s3://b/p",
                                                      "storage_options": options}}}
    report.write_json(tmp_path, secret)
    report.write_markdown(tmp_path, secret)
    report.write_html(tmp_path, secret, [])
    for name in ("report.json", "report.md", "report.html"):
        text = (tmp_path / name).read_text()
        assert "wJalrXUtnFEMI-SECRET" not in text and "FwoGZX-SESSION-TOKEN" not in text, name
    written = json.loads((tmp_path / "report.json").read_text())["scenario"]["checkpoint"]
    assert written["storage_options"] == {**options, "secret": "***", "token": "***"}
    assert "AKIDPUBLIC" in (tmp_path / "report.html").read_text()
    assert secret["scenario"]["checkpoint"]["storage_options"] == options  # not changed


def test_credentials_in_the_command_trainers_environment_are_not_written_into_the_report(
        doc: dict[str, Any], tmp_path: Path) -> None:
    """``trainer.env`` of a command trainer (a user's script) often carries an API token or a
    store's secret key; it was copied as given into report.json, .md and .html."""
    env = {"HF_TOKEN": "hf_XXSECRET1", "WANDB_API_KEY": "wandb-SECRET2",
           "AWS_SECRET_ACCESS_KEY": "aws-SECRET3", "DB_PASSWORD": "pw-SECRET4",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    s = doc["scenario"]
    trainer = {"command": ["python", "train.py"], "nproc_per_node": 2, "env": env}
    with_env = {**doc, "scenario": {**s, "trainer": trainer}}
    report.write_json(tmp_path, with_env)
    report.write_markdown(tmp_path, with_env)
    report.write_html(tmp_path, with_env, [])
    for name in ("report.json", "report.md", "report.html"):
        text = (tmp_path / name).read_text()
        assert not any(f"SECRET{i}" in text for i in range(1, 5)), name
    written = json.loads((tmp_path / "report.json").read_text())["scenario"]["trainer"]["env"]
    assert written == {**env, "HF_TOKEN": "***", "WANDB_API_KEY": "***",
                       "AWS_SECRET_ACCESS_KEY": "***", "DB_PASSWORD": "***"}
    assert with_env["scenario"]["trainer"]["env"] == env  # not changed


def test_reference_losses_come_from_the_reference_events(tmp_path: Path) -> None:
    (tmp_path / "events").mkdir()
    lines = [{"t": T0 + s, "rank": r, "attempt": 0, "event": "step_end", "step": s,
              "loss": _loss(s) if r else None, "seconds": 0.1} for s in (2, 1) for r in (0, 1)]
    (tmp_path / "events" / "rank0.jsonl").write_text(
        "".join(json.dumps(e) + "\n" for e in lines) + '{"torn')
    assert report.reference_losses(tmp_path) == [{"step": 1, "loss": _loss(1)},
                                                 {"step": 2, "loss": _loss(2)}]
    assert report.reference_losses(tmp_path / "gone") == []


# --- a real browser -------------------------------------------------------------------------

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--remote-debugging-pipe"]

# For every image: decoded (complete, natural size), laid out (shown width), and its pixels as
# the page has them (drawn into a canvas): how many are not near-white.
IMAGES_JS = """[...document.images].map(i => {
  const c = document.createElement('canvas'); c.width = i.naturalWidth; c.height = i.naturalHeight;
  let inked = -1;
  if (i.naturalWidth > 0) {
    const g = c.getContext('2d'); g.drawImage(i, 0, 0);
    const d = g.getImageData(0, 0, c.width, c.height).data; inked = 0;
    for (let k = 0; k < d.length; k += 4) if (d[k] + d[k + 1] + d[k + 2] < 600) inked++;
  }
  return {alt: i.alt, complete: i.complete, width: i.naturalWidth, height: i.naturalHeight,
          shown: i.getBoundingClientRect().width, inked: inked};
})"""


class Chromium:
    """Headless Chromium driven over the DevTools protocol on a pipe (fds 3 and 4, NUL-framed
    JSON): no port, no websocket package, nothing reachable from outside the test."""

    def __init__(self, profile: Path) -> None:
        def high(fd: int) -> int:  # out of the way of 3 and 4, which the child dup2s onto
            moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
            os.close(fd)
            return moved

        to_browser_r, to_browser_w = map(high, os.pipe())
        from_browser_r, from_browser_w = map(high, os.pipe())

        def wire() -> None:
            os.dup2(to_browser_r, 3)
            os.dup2(from_browser_w, 4)

        self._log = open(profile / "chromium.log", "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(  # preexec_fn only wires the two pipe ends
            [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank"],
            pass_fds=(3, 4), preexec_fn=wire, stdin=subprocess.DEVNULL,
            stdout=self._log, stderr=self._log)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._w, self._r = to_browser_w, from_browser_r
        self._buf = b""
        self._id = 0

    def call(self, method: str, session: str | None = None, timeout_s: float = 60.0,
             **params: Any) -> dict[str, Any]:
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout_s
        while True:
            while b"\0" in self._buf:
                raw, self._buf = self._buf.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self._id:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return dict(reply["result"])
            if time.monotonic() > deadline:
                raise TimeoutError(f"chromium did not answer {method} in {timeout_s} s")
            chunk = os.read(self._r, 1 << 16)
            if not chunk:
                raise RuntimeError(f"chromium closed the pipe (exit {self.proc.poll()})")
            self._buf += chunk

    def evaluate(self, session: str, expression: str) -> Any:
        result = self.call("Runtime.evaluate", session, expression=expression,
                           returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def open(self, url: str, timeout_s: float = 60.0) -> str:
        """A new tab at ``url``, once loaded: its session id."""
        target = self.call("Target.createTarget", url=url)["targetId"]
        session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        deadline = time.monotonic() + timeout_s
        loaded = f"location.href === {json.dumps(url)} && document.readyState === 'complete'"
        while not self.evaluate(session, loaded):  # the new tab shows about:blank first
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not finish loading in {timeout_s} s")
            time.sleep(0.1)
        return str(session)

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout_s=10)
            self.proc.wait(timeout=20)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        finally:
            os.close(self._w)
            os.close(self._r)
            self._log.close()


@pytest.fixture(scope="module")
def chromium() -> Iterator[Chromium]:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"{CHROMIUM} is absent (apt package 'chromium'; .ci/run installs it)")
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        browser = Chromium(Path(profile))
        try:
            yield browser
        finally:
            browser.close()


def test_a_real_browser_renders_the_plots(rendered: tuple[Path, list[plots.Plot]],
                                          chromium: Chromium, tmp_path: Path) -> None:
    out, figures = rendered
    session = chromium.open((out / "report.html").as_uri())
    images = chromium.evaluate(session, IMAGES_JS)
    assert [i["alt"] for i in images] == [p.alt for p in figures]
    for image, plot in zip(images, figures):
        assert image["complete"] and (image["width"], image["height"]) == _png_size(plot.png or b"")
        assert image["shown"] > 300, f"{plot.name} is not laid out: {image}"
        assert image["inked"] > 0.02 * image["width"] * image["height"], f"{plot.name} is blank"
    assert chromium.evaluate(session, "document.querySelector('.banner').innerText").startswith(
        "PASS")
    assert chromium.evaluate(session, "document.scripts.length") == 0

    # The same check catches a plot the browser cannot decode: damage one image's data.
    page = (out / "report.html").read_text()
    damaged = tmp_path / "damaged.html"
    damaged.write_text(page.replace("base64,iVBORw0KGgo", "base64,AAAAAAAAAA", 1))
    images = chromium.evaluate(chromium.open(damaged.as_uri()), IMAGES_JS)
    assert [i["width"] > 0 for i in images] == [False, True, True]


@pytest.mark.slow
@pytest.mark.multiproc
def test_chaos_run_writes_the_whole_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    """End to end: a real 2-rank run with a kill writes json, md, html and the three PNGs,
    and reports/README.md names every field of its report.json."""
    from antifragile.chaos.run.pipeline import run

    monkeypatch.setenv("ANTIFRAGILE_CACHE", str(tmp_path / "cache"))
    s = parse_scenario(yaml.safe_load("""
        name: report-e2e
        seed: 3
        trainer: {parallel: {dp: 2, tp: 1, pp: 1}, steps: 16, batch_size: 8,
                  model: {layers: 2, d_model: 32, heads: 4, vocab: 64, seq_len: 16}}
        checkpoint: {every_steps: 4, keep_last: 3}
        faults: [{kind: kill_rank, rank: 1, at_step: 10}]
        expect: {bitwise_equal_to_reference: true}
    """))
    outcome = run(s, tmp_path / "out", progress=lambda _: None)
    assert outcome.passed, outcome.report["verdict"]
    out = tmp_path / "out"
    for name in ("report.json", "report.md", "report.html", "loss.png", "timeline.png",
                 "checkpoints.png"):
        assert (out / name).stat().st_size > 0, name
    doc = json.loads((out / "report.json").read_text())
    assert {(w["attempt"], w["rank"]) for w in doc["timeline"]["workers"]} == {
        (0, 0), (0, 1), (1, 0), (1, 1)}
    assert [e["step"] for e in doc["reference_losses"]] == list(range(1, 17))
    assert undocumented(doc) == []
    assert _png_size((out / "timeline.png").read_bytes()) == plots.figure_size_px(
        "timeline.png", doc)


def test_a_slot_given_up_and_spares_lost_while_idle_are_reported(
        doc: dict[str, Any], tmp_path: Path) -> None:
    events = [{"t": T0 + 1, "rank": -1, "attempt": -1, "event": "spare_ready", "worker": "2.0"},
              {"t": T0 + 2, "rank": -1, "attempt": -1, "event": "rank_died", "slot": 2,
               "phase": "spare", "how": "signal 9"},
              {"t": T0 + 3, "rank": -1, "attempt": -1, "event": "spare_lost", "slot": 2,
               "deaths": 3, "by": "supervisor"}]
    spares = figures.spares(RunRecord(0, T0, T0 + 4, events, [], {}))
    assert spares["ready"] == 1 and len(spares["lost_while_idle"]) == 1
    assert spares["given_up"] == [{"t": T0 + 3, "slot": 2, "deaths": 3}]
    text = report.write_markdown(tmp_path, {**doc, "run": {**doc["run"], "spares": spares}}
                                 ).read_text()
    assert "1 died while idle (replaced); slot 2 given up after 3 deaths" in text, text


def test_a_second_kill_of_an_in_process_survivor_is_charged_to_the_generation_it_hit() -> None:
    """In process, a survivor keeps its pid into the next generation: the kill of rank 1 (pid
    101) in generation 1 was charged to generation 0, its first start with that pid, which had
    ended for another reason (the report said "injected at step 12 ... attempt 0 did not end
    after it" for a kill at step 22, and the verdict failed)."""
    job = _Job()
    for attempt, pids in ((0, (100, 101)), (1, (102, 101)), (2, (102, 103))):
        t = T0 + 10 * attempt
        for rank, pid in enumerate(pids):
            job.emit(t, rank, attempt, "start", pid=pid, world_size=2, dp=2, tp=1, pp=1)
            if attempt:
                job.emit(t + 0.2, rank, attempt, "restore_end", step=4 * attempt, seconds=0.1)
        for step in range(4 * attempt + 1, 4 * attempt + 6):
            for rank in range(2):
                job.emit(t + 0.3 + 0.5 * (step - 4 * attempt), rank, attempt, "step_end",
                         step=step, loss=1.0, seconds=0.4)
    kills = [Injection("kill_rank", T0 + 2.9, step=5, rank=0, fault_index=0, detail={"pid": 100}),
             Injection("kill_rank", T0 + 12.9, step=9, rank=1, fault_index=1,
                       detail={"pid": 101})]
    record = RunRecord(0, T0, T0 + 30, job.events, kills, {0: T0 + 3.0, 1: T0 + 13.0})
    first, second = (measure.fault_timings(record, k) for k in kills)
    assert (first.injected_step, first.ended_attempt) == (5, 0)
    assert (second.injected_step, second.ended_attempt) == (9, 1), second
    assert second.effect_observed and second.restored_step == 8


def test_a_fallback_decided_by_a_supervisor_is_reported_with_its_reason() -> None:
    """Every rank died (a cut link): no survivor exits with the restart code and a reason, so
    the supervisor that found nobody to re-form says why; the report names it."""
    job = _Job()
    for attempt, pids in ((0, (100, 101)), (1, (102, 103))):
        t = T0 + 10 * attempt
        for rank, pid in enumerate(pids):
            job.emit(t, rank, attempt, "start", pid=pid, world_size=2, dp=2, tp=1, pp=1,
                     recovery="in_process", cause="start" if attempt == 0 else "restart")
            job.emit(t + 0.3 + 0.5 * attempt, rank, attempt, "step_end", step=5 * attempt + 1,
                     loss=1.0, seconds=0.4)
    job.emit(T0 + 4.0, 1, 0, "rank_died", by="supervisor", pid=101, how="signal 9", hung=True)
    job.emit(T0 + 4.1, 1, 0, "fallback", by="supervisor",
             error="every rank of generation 0 died: no survivor to re-form it")
    kill = Injection("kill_rank", T0 + 2.0, step=1, rank=1, fault_index=0, detail={"pid": 101})
    record = RunRecord(0, T0, T0 + 20, job.events, [kill], {0: T0 + 4.2})
    t = measure.fault_timings(record, kill)
    assert t.recovery_mode == "restart" and t.fallback is not None
    assert "no survivor to re-form it" in t.fallback, t


def test_a_spare_takes_over_once_however_often_it_re_forms_after() -> None:
    """A spare that took a rank survives later failures and starts again (cause in_process) in
    each later generation: counted once per start it was 19 take-overs for 11 recoveries."""
    def event(t: float, kind: str, attempt: int, rank: int, **fields: Any) -> dict[str, Any]:
        return {"t": T0 + t, "event": kind, "attempt": attempt, "rank": rank, **fields}

    events = [event(0.0, "spare_ready", -1, -1, worker="2.0"),
              event(0.0, "spare_ready", -1, -1, worker="3.0"),
              event(1.0, "start", 1, 1, worker="2.0", cause="in_process"),
              event(1.0, "start", 1, 0, worker="0.0", cause="in_process"),
              event(2.0, "start", 2, 1, worker="2.0", cause="in_process"),
              event(2.0, "start", 2, 0, worker="3.0", cause="in_process")]
    spares = figures.spares(RunRecord(0, T0, T0 + 3, events, [], {}))
    assert spares["took_over"] == [{"attempt": 1, "rank": 1, "worker": "2.0"},
                                   {"attempt": 2, "rank": 0, "worker": "3.0"}]


def test_the_steps_slowed_by_a_persist_are_charged_to_its_checkpoint(tmp_path: Path) -> None:
    """A save's stall is only what the loop waits for; its persist's threads then take cores
    and the GIL from the steps that run beside it. Two ranks, 0.05 s steps, a save at step 20
    committed 0.3 s after staging: steps 21 and 22 take 0.2 and 0.1 s on the slower rank, so
    the checkpoint's slowdown is 0.15 + 0.05 s; the save at step 40 slows nothing."""
    events: list[dict[str, Any]] = []
    t = T0
    slow = {21: 0.2, 22: 0.1}
    for step in range(1, 51):
        seconds = slow.get(step, 0.05)
        t += seconds
        for r in (0, 1):
            events.append({"t": t, "rank": r, "attempt": 0, "event": "step_end", "step": step,
                           "loss": 1.0, "seconds": seconds if r == 1 else 0.05})
        if step in (20, 40):
            for r in (0, 1):
                events.append({"t": t + 0.001, "rank": r, "attempt": 0, "event": "ckpt_staged",
                               "step": step, "stall_s": 0.002})
                events.append({"t": t + (0.3 if step == 20 else 0.04), "rank": r, "attempt": 0,
                               "event": "ckpt_committed", "step": step, "bytes": 1000,
                               "persist_s": 0.3})
    events.sort(key=lambda e: e["t"])
    record = RunRecord(0, T0, t + 0.1, events, [])
    rows = {c["step"]: c for c in figures.checkpoints(record)}
    assert rows[20]["slowdown_s"] == pytest.approx(0.2)
    assert rows[40]["slowdown_s"] == pytest.approx(0.0)
    cost = figures.checkpoint_cost(record, list(rows.values()))
    assert cost is not None and cost["stall_s"] == pytest.approx(0.004)
    assert cost["share_of_step_time"] == pytest.approx((0.004 + 0.2) / (48 * 0.05 + 0.3))
    doc = build_doc(record)
    doc["run"]["checkpoint_cost"] = cost
    md = report.write_markdown(tmp_path, doc).read_text()
    assert "0.20 s of slower steps while they persisted (7.6% of the steps' time)" in md
    assert "| 0 | 20 | 0.002 | 0.30 | 0.20 |" in md


def test_a_save_whose_processes_died_before_its_commit_event_is_committed_if_restored(
        tmp_path: Path) -> None:
    """Step 5's save commits while its ranks are being killed, so no ``ckpt_committed`` event
    is ever written; the next attempt restores step 5, which proves the COMMIT landed. The
    report says so instead of listing step 5 as uncommitted. Step 10's save, skipped as busy,
    and step 15's, cut short and never restored, stay uncommitted."""
    events: list[dict[str, Any]] = []
    for step in (5, 10, 15):
        events.append({"t": T0 + step * 0.1, "rank": 0, "attempt": 0, "event": "ckpt_staged",
                       "step": step, "stall_s": 0.001})
    events.append({"t": T0 + 1.01, "rank": 0, "attempt": 0, "event": "ckpt_failed", "step": 10,
                   "error": "step 10 skipped: the save of step 5 is still persisting"})
    events.append({"t": T0 + 3.0, "rank": 0, "attempt": 1, "event": "restore_end", "step": 5,
                   "seconds": 0.2})
    record = RunRecord(0, T0, T0 + 4.0, events, [])
    rows = {c["step"]: c for c in figures.checkpoints(record)}
    assert rows[5]["committed"] is True and rows[5]["restored_by"] == 1
    assert rows[5]["persist_s"] is None
    assert rows[10]["committed"] is False and "restored_by" not in rows[10]
    assert rows[15]["committed"] is False and "restored_by" not in rows[15]
    doc = build_doc(record)
    md = report.write_markdown(tmp_path, doc).read_text()
    assert "| 0 | 5 | 0.001 | - | - | - | True (restored by attempt 1) |" in md
    assert "| 0 | 15 | 0.001 | - | - | - | False |" in md


def test_the_runs_final_blocking_save_is_marked_final() -> None:
    """The save after the run's last step blocks until it commits, so its stall is its whole
    persist: the job's shutdown, not a stall of training (a nightly run compared it as one: a
    1.0 s -> 1.7 s persist right after an S3 outage read as a stall regression). It is marked
    ``final``. A blocking save mid-run (synchronous checkpoints) is not, nor is the last save
    of an attempt that died after it. Nor does it count in the checkpoints' cost to the
    training loop."""
    events: list[dict[str, Any]] = []

    def step(attempt: int, n: int) -> None:
        for r in (0, 1):
            events.append({"t": T0 + n * 0.1 + attempt, "rank": r, "attempt": attempt,
                           "event": "step_end", "step": n, "loss": 1.0, "seconds": 0.1})

    def save(attempt: int, n: int, blocked_s: float | None) -> None:
        t = T0 + n * 0.1 + attempt + 0.01
        for r in (0, 1):
            events.append({"t": t, "rank": r, "attempt": attempt, "event": "ckpt_staged",
                           "step": n, "stall_s": 0.001})
            if blocked_s is not None:
                events.append({"t": t + blocked_s, "rank": r, "attempt": attempt,
                               "event": "ckpt_blocked", "step": n, "seconds": blocked_s})
            events.append({"t": t + (blocked_s or 0.05), "rank": r, "attempt": attempt,
                           "event": "ckpt_committed", "step": n, "bytes": 10,
                           "persist_s": blocked_s or 0.05})

    for n in range(1, 11):
        step(0, n)
        if n == 5:
            save(0, 5, 0.3)  # synchronous, mid-run
    save(0, 10, 0.4)  # blocking, but attempt 0 died after it: attempt 1 trains on
    for n in range(6, 21):
        step(1, n)
    save(1, 20, 1.7)
    # one rank's last step_end written after the other rank staged the final save
    events.append({"t": T0 + 3.5, "rank": 1, "attempt": 1, "event": "step_end", "step": 20,
                   "loss": 1.0, "seconds": 0.1})
    events.sort(key=lambda e: e["t"])
    record = RunRecord(0, T0, T0 + 5, events, [])
    rows = {(c["attempt"], c["step"]): c for c in figures.checkpoints(record)}
    assert [k for k, c in rows.items() if c.get("final")] == [(1, 20)]
    assert rows[(1, 20)]["stall_s"] == pytest.approx(1.701)
    # nor is it part of what the checkpoints cost the training loop
    cost = figures.checkpoint_cost(record, list(rows.values()))
    assert cost is not None and cost["stall_s"] == pytest.approx(0.301 + 0.401)


def test_a_script_without_the_probe_has_its_final_blocking_save_marked_final() -> None:
    """A script that reports no step (``probe: false``) but checkpoints through
    CheckpointEngine: its last blocking save is still the job's shutdown. Without step events
    it was never marked ``final``, so the suite's mean stall counted its whole persist (1.7 s
    beside two 0.01 s stalls: 0.57 s instead of 0.01 s)."""
    events: list[dict[str, Any]] = []
    for r in (0, 1):
        events.append({"t": T0, "rank": r, "attempt": 0, "event": "start", "pid": 10 + r,
                       "world_size": 2})
        for n, t in ((5, 1.0), (10, 2.0), (15, 3.0)):
            events.append({"t": T0 + t, "rank": r, "attempt": 0, "event": "ckpt_staged",
                           "step": n, "stall_s": 0.01})
            if n == 15:
                events.append({"t": T0 + t + 1.7, "rank": r, "attempt": 0,
                               "event": "ckpt_blocked", "step": n, "seconds": 1.69})
            events.append({"t": T0 + t + 1.7, "rank": r, "attempt": 0, "event": "ckpt_committed",
                           "step": n, "bytes": 10, "persist_s": 1.7})
    events.sort(key=lambda e: e["t"])
    record = RunRecord(0, T0, T0 + 6, events, [])
    rows = figures.checkpoints(record)
    assert [(c["step"], c.get("final", False)) for c in rows] == [
        (5, False), (10, False), (15, True)]
    entry = summary.summarize("s", "s.yaml", {"checkpoints": rows}, None)
    assert entry["stall_mean_s"] == pytest.approx(0.01)


def test_a_synchronous_save_after_the_last_step_is_final() -> None:
    """``probe.dcp_save`` (examples/fsdp2_dcp) reports one synchronous save: its time is both
    stall and persist, and no ``ckpt_blocked`` follows. The save after the last step is the
    job's shutdown all the same, but it was not marked ``final``: the checkpoints' cost to the
    training loop and the suite's mean stall counted it (2.0 s beside a 0.5 s save mid-run)."""
    events: list[dict[str, Any]] = []
    for r in (0, 1):
        for n in range(1, 11):
            events.append({"t": T0 + n, "rank": r, "attempt": 0, "event": "step_end",
                           "step": n, "loss": 1.0, "seconds": 0.5})
        for n, seconds in ((5, 0.5), (10, 2.0)):
            for kind in ("ckpt_staged", "ckpt_committed"):
                events.append({"t": T0 + n + seconds, "rank": r, "attempt": 0, "event": kind,
                               "step": n, "stall_s": seconds, "persist_s": seconds,
                               "bytes": 10})
    events.sort(key=lambda e: e["t"])
    record = RunRecord(0, T0, T0 + 13, events, [])
    rows = figures.checkpoints(record)
    assert [(c["step"], c.get("final", False)) for c in rows] == [(5, False), (10, True)]
    cost = figures.checkpoint_cost(record, rows)
    assert cost is not None and cost["stall_s"] == pytest.approx(0.5)
    entry = summary.summarize("s", "s.yaml", {"checkpoints": rows}, None)
    assert entry["stall_mean_s"] == pytest.approx(0.5)


def test_a_run_in_a_reused_out_leaves_no_earlier_report_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``chaos run --out`` again: the run replaced run/ and ckpt/ and then ended without a
    verdict (the reference failed, Ctrl-C); the earlier run's report stayed beside them and
    read as this run's."""
    from antifragile.chaos.run import pipeline
    from antifragile.chaos.scenario import parse_scenario

    for name in ("report.json", "report.md", "report.html", "loss.png", "timeline.png"):
        (tmp_path / name).write_text("the earlier run's")
    (tmp_path / "notes.txt").write_text("the user's")

    def no_verdict(*_: object, **__: object) -> None:
        raise pipeline.ChaosRunError("the fault-free reference run failed")

    monkeypatch.setattr(pipeline, "_run", no_verdict)
    with pytest.raises(pipeline.ChaosRunError):
        pipeline.run(parse_scenario({"name": "x"}), tmp_path, progress=lambda _: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_the_final_save_is_marked_in_the_markdown_and_html_tables(tmp_path: Path) -> None:
    """report.json marks the save after the last step ``final`` (its stall is the job's
    shutdown, left out of the checkpoints' cost to the loop); report.md and report.html showed
    its stall like any other, so their rows did not add up to the cost line above them."""
    checkpoints = [{"step": 5, "attempt": 0, "stall_s": 0.03, "persist_s": 0.09,
                    "bytes": 2**20, "committed": True},
                   {"step": 10, "attempt": 0, "stall_s": 0.4, "persist_s": 0.39,
                    "bytes": 2**20, "committed": True, "final": True}]
    d = {**build_doc(synthetic_record()), "checkpoints": checkpoints}
    report.write_markdown(tmp_path, d)
    report.write_html(tmp_path, d, [])
    md = (tmp_path / "report.md").read_text()
    rows = md.split("## Checkpoints\n\n", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    steps = [[c.strip() for c in row.split("|")[1:-1]][1] for row in rows]
    assert steps == ["5", "10 (final)"], rows
    page = (tmp_path / "report.html").read_text()
    table = page.split("<h2>Checkpoints</h2>", 1)[1].split("</table>", 1)[0]
    cells = [re.findall(r"<td>(.*?)</td>", row)[1] for row in table.split("<tr>")[2:]]
    assert cells == ["5", "10 (final)"], cells


#: a locale whose encoding is ASCII (Python's UTF-8 mode and C-locale coercion turned off), as
#: a machine set to a Latin-1 or plain C locale has it
ASCII_LOCALE = {"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}


def test_the_markdown_is_utf_8_whatever_the_locale(doc: dict[str, Any], tmp_path: Path) -> None:
    """A scenario file is read as UTF-8 whatever the locale, but report.md was written in the
    locale's encoding: under an ASCII or Latin-1 locale a description with an em dash raised
    UnicodeEncodeError after the whole run (a traceback, and no report at all)."""
    scenario = {**doc["scenario"], "description": "Ein Rang fällt aus — der Job läuft weiter."}
    (tmp_path / "doc.json").write_text(json.dumps({**doc, "scenario": scenario}),
                                       encoding="utf-8")
    code = ("import json, sys; from pathlib import Path; "
            "from antifragile.chaos.report import document as report; "
            "out = Path(sys.argv[1]); "
            "report.write_markdown(out, json.loads((out / 'doc.json').read_text('utf-8')))")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                          text=True, env={**os.environ, **ASCII_LOCALE}, timeout=60)
    assert done.returncode == 0, done.stderr
    md = (tmp_path / "report.md").read_bytes().decode("utf-8")
    assert "Ein Rang fällt aus — der Job läuft weiter." in md


def test_time_held_at_pause_points_is_shown_beside_the_wall_time(
        doc: dict[str, Any], tmp_path: Path) -> None:
    """Goodput divides by the wall time less the time chaos held the job at pause points, but
    the report showed the wall time alone beside it: a reader dividing by hand got another
    goodput."""
    from antifragile.chaos.report.document import write_html, write_markdown

    held = {**doc, "run": {**doc["run"], "wall_s": 20.0, "paused_s": 2.5}}
    md = write_markdown(tmp_path, held).read_text(encoding="utf-8")
    assert "wall time 20.00 s (2.50 s of it held at pause points, not in goodput)" in md, md
    page = write_html(tmp_path, held, []).read_text(encoding="utf-8")
    assert "<td>held at pause points s (not in goodput)</td><td>2.500</td>" in page


def test_report_md_says_why_a_checkpoint_did_not_commit(doc: dict[str, Any],
                                                        tmp_path: Path) -> None:
    """report.md listed a save skipped as busy or failed as "False" and no more (report.html
    had the error): a reader of a lost-steps bound missed by a skipped save could not tell
    from it why the step before was not restored."""
    from antifragile.chaos.report.document import write_markdown

    md = write_markdown(tmp_path, doc).read_text(encoding="utf-8")
    table = md.split("## Checkpoints", 1)[1].split("##", 1)[0]
    assert "| 1 | 8 | - | - | - | - | False | step 8 skipped: the save of step 6 is still " \
           "persisting |" in table, table
    assert "commit of step 10 timed out: missing ranks [3]" in table, table


def _hang_waited_out() -> RunRecord:
    """2 ranks, 4 steps of 0.5 s; rank 1 SIGSTOPped for 10 s right after step 2, its
    checkpoint persisting; the script has no process-group timeout, so rank 0's step 3 waits
    the hang out and ends 10 s late: no restart."""
    events: list[dict[str, Any]] = [
        {"t": T0 + 0.5, "rank": 0, "attempt": 0, "event": "start", "pid": 1}]
    for step in range(1, 5):
        seconds = 10.5 if step == 3 else 0.5
        t = T0 + 1.0 + 0.5 * step + (10.0 if step >= 3 else 0.0)
        for rank in (0, 1):
            events.append({"t": t, "rank": rank, "attempt": 0, "event": "step_end",
                           "step": step, "loss": 1.0, "seconds": seconds if rank == 0 else 0.5})
    for rank in (0, 1):
        events.append({"t": T0 + 2.01, "rank": rank, "attempt": 0, "event": "ckpt_staged",
                       "step": 2, "stall_s": 0.01})
        events.append({"t": T0 + 2.3, "rank": rank, "attempt": 0, "event": "ckpt_committed",
                       "step": 2, "bytes": 1000, "rank_bytes": 500, "persist_s": 0.29})
    events.sort(key=lambda e: e["t"])
    hang = Injection("hang_rank", T0 + 2.0, step=2, rank=1, fault_index=0,
                     detail={"pid": 2, "duration_s": 10.0, "mode": "process",
                             "done_t": T0 + 2.0})
    return RunRecord(0, T0, T0 + 14.0, events, [hang], {0: T0 + 13.5})


def test_goodput_does_not_count_a_hang_the_job_waited_out_as_step_time() -> None:
    """A script that waits out a SIGSTOPped peer (no process-group timeout) ends the step it
    was in 30 s late on the other rank: goodput counted those 30 s as time of a step that
    counts, so a run that stood still for most of its wall time had 16x the fault-free
    goodput. The time a hang held the job is lost, as a restart's is."""
    assert figures.goodput(_hang_waited_out()) == pytest.approx(4 * 0.5 / 14.0)


def test_a_hang_during_a_persist_is_not_the_checkpoints_cost() -> None:
    """The step a hang held overlapped the checkpoint persisting beside it, so its 10 s of
    standing still were counted as the checkpoint's "slower steps" (and the cost's share of
    the steps' time counted the 10 s too)."""
    record = _hang_waited_out()
    rows = figures.checkpoints(record)
    assert [r["slowdown_s"] for r in rows] == [pytest.approx(0.0)]
    cost = figures.checkpoint_cost(record, rows)
    assert cost is not None
    assert cost["share_of_step_time"] == pytest.approx(0.01 / 2.0)


def test_two_hangs_at_once_take_their_time_out_of_goodput_once() -> None:
    """Two hangs held the job over the same seconds (ranks 0 and 1 SIGSTOPped together, as
    two faults of one scenario may): each step's time was less each hang's overlap with it,
    so the 10 s both held were taken out twice, the step counted -9.5 s and goodput went
    negative."""
    record = _hang_waited_out()
    for e in record.events:  # each rank's clock ran on while it was stopped: both 10.5 s
        if e["event"] == "step_end" and e["step"] == 3:
            e["seconds"] = 10.5
    first = record.injections[0]
    record.injections.append(Injection("hang_rank", first.t, step=2, rank=0, fault_index=1,
                                       detail={**first.detail, "pid": 1}))
    assert figures.goodput(record) == pytest.approx(4 * 0.5 / 14.0)


def test_a_step_of_unknown_time_counts_in_goodput_at_its_attempts_pace() -> None:
    """A script's first step of a process, reported before anything else, has no time
    (``probe.step_end`` reports None): goodput counts it at the median of the attempt's known
    steps, as the step ran, rather than as 0 s (a step lost per attempt) or a crash on None;
    the checkpoints' slower steps leave it out."""
    record = _hang_waited_out()
    record.injections.clear()
    for e in record.events:
        if e["event"] == "step_end" and e["step"] == 1:
            e["seconds"] = None
    assert figures.goodput(record) == pytest.approx((3 * 0.5 + 10.5) / 14.0)
    rows = figures.checkpoints(record)
    assert figures.checkpoint_cost(record, rows) is not None


def test_a_final_step_not_known_is_not_written_as_none(doc: dict[str, Any],
                                                       tmp_path: Path) -> None:
    """A command trainer run with --no-reference has no expected step, and one that committed
    nothing has no final step: report.md said "final step None" and report.html "None of
    None", where every other figure not measured is "-"."""
    scenario = {**doc["scenario"], "trainer": {"command": ["python", "train.py"],
                                               "nproc_per_node": 4}}
    run = {**doc["run"], "final_step": None, "expected_step": None}
    changed = {**doc, "scenario": scenario, "run": run}
    report.write_markdown(tmp_path, changed)
    report.write_html(tmp_path, changed, [])
    md = (tmp_path / "report.md").read_text()
    assert "final step -\n" in md and "None" not in md.split("## Faults")[0], md
    page = (tmp_path / "report.html").read_text()
    assert "<td>final step</td><td>-</td>" in page, page
    known = {**changed, "run": {**run, "final_step": 40, "expected_step": 50}}
    report.write_html(tmp_path, known, [])
    assert "<td>final step</td><td>40 of 50</td>" in (tmp_path / "report.html").read_text()


def test_every_field_the_report_and_the_suite_write_is_in_reports_readme(
        doc: dict[str, Any]) -> None:
    """reports/README.md is where a user looks a field of report.json, summary.json or
    crashcheck.json up: a field written but not listed there (``baseline.file`` and
    ``.tolerances`` of summary.json; a crashcheck mutation's ``index`` and ``status``) was
    one the user had to guess. The faults, checkpoints, timeline, verdict and losses here are
    built by the same functions as a real run's (the whole report.json of a real run is
    checked by ``test_chaos_run_writes_the_whole_report``)."""
    import dataclasses

    from antifragile.chaos.crashcheck.record import Mutation

    assert undocumented(doc) == []
    entries = [summary.summarize("synthetic", "synthetic.yaml", doc, "synthetic/report.json")]
    baseline = summary.compare(entries, {"format": summary.FORMAT, "scenarios": entries},
                               file="prev/summary.json")
    built = summary.build(entries, suite="scenarios", wall_s=1.0, baseline=baseline)
    assert undocumented(built) == []
    # several baselines, one the scenario regressed against: the band's fields too
    slower = [{**entries[0], "recovery_max_s": (entries[0]["recovery_max_s"] or 1.0) * 10 + 10}]
    several = summary.compare_many(slower, [(f"prev{i}/summary.json", {
        "format": summary.FORMAT, "scenarios": entries}) for i in (1, 2)])
    assert several["regressions"], several
    built = summary.build(slower, suite="scenarios", wall_s=1.0, baseline=several)
    assert undocumented(built) == []
    mutation = {f.name: None for f in dataclasses.fields(Mutation)}
    assert undocumented({"mutations": [mutation]}) == []


@pytest.mark.parametrize("determinism, said", [
    (None, None),
    ({"deterministic": True, "error": None, "differing_entries": []},
     "two fault-free runs bitwise equal (--check-determinism): yes"),
    ({"deterministic": False, "error": None, "differing_entries": ["model/w", "optim/m"]},
     "two fault-free runs bitwise equal (--check-determinism): NO (2 entries differ)")])
def test_the_determinism_check_is_shown_where_it_ran(
        doc: dict[str, Any], tmp_path: Path, determinism: dict[str, Any] | None,
        said: str | None) -> None:
    """A run with --check-determinism said so only in report.json: the pages a user reads
    did not say that the trainer had been found deterministic, or not."""
    changed = {**doc, "determinism": determinism}
    md = report.write_markdown(tmp_path, changed).read_text()
    page = report.write_html(tmp_path, changed, []).read_text()
    if said is None:
        assert "check-determinism" not in md and "check-determinism" not in page
    else:
        assert f"- {said}\n" in md, md
        head, _, answer = said.rpartition(": ")
        assert f"<td>{head}</td><td>{answer}</td>" in page, page
