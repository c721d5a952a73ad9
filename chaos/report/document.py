"""Reports: ``report.json`` (machine-readable), ``report.md`` and ``report.html`` (for people).

``report.html`` is one self-contained file: inline CSS, the PNG plots as data URIs, no script and
no external resource (a Content-Security-Policy says so to the browser), so it can be mailed,
attached to a CI run or opened offline. Its helpers (``html_page``, ``html_table``, ``img_tag``)
are public for other pages (the suite summary) to reuse.
"""

from __future__ import annotations

import base64
import contextlib
import html
import json
import os
import platform
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from antifragile.chaos.report import strict_json

if TYPE_CHECKING:
    from collections.abc import Callable

    from antifragile.chaos.observe.record import RunRecord
    from antifragile.chaos.report.plots import Plot


def environment() -> dict[str, Any]:
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform(), "cpus": os.cpu_count(),
            "cuda": torch.cuda.is_available()}


def _rel(t: float | None, t0: float) -> float | None:
    return None if t is None else round(t - t0, 3)


def timeline(record: RunRecord) -> dict[str, Any]:
    """The per-rank, per-attempt spans the timeline plot needs, in seconds since the run started.

    One ``workers`` entry per (attempt, rank) process, from its own events only: start,
    restore begin/end, first/last finished step, each checkpoint (staged, committed or failed),
    hang detection (by the rank's supervisor) and exit. A rank killed from outside writes no
    ``exit``; its supervisor's ``rank_died`` (``exit_code`` "signal 9") closes its span.
    """
    t0 = record.started_t
    workers: dict[tuple[int, int], dict[str, Any]] = {}
    for e in record.events:
        if e["rank"] < 0:  # an idle spare: not a rank yet
            continue
        w = workers.setdefault((e["attempt"], e["rank"]), {
            "attempt": e["attempt"], "rank": e["rank"], "pid": None, "start_s": None,
            "restore_begin_s": None, "restore_end_s": None, "restored_step": None,
            "first_step": None, "first_step_s": None, "last_step": None, "last_step_s": None,
            "steps": 0, "checkpoints": [], "hang_detected_s": None, "exit_s": None,
            "exit_code": None})
        t, kind = _rel(e["t"], t0), e["event"]
        # a command's rank seen in /proc (worker_started) until it reports its own start
        if kind == "start" or (kind == "worker_started" and w["start_s"] is None):
            w["start_s"], w["pid"] = t, e.get("pid")
        elif kind == "restore_begin":
            w["restore_begin_s"] = t
        elif kind == "restore_end":
            w["restore_end_s"], w["restored_step"] = t, e.get("step")
        elif kind == "step_end":
            if w["first_step"] is None:
                w["first_step"], w["first_step_s"] = e["step"], t
            w["last_step"], w["last_step_s"] = e["step"], t
            w["steps"] += 1
        elif kind in ("ckpt_staged", "ckpt_committed", "ckpt_failed"):
            c = next((c for c in w["checkpoints"] if c["step"] == e["step"]), None)
            if c is None:
                c = {"step": e["step"], "staged_s": None, "stall_s": None, "committed_s": None,
                     "persist_s": None, "failed_s": None}
                w["checkpoints"].append(c)
            if kind == "ckpt_staged":
                c["staged_s"], c["stall_s"] = t, round(e["stall_s"], 4)
            elif kind == "ckpt_committed":
                c["committed_s"], c["persist_s"] = t, round(e["persist_s"], 4)
            else:
                c["failed_s"], c["error"] = t, e.get("error")
        elif kind == "hang_detected":
            w["hang_detected_s"] = t
        elif kind == "exit":
            w["exit_s"], w["exit_code"] = t, e.get("code")
        elif kind == "rank_died" and w["exit_s"] is None:  # killed: its supervisor says how
            w["exit_s"], w["exit_code"] = t, e.get("how")
    attempt_of = sorted((w["start_s"], w["attempt"]) for w in workers.values()
                        if w["start_s"] is not None)
    injections = []
    for i in record.injections:
        t = _rel(i.t, t0)
        attempt = max((a for s, a in attempt_of if s <= (t or 0.0)), default=0)
        injections.append({"kind": i.kind, "t_s": t, "step": i.step, "rank": i.rank,
                           "attempt": attempt, "skipped": i.skipped, "missed": i.missed,
                           "duration_s": i.detail.get("duration_s"),
                           "ended_s": _rel(i.detail.get("ended_t"), t0),
                           "between": i.detail.get("between"),
                           "ranks": i.detail.get("ranks"),  # host_down: all it took
                           "mode": i.detail.get("mode")})
    return {"started_t": t0, "wall_s": round(record.wall_s, 3),
            "attempts": [{"attempt": a, "ended_s": _rel(t, t0)}
                         for a, t in sorted(record.attempt_ends.items())],
            "workers": sorted(workers.values(), key=lambda w: (w["attempt"], w["rank"])),
            "injections": injections}


def reference_losses(reference_run: Path) -> list[dict[str, Any]]:
    """The fault-free run's loss per step (one entry per step), from its event files; empty when
    they are gone (an older reference cache)."""
    from antifragile.trainer.events import read_events

    try:
        events = read_events(reference_run)
    except (OSError, ValueError):
        return []
    losses: dict[int, float] = {}
    for e in events:
        if e["event"] == "step_end" and e.get("loss") is not None:
            losses.setdefault(e["step"], e["loss"])
    return [{"step": step, "loss": loss} for step, loss in sorted(losses.items())]


#: ``checkpoint.storage_options`` that are credentials: a report is uploaded by CI, mailed,
#: attached to an issue, so it shows them as ``***``
SECRET_OPTIONS = ("secret", "token")
#: words of an environment variable's name (split at ``_``) that make its value a credential:
#: ``HF_TOKEN``, ``WANDB_API_KEY``, ``AWS_SECRET_ACCESS_KEY`` (not ``TOKENIZERS_PARALLELISM``)
SECRET_WORDS = frozenset({"SECRET", "TOKEN", "PASSWORD", "PASSWD", "CREDENTIAL", "CREDENTIALS",
                          "KEY", "APIKEY"})


def _hidden(values: dict[str, Any], secret: Callable[[str], bool]) -> dict[str, Any]:
    return {k: "***" if secret(k) else x for k, x in values.items()}


def _without_secrets(report: dict[str, Any]) -> dict[str, Any]:
    """``report`` with its scenario's credentials (storage options, a command trainer's
    environment) replaced by ``***``."""
    s = report.get("scenario") or {}
    checkpoint, trainer = s.get("checkpoint") or {}, s.get("trainer") or {}
    options = checkpoint.get("storage_options") or {}
    env = trainer.get("env") or {}
    hidden_options = _hidden(options, lambda k: k in SECRET_OPTIONS)
    hidden_env = _hidden(env, lambda k: not SECRET_WORDS.isdisjoint(k.upper().split("_")))
    if hidden_options == options and hidden_env == env:
        return report
    s = {**s, "checkpoint": {**checkpoint, "storage_options": hidden_options}} if options else s
    s = {**s, "trainer": {**trainer, "env": hidden_env}} if env else s
    return {**report, "scenario": s}


class ReportError(Exception):
    """A report file that could not be written (a full disk, a folder made read-only); the
    message names it and says why."""


#: the report's files besides its plots (``write_report`` writes them all, or none)
REPORT_FILES = ("report.json", "report.md", "report.html")


def remove_report(out: Path) -> None:
    """An earlier run's report in ``out``: gone before a run there replaces its run/ and ckpt/
    (a run that then ends without a verdict must not leave it to read as its own)."""
    from antifragile.chaos.report.plots import NAMES

    for name in (*REPORT_FILES, *NAMES):
        (out / name).unlink(missing_ok=True)


def write_report(out: Path, doc: dict[str, Any]) -> list[Plot]:
    """Every file of ``doc``'s report into ``out``: json, the plots that drew, markdown, html.
    Each is written into ``out/.report.tmp/`` first and renamed into ``out`` once all are
    written, so a failure to write (ReportError: a full disk) leaves no file cut short and no
    report at all: not even an earlier run's in a reused ``out`` (its run/ and ckpt/ are this
    run's now: its report would pass for this one's). A plot that did not draw leaves no
    earlier PNG of its name either."""
    from antifragile.chaos.report.plots import render_all

    rendered = render_all(doc)  # never raises: a failed plot carries its error
    staging = out / ".report.tmp"
    names = [*REPORT_FILES, *(p.name for p in rendered)]
    current = "report.json"
    try:
        shutil.rmtree(staging, ignore_errors=True)  # a crashed earlier write's
        staging.mkdir()
        write_json(staging, doc)
        for plot in rendered:
            if plot.png is not None:
                current = plot.name
                (staging / plot.name).write_bytes(plot.png)
        current = "report.md"
        write_markdown(staging, doc, rendered)
        current = "report.html"
        write_html(staging, doc, rendered)
        for name in names:
            current = name
            if (staging / name).exists():
                os.replace(staging / name, out / name)
            else:
                (out / name).unlink(missing_ok=True)
    except OSError as exc:
        for name in names:
            with contextlib.suppress(OSError):
                (out / name).unlink(missing_ok=True)
        raise ReportError(f"{out / current}: cannot be written: {exc.strerror or exc}"
                          ) from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return rendered


def write_json(out: Path, report: dict[str, Any]) -> Path:
    path = out / "report.json"
    path.write_text(strict_json(_without_secrets(report), indent=2))
    return path


def committed_cell(c: dict[str, Any]) -> str:
    """A checkpoint's committed column: True, False, or True as proven by a later restore."""
    if c.get("restored_by") is not None:
        return f"True (restored by attempt {c['restored_by']})"
    return str(c["committed"])


def _step_cell(c: dict[str, Any]) -> str:
    """A checkpoint's step, marked when it is the save after the run's last step (its stall
    is the job's shutdown: not in the checkpoints' cost to the loop)."""
    return f"{c['step']} (final)" if c.get("final") else str(c["step"])


def figure(x: float) -> str:
    """Two decimals, or two significant digits below 0.1 (a stall of milliseconds is not 0):
    a figure as the reports and the suite's reasons show it."""
    return f"{x:.2f}" if x == 0 or abs(x) >= 0.1 else f"{x:.2g}"


def _fmt(x: Any, unit: str = "") -> str:
    if x is None:
        return "-"
    return f"{figure(x)}{unit}" if isinstance(x, float) else f"{x}{unit}"


def _share(x: float) -> str:
    """A percentage to one decimal, or two significant digits below 0.1% (not 0.0%)."""
    return f"{x:.1%}" if x == 0 or abs(x) >= 0.001 else f"{x * 100:.2g}%"


def _goodput(x: float | None) -> str | None:
    """A goodput, a reference's, or their ratio, as report.md and report.html both show it:
    a share (``_share``); None where there is none."""
    return None if x is None else _share(x)


def _effect_cell(f: dict[str, Any]) -> str:
    """Whether the fault had the effect it exists for (see reports/README.md)."""
    if f.get("skipped"):
        return "skipped"
    return {True: "yes", False: "NO", None: "-"}[f.get("effect_observed")]


def _recovery_cell(f: dict[str, Any]) -> str:
    """The recovery time, or "none" for a made fault that caused no restart: a later restart
    is not its recovery."""
    if f.get("recovery_s") is not None:
        return _fmt(f["recovery_s"])
    if f.get("interrupted_by_t") is not None:
        return "interrupted by the next fault"
    if not f.get("skipped") and not f.get("missed") and f.get("ended_attempt") is None:
        return "none (caused no restart)"
    return "-"


def _no_faults(scenario: dict[str, Any]) -> str:
    """What the faults section says when none was injected: a scenario with faults whose
    triggers were never reached is not one without faults (the verdict fails it)."""
    n = len(scenario.get("faults") or [])
    return (f"No fault was injected; the scenario has {n} (see the verdict)." if n
            else "No faults in this scenario.")


def _md(text: str) -> str:
    """Free text (a description, an error message, a log line) as Markdown text: ``<`` and
    ``&`` escaped, so a viewer shows them as report.html does instead of rendering a tag."""
    return html.escape(text, quote=False)


def _md_item(text: str) -> str:
    """Free text as one item of a Markdown list: its line breaks (a log's last lines in an
    error) joined, so no line of it starts a heading, a list or a paragraph of its own."""
    return _md(" ".join(text.split()))


_DETERMINISM = "two fault-free runs bitwise equal (--check-determinism)"


def _determinism(report: dict[str, Any]) -> str | None:
    """What ``--check-determinism`` found (None: it did not run)."""
    d = report.get("determinism")
    if not d:
        return None
    if d.get("deterministic"):
        return "yes"
    n = len(d.get("differing_entries") or [])
    return f"NO ({d.get('error') or f'{n} entries differ'})"


def write_markdown(out: Path, report: dict[str, Any], plots: list[Plot] | None = None) -> Path:
    """``plots``: link the PNGs that were drawn (and say which were not, and why)."""
    s, v, run = report["scenario"], report["verdict"], report["run"]
    lines = [f"# {s['name']}: {v['verdict'].upper()}", ""]
    if s.get("description"):
        lines += [_md(s["description"]), ""]
    vs_ref = run.get("goodput_vs_reference")
    held = (f" ({_fmt(run['paused_s'], ' s')} of it held at pause points, not in goodput)"
            if run.get("paused_s") else "")
    lines += [f"- wall time {_fmt(run['wall_s'], ' s')}{held}, goodput "
              f"{_goodput(run['goodput']) or '-'}"
              + (f" ({_goodput(vs_ref)} of the fault-free run's "
                 f"{_goodput(run['reference_goodput'])})" if vs_ref is not None else "")
              + f", attempts {run['attempts']}, final step {_fmt(run['final_step'])}",
              f"- bitwise equal to the fault-free reference: {_fmt(v['bitwise_equal'])}"]
    determinism = _determinism(report)
    if determinism is not None:
        lines.append(f"- {_DETERMINISM}: {determinism}")
    lines += [f"- {_md_item(str(reason))}" for reason in v["reasons"]]
    cost = run.get("checkpoint_cost")
    if cost:
        lines.append(f"- checkpoints cost the training loop {_fmt(cost['stall_s'], ' s')} of "
                     f"stall and {_fmt(cost['slowdown_s'], ' s')} of slower steps while they "
                     f"persisted ({_share(cost['share_of_step_time'])} of the steps' time)")
    spares = run.get("spares") or {}
    if spares.get("ready") or spares.get("lost_while_idle") or spares.get("given_up"):
        lines.append(f"- warm spares: {spares.get('ready', 0)} ready, "
                     f"{len(spares.get('took_over', []))} took over a rank, "
                     f"{len(spares.get('lost_while_idle', []))} died while idle (replaced)"
                     + (f", {len(spares['lost_with_slot'])} lost with their host or "
                        "supervisor (not replaced)" if spares.get("lost_with_slot") else "")
                     + "".join(f"; slot {g['slot']} given up after {g['deaths']} deaths "
                               "before training" for g in spares.get("given_up", [])))
    if report.get("differing_entries"):
        lines += ["", "Entries that differ from the reference: "
                  + ", ".join(f"`{k}`" for k in report["differing_entries"])]
    if report.get("not_measured"):
        lines += ["", "## Not measured", ""]
        lines += [f"- {_md_item(what)}" for what in report["not_measured"]]
    lines += ["", "## Faults", ""]
    if report["faults"]:
        lines += ["| kind | step | rank | effect seen | mode | detect s | re-form s | "
                  "restore s | recompute s | recovery s | restored step | lost steps | note |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    else:
        lines.append(_no_faults(s))
    for f in report["faults"]:
        note = f["skipped"] or f.get("effect") or ""
        if f.get("fallback"):
            note = f"fell back to a restart: {f['fallback']}; {note}"
        if f["checkpoint_step"] is not None:
            note = f"step {f['checkpoint_step']}: {note}"
        lines.append(
            f"| {f['kind']} | {_fmt(f['injected_step'])} | {_fmt(f['rank'])} | "
            f"{_effect_cell(f)} | {_fmt(f.get('recovery_mode'))} | {_fmt(f['detect_s'])} | "
            f"{_fmt(f['restart_s'])} | "
            f"{_fmt(f['restore_s'])} | {_fmt(f['recompute_s'])} | {_recovery_cell(f)} | "
            f"{_fmt(f['restored_step'])} | {_fmt(f['lost_steps'])} | "
            f"{_md(' '.join(note.replace('|', '/').split()))} |")  # a row is one line
    lines += ["", "## Checkpoints", "",
              "| attempt | step | stall s | persist s | slower steps s | MiB | committed | error |",
              "|---|---|---|---|---|---|---|---|"]
    for c in report["checkpoints"]:
        mib = c["bytes"] / 2**20 if c["bytes"] else None
        error = " ".join((c.get("error") or "").replace("|", "/").split())  # one line
        lines.append(f"| {c['attempt']} | {_step_cell(c)} | {_fmt(c['stall_s'])} | "
                     f"{_fmt(c['persist_s'])} | {_fmt(c.get('slowdown_s'))} | {_fmt(mib)} | "
                     f"{committed_cell(c)} | {_md(error)} |")
    if plots:
        lines += ["", "## Plots", "", "All of it in one page: [report.html](report.html)", ""]
        for plot in plots:
            lines += [f"![{plot.alt}]({plot.name})" if plot.png is not None else
                      f"{plot.name} could not be drawn: "
                      f"{_md((plot.error or '').splitlines()[0])}",
                      ""]
    path = out / "report.md"
    path.write_text("\n".join(lines).rstrip("\n") + "\n", encoding="utf-8")
    return path


CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1150px;
       color: #222; padding: 0 1em; }
h1 { margin-bottom: 0.2em; } h2 { margin-top: 1.6em; border-bottom: 1px solid #ddd; }
.banner { padding: 0.8em 1.2em; border-radius: 6px; margin: 1em 0; font-size: 1.1em; }
.banner.pass { background: #e6f4ea; border: 2px solid #2ca02c; }
.banner.fail { background: #fdecea; border: 2px solid #d62728; }
.banner.skipped { background: #fff8e1; border: 2px solid #e6a700; }
.banner ul { margin: 0.4em 0 0; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }
th { background: #f3f3f3; } td:first-child, th:first-child { text-align: left; }
table.kv td { text-align: left; } table.kv td:first-child { color: #555; }
tr.bad td { background: #fdecea; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: 13px; }
.error { background: #fdecea; border: 1px solid #d62728; padding: 0.5em 1em; }
pre { background: #f7f7f7; padding: 0.8em; overflow-x: auto; font-size: 12px; }
"""

# No script, no external resource: the browser is told so, and refuses anything else.
_CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"


def _cell(x: Any) -> str:
    """Three decimals, or two significant digits below 0.1 (as ``_fmt``: a write at 65 KiB/s
    is 6.3e-05 GiB/s, not 0.000)."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.3f}" if x == 0 or abs(x) >= 0.1 else f"{x:.2g}"
    return str(x)


def html_table(headers: list[str] | None, rows: list[list[Any]],
               row_classes: list[str] | None = None) -> str:
    """A table whose every header and cell is escaped; ``row_classes`` tags rows (e.g. ``bad``).
    Without ``headers``: a key / value table (first column names, second values)."""
    if headers is None:
        head, table = "", '<table class="kv">'
    else:
        cells = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
        head, table = f"<thead><tr>{cells}</tr></thead>", "<table>"
    body = []
    for i, row in enumerate(rows):
        cls = row_classes[i] if row_classes and row_classes[i] else ""
        cells = "".join(f"<td>{html.escape(_cell(x))}</td>" for x in row)
        body.append(f'<tr class="{html.escape(cls)}">{cells}</tr>' if cls else f"<tr>{cells}</tr>")
    return f"{table}{head}<tbody>{''.join(body)}</tbody></table>"


def img_tag(png: bytes, alt: str) -> str:
    """An ``<img>`` carrying its PNG inline (a data URI), so the page needs no other file."""
    data = base64.b64encode(png).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def html_page(title: str, body: str, extra_css: str = "") -> str:
    """A self-contained page: inline CSS (``CSS`` plus ``extra_css``), no script, no fetch."""
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{html.escape(title)}</title><style>{CSS}{extra_css}</style></head>"
            f"<body>\n{body}\n</body></html>\n")


def _plot_html(plot: Plot) -> str:
    if plot.png is not None:
        return (f"<figure>{img_tag(plot.png, plot.alt)}<figcaption>{html.escape(plot.alt)} "
                f"({html.escape(plot.name)})</figcaption></figure>")
    return (f'<div class="error"><strong>{html.escape(plot.name)} could not be drawn</strong> '
            f"(the rest of the report is complete):<pre>{html.escape(plot.error or '')}</pre>"
            "</div>")


# The faults table's columns after ``kind`` and the injection time: every measured field.
_FAULT_COLUMNS = ["injected_t", "injected_step", "rank", "effect_observed", "ended_attempt",
                  "recovery_mode", "detect_s", "restart_s", "restore_s", "recompute_s",
                  "recovery_s",
                  "restored_step", "lost_steps", "checkpoint_step", "skipped", "missed", "effect"]


def _more(fault: dict[str, Any]) -> str:
    """Fields a fault kind adds of its own (e.g. a storage outage's effects), compactly."""
    extra = {k: x for k, x in fault.items() if k not in _FAULT_COLUMNS and k != "kind"
             and x not in (None, [], {})}
    return json.dumps(extra, separators=(", ", ": "), default=str) if extra else ""


def _failed_fault(f: dict[str, Any]) -> bool:
    """A fault the verdict holds against the run: no effect, or a job that came back and
    never got back to the fault's step (not a recovery the next fault cut short, nor one the
    script's events cannot time)."""
    return f.get("effect_observed") is False or (
        f.get("recovery_s") is None and f.get("restored_step") is not None
        and f.get("interrupted_by_t") is None and not f.get("unmeasured"))


def write_html(out: Path, report: dict[str, Any], plots: list[Plot]) -> Path:
    """``report.html``: verdict, run summary, faults, checkpoints, plots, environment, scenario."""
    report = _without_secrets(report)
    s, v, run = report["scenario"], report["verdict"], report["run"]
    verdict = str(v["verdict"])
    equal = {True: "yes", False: "NO", None: "not checked"}[v.get("bitwise_equal")]
    reasons = "".join(f"<li>{html.escape(str(r))}</li>" for r in v["reasons"])
    parts = [f"<h1>{html.escape(s['name'])}</h1>"]
    if s.get("description"):
        parts.append(f"<p>{html.escape(s['description'])}</p>")
    parts.append(f'<div class="banner {verdict if verdict in ("pass", "skipped") else "fail"}">'
                 f"<strong>{html.escape(verdict.upper())}</strong> &mdash; final state bitwise "
                 f"equal to the fault-free reference: {html.escape(equal)}"
                 + (f"<ul>{reasons}</ul>" if reasons else "") + "</div>")
    wall, goodput = run.get("wall_s"), run.get("goodput")
    determinism = _determinism(report)
    # a command trainer's steps are its script's: known from the reference run, if any
    expected = s["trainer"].get("steps", run.get("expected_step"))
    parts += ["<h2>Run</h2>", html_table(None, [
        ["wall time s", wall], ["held at pause points s (not in goodput)",
                                run.get("paused_s")],
        ["goodput (time of steps that count / (wall - held))", _goodput(goodput)],
        ["goodput of the fault-free reference run", _goodput(run.get("reference_goodput"))],
        ["goodput / the reference's", _goodput(run.get("goodput_vs_reference"))],
        ["checkpoints' cost to the loop (stall + slower steps while persisting)",
         None if not run.get("checkpoint_cost") else
         f"{_fmt(run['checkpoint_cost']['stall_s'], ' s')} + "
         f"{_fmt(run['checkpoint_cost']['slowdown_s'], ' s')}"
         f" = {_share(run['checkpoint_cost']['share_of_step_time'])} of the steps' time"],
        ["attempts", run.get("attempts")],
        ["final step", _fmt(run.get("final_step"))
         + (f" of {expected}" if expected is not None else "")],
        ["trainer exit code", run.get("returncode")],
        ["checkpoint url", run.get("checkpoint_url")],
        ["reference url", run.get("reference_url")]]
        + ([[_DETERMINISM, determinism]] if determinism is not None else []))]
    if report.get("differing_entries"):
        parts += ["<h2>Entries that differ from the reference</h2>",
                  "<p>" + ", ".join(f"<code>{html.escape(k)}</code>"
                                    for k in report["differing_entries"]) + "</p>"]
    if report.get("not_measured"):
        parts += ["<h2>Not measured</h2>", "<ul>" + "".join(
            f"<li>{html.escape(what)}</li>" for what in report["not_measured"]) + "</ul>"]
    t0 = (report.get("timeline") or {}).get("started_t")
    faults = report.get("faults") or []
    parts.append("<h2>Faults</h2>")
    parts.append(html_table(
        ["kind", "injected at s (since start)", *_FAULT_COLUMNS[1:], "more"],
        [[f["kind"], f["injected_t"] - t0 if t0 is not None else f["injected_t"],
          *(_recovery_cell(f) if k == "recovery_s" and f.get("recovery_s") is None else f.get(k)
            for k in _FAULT_COLUMNS[1:]), _more(f)] for f in faults],
        ["bad" if _failed_fault(f) else "" for f in faults])
        if faults else f"<p>{html.escape(_no_faults(s))}</p>")
    cks = report.get("checkpoints") or []
    parts.append("<h2>Checkpoints</h2>")
    parts.append(html_table(
        ["attempt", "step", "stall s", "persist s", "slower steps s", "MiB", "GiB/s",
         "committed", "error"],
        [[c["attempt"], _step_cell(c), c["stall_s"], c["persist_s"], c.get("slowdown_s"),
          c["bytes"] / 2**20 if c.get("bytes") else None, c.get("throughput_gib_s"),
          committed_cell(c), c.get("error")] for c in cks],
        ["" if c["committed"] else "bad" for c in cks])
        if cks else "<p>No checkpoint was staged.</p>")
    parts.append("<h2>Plots</h2>")
    parts += [_plot_html(p) for p in plots]
    env = report.get("environment") or {}
    parts += ["<h2>Environment</h2>", html_table(None, [[k, x] for k, x in env.items()]),
              "<h2>Scenario</h2>",
              f"<pre>{html.escape(yaml.safe_dump(s, sort_keys=False))}</pre>"]
    path = out / "report.html"
    path.write_text(html_page(f"{s['name']}: {verdict.upper()}", "\n".join(parts)),
                    encoding="utf-8")
    return path
