"""The report's PNG plots, drawn only from the report document (so ``report.json`` can redraw them).

- ``loss.png``: loss per step, one series per attempt, the fault-free reference underneath,
  each fault injection and each recovery point marked, recomputed steps shaded.
- ``timeline.png``: one row per rank over wall time: start-up, restore, training per attempt,
  checkpoint persist spans, fault injections, hung / dead / down periods.
- ``checkpoints.png``: per checkpoint, what the training loop waited (stall) and how long the
  background write took (persist); failed saves marked.

Matplotlib is imported lazily and drawn on ``Figure`` objects (Agg, no pyplot, no display), and
every plot is rendered on its own: a plot that fails carries its error instead of its image, so a
plotting bug never loses ``report.json`` or ``report.md``.
"""

from __future__ import annotations

import io
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DPI = 100
WIDTH_IN = 11.0
NAMES = ("loss.png", "timeline.png", "checkpoints.png")  # every plot a report may have
# Attempts in blues and purples: green means a checkpoint save or a recovery, red a fault.
ATTEMPT_COLORS = ["#1f77b4", "#9467bd", "#17becf", "#8c564b", "#e377c2", "#7f7f7f"]
FAULT_COLOR = "#d62728"
RECOVERY_COLOR = "#2ca02c"
FINAL_COLOR = "#bdbdbd"  # the final save's wait: shutdown, not training
_LABEL_BOX = {"boxstyle": "round,pad=0.15", "fc": "white", "alpha": 0.75, "lw": 0}
_FAILURES = {"kill_rank", "crash_during_save", "host_down"}


@dataclass(slots=True)
class Plot:
    """One rendered plot: ``png`` when it drew, ``error`` (one line + traceback) when it did not."""

    name: str  # file name in the report folder
    alt: str  # what the image shows, for <img alt> and for people who cannot see it
    png: bytes | None = None
    error: str | None = None


def figure_size_px(name: str, doc: dict[str, Any]) -> tuple[int, int]:
    """The pixel size each plot is drawn at (width, height): fixed, so reports compare."""
    inches = {"loss.png": (WIDTH_IN, 5.5), "checkpoints.png": (WIDTH_IN, 6.0),
              "timeline.png": (WIDTH_IN, 2.6 + 0.5 * _world_size(doc))}[name]
    return round(inches[0] * DPI), round(inches[1] * DPI)


def render_all(doc: dict[str, Any]) -> list[Plot]:
    """Draw every plot of ``doc`` (``document.write_report`` writes them). Never raises for a
    plot that fails: its ``error`` says why."""
    plots = [Plot("loss.png", "Loss per step for each attempt, with the fault-free reference, "
                  "fault injections and recovery points marked"),
             Plot("timeline.png", "Per-rank timeline over wall time: start-up, restore, training, "
                  "checkpoint persists, faults and down periods"),
             Plot("checkpoints.png", "Per checkpoint: training-loop stall and background "
                  "persist time; failed saves marked")]
    draw: dict[str, Callable[[Any, dict[str, Any]], None]] = {
        "loss.png": _draw_loss, "timeline.png": _draw_timeline,
        "checkpoints.png": _draw_checkpoints}
    for plot in plots:
        try:
            plot.png = _render(draw[plot.name], doc, figure_size_px(plot.name, doc))
        except Exception as exc:  # a plot must never cost the report
            plot.png = None
            plot.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
    return plots


def _render(draw: Callable[[Any, dict[str, Any]], None], doc: dict[str, Any],
            size_px: tuple[int, int]) -> bytes:
    from matplotlib.figure import Figure  # lazy: the CLI starts fast, import errors are caught

    fig = Figure(figsize=(size_px[0] / DPI, size_px[1] / DPI), dpi=DPI, layout="constrained")
    draw(fig, doc)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None})
    return buf.getvalue()


def _world_size(doc: dict[str, Any]) -> int:
    trainer = doc.get("scenario", {}).get("trainer", {})
    if "nproc_per_node" in trainer:  # a command trainer: the script decides its parallelism
        return max(int(trainer["nproc_per_node"]) * int(trainer.get("nodes", 1)), 1)
    p = trainer.get("parallel", {})
    return max(int(p.get("dp", 1)) * int(p.get("tp", 1)) * int(p.get("pp", 1)), 1)


def _attempt_color(attempt: int) -> str:
    return ATTEMPT_COLORS[attempt % len(ATTEMPT_COLORS)]


def _fault_label(f: dict[str, Any]) -> str:
    where = f" r{f['rank']}" if f.get("rank") is not None else ""
    if f.get("checkpoint_step") is not None and f["kind"] == "corrupt_shard":
        where += f" (ckpt {f['checkpoint_step']})"
    return f"{f['kind']}{where}" + (" (skipped)" if f.get("skipped") else
                                    " (missed)" if f.get("missed") else "")


def _draw_loss(fig: Any, doc: dict[str, Any]) -> None:
    ax = fig.subplots()
    name = doc["scenario"]["name"]
    ax.set_title(f"{name}: training loss per step (faults and recoveries marked)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (cross-entropy)")
    reference = {e["step"]: e["loss"] for e in doc.get("reference_losses") or []}
    if reference:
        steps = sorted(reference)
        ax.plot(steps, [reference[s] for s in steps], color="#7f7f7f", lw=7, alpha=0.3,
                solid_capstyle="round", label="fault-free reference", zorder=1)
    series: dict[int, dict[int, float]] = {}
    for e in doc.get("losses") or []:
        series.setdefault(e["attempt"], {}).setdefault(e["step"], e["loss"])
    markers = "osD^v<>"
    for attempt, points in sorted(series.items()):
        steps = sorted(points)
        ax.plot(steps, [points[s] for s in steps], color=_attempt_color(attempt), lw=1.2,
                marker=markers[attempt % len(markers)], ms=3.5, zorder=2 + attempt,
                label=f"attempt {attempt} (steps {steps[0]}-{steps[-1]})")
    shaded = False
    for f in doc.get("faults") or []:
        step = f.get("injected_step")
        if step is None:
            continue
        made = not f.get("skipped") and not f.get("missed")
        ax.axvline(step, color=FAULT_COLOR if made else "#999999", ls="--",
                   lw=1.2, zorder=1)
        ax.annotate(f"{_fault_label(f)} @ step {step}", (step, 1.0),
                    xycoords=("data", "axes fraction"), xytext=(3, -4),
                    textcoords="offset points", rotation=90, va="top", ha="left",
                    fontsize=8, color=FAULT_COLOR, bbox=_LABEL_BOX)
        restored = f.get("restored_step")
        if restored is None:
            continue
        if step > restored:
            ax.axvspan(restored, step, color="#ff7f0e", alpha=0.12, zorder=0,
                       label=None if shaded else "recomputed steps (trained twice)")
            shaded = True
        ax.axvline(restored, color=RECOVERY_COLOR, ls=":", lw=1.5, zorder=1)
        caught = (f"caught up after {f['recovery_s']:.1f} s" if f.get("recovery_s") is not None
                  else "interrupted by the next fault" if f.get("interrupted_by_t") is not None
                  else "recovery not measured" if f.get("unmeasured")
                  else "never caught up")
        ax.annotate(f"restored step {restored}; {caught}", (restored, 0.0),
                    xycoords=("data", "axes fraction"), xytext=(-3, 4),
                    textcoords="offset points", rotation=90, va="bottom", ha="right",
                    fontsize=8, color=RECOVERY_COLOR, bbox=_LABEL_BOX)
    from matplotlib.lines import Line2D

    handles, _ = ax.get_legend_handles_labels()
    handles += [Line2D([], [], color=FAULT_COLOR, ls="--", label="fault injected"),
                Line2D([], [], color=RECOVERY_COLOR, ls=":", label="restored from checkpoint")]
    ax.legend(handles=handles, loc="upper right", fontsize=8)
    if not series and not reference:
        ax.text(0.5, 0.5, "no losses were reported", transform=ax.transAxes, ha="center")
    ax.grid(alpha=0.3)


def _first(*values: Any) -> Any:
    """The first value that is not None (0.0 is a time like any other)."""
    return next((v for v in values if v is not None), None)


def _bar(ax: Any, y: float, start: float | None, end: float | None, height: float,
         **style: Any) -> None:
    if start is None or end is None or end < start:
        return
    ax.broken_barh([(start, max(end - start, 0.0))], (y - height / 2, height), **style)


def _draw_timeline(fig: Any, doc: dict[str, Any]) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    ax = fig.subplots()
    tl = doc.get("timeline") or {}
    world = _world_size(doc)
    ax.set_title(f"{doc['scenario']['name']}: per-rank timeline "
                 f"({doc.get('run', {}).get('attempts', 1)} attempt(s))")
    ax.set_xlabel("seconds since the run started")
    ended = {a["attempt"]: a["ended_s"] for a in tl.get("attempts", [])}
    workers = tl.get("workers", [])
    attempts = sorted({w["attempt"] for w in workers})
    legend: dict[str, Any] = {}
    for w in workers:
        y, a = w["rank"], w["attempt"]
        end = _first(w.get("exit_s"), ended.get(a), w.get("last_step_s"))
        train_from = _first(w.get("restore_end_s"), w.get("start_s"))
        if w.get("restore_begin_s") is not None:
            _bar(ax, y, w["start_s"], w["restore_begin_s"], 0.5, color="#c7c7c7")
            legend["startup"] = Patch(color="#c7c7c7", label="start-up (before restore)")
            _bar(ax, y, w["restore_begin_s"], _first(w.get("restore_end_s"), end), 0.5,
                 color="#ff7f0e")
            legend["restore"] = Patch(color="#ff7f0e", label="restore (load checkpoint)")
        _bar(ax, y, train_from, end, 0.5, color=_attempt_color(a))
        legend[f"train{a}"] = Patch(color=_attempt_color(a), label=f"attempt {a}: training")
        for c in w.get("checkpoints", []):
            lane = y + 0.36  # a thin lane under the rank's bar
            if c.get("staged_s") is None:  # refused before staging (e.g. previous one busy)
                if c.get("failed_s") is not None:
                    ax.plot([c["failed_s"]], [lane], marker="x", color=FAULT_COLOR, ms=7)
                    legend["skipped"] = Line2D([], [], marker="x", color=FAULT_COLOR, ls="",
                                               label="checkpoint refused / failed")
                continue
            began = c["staged_s"] - (c.get("stall_s") or 0.0)  # persist_s counts from save()
            if c.get("persist_s") is not None:
                _bar(ax, lane, began, began + c["persist_s"], 0.14, color="#2ca02c")
                legend["persist"] = Patch(color="#2ca02c", label="checkpoint save (to commit)")
            elif c.get("failed_s") is not None:
                _bar(ax, lane, began, c["failed_s"], 0.14, color=FAULT_COLOR)
                legend["failed"] = Patch(color=FAULT_COLOR, label="checkpoint save failed")
            ax.plot([c["staged_s"]], [lane], marker="|", color="black", ms=7)
            legend["staged"] = Line2D([], [], marker="|", color="black", ls="", ms=7,
                                      label="checkpoint staged (loop resumes)")
        if w.get("exit_code") not in (None, 0):
            ax.annotate(f"exit {w['exit_code']}", (end, y), xytext=(2, -10),
                        textcoords="offset points", fontsize=7)
        if w.get("hang_detected_s") is not None:
            ax.plot([w["hang_detected_s"]], [y], marker="v", color="black", ms=7, zorder=5)
            legend["hang_detected"] = Line2D([], [], marker="v", color="black", ls="",
                                             label="hang detected (watchdog)")
    starts = {(w["attempt"], w["rank"]): w["start_s"] for w in workers}
    down = {"color": "#eeeeee", "hatch": "//", "edgecolor": "#bbbbbb"}
    for rank in range(world):  # no process on a rank: launching, or torn down and restarting
        if attempts and (attempts[0], rank) in starts:
            _bar(ax, rank, 0.0, starts[(attempts[0], rank)], 0.5, **down)
        for a in attempts:
            restarted = _first(starts.get((a + 1, rank)),
                               min((t for (b, _), t in starts.items() if b == a + 1),
                                   default=None))
            _bar(ax, rank, ended.get(a), restarted, 0.5, **down)
    legend["down"] = Patch(facecolor="#eeeeee", hatch="//", edgecolor="#bbbbbb",
                           label="no process (launch / restart)")
    for inj in tl.get("injections", []):
        t, rank = inj["t_s"], inj.get("rank")
        if inj.get("skipped") or inj.get("missed"):
            continue
        if rank is None:  # on storage or the network: every rank sees it
            ax.axvline(t, color=FAULT_COLOR, ls="--", lw=1.2)
            stop = inj.get("ended_s") or (t + inj["duration_s"] if inj.get("duration_s")
                                          else None)
            label = inj["kind"] + (f" nodes {inj['between']}" if inj.get("between") else "")
            if stop is not None:
                ax.axvspan(t, stop, color=FAULT_COLOR, alpha=0.1, lw=0)
                label += f" ({stop - t:.1f} s)"
                legend["outage"] = Patch(color=FAULT_COLOR, alpha=0.1,
                                         label="storage / link outage")
            ax.annotate(label, (t, 1.0), xycoords=("data", "axes fraction"),
                        xytext=(2, -2), textcoords="offset points", fontsize=8, va="top",
                        color=FAULT_COLOR, bbox=_LABEL_BOX)
            legend["storage"] = Line2D([], [], color=FAULT_COLOR, ls="--",
                                       label="fault on storage / network")
            continue
        attempt_end = ended.get(inj.get("attempt", -1))
        for hit in inj.get("ranks") or [rank]:  # a host_down takes every rank of its host
            if inj["kind"] == "hang_rank":
                stop = t + float(inj.get("duration_s") or 0.0)
                _bar(ax, hit, t, min(stop, attempt_end or stop), 0.5, facecolor="none",
                     edgecolor=FAULT_COLOR, hatch="xx")
                how = ("training thread held (ptrace)" if inj.get("mode") == "thread"
                       else "hung (SIGSTOP)")
                legend[how] = Patch(facecolor="none", edgecolor=FAULT_COLOR, hatch="xx",
                                    label=how)
            elif inj["kind"] in _FAILURES and attempt_end is not None:
                _bar(ax, hit, t, attempt_end, 0.5, color="#444444", hatch="..")
                legend["dead"] = Patch(color="#444444", hatch="..",
                                       label="killed, not yet detected")
            ax.plot([t], [hit], marker="X", color=FAULT_COLOR, ms=11, mec="white", zorder=6)
        ax.annotate(inj["kind"], (t, rank), xytext=(6, 6), textcoords="offset points",
                    fontsize=8, color=FAULT_COLOR, zorder=7, bbox=_LABEL_BOX)
        legend["fault"] = Line2D([], [], marker="X", color=FAULT_COLOR, ls="",
                                 label="fault injected")
    ax.set_yticks(range(world), [f"rank {r}" for r in range(world)])
    ax.set_ylim(world - 0.4, -0.6)
    ax.set_xlim(0, max(float(tl.get("wall_s") or doc.get("run", {}).get("wall_s") or 1.0), 1e-3))
    ax.grid(axis="x", alpha=0.3)
    if not workers:
        ax.text(0.5, 0.5, "no worker events were recorded", transform=ax.transAxes,
                ha="center")
    fig.legend(handles=list(legend.values()), loc="outside lower center",
               ncol=min(len(legend), 5), fontsize=8)


def _short(x: float, unit: str, decimals: int, exact_from: float) -> str:
    """A bar's label: ``decimals`` places from ``exact_from``, two significant digits below
    (a sub-millisecond stall is not "0 ms", the label of a save that cost nothing)."""
    return f"{x:.{decimals}f}{unit}" if x == 0 or x >= exact_from else f"{x:.2g}{unit}"


def _draw_checkpoints(fig: Any, doc: dict[str, Any]) -> None:
    from matplotlib.patches import Patch

    stall_ax, persist_ax = fig.subplots(2, 1, sharex=True)
    cks = doc.get("checkpoints") or []
    several = len({c["attempt"] for c in cks}) > 1
    # the run's final blocking save: its stall is the job's shutdown (its whole persist), not
    # a stall of training; the tables mark it "N (final)" and the checkpoints' cost leaves it out
    labels = [f"{c['step']}" + (" (final)" if c.get("final") else "")
              + (f"\n(a{c['attempt']})" if several else "") for c in cks]
    xs = list(range(len(cks)))
    stall_ax.set_title(f"{doc['scenario']['name']}: checkpoint cost per save "
                       "(slowest rank)")
    stall = [c.get("stall_s") or 0.0 for c in cks]
    persist = [c.get("persist_s") or 0.0 for c in cks]
    colors = [FAULT_COLOR if not c.get("committed") else FINAL_COLOR if c.get("final")
              else "#ff7f0e" for c in cks]
    stall_ax.bar(xs, stall, color=colors)
    persist_ax.bar(xs, persist, color=["#2ca02c" if c.get("committed") else FAULT_COLOR
                                       for c in cks])
    for x, c in enumerate(cks):
        stall_ax.annotate("-" if c.get("stall_s") is None
                          else _short(stall[x] * 1e3, " ms", 0, 1.0), (x, stall[x]), xytext=(0, 2),
                          textcoords="offset points", ha="center", fontsize=7)
        text = (("restored later" if c.get("persist_s") is None
                 else _short(persist[x], " s", 2, 0.1)) if c.get("committed") else "failed")
        persist_ax.annotate(text, (x, persist[x]), xytext=(0, 2), textcoords="offset points",
                            ha="center", fontsize=7,
                            color="black" if c.get("committed") else FAULT_COLOR)
    stall_ax.set_ylabel("stall s\n(training loop waited)")
    persist_ax.set_ylabel("persist s\n(background write)")
    persist_ax.set_xlabel("checkpoint step" + (" (attempt)" if several else ""))
    persist_ax.set_xticks(xs, labels)
    for ax in (stall_ax, persist_ax):
        ax.grid(axis="y", alpha=0.3)
        ax.margins(y=0.15)
    if not cks:
        persist_ax.text(0.5, 0.5, "no checkpoints were taken", transform=persist_ax.transAxes,
                        ha="center")
    handles = [Patch(color="#ff7f0e", label="stall (committed)"),
               Patch(color="#2ca02c", label="persist (committed)")]
    if any(c.get("final") for c in cks):
        handles.append(Patch(color=FINAL_COLOR,
                             label="final save (the job's shutdown, not a stall of training)"))
    if any(not c.get("committed") for c in cks):
        handles.append(Patch(color=FAULT_COLOR, label="not committed (failed or cut short)"))
    stall_ax.legend(handles=handles, loc="best", fontsize=8)  # off the bars and labels
