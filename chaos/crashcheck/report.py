"""The crashcheck report: ``crashcheck.json``, ``crashcheck.md``, ``crashcheck.html`` and
``outcomes.png`` (the outcome of every crash state against its cut time).

Drawn only from the JSON document, so the JSON alone can redraw everything.
"""

from __future__ import annotations

import contextlib
import html
import io
import json
import os
from pathlib import Path
from typing import Any

from antifragile.chaos.crashcheck.check import BAD, OUTCOMES
from antifragile.chaos.crashcheck.pipeline import MAY_REFUSE
from antifragile.chaos.report.document import html_page, html_table, img_tag

COLORS = {"old": "#1f77b4", "new": "#2ca02c", "refused": "#ff7f0e", "torn": "#d62728",
          "lost": "#7f7f7f", "unchecked": "#bcbd22"}
METHOD = (
    "Every mutating S3 request of the save of step k+1 (PUT, COPY, DELETE, multi-object "
    "delete per key, multipart completion) was recorded by an HTTP proxy in front of the S3 "
    "server, with the time it was issued and the time its answer came back, before the "
    "client had it (the proxy holds each request back `latency_s` before forwarding it, as "
    "a real object store's latency would). A crash at time T leaves every mutation "
    "acknowledged before T applied and any subset of those in flight at T; all subsets are "
    "enumerated up to the "
    "bound, larger in-flight sets are sampled (seeded; `sampled_cuts` counts them). States "
    "are deduplicated on their final objects (key -> body digest). Each state was rebuilt "
    "under a fresh prefix (one PUT per object) and loaded by a brand-new engine instance in "
    "a checker process that never saw the save (a pool of long-lived checker processes, "
    "one state at a time each; not one process per state). Loads run with one rank: "
    "antifragile and DCP reshard a save of N ranks onto one; torchsnapshot restores rank "
    "0's entries.")


def table_rows(doc: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for c in doc["cases"]:
        for rule, r in c["rules"].items():
            counts = r["counts"]
            rows.append([c["engine"], c["ranks"], c["case"],
                         rule + ("" if r["documented"] else " (not documented)"),
                         c["states"], *[counts.get(o, 0) for o in OUTCOMES]])
    return rows


HEADERS = ["engine", "ranks", "case", "load rule", "states", *OUTCOMES]


def verdict(doc: dict[str, Any]) -> tuple[bool, list[str]]:
    """ok when the documented rule of every case has no refused, torn or lost state, and loads
    step k+1 from the state the save left when nothing crashed (else every crash state of a
    save that never landed loads step k and passes); only ``MAY_REFUSE`` cases may instead
    report the save refused, by the engine's own refusal of a committed step
    (``save_refused``): any other error of the save fails, even when step k+1 loads. A state
    left unchecked (its checker died or hung) is not ok either: nothing is known of it. Nor
    is a case asked for but missing (the report of a run that stopped before it), nor one
    whose documented rule was not checked."""
    reasons = []
    checked = {c["case"] for c in doc["cases"]}
    for name in doc.get("settings", {}).get("cases", []):
        if name not in checked:
            reasons.append(f"{doc['engine']}: case {name} was not checked (the run stopped "
                           "before it)")
    if not doc["cases"] and not reasons:
        reasons.append("no case was checked")
    for c in doc["cases"]:
        if not any(r["documented"] for r in c["rules"].values()):  # else nothing is judged
            reasons.append(f"{c['engine']} ({c['ranks']} ranks, {c['case']}): the documented "
                           f"load rule was not checked (only {', '.join(c['rules'])})")
        for rule, r in c["rules"].items():
            if not r["documented"]:
                continue
            where = f"{c['engine']} ({c['ranks']} ranks, {c['case']}, rule {rule})"
            bad = {o: r["counts"][o] for o in BAD if r["counts"][o]}
            if bad:
                reasons.append(f"{where}: " + ", ".join(f"{n} {o}" for o, n in bad.items()))
            if r["counts"].get("unchecked"):
                why = c.get("unchecked") or [{"reason": "?"}]
                reasons.append(f"{where}: {r['counts']['unchecked']} state(s) unchecked (the "
                               f"first: {why[0]['reason']})")
            refused = c.get("save_refused") is True and c["case"] in MAY_REFUSE
            if r["final"] not in ("new", "unchecked") and not refused:
                reasons.append(f"{where}: the save of step {c['expected']['new_step']}, not "
                               f"interrupted, loads {r['final']}, not new"
                               + (f" (the save failed: {c['save_error']})"
                                  if c.get("save_error") else ""))
            elif c.get("save_error") is not None and not refused:  # its step loads, yet
                # it raised: a failed save, and no state was judged against it committed
                reasons.append(f"{where}: the save of step {c['expected']['new_step']} "
                               f"failed ({c['save_error']}), though its state loads "
                               f"{r['final']}")
    return not reasons, reasons


class ReportError(Exception):
    """A report file could not be written (a full disk, an unwritable folder); the message
    names it and is meant for the user as is."""


def write_all(out: Path, doc: dict[str, Any]) -> list[Path]:
    """Every report file of ``doc`` into ``out``: each is written beside its place and renamed
    there once all are written, so a failure to write (ReportError: a full disk) leaves
    neither a file cut short nor a report in part (an earlier ``write_all``'s files stay,
    whole)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ReportError(f"{out}: cannot create the folder: {exc.strerror or exc}") from exc
    png = plot(doc)
    files: dict[str, str | bytes] = {"crashcheck.json": json.dumps(doc, indent=1) + "\n"}
    if png is not None:
        files["outcomes.png"] = png
    files["crashcheck.md"] = markdown(doc, png is not None)
    files["crashcheck.html"] = page(doc, png)
    written: list[Path] = []
    current = ""
    try:
        for name, data in files.items():
            current = name
            temp = out / f"{name}.tmp"
            written.append(temp)
            if isinstance(data, bytes):
                temp.write_bytes(data)
            else:
                temp.write_text(data, encoding="utf-8")
        for name in files:
            current = name
            os.replace(out / f"{name}.tmp", out / name)
    except OSError as exc:
        for temp in written:
            with contextlib.suppress(OSError):
                temp.unlink()
        raise ReportError(f"{out / current}: cannot be written: {exc.strerror or exc}"
                          ) from exc
    return [out / name for name in files]


def _case_line(c: dict[str, Any]) -> str:
    sampled = (f"; {c['sampled_cuts']} cut(s) with more than {c['exhaustive_bound']} "
               "mutations in flight were sampled (seeded), not enumerated"
               if c["sampled_cuts"] else "; every subset of every in-flight set enumerated")
    capped = (f"; {c['distinct_states']} distinct states found, a seeded sample of "
              f"{c['states']} checked" if c["capped_at"] else "")
    error, saved = c.get("save_error"), ""
    if error is not None:
        how = "was refused" if c.get("save_refused") is True else "failed"
        saved = f"; the save {how} ({error})"
    return (f"{c['engine']}, {c['ranks']} rank(s), {c['case']}{saved}: {len(c['mutations'])} "
            f"mutations ({c['requests']} requests in all), {c['cut_points']} cut points, "
            f"{c['crash_points']} crash points, widest in-flight set {c['max_in_flight']}"
            f"{sampled}{capped}; same-key overlaps {c['same_key_overlaps']}; "
            f"times: {c['timings']}")


def _witness_lines(w: dict[str, Any]) -> list[str]:
    lines = [f"  - cut at {w['cut_s']:.4f} s after the save began; "
             f"{w['acknowledged_before_cut']} mutations acknowledged before it",
             f"  - in flight: {'; '.join(w['in_flight']) or 'nothing'}",
             f"  - objects that differ from before the save: "
             f"{'; '.join(w.get('changed_by_the_save', [])) or 'none'}",
             f"  - loaded: {json.dumps(w['loaded'])}"]
    return lines


def _md(text: str) -> str:
    """Free text (an S3 error's XML, an exception's ``<class ...>``) as Markdown text: ``<``
    and ``&`` escaped, so a viewer shows them as crashcheck.html does instead of a tag."""
    return html.escape(text, quote=False)


def markdown(doc: dict[str, Any], has_plot: bool) -> str:
    ok, reasons = verdict(doc)
    lines = [f"# crashcheck: {doc['engine']}", "",
             f"Verdict: **{'OK' if ok else 'FAIL'}** (the documented load rule: 0 refused, "
             "0 torn, 0 lost, 0 unchecked)", ""]
    lines += [f"- {_md(r)}" for r in reasons]
    lines += ["", "| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in table_rows(doc)]
    lines += ["", "`old`: step k loaded, bitwise equal; `new`: step k+1, bitwise equal; "
              "`refused`: an error or nothing, while step k's or k+1's folder was intact; "
              "`torn`: data equal to "
              "neither, or step k after a committed step was skipped; "
              "`lost`: step k, committed before the save, no longer loads (nothing "
              "does, or only an older step); `unchecked`: the checker process died or hung on "
              "the state (the reason is in crashcheck.json).", "",
              "## Cases", ""]
    lines += [f"- {_md(_case_line(c))}" for c in doc["cases"]]
    lines += ["", "## Witnesses (one minimal state per non-ok outcome)", ""]
    any_witness = False
    for c in doc["cases"]:
        for rule, r in c["rules"].items():
            for outcome, w in r["witnesses"].items():
                any_witness = True
                lines.append(f"- **{outcome}**: {c['engine']}, {c['ranks']} rank(s), "
                             f"{c['case']}, rule {rule} (state {w['state']})")
                lines += [_md(line) for line in _witness_lines(w)]
    unchecked = sum(len(c.get("unchecked", [])) for c in doc["cases"])
    if unchecked:  # no outcome, so no witness: not "every state loaded"
        lines.append(f"{unchecked} state(s) unchecked (no outcome; the reasons are in "
                     "crashcheck.json)" + ("" if any_witness else
                                           ", every other state loaded step k or step k+1"))
    elif not any_witness:
        lines.append("None: every state checked loaded step k or step k+1, bitwise.")
    lines += ["", "## Method", "", METHOD, ""]
    if has_plot:
        lines += ["![outcome of every crash state against its cut time](outcomes.png)", ""]
    return "\n".join(lines)


def page(doc: dict[str, Any], png: bytes | None) -> str:
    ok, reasons = verdict(doc)
    rows = table_rows(doc)
    classes = ["bad" if any(row[5 + OUTCOMES.index(o)] for o in BAD) else "" for row in rows]
    body = [f"<h1>crashcheck: {html.escape(doc['engine'])}</h1>",
            f"<p>Verdict: <strong>{'OK' if ok else 'FAIL'}</strong></p>",
            "<ul>" + "".join(f"<li>{html.escape(r)}</li>" for r in reasons) + "</ul>",
            html_table(HEADERS, rows, classes), "<h2>Cases</h2><ul>"]
    body += [f"<li>{html.escape(_case_line(c))}</li>" for c in doc["cases"]]
    body.append("</ul><h2>Witnesses</h2><ul>")
    for c in doc["cases"]:
        for rule, r in c["rules"].items():
            for outcome, w in r["witnesses"].items():
                text = "\n".join(_witness_lines(w))
                body.append(f"<li><strong>{html.escape(outcome)}</strong>: "
                            f"{html.escape(c['engine'])}, {c['ranks']} rank(s), "
                            f"{html.escape(c['case'])}, rule {html.escape(rule)}"
                            f"<pre>{html.escape(text)}</pre></li>")
    body.append(f"</ul><h2>Method</h2><p>{html.escape(METHOD)}</p>")
    if png is not None:
        body.append(img_tag(png, "outcome of every crash state against its cut time"))
    return html_page(f"crashcheck {doc['engine']}", "\n".join(body))


def plot(doc: dict[str, Any]) -> bytes | None:
    """One panel per (case, rule): each state's outcome against its cut time."""
    panels = [(c, rule) for c in doc["cases"] for rule in c["rules"]]
    if not panels:
        return None
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(11, 1.9 * len(panels) + 0.6), dpi=100, layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, (c, rule) in zip(axes, panels, strict=True):
        for y, outcome in enumerate(OUTCOMES):
            xs = [p["cut_s"] for p in c["cuts"] if p.get(rule) == outcome]
            if xs:
                ax.scatter(xs, [y] * len(xs), s=9, color=COLORS[outcome], alpha=0.5,
                           label=f"{outcome} ({len(xs)})")
        ax.set_yticks(range(len(OUTCOMES)), OUTCOMES)
        ax.set_ylim(-0.6, len(OUTCOMES) - 0.4)
        ax.set_title(f"{c['engine']}, {c['ranks']} rank(s), {c['case']}, rule {rule}: "
                     f"{c['states']} states", fontsize=9)
        ax.legend(loc="upper left", fontsize=7, ncols=len(OUTCOMES))
    axes[-1].set_xlabel("crash time (s after the recorded save began)")
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()
