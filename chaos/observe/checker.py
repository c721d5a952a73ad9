"""The verdict: the faulty run's final state equals the reference run's, and every bound holds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from antifragile.chaos.observe.measure import FaultTimings
from antifragile.chaos.scenario import Scenario
from antifragile.engine import CheckpointError
from antifragile.trainer.ckpt_backends import read_checkpoint


@dataclass(slots=True)
class Verdict:
    verdict: str = "pass"
    reasons: list[str] = field(default_factory=list)
    bitwise_equal: bool | None = None

    def fail(self, reason: str) -> None:
        self.verdict = "fail"
        self.reasons.append(reason)


def compare_final(faulty_url: str, reference_url: str, step: int, *,
                  engine: str = "antifragile") -> list[str]:
    """Arrays (model and optimizer) and values that differ between the two final checkpoints,
    both written by ``engine`` (each backend's reader gives flat ``{key: tensor | value}``)."""
    try:
        got = read_checkpoint(engine, faulty_url, step)
        want = read_checkpoint(engine, reference_url, step)
    except CheckpointError as exc:
        return [f"cannot read the final checkpoint of step {step}: {exc}"]
    except Exception as exc:  # a peer engine's own error on a damaged or missing file
        return [f"cannot read the final {engine} checkpoint of step {step}: "
                f"{type(exc).__name__}: {exc}"]
    diffs = sorted(set(got) ^ set(want))
    for key in sorted(set(got) & set(want)):
        x, y = got[key], want[key]
        same = (torch.equal(x, y) and x.dtype == y.dtype) if isinstance(x, torch.Tensor) \
            and isinstance(y, torch.Tensor) else x == y
        if not same:
            diffs.append(key)
    return diffs


def verify_committed(url: str) -> dict[int, list[str]]:
    """Every committed step still stored under ``url`` read back in full (sizes, checksums,
    coverage): step -> its problems (empty: intact). After a storage fault this is the proof
    that no save committed torn."""
    from concurrent.futures import ThreadPoolExecutor

    from antifragile.engine.commit import committed_steps
    from antifragile.engine.storage import open_storage
    from antifragile.engine.verify import verify_step

    try:
        storage = open_storage(url)
        steps = committed_steps(storage)
    except CheckpointError as exc:
        return {-1: [f"cannot list the committed steps: {exc}"]}
    with ThreadPoolExecutor(8) as pool:
        reports = {step: verify_step(storage, step, pool) for step in steps}
    return {step: [f"{p.key}: {p.reason}" for p in r.problems] for step, r in reports.items()}


def judge(s: Scenario, *, returncode: int, timings: list[FaultTimings], final_step: int | None,
          faulty_url: str, reference_url: str | None,
          committed: dict[int, list[str]] | None = None) -> Verdict:
    """``committed``: :func:`verify_committed`'s findings, when they were taken."""
    v = Verdict()
    for step, problems in sorted((committed or {}).items()):
        if problems:
            v.fail(f"committed step {step} does not verify: {'; '.join(problems[:3])}")
    if returncode != 0:
        v.fail(f"the trainer exited with code {returncode}")
    if final_step != s.trainer.steps:
        v.fail(f"the run ended at step {final_step}, not {s.trainer.steps}")
    if reference_url is not None and final_step == s.trainer.steps:
        diffs = compare_final(faulty_url, reference_url, s.trainer.steps,
                              engine=s.checkpoint.engine)
        v.bitwise_equal = not diffs
        if diffs and s.expect.bitwise_equal_to_reference:
            v.fail(f"final state differs from the reference in {len(diffs)} entries, "
                   f"e.g. {diffs[:3]}")
    for t in timings:
        if t.skipped:
            continue
        if t.outage is not None and not t.outage["training_continued"]:
            v.fail(f"{t.kind} at step {t.injected_step}: training did not go on during the "
                   f"outage ({t.outage['steps_during_outage']} steps, or a restart)")
        if t.outage is not None and t.outage.get("error"):
            v.fail(f"{t.kind} at step {t.injected_step}: storage did not come back: "
                   f"{t.outage['error']}")
        if t.kind in ("kill_rank", "hang_rank", "crash_during_save") and t.recovery_s is None:
            v.fail(f"{t.kind} at step {t.injected_step}: no recovery was observed")
            continue
        if s.expect.max_recovery_s is not None and t.recovery_s is not None \
                and t.recovery_s > s.expect.max_recovery_s:
            v.fail(f"{t.kind} at step {t.injected_step}: recovery took {t.recovery_s:.1f} s "
                   f"> max_recovery_s {s.expect.max_recovery_s}")
        if s.expect.max_lost_steps is not None and t.lost_steps is not None \
                and t.lost_steps > s.expect.max_lost_steps:
            v.fail(f"{t.kind} at step {t.injected_step}: {t.lost_steps} steps lost "
                   f"> max_lost_steps {s.expect.max_lost_steps}")
    return v


def summary(v: Verdict) -> dict[str, Any]:
    return {"verdict": v.verdict, "reasons": v.reasons, "bitwise_equal": v.bitwise_equal}
