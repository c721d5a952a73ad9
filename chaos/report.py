"""Reports: ``report.json`` (machine-readable) and ``report.md`` (for people)."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import torch


def environment() -> dict[str, Any]:
    return {"python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform(), "cpus": __import__("os").cpu_count(),
            "cuda": torch.cuda.is_available()}


def write_json(out: Path, report: dict[str, Any]) -> Path:
    path = out / "report.json"
    path.write_text(json.dumps(report, indent=2, sort_keys=False, allow_nan=True))
    return path


def _fmt(x: Any, unit: str = "") -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.2f}{unit}"
    return f"{x}{unit}"


def write_markdown(out: Path, report: dict[str, Any]) -> Path:
    s, v, run = report["scenario"], report["verdict"], report["run"]
    lines = [f"# {s['name']}: {v['verdict'].upper()}", ""]
    if s.get("description"):
        lines += [s["description"], ""]
    lines += [f"- wall time {_fmt(run['wall_s'], ' s')}, goodput {_fmt(run['goodput'])}, "
              f"attempts {run['attempts']}, final step {run['final_step']}",
              f"- bitwise equal to the fault-free reference: {_fmt(v['bitwise_equal'])}"]
    lines += [f"- {reason}" for reason in v["reasons"]]
    lines += ["", "## Faults", "",
              "| kind | step | rank | detect s | restart s | restore s | recompute s | "
              "recovery s | restored step | lost steps | note |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for f in report["faults"]:
        note = f["skipped"] or (f"damaged step {f['checkpoint_step']}"
                                if f["checkpoint_step"] is not None else "")
        lines.append(
            f"| {f['kind']} | {_fmt(f['injected_step'])} | {_fmt(f['rank'])} | "
            f"{_fmt(f['detect_s'])} | {_fmt(f['restart_s'])} | {_fmt(f['restore_s'])} | "
            f"{_fmt(f['recompute_s'])} | {_fmt(f['recovery_s'])} | {_fmt(f['restored_step'])} | "
            f"{_fmt(f['lost_steps'])} | {note} |")
    lines += ["", "## Checkpoints", "",
              "| attempt | step | stall s | persist s | MiB | committed |",
              "|---|---|---|---|---|---|"]
    for c in report["checkpoints"]:
        mib = c["bytes"] / 2**20 if c["bytes"] else None
        lines.append(f"| {c['attempt']} | {c['step']} | {_fmt(c['stall_s'])} | "
                     f"{_fmt(c['persist_s'])} | {_fmt(mib)} | {c['committed']} |")
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
