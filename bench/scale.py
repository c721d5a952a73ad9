"""How an engine save grows with the state (``python -m bench.engine --sweep 1,2,4,8``): save
time against an O_DIRECT write of as many bytes, and the peak RSS, at each size."""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

from antifragile.engine import CheckpointEngine
from antifragile.engine._paths import step_dir
from bench._machine import (
    drop_page_cache,
    mem_available_bytes,
    peak_rss_bytes,
    remove,
    reset_peak_rss,
    rss_bytes,
    timed,
)
from bench._peers import DirectWriter
from bench._state import gpt_like_state, model_dim, state_nbytes

GIB = 2**30
MIN_SAMPLES = 3  # as bench.engine's: a median of fewer has no spread to judge by


@dataclass(kw_only=True, slots=True)
class ScalePoint:
    size_gib: float
    nbytes: int
    staging_nbytes: int
    stall_s: list[float]
    persist_s: list[float]
    direct_s: list[float]
    base_rss: int
    peak_rss: int

    @property
    def persist_gib_s(self) -> float:
        return self.nbytes / GIB / statistics.median(self.persist_s)

    @property
    def direct_ratio(self) -> float:
        return statistics.median(self.direct_s) / statistics.median(self.persist_s)

    @property
    def s_per_gib(self) -> float:
        return statistics.median(self.persist_s) / (self.nbytes / GIB)

    @property
    def rss_extra(self) -> float:
        """Peak RSS during the saves beyond the process before the state, the state and the
        staging area, as a fraction of state + staging."""
        held = self.nbytes + self.staging_nbytes
        return (self.peak_rss - self.base_rss - held) / held

    @property
    def rss_verdict(self) -> str:
        return "PASS" if self.rss_extra <= 0.10 else "MISS"


def growth(points: list[ScalePoint | str]) -> tuple[float, str] | None:
    """s/GiB at the slowest size over the fastest, and its verdict (target <= 1.5x: linear,
    no cliff; ``n/a`` where a size has fewer than ``MIN_SAMPLES`` saves, as ``bench.engine``
    judges its targets); None with fewer than two sizes measured."""
    measured = [p for p in points if isinstance(p, ScalePoint)]
    if len(measured) < 2:
        return None
    per_gib = [p.s_per_gib for p in measured]
    ratio = max(per_gib) / min(per_gib)
    n = min(len(p.persist_s) for p in measured)
    if n < MIN_SAMPLES:
        return ratio, f"n/a (n={n}: at least {MIN_SAMPLES} saves a size for a verdict, --reps)"
    return ratio, "PASS" if ratio <= 1.5 else "MISS"


def scale_json(points: list[ScalePoint | str]) -> dict[str, Any]:
    """The sweep as JSON: each size's samples and the figures and verdicts ``render_scale``
    prints (a size skipped: why), and the s/GiB growth with its verdict."""
    grown = growth(points)
    return {"points": [p if isinstance(p, str) else asdict(p) | {
        "persist_gib_s": p.persist_gib_s, "direct_ratio": p.direct_ratio,
        "s_per_gib": p.s_per_gib, "rss_extra": p.rss_extra, "rss_verdict": p.rss_verdict}
        for p in points],
        "s_per_gib_growth": grown[0] if grown else None,
        "growth_verdict": grown[1] if grown else None}


def scale_point(size_gib: float, parent: str, reps: int) -> ScalePoint | str:
    """Engine saves of a ``size_gib`` state (blocking staging, committed and fsync'd) and
    O_DIRECT writes of as many bytes from the engine's staging arena, alternating; the peak
    RSS of the timed saves. A string (why) when the machine lacks the memory."""
    need = 2.2 * size_gib * GIB
    if mem_available_bytes() < need:
        return (f"{size_gib:g} GiB skipped: {mem_available_bytes() / GIB:.1f} GiB available, "
                f"needs ~{need / GIB:.1f} (state + staging)")
    root = tempfile.mkdtemp(prefix="antifragile-scale-", dir=parent)
    ckpt: CheckpointEngine | None = None
    direct: DirectWriter | None = None
    stall, persist, direct_s = [], [], []
    try:
        base = rss_bytes()
        state = gpt_like_state(model_dim(size_gib * GIB))
        nbytes = state_nbytes(state)
        ckpt = CheckpointEngine(os.path.join(root, "engine"), keep_last=None)
        drop_page_cache()
        ckpt.save(0, state).wait()  # plans and allocates the staging area
        direct = DirectWriter.of(ckpt)
        reset_peak_rss()
        for rep in range(1, reps + 1):
            drop_page_cache()
            start = time.perf_counter()
            handle = ckpt.save(rep, state)
            stall.append(time.perf_counter() - start)
            handle.wait()
            persist.append(time.perf_counter() - start)
            remove(os.path.join(ckpt.url, step_dir(rep - 1)))
            drop_page_cache()
            out = os.path.join(root, "direct")
            direct_s.append(timed(partial(direct.write, out)))
            remove(out)
        peak = peak_rss_bytes()
        staging = ckpt._staging.nbytes if ckpt._staging is not None else 0
    finally:
        if direct is not None:
            direct.close()
        if ckpt is not None:
            ckpt.close()
        shutil.rmtree(root, ignore_errors=True)
    return ScalePoint(size_gib=size_gib, nbytes=nbytes, staging_nbytes=staging, stall_s=stall,
                      persist_s=persist, direct_s=direct_s, base_rss=base, peak_rss=peak)


def render_scale(points: list[ScalePoint | str]) -> str:
    lines = ["[scale] engine save() until committed vs state size (blocking staging; O_DIRECT "
             "sequential write of the same bytes from the staging arena; medians)",
             f"  {'size':>8} {'stall':>8} {'persist':>9} {'GiB/s':>7} {'O_DIRECT':>9} "
             f"{'ratio':>6} {'s/GiB':>7}  peak RSS during saves (over process + state + staging)"]
    for p in points:
        if isinstance(p, str):
            lines.append(f"  {p}")
            continue
        lines.append(
            f"  {p.nbytes / GIB:6.2f}Gi {statistics.median(p.stall_s):7.3f}s "
            f"{statistics.median(p.persist_s):8.3f}s {p.persist_gib_s:7.3f} "
            f"{statistics.median(p.direct_s):8.3f}s {p.direct_ratio:5.2f}x {p.s_per_gib:6.3f}s"
            f"  {p.peak_rss / GIB:6.2f} GiB ({100 * p.rss_extra:+.1f}%, target <= 10% "
            f"{p.rss_verdict})")
    grown = growth(points)
    if grown is not None:
        lines.append(f"  ratio s/GiB largest / smallest {grown[0]:6.3f}x  target <= 1.5x "
                     f"(linear, no cliff) {grown[1]}")
    return "\n".join(lines)
