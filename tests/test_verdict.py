"""The verdict cannot pass by accident: the comparison is of bits, a reference is needed to claim
bitwise equality, and every fault must have been made and have had its effect.

Checkpoints are written by the real engine in this process; runs are synthetic ``RunRecord``s
(as in test_report.py) unless a test says it runs ``chaos run``.
"""

from __future__ import annotations

import math
import os
import random
import threading
import time
import warnings
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from antifragile.chaos.faults import Injection
from antifragile.chaos.observe import checker, measure
from antifragile.chaos.observe.record import RunRecord
from antifragile.chaos.run.draws import Draws
from antifragile.chaos.scenario import parse_scenario
from antifragile.engine import CheckpointEngine
from tests.test_report import SCENARIO, T0, WORLD, _Job, _loss, synthetic_record

STEPS = 12


def _scenario(**expect: Any) -> Any:
    return parse_scenario({
        "name": "verdict", "seed": 1,
        "trainer": {"parallel": {"dp": 2}, "steps": STEPS, "batch_size": 8,
                    "model": {"layers": 2, "d_model": 32, "heads": 4, "vocab": 64,
                              "seq_len": 16}},
        "checkpoint": {"every_steps": 4}, "expect": expect})


def _save(url: Path, state: dict[str, Any], step: int = STEPS) -> str:
    with CheckpointEngine(str(url), keep_last=None) as engine:
        engine.save(step, state).wait()
    return str(url)


def _nan_tensor(*payloads: int) -> torch.Tensor:
    return torch.tensor([0x7FC00000 | p for p in payloads], dtype=torch.int32).view(torch.float32)


def _state(w: torch.Tensor, **train: Any) -> dict[str, Any]:
    return {"model": {"w": w}, "optim": {"state.w.exp_avg": torch.ones(3)},
            "train": {"step": STEPS, "data_cursor": 96, **train}}


# --- item 14: bits, not numeric equality ---------------------------------------------------

def test_signed_zeros_differ(tmp_path: Path) -> None:
    ref = _save(tmp_path / "ref", _state(torch.tensor([0.0, 1.0, 2.0])))
    got = _save(tmp_path / "got", _state(torch.tensor([-0.0, 1.0, 2.0])))
    assert checker.compare_final(got, ref, STEPS).differs == ["model/w"]


def test_identical_nans_are_equal_and_nan_payloads_differ(tmp_path: Path) -> None:
    ref = _save(tmp_path / "ref", _state(_nan_tensor(1, 0, 0)))
    same = _save(tmp_path / "same", _state(_nan_tensor(1, 0, 0)))
    other = _save(tmp_path / "other", _state(_nan_tensor(2, 0, 0)))
    assert all(math.isnan(x) for x in _nan_tensor(1, 0, 0).tolist())
    assert checker.compare_final(same, ref, STEPS).differs == []
    assert checker.compare_final(other, ref, STEPS).differs == ["model/w"]


@pytest.mark.parametrize("value", [96.0, True, "96", [96], None])
def test_json_values_compare_by_type_and_value(tmp_path: Path, value: Any) -> None:
    ref = _save(tmp_path / "ref", _state(torch.ones(3), extra=96))
    got = _save(tmp_path / "got", _state(torch.ones(3), extra=value))
    assert checker.compare_final(got, ref, STEPS).differs == ["train"]


def test_nested_json_values_compare_by_type_and_bits(tmp_path: Path) -> None:
    ref = _save(tmp_path / "ref", _state(torch.ones(3), extra={"lr": [0.0, 1]}))
    assert checker.compare_final(_save(tmp_path / "same", _state(
        torch.ones(3), extra={"lr": [0.0, 1]})), ref, STEPS).differs == []
    for i, value in enumerate(({"lr": [-0.0, 1]}, {"lr": [0.0, 1.0]}, {"lr": [0.0, True]})):
        got = _save(tmp_path / f"got{i}", _state(torch.ones(3), extra=value))
        assert checker.compare_final(got, ref, STEPS).differs == ["train"], value


def test_conjugate_and_negative_views_compare_by_their_values(tmp_path: Path) -> None:
    """A tensor that torch.load hands back (DCP stores a tuple by pickling it) keeps its
    conjugate or negative bit: comparing it raised a RuntimeError out of the verdict."""
    import torch.distributed.checkpoint as dcp

    x = torch.tensor([1 + 1j, 2 - 3j])
    y = torch.tensor([1.0, -2.0])
    assert checker.same_tensor(x.conj(), x.conj().resolve_conj())
    assert not checker.same_tensor(x.conj(), x)
    assert checker.same_tensor(torch._neg_view(y), -y)
    assert not checker.same_tensor(torch._neg_view(y), y)
    for run, value in (("ref", x.conj()), ("same", x.conj().resolve_conj()), ("other", x)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"model": {"w": torch.ones(2)}, "pair": (value,)},
                     checkpoint_id=str(tmp_path / run / f"step_{STEPS:09d}"))
    ref = str(tmp_path / "ref")
    assert checker.compare_final(str(tmp_path / "same"), ref, STEPS, engine="dcp").equal
    other = checker.compare_final(str(tmp_path / "other"), ref, STEPS, engine="dcp")
    assert other.error is None and other.differs == ["pair"]


def test_dtype_and_shape_are_part_of_the_bits(tmp_path: Path) -> None:
    ref = _save(tmp_path / "ref", _state(torch.zeros(4)))
    for i, w in enumerate((torch.zeros(4, dtype=torch.int32), torch.zeros(2, 2))):
        got = _save(tmp_path / f"got{i}", _state(w))
        assert checker.compare_final(got, ref, STEPS).differs == ["model/w"], w


def test_equal_checkpoints_compare_equal(tmp_path: Path) -> None:
    w = torch.randn(5, 3)
    ref = _save(tmp_path / "ref", _state(w.clone()))
    got = _save(tmp_path / "got", _state(w.clone()))
    comparison = checker.compare_final(got, ref, STEPS)
    assert comparison.differs == [] and comparison.error is None
    assert comparison.compared_bytes == (15 + 3) * 4


@pytest.mark.parametrize(("x", "y"), [
    ((1, 2), [1, 2]),
    ({1: "a"}, {"1": "a"}),
    (b"ab", bytearray(b"ab")),
    ((torch.ones(2), torch.zeros(2)), [torch.ones(2), torch.zeros(2)]),
], ids=["tuple-list", "int-str-key", "bytes-bytearray", "tensors-in-tuple-list"])
def test_entries_that_load_as_other_types_differ(tmp_path: Path, x: Any, y: Any) -> None:
    """JSON has no tuples or int keys, and bytes are stored as uint8: the type record says what
    a load gives back. ``read()`` left it out, so two final checkpoints that load as a tuple
    and as a list (or int and str keys) compared equal."""
    ref = _save(tmp_path / "ref", {**_state(torch.ones(3)), "extra": x})
    same = _save(tmp_path / "same", {**_state(torch.ones(3)), "extra": x})
    got = _save(tmp_path / "got", {**_state(torch.ones(3)), "extra": y})
    assert checker.compare_final(same, ref, STEPS).equal
    assert checker.compare_final(got, ref, STEPS).differs


def _nan32(payload: int) -> np.float32:
    return np.array([0x7FC00000 | payload], dtype=np.uint32).view(np.float32)[0]


@pytest.mark.parametrize(("x", "y", "same"), [
    (np.float32(0.0), np.float32(-0.0), False),
    (np.float16(0.0), np.float16(-0.0), False),
    (_nan32(1), _nan32(1), True),
    (_nan32(1), _nan32(2), False),
    (np.float32(1.0), np.float64(1.0), False),
    (np.float64(1.0), 1.0, False),
    (np.int64(3), 3, False),
    (np.bool_(True), True, False),
    (complex(0.0, 0.0), complex(0.0, -0.0), False),
    (complex(1.0, 2.0), complex(1.0, 2.0), True),
    (np.array([0.0]), np.array([-0.0]), False),
    (np.array([1, 2]), np.array([1, 2]), True),
    (np.array([1, 2]), np.array([[1, 2]]), False),
    (np.array([1, 2], dtype=np.int32), np.array([1, 2], dtype=np.int64), False),
    (np.array([0.0, "a"], dtype=object), np.array([-0.0, "a"], dtype=object), False),
    (np.array([1.5, "a"], dtype=object), np.array([1.5, "a"], dtype=object), True),
    (True, 1, False),
    (Decimal("1.0"), Decimal("1.00"), False),
    (Decimal("1.0"), Decimal("1.0"), True),
    ({1, 2}, {2, 1}, True),
    ({0.0}, {-0.0}, False),
    ({1: "a"}, {1: "a"}, True),
    ({1: "a"}, {True: "a"}, False),
    ({1: "a"}, {1.0: "a"}, False),
    ({0.0: "a"}, {-0.0: "a"}, False),
    ({np.int64(0): "a"}, {0: "a"}, False),
], ids=lambda v: repr(v)[:40])
def test_non_tensor_values_compare_bit_for_bit(x: Any, y: Any, same: bool) -> None:
    """What DCP and torchsnapshot hand back pickled (numpy arrays and scalars, complex,
    arbitrary objects) is compared by type and bits too, never by a loose ``==``."""
    assert checker.same_value(x, y) is same
    assert checker.same_value(y, x) is same


def test_a_numpy_rng_state_in_a_dcp_checkpoint_compares(tmp_path: Path) -> None:
    """``np.random.get_state()`` saved by DCP (a tuple holding a uint32 array): compared, not
    a ValueError from ``array == array``."""
    import torch.distributed.checkpoint as dcp

    for run, draws in (("ref", 0), ("same", 0), ("other", 1)):
        rng = np.random.RandomState(0)
        rng.random_sample(draws)
        state = {"model": {"w": torch.arange(4.0)}, "rng": {"numpy": rng.get_state()}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, checkpoint_id=str(tmp_path / run / f"step_{STEPS:09d}"))
    ref = str(tmp_path / "ref")
    same = checker.compare_final(str(tmp_path / "same"), ref, STEPS, engine="dcp")
    assert same.error is None and same.differs == []
    other = checker.compare_final(str(tmp_path / "other"), ref, STEPS, engine="dcp")
    assert other.error is None and other.differs and all("rng" in k for k in other.differs)


def test_a_value_that_cannot_be_compared_differs(monkeypatch: pytest.MonkeyPatch) -> None:
    """An object without a bit-exact comparison (it cannot even be pickled) is reported as
    differing, and why, rather than trusted to ``==``."""
    lock = threading.Lock()
    entries = {"model/w": torch.ones(2), "train/lock": lock}
    monkeypatch.setattr(checker, "read_checkpoint", lambda engine, url, step: dict(entries))
    assert checker.same_value(lock, lock) is False
    comparison = checker.compare_final("faulty", "reference", STEPS, engine="dcp")
    assert len(comparison.differs) == 1
    assert comparison.differs[0].startswith("train/lock (uncomparable: ")


# --- item 14: bitwise equality needs a reference ---------------------------------------------

def _judge(s: Any, **kw: Any) -> checker.Verdict:
    args: dict[str, Any] = {"returncode": 0, "timings": [], "final_step": STEPS,
                            "faulty_url": "unused", "reference_url": None,
                            "final_committed": True}
    return checker.judge(s, **{**args, **kw})


def test_bitwise_expectation_without_a_reference_fails() -> None:
    v = _judge(_scenario(bitwise_equal_to_reference=True))
    assert v.verdict == "fail" and v.bitwise_equal is None
    assert any("bitwise_equal_to_reference" in r and "--no-reference" in r for r in v.reasons)
    assert _judge(_scenario(bitwise_equal_to_reference=False)).verdict == "pass"


def test_a_script_found_deterministic_is_not_told_to_check_its_determinism(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A script's bitwise FAIL says where to look, --check-determinism among the places; a run
    made with --check-determinism that found the two fault-free runs equal was sent to it too."""
    monkeypatch.setattr(checker, "compare_final", lambda *a, **k: checker.Comparison(
        differs=["model/w"], compared_bytes=8))
    s = parse_scenario({"name": "mine", "trainer": {"command": ["python", "-c", "pass"]},
                        "faults": []})
    args: dict[str, Any] = {"final_step": 8, "expected_step": 8, "faulty_url": "faulty",
                            "reference_url": "reference", "last_step": 8,
                            "reference_last_step": 8}
    (unchecked,) = [r for r in _judge(s, **args).reasons if "differs" in r]
    assert "--check-determinism" in unchecked, unchecked
    v = _judge(s, **args, determinism=checker.Comparison(compared_bytes=8))
    (reason,) = [r for r in v.reasons if "differs" in r]
    assert "random generators" in reason and "--check-determinism" not in reason, reason


# --- other ways to pass by accident -------------------------------------------------------------

def test_nothing_to_compare_fails(tmp_path: Path) -> None:
    """Two final checkpoints whose tensors hold no element are not "equal": no bit was
    compared."""
    empty = {"model": {"w": torch.empty(0)}, "train": {"step": STEPS}}
    ref = _save(tmp_path / "ref", empty)
    got = _save(tmp_path / "got", empty)
    comparison = checker.compare_final(got, ref, STEPS)
    assert comparison.compared_bytes == 0 and comparison.error
    assert "nothing to compare" in comparison.error
    v = _judge(_scenario(), faulty_url=got, reference_url=ref)
    assert v.verdict == "fail" and v.bitwise_equal is False, v


def test_a_reader_that_returns_nothing_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer engine's reader that finds no entry in either checkpoint (both sides empty)."""
    monkeypatch.setattr(checker, "read_checkpoint", lambda engine, url, step: {})
    comparison = checker.compare_final("faulty", "reference", STEPS, engine="dcp")
    assert comparison.differs == [] and comparison.error and "nothing to compare" in \
        comparison.error
    v = _judge(_scenario(), faulty_url="faulty", reference_url="reference")
    assert v.verdict == "fail" and v.bitwise_equal is False


def test_a_missing_final_checkpoint_fails_even_without_a_bitwise_expectation() -> None:
    v = _judge(_scenario(bitwise_equal_to_reference=False), final_committed=False)
    assert v.verdict == "fail"
    assert any(f"no committed checkpoint of the final step {STEPS}" in r for r in v.reasons)


def test_final_committed_reads_the_engine(tmp_path: Path) -> None:
    url = _save(tmp_path / "ckpt", _state(torch.ones(3)), step=STEPS - 4)
    assert checker.final_committed("antifragile", url, STEPS) is False
    _save(tmp_path / "ckpt", _state(torch.ones(3)), step=STEPS)
    assert checker.final_committed("antifragile", url, STEPS) is True
    assert checker.final_committed("antifragile", str(tmp_path / "none"), STEPS) is False


# --- synthetic runs: every fault made, and made a difference ------------------------------------

def _kill(job: _Job, t: float, attempt: int, rank: int, step: int, fault_index: int = 0
          ) -> float:
    """SIGKILL ``rank`` at ``t`` (the scenario's fault ``fault_index``): the survivors fail on
    their next collective, the attempt ends."""
    job.injections.append(Injection("kill_rank", t, step=step, rank=rank, fault_index=fault_index,
                                    detail={"pid": 1000 + 10 * attempt + rank}))
    for r in range(WORLD):
        if r != rank:
            job.emit(t + 0.5, r, attempt, "exit", code=1, error="RuntimeError: peer closed")
    job.attempt_ends[attempt] = t + 0.6
    return t + 0.6


def _finish(job: _Job, t: float, attempt: int) -> RunRecord:
    for r in range(WORLD):
        job.emit(t + 0.45, r, attempt, "exit", code=0)
    job.attempt_ends[attempt] = t + 0.5
    job.events.sort(key=lambda e: e["t"])
    return RunRecord(0, T0, t + 0.6, job.events, job.injections, job.attempt_ends)


def _verdict(record: RunRecord, faults: list[dict[str, Any]], **expect: Any
             ) -> tuple[checker.Verdict, list[measure.FaultTimings]]:
    s = parse_scenario({**SCENARIO, "faults": faults,
                        "expect": {"bitwise_equal_to_reference": False, **expect}})
    timings = [measure.fault_timings(record, i, window_s=measure.detection_window_s(s))
               for i in record.injections]
    return checker.judge(s, returncode=record.returncode, timings=timings, final_step=12,
                         faulty_url="unused", reference_url=None, final_committed=True), timings


KILL = {"kind": "kill_rank", "rank": 1, "at_step": 7}
KILL_AT_9 = {**KILL, "at_step": 9}


def _hang_then_kill() -> RunRecord:
    """Rank 2 is stopped for 1 s at step 4 and resumes before anyone notices (no restart);
    checkpoint 4 is corrupted at step 6; rank 1 is killed at step 7; attempt 1 restores step 6
    (the newest: the damaged 4 is never read) and finishes."""
    job = _Job()
    t = job.steps(job.start(T0 + 1.0, 0), 0, 1, 4)
    job.injections.append(Injection("hang_rank", t + 0.05, step=4, rank=2, fault_index=0,
                                    detail={"pid": 1002, "duration_s": 1.0}))
    t = job.steps(t + 1.5, 0, 5, 6)
    job.injections.append(Injection("corrupt_shard", t + 0.05, step=6, fault_index=1, detail={
        "checkpoint_step": 4, "object": "model/w/c.0", "mode": "bitflip"}))
    t = job.steps(t, 0, 7, 7)
    t = _kill(job, t + 0.05, 0, 1, 7, fault_index=2)
    t = job.steps(job.start(t + 3.0, 1, restore=6), 1, 7, 12)
    return _finish(job, t, 1)


def test_recovery_is_the_restart_the_fault_caused() -> None:
    record = _hang_then_kill()
    v, (hang, corrupt, kill) = _verdict(record, [
        {"kind": "hang_rank", "rank": 2, "at_step": 4, "duration_s": 1},
        {"kind": "corrupt_shard", "at_step": 6}, KILL])
    kill_t = record.injections[2].t
    assert kill.ended_attempt == 0 and kill.detect_s == pytest.approx(0.6)
    assert kill.restored_step == 6 and kill.lost_steps == 1 and kill.recovery_s is not None
    assert kill.recovery_s == pytest.approx(record.attempt_ends[0] - kill_t + kill.restart_s
                                            + kill.restore_s + kill.recompute_s)
    for harmless in (hang, corrupt):  # neither inherits the kill's restart
        assert harmless.ended_attempt is None and harmless.recovery_s is None
        assert harmless.detect_s is None and harmless.restored_step is None
        assert harmless.lost_steps is None
    assert hang.effect_observed is False and "no restart" in (hang.effect or "")
    assert v.verdict == "fail"
    assert any(r.startswith("hang_rank at step 4: no observable effect") for r in v.reasons)


def test_existing_synthetic_run_keeps_its_measurements() -> None:
    record = synthetic_record()
    v, (hang, corrupt, kill) = _verdict(record, SCENARIO["faults"])
    assert v.verdict == "pass", v.reasons
    assert (hang.ended_attempt, hang.restored_step, hang.detect_s) == (0, 2, pytest.approx(2.3))
    assert (kill.ended_attempt, kill.restored_step, kill.lost_steps) == (1, 4, 4)
    assert corrupt.ended_attempt is None and corrupt.recovery_s is None
    assert corrupt.effect_observed and "skipped the damaged step 6" in (corrupt.effect or "")
    assert hang.effect_observed and "found it hung (stopped" in (hang.effect or "")
    assert kill.effect_observed


def test_a_damaged_step_nobody_read_is_no_effect() -> None:
    v, timings = _verdict(_hang_then_kill(), [
        {"kind": "hang_rank", "rank": 2, "at_step": 4, "duration_s": 1},
        {"kind": "corrupt_shard", "at_step": 6}, KILL])
    corrupt = timings[1]
    assert corrupt.effect_observed is False and "step 4" in (corrupt.effect or "")
    assert any(r.startswith("corrupt_shard at step 6: no observable effect") for r in v.reasons)


def _corrupt_then_kill(*, skipped: int | None, restore: int) -> RunRecord:
    job = _Job()
    t = job.steps(job.start(T0 + 1.0, 0), 0, 1, 7)
    job.injections.append(Injection("corrupt_shard", t + 0.05, step=7, fault_index=0, detail={
        "checkpoint_step": 6, "object": "model/w/c.0", "mode": "bitflip"}))
    t = _kill(job, t + 0.1, 0, 1, 7, fault_index=1)
    t = job.steps(job.start(t + 3.0, 1, restore=restore, skipped=skipped), 1, restore + 1, 12)
    return _finish(job, t, 1)


def test_a_damaged_step_restored_without_noticing_fails() -> None:
    faults = [{"kind": "corrupt_shard", "at_step": 7}, KILL]
    v, (corrupt, _) = _verdict(_corrupt_then_kill(skipped=None, restore=6), faults)
    assert corrupt.effect_observed is False and "without noticing" in (corrupt.effect or "")
    assert v.verdict == "fail"
    v, (corrupt, _) = _verdict(_corrupt_then_kill(skipped=6, restore=4), faults)
    assert corrupt.effect_observed and v.verdict == "pass", v.reasons



def test_a_damaged_step_restored_without_noticing_is_not_redeemed_by_a_later_skip() -> None:
    """The first restore that read the damaged step decides. Attempt 1 loaded the damaged
    step 6 without noticing (no effect); a second corrupt_shard then damaged step 6 again and
    attempt 2's restore skipped it. That skip is the second fault's effect; it was credited to
    the first as well, whose damage the job never noticed."""
    job = _Job()
    t = job.steps(job.start(T0 + 1.0, 0), 0, 1, 7)
    job.injections.append(Injection("corrupt_shard", t + 0.05, step=7, fault_index=0, detail={
        "checkpoint_step": 6, "object": "model/w/c.0", "mode": "bitflip"}))
    t = _kill(job, t + 0.1, 0, 1, 7, fault_index=1)
    t = job.steps(job.start(t + 3.0, 1, restore=6), 1, 7, 7)
    job.injections.append(Injection("corrupt_shard", t + 0.05, step=7, fault_index=2, detail={
        "checkpoint_step": 6, "object": "model/w/c.1", "mode": "bitflip"}))
    t = _kill(job, t + 0.1, 1, 1, 7, fault_index=3)
    t = job.steps(job.start(t + 3.0, 2, restore=4, skipped=6), 2, 5, 12)
    record = _finish(job, t, 2)
    first, second = (measure.fault_timings(record, i) for i in record.injections
                     if i.kind == "corrupt_shard")
    assert second.effect_observed, second.effect
    assert first.effect_observed is False and "without noticing" in (first.effect or "")

def _kill_then_restore(restore: int, skipped: int | None = None) -> RunRecord:
    """Checkpoints 2, 4 and 6 commit (each 0.4 s after its step), rank 1 is killed at step 7,
    attempt 1 restores ``restore`` (reporting ``skipped`` as passed over) and finishes."""
    job = _Job()
    t = job.steps(job.start(T0 + 1.0, 0), 0, 1, 7)
    t = _kill(job, t + 0.1, 0, 1, 7)
    t = job.steps(job.start(t + 3.0, 1, restore=restore, skipped=skipped), 1, restore + 1, 12)
    return _finish(job, t, 1)


def test_a_restore_older_than_the_newest_committed_step_fails() -> None:
    """Step 6 had committed before the kill; a restore of step 4 that skipped nothing lost two
    steps of work for no reason (within max_lost_steps and bitwise equal all the same, since
    the recompute is deterministic): the verdict fails. Skipped with a reason (damaged,
    unreadable), going back is right."""
    v, (kill,) = _verdict(_kill_then_restore(restore=6), [KILL], max_lost_steps=4)
    assert kill.restorable_step == 6 and v.verdict == "pass", v.reasons
    v, (kill,) = _verdict(_kill_then_restore(restore=4), [KILL], max_lost_steps=4)
    assert kill.restored_step == 4 and kill.restorable_step == 6
    assert v.verdict == "fail"
    assert any("restored step 4, although step 6 had committed before the fault" in r
               for r in v.reasons), v.reasons
    v, (kill,) = _verdict(_kill_then_restore(restore=4, skipped=6), [KILL], max_lost_steps=4)
    assert kill.restorable_step == 4 and v.verdict == "pass", v.reasons


def test_a_step_committed_again_after_a_restore_skipped_it_is_restorable_again() -> None:
    """Checkpoint 6 is damaged and skipped by attempt 1's restore (back to 4); attempt 1
    commits step 6 anew and is killed at step 7. That earlier skip does not excuse attempt 2
    going back to step 4 past the new commit of step 6."""
    def run(restore: int) -> RunRecord:
        job = _Job()
        t = job.steps(job.start(T0 + 1.0, 0), 0, 1, 7)
        job.injections.append(Injection("corrupt_shard", t + 0.05, step=7, fault_index=0,
                                        detail={"checkpoint_step": 6, "object": "model/w/c.0",
                                                "mode": "bitflip"}))
        t = _kill(job, t + 0.1, 0, 1, 7, fault_index=1)
        t = job.steps(job.start(t + 3.0, 1, restore=4, skipped=6), 1, 5, 7)
        t = _kill(job, t + 0.1, 1, 1, 7, fault_index=2)
        t = job.steps(job.start(t + 3.0, 2, restore=restore), 2, restore + 1, 12)
        return _finish(job, t, 2)

    faults = [{"kind": "corrupt_shard", "at_step": 7}, KILL, {**KILL, "on_pass": 2}]
    v, (_, first, second) = _verdict(run(restore=6), faults, max_lost_steps=4)
    assert (first.restorable_step, second.restorable_step) == (4, 6)
    assert v.verdict == "pass", v.reasons
    v, (_, _, second) = _verdict(run(restore=4), faults, max_lost_steps=4)
    assert second.restored_step == 4 and second.restorable_step == 6
    assert v.verdict == "fail"
    assert any("restored step 4, although step 6 had committed" in r for r in v.reasons)


def _crash_during_save(*, committed_before_kill: bool, restore: int,
                       committed_event: bool = False, skipped: int | None = None) -> RunRecord:
    """Rank 0 is killed once checkpoint 8 is staged (it commits at +0.4 s in ``_Job``)."""
    job = _Job()
    t = job.steps(job.start(T0 + 1.0, 0), 0, 1, 7)
    t += 0.5
    for r in range(WORLD):
        job.emit(t, r, 0, "step_end", step=8, loss=None, seconds=0.45)
        job.emit(t + 0.01, r, 0, "ckpt_staged", step=8, stall_s=0.01)
        if committed_event and r:
            job.emit(t + 0.3, r, 0, "ckpt_committed", step=8, bytes=4_000_000,
                     rank_bytes=1_000_000, persist_s=0.3)
    job.injections.append(Injection("crash_during_save", t + 0.02, step=8, rank=0, fault_index=0,
                                    detail={
        "pid": 1000, "checkpoint_step": 8, "committed_before_kill": committed_before_kill}))
    for r in (1, 2, 3):
        job.emit(t + 0.5, r, 0, "exit", code=1, error="RuntimeError: peer closed")
    job.attempt_ends[0] = t + 0.6
    t = job.steps(job.start(t + 3.6, 1, restore=restore, skipped=skipped), 1, restore + 1, 12)
    return _finish(job, t, 1)


CRASH = [{"kind": "crash_during_save", "rank": 0, "at_checkpoint": 4}]


def test_crash_during_save_before_commit_passes() -> None:
    v, (crash,) = _verdict(_crash_during_save(committed_before_kill=False, restore=6), CRASH)
    assert v.verdict == "pass", v.reasons
    assert crash.effect_observed and crash.ended_attempt == 0 and crash.restored_step == 6


def test_crash_during_save_that_lost_the_race_to_commit_fails() -> None:
    v, (crash,) = _verdict(_crash_during_save(committed_before_kill=True, restore=8), CRASH)
    assert crash.effect_observed is False and crash.recovery_s is not None
    assert v.verdict == "fail" and any("won the race" in r for r in v.reasons), v.reasons


@pytest.mark.parametrize("how", ["committed event", "restored"])
def test_crash_during_save_whose_step_committed_after_the_kill_fails(how: str) -> None:
    record = _crash_during_save(committed_before_kill=False, restore=8 if how == "restored"
                                else 6, committed_event=how == "committed event")
    v, (crash,) = _verdict(record, CRASH)
    assert crash.effect_observed is False and "committed after" in (crash.effect or "")
    assert v.verdict == "fail"


def test_crash_during_save_that_left_a_torn_commit_fails() -> None:
    """The crashed save's step was committed (no event said so: the coordinator died as it
    wrote COMMIT) but did not load: the next restore skipped it and loaded step 6. That is the
    torn checkpoint the fault exists to catch; it passed, as a crash during a save recovered
    from."""
    v, (crash,) = _verdict(_crash_during_save(committed_before_kill=False, restore=6,
                                              skipped=8), CRASH)
    assert crash.effect_observed is False and "torn" in (crash.effect or ""), crash.effect
    assert v.verdict == "fail" and any("skipped" in r for r in v.reasons), v.reasons


def _outage(requests_faulted: int | None, requests_delayed: int = 0) -> RunRecord:
    job = _Job()
    t = job.steps(job.start(T0 + 1.0, 0), 0, 1, 5)
    detail: dict[str, Any] = {"mode": "error", "duration_s": 1.0, "latency_s": None,
                              "ended_t": None}
    if requests_faulted is not None:
        detail.update(ended_t=t + 1.05, requests_faulted=requests_faulted,
                      connections_passed=0, requests_delayed=requests_delayed)
    job.injections.append(Injection("storage_outage", t + 0.05, step=5, fault_index=0,
                                    detail=detail))
    return _finish(job, job.steps(t, 0, 6, 12), 0)


OUTAGE = [{"kind": "storage_outage", "at_step": 5, "duration_s": 1}]


def _outage_verdict(record: RunRecord) -> tuple[checker.Verdict, measure.FaultTimings]:
    s = parse_scenario({**SCENARIO, "checkpoint": {"url": "s3://b/p", "every_steps": 2},
                        "faults": OUTAGE, "expect": {"bitwise_equal_to_reference": False}})
    (t,) = [measure.fault_timings(record, i) for i in record.injections]
    return checker.judge(s, returncode=0, timings=[t], final_step=12, faulty_url="unused",
                         reference_url=None, final_committed=True), t


def test_an_outage_that_faulted_no_request_fails() -> None:
    v, outage = _outage_verdict(_outage(requests_faulted=0))
    assert outage.effect_observed is False and "no request" in (outage.effect or "")
    assert v.verdict == "fail"
    v, outage = _outage_verdict(_outage(requests_faulted=None))  # never ended: never counted
    assert outage.effect_observed is False and v.verdict == "fail"
    v, outage = _outage_verdict(_outage(requests_faulted=3))
    assert outage.effect_observed and "3 requests" in (outage.effect or "")
    assert v.verdict == "pass", v.reasons


def _link_cut(*, restart: bool, detected: bool = False) -> RunRecord:
    job = _Job()
    t = job.steps(job.start(T0 + 1.0, 0), 0, 1, 6)
    cut = t + 0.05
    job.injections.append(Injection("drop_link", cut, step=6, fault_index=0, detail={
        "between": [0, 1], "duration_s": 3.0, "mechanism": "veth down"}))
    if not restart:
        return _finish(job, job.steps(cut + 3.0, 0, 7, 12), 0)
    if detected:
        job.emit(cut + 2.0, 2, 0, "hang_detected", by="supervisor", slot=2, how="stalled",
                 thread_state="S", stall_s=6.0, timeout_s=2.0)
        job.emit(cut + 2.0, 2, 0, "rank_died", by="supervisor", slot=2, how="signal 9",
                 hung=True)
    job.attempt_ends[0] = cut + 2.5
    t = job.steps(job.start(cut + 4.0, 1, restore=6), 1, 7, 12)
    return _finish(job, t, 1)


def _link_verdict(record: RunRecord) -> tuple[checker.Verdict, measure.FaultTimings]:
    s = parse_scenario({**SCENARIO, "trainer": {**SCENARIO["trainer"], "nodes": 2},
                        "faults": [{"kind": "drop_link", "at_step": 6, "duration_s": 3}],
                        "expect": {"bitwise_equal_to_reference": False}})
    (t,) = [measure.fault_timings(record, i) for i in record.injections]
    return checker.judge(s, returncode=0, timings=[t], final_step=12, faulty_url="unused",
                         reference_url=None, final_committed=True), t


def test_a_link_cut_nobody_noticed_fails() -> None:
    v, cut = _link_verdict(_link_cut(restart=False))
    assert cut.effect_observed is False and "not observed" in (cut.effect or "")
    assert v.verdict == "fail" and cut.recovery_s is None
    for detected in (False, True):
        v, cut = _link_verdict(_link_cut(restart=True, detected=detected))
        assert cut.effect_observed and cut.ended_attempt == 0 and cut.recovery_s is not None
        assert v.verdict == "pass", v.reasons
        assert ("found it hung" in (cut.effect or "")) == detected


def test_a_cut_is_not_credited_with_the_detection_of_a_rank_a_hang_rank_stopped() -> None:
    """A cut of the link between nodes 0 and 1 that the job did not notice, and a stop of rank 2
    in the same attempt: rank 2's supervisor finds it stopped and the attempt ends. That
    watchdog's finding is the stop's evidence, yet the cut was credited with it (and with the
    restart), so a cut that did nothing passed."""
    job = _Job()
    t = job.steps(job.start(T0 + 1.0, 0), 0, 1, 6)
    cut = t + 0.05
    job.injections.append(Injection("drop_link", cut, step=6, fault_index=0, detail={
        "between": [0, 1], "duration_s": 3.0, "mechanism": "veth down"}))
    job.injections.append(Injection("hang_rank", cut + 0.01, step=6, rank=2, fault_index=1,
                                    detail={"pid": 1002, "duration_s": 20.0,
                                            "done_t": cut + 0.02}))
    job.emit(cut + 2.0, 2, 0, "hang_detected", by="supervisor", slot=2, how="stopped",
             thread_state="T", stall_s=2.0, timeout_s=2.0)
    job.emit(cut + 2.0, 2, 0, "rank_died", by="supervisor", slot=2, how="signal 9", hung=True)
    for r in (0, 1, 3):
        job.emit(cut + 2.1, r, 0, "exit", code=1, error="RuntimeError: connection closed")
    job.attempt_ends[0] = cut + 2.5
    record = _finish(job, job.steps(job.start(cut + 4.0, 1, restore=6), 1, 7, 12), 1)
    s = parse_scenario({**SCENARIO, "trainer": {**SCENARIO["trainer"], "nodes": 2},
                        "faults": [{"kind": "drop_link", "at_step": 6, "duration_s": 3},
                                   {"kind": "hang_rank", "rank": 2, "at_step": 6,
                                    "duration_s": 20}],
                        "expect": {"bitwise_equal_to_reference": False}})
    cut_t, hang = [measure.fault_timings(record, i, window_s=measure.detection_window_s(s))
                   for i in record.injections]
    assert hang.effect_observed and hang.ended_attempt == 0
    assert cut_t.effect_observed is False, cut_t.effect
    assert cut_t.ended_attempt is None and cut_t.recovery_s is None
    assert "hang_rank" in (cut_t.effect or ""), cut_t.effect
    v = checker.judge(s, returncode=0, timings=[cut_t, hang], final_step=12,
                      faulty_url="unused", reference_url=None, final_committed=True)
    assert v.verdict == "fail"
    assert any(r.startswith("drop_link at step 6: no observable effect") for r in v.reasons)


def test_a_missed_fault_fails_and_a_skipped_one_is_skipped() -> None:
    job = _Job()
    t = job.steps(job.start(T0 + 1.0, 0), 0, 1, 12)
    job.injections.append(Injection("corrupt_shard", T0 + 1.6, step=1, fault_index=0,
                                    missed="no committed checkpoint to corrupt"))
    record = _finish(job, t, 0)
    # by time: at step 1, before the first save, validation refuses a corrupt_shard
    v, (corrupt,) = _verdict(record, [{"kind": "corrupt_shard", "at_s": 0.6}])
    assert corrupt.effect_observed is False and v.verdict == "fail"
    assert v.reasons == ["corrupt_shard at step 1: no observable effect: not made: no committed "
                         "checkpoint to corrupt"]

    job = _Job()
    t = job.steps(job.start(T0 + 1.0, 0), 0, 1, 12)
    job.injections.append(Injection("drop_link", T0 + 2.6, step=2, fault_index=0,
                                    skipped="network namespaces "
                                    "unavailable: creating them needs root"))
    s = parse_scenario({**SCENARIO, "trainer": {**SCENARIO["trainer"], "nodes": 2},
                        "faults": [{"kind": "drop_link", "at_step": 2}],
                        "expect": {"bitwise_equal_to_reference": False}})
    timings = [measure.fault_timings(_finish(job, t, 0), i) for i in job.injections]
    judged = dict(returncode=0, timings=timings, final_step=12, faulty_url="unused",
                  reference_url=None, final_committed=True)
    v = checker.judge(s, **judged)  # type: ignore[arg-type]
    assert v.verdict == "skipped" and timings[0].effect_observed is None
    assert v.reasons == ["drop_link at step 2: skipped: network namespaces unavailable: "
                         "creating them needs root"]
    v = checker.judge(s, **{**judged, "final_step": 11})  # type: ignore[arg-type]
    assert v.verdict == "fail", "a failure wins over a skip"
    assert v.reasons == ["the run ended at step 11, not 12"]


def test_a_fault_that_never_fired_fails() -> None:
    job = _Job()
    record = _finish(job, job.steps(job.start(T0 + 1.0, 0), 0, 1, 12), 0)
    v, _ = _verdict(record, [KILL, {"kind": "kill_rank", "rank": 0, "mtbf_s": 100}])
    assert v.verdict == "fail"
    assert v.reasons == [f"faults.{i} (kill_rank): never injected (its trigger was never "
                         "reached)" for i in (0, 1)]


def test_every_fault_must_fire_not_every_kind() -> None:
    """Two kill_rank faults: the first (mtbf_s) fires twice, the second never. Counting per
    kind (2 kill_rank wanted, 2 made) would pass; each fault of the scenario must have fired."""
    job = _Job()
    t = job.steps(job.start(T0 + 1.0, 0), 0, 1, 5)
    t = _kill(job, t + 0.05, 0, 0, 5, fault_index=0)
    t = job.steps(job.start(t + 1.0, 1, restore=4), 1, 5, 9)
    t = _kill(job, t + 0.05, 1, 0, 9, fault_index=0)
    t = job.steps(job.start(t + 1.0, 2, restore=8), 2, 9, 12)
    faults = [{"kind": "kill_rank", "rank": 0, "mtbf_s": 20},
              {"kind": "kill_rank", "rank": 1, "mtbf_s": 3600}]
    v, timings = _verdict(_finish(job, t, 2), faults)
    assert [t.fault_index for t in timings] == [0, 0]
    assert all(t.effect_observed for t in timings), [t.effect for t in timings]
    assert v.verdict == "fail"
    assert v.reasons == ["faults.1 (kill_rank): never injected (its trigger was never "
                         "reached)"]


def test_a_fault_that_hit_another_step_than_its_own_fails() -> None:
    """A kill due at step 7 that hit the job at step 11 (the job was not held where the fault
    was due) ended an attempt and was recovered from, but not where the scenario says."""
    job = _Job()
    t = job.steps(job.start(T0 + 1.0, 0), 0, 1, 11)
    t = _kill(job, t + 0.05, 0, 1, 7)
    t = job.steps(job.start(t + 3.0, 1, restore=10), 1, 11, 12)
    v, (kill,) = _verdict(_finish(job, t, 1), [KILL])
    assert kill.effect_observed and kill.injected_step == 11
    assert v.verdict == "fail"
    assert v.reasons == ["faults.0 (kill_rank): due at step 7, but it hit the job at step 11"]


def test_a_fault_due_on_a_later_pass_that_hit_an_earlier_one_fails() -> None:
    """A kill due the second time the job gets to step 7 (``on_pass: 2``) hit it the first
    time, in attempt 0: the crash loop the scenario asks for was not made."""
    # the kill of rank 0 at step 11 is what could bring pass 2 (a scenario without another
    # fault that ends an attempt is refused: chaos validate)
    job = _Job()
    t = job.steps(job.start(T0 + 1.0, 0), 0, 1, 7)
    t = _kill(job, t + 0.05, 0, 1, 7)
    t = job.steps(job.start(t + 3.0, 1, restore=6), 1, 7, 11)
    t = _kill(job, t + 0.05, 1, 0, 11, fault_index=1)
    t = job.steps(job.start(t + 3.0, 2, restore=10), 2, 11, 12)
    v, (kill, _) = _verdict(_finish(job, t, 2), [{**KILL, "on_pass": 2},
                                                 {**KILL, "rank": 0, "at_step": 11}])
    assert kill.effect_observed and kill.injected_step == 7 and kill.times_at_step == 1
    assert v.verdict == "fail"
    assert v.reasons == ["faults.0 (kill_rank): due on pass 2 of step 7, but the job had got "
                         "there 1 time(s) when it hit"]
    # made on its pass: attempt 1 restored step 6 and got to step 7 again
    job = _Job()
    t = job.steps(job.start(T0 + 1.0, 0), 0, 1, 7)
    t = _kill(job, t + 0.05, 0, 1, 7)
    t = job.steps(job.start(t + 3.0, 1, restore=6), 1, 7, 7)
    t = _kill(job, t + 0.05, 1, 1, 7, fault_index=1)
    t = job.steps(job.start(t + 3.0, 2, restore=6), 2, 7, 12)
    v, (_, second) = _verdict(_finish(job, t, 2), [KILL, {**KILL, "on_pass": 2}])
    assert second.times_at_step == 2 and v.verdict == "pass", v.reasons


def test_the_runner_tags_each_injection_with_its_fault() -> None:
    """Step- and checkpoint-triggered faults sharing a pause point keep their scenario index,
    which the checker counts by (a copy of the fault made for a save phase too)."""
    from antifragile.chaos.run import pauses

    s = parse_scenario({**SCENARIO, "faults": [
        {"kind": "kill_rank", "rank": 0, "mtbf_s": 50},
        {"kind": "kill_rank", "rank": 1, "at_step": 4},
        {"kind": "hang_rank", "rank": 0, "at_step": 4},
        {"kind": "crash_during_save", "rank": "random", "at_checkpoint": 1}]})
    pending = [pauses.Pending(f, i) for i, f in enumerate(s.faults)]
    points = pauses.pause_plan(s, pending, Draws(0))
    assert [p.index for p in pending] == [0]
    planned = sorted((i, f.kind) for point in points.values() for i, f in point.faults)
    assert planned == [(1, "kill_rank"), (2, "hang_rank"), (3, "crash_during_save")]


def test_a_random_faults_target_picks_do_not_depend_on_how_often_its_arrivals_were_redrawn(
        ) -> None:
    """A ``rank: random`` kill with ``mtbf_s``: an arrival that comes while the job is down is
    drawn again, and how many are depends on how long the restarts take. One generator served
    the arrivals and the picks, so with the same seed the rank each kill hit depended on that
    count: the seed did not fix which ranks a run killed. The k-th kill picks the same rank
    whatever came before it now (its arrival times still differ)."""
    from antifragile.chaos.faults.base import Target
    from antifragile.chaos.run import pauses, runner

    s = parse_scenario({**SCENARIO, "seed": 7, "faults": [
        {"kind": "kill_rank", "rank": "random", "mtbf_s": 5},
        {"kind": "kill_rank", "rank": "random", "mtbf_s": 3}]})

    def picks(down: int) -> list[list[int]]:
        """Each fault's first 8 picks, the first ``down`` arrivals coming while the job is
        down (drawn again: nothing picked)."""
        pending = [pauses.Pending(f, i, next_t=0.0) for i, f in enumerate(s.faults)]
        draws = Draws(s.seed)
        arrivals = 0
        picked: list[list[int]] = [[], []]

        def up() -> bool:
            nonlocal arrivals
            arrivals += 1
            return arrivals > down

        def make(p: pauses.Pending, rng: random.Random) -> None:
            target = Target(pids={r: 100 + r for r in range(WORLD)}, coordinates={},
                            ckpt_url="unused", rng=rng, started=dict.fromkeys(range(WORLD)))
            picked[p.index].append(target.resolve("random"))

        while min(len(p) for p in picked) < 8:
            runner._time_faults(pending, min(p.next_t or 0.0 for p in pending), up, draws, make)
        return [p[:8] for p in picked]

    assert len({str(picks(down)) for down in range(6)}) == 1


def test_faults_at_one_step_on_different_passes_get_a_pause_point_each() -> None:
    """Two kills at step 4 land together (one point); a third with ``on_pass: 2`` gets its own
    point, held the second time the job gets to step 4."""
    from antifragile.chaos.run import pauses

    s = parse_scenario({**SCENARIO, "faults": [
        {"kind": "kill_rank", "rank": 1, "at_step": 4},
        {"kind": "kill_rank", "rank": 0, "at_step": 4},
        {"kind": "kill_rank", "rank": 1, "at_step": 4, "on_pass": 2}]})
    pending = [pauses.Pending(f, i) for i, f in enumerate(s.faults)]
    points = pauses.pause_plan(s, pending, Draws(0))
    assert [(p.as_json(), [i for i, _ in p.faults]) for p in points.values()] == [
        ({"id": "p0", "step": 4}, [0, 1]), ({"id": "p1", "step": 4, "pass": 2}, [2])]


def test_a_fault_of_a_later_pass_alone_at_its_step_waits_for_that_pass(tmp_path: Path) -> None:
    """``on_pass: 3`` with no fault of passes 1 and 2 at step 4: the trainer holds the lowest
    pass not yet released at a step, and the kill's point was the only one there, so it held
    the first time the job got to step 4 and the kill landed two passes early. The passes
    before it hold too now, with nothing due (chaos releases them at once)."""
    from antifragile.chaos.run import pauses
    from antifragile.trainer.pause import PausePoints

    s = parse_scenario({**SCENARIO, "faults": [  # the kill at step 2 brings the passes
        {"kind": "kill_rank", "rank": 1, "at_step": 4, "on_pass": 3},
        {"kind": "kill_rank", "rank": 0, "at_step": 2}]})
    pending = [pauses.Pending(f, i) for i, f in enumerate(s.faults)]
    points = pauses.pause_plan(s, pending, Draws(0))
    pauses.write_plan(tmp_path, points)

    def faults_held_passing_step_4() -> list[list[int]]:
        """A new process of rank 0 (the job back before step 4): the faults of each point it
        held there, each released as soon as it is reached."""
        held: list[list[int]] = []

        def emit(event: str, **fields: Any) -> None:
            if event == "paused":
                point = points[fields["point"]]
                held.append([i for i, _ in point.faults])
                pauses.release(tmp_path, point)

        PausePoints(str(tmp_path), 0, emit).step_end(4)
        return held

    assert [faults_held_passing_step_4() for _ in range(4)] == [[[]], [[]], [[0]], []]


def test_a_pause_point_reached_again_by_a_newer_generation_holds_from_its_first_pause() -> None:
    """Rank 0 of attempt 0 reached the point of step 4 and was held; rank 1 died before it got
    there, and attempt 1 reached it 30 s later. The hold counted from attempt 0's first pause,
    so the restart in between was taken for time chaos held the trainer and left out of the
    wall time: goodput came out higher than the run's."""
    from antifragile.chaos.run import pauses, runner

    point = pauses.Point("p0", 4, None)
    job = runner._Job(WORLD)
    for attempt in (0, 1):
        for rank in range(WORLD):
            job.see({"event": "start", "attempt": attempt, "rank": rank, "pid": 100 + rank,
                     "t": T0 + attempt})
        if attempt == 0:
            assert not job.all_paused(point, {"attempt": 0, "rank": 0, "t": T0 + 10.0})
    held = [job.all_paused(point, {"attempt": 1, "rank": r, "t": T0 + 40.0 + r / 10})
            for r in range(WORLD)]
    assert held == [False] * (WORLD - 1) + [True]
    assert point.first_paused_t == T0 + 40.0


def test_a_pause_point_held_by_a_generation_that_ended_waits_for_the_next_one() -> None:
    """Ranks 0-2 of attempt 0 were held at step 4's point when another fault killed rank 3
    before it got there; attempt 0 ended, and attempt 1's first start came more than the
    detection window after the last pause. The point was given up as never reached, its kill
    missed with a reason blaming the script ("a script must call antifragile.probe.step_end on
    every rank"), though the trainer holds the next generation there again. It waits for
    attempt 1 now, whose ranks it holds, so the kill lands there. A rank of the newest
    generation, still running, that never comes still has the point given up."""
    from antifragile.chaos.run import pauses, runner

    point = pauses.Point("p0", 4, None)
    job = runner._Job(WORLD)
    now = time.time()
    me = os.getpid()  # a process that runs: the ranks are alive until an event says otherwise
    for rank in range(WORLD):
        job.see({"event": "start", "attempt": 0, "rank": rank, "pid": me, "t": now})
    for rank in range(WORLD - 1):
        assert not job.all_paused(point, {"attempt": 0, "rank": rank, "t": now - 30.0})
    assert job.waits_in_vain(point, now, 10.0)  # attempt 0 runs: rank 3 never came
    job.see({"event": "rank_died", "attempt": 0, "rank": WORLD - 1, "t": now - 25.0})
    for rank in range(WORLD - 1):
        job.see({"event": "generation_end", "attempt": 0, "rank": rank, "t": now - 25.0})
    assert job.ended(0)
    assert not job.waits_in_vain(point, now, 10.0)  # attempt 1 not started yet
    for rank in range(WORLD):
        job.see({"event": "start", "attempt": 1, "rank": rank, "pid": me, "t": now})
    assert not job.waits_in_vain(point, now, 10.0)
    held = [job.all_paused(point, {"attempt": 1, "rank": r, "t": now + 1.0})
            for r in range(WORLD)]
    assert held == [False] * (WORLD - 1) + [True]


def test_a_hold_costs_the_job_from_the_last_rank_s_arrival_not_the_first() -> None:
    """Rank 1 was stopped (a hang fault) for 30 s before it got to step 4's pause point, where
    rank 0 was held meanwhile. Without the hold rank 0 would have waited for rank 1 in the next
    step's collectives all the same: chaos's hold cost the job only from rank 1's arrival to
    the release. Counted from rank 0's arrival, the hang's 30 s were left out of the wall
    time as chaos's, and goodput came out higher than the run's."""
    from antifragile.chaos.run import pauses, runner

    point = pauses.Point("p0", 4, None)
    job = runner._Job(2)
    for rank in range(2):
        job.see({"event": "start", "attempt": 0, "rank": rank, "pid": 100 + rank, "t": T0})
    assert not job.all_paused(point, {"attempt": 0, "rank": 0, "t": T0 + 10.0})
    assert job.all_paused(point, {"attempt": 0, "rank": 1, "t": T0 + 40.0})
    job.hold_ended(point, T0 + 40.5, complete=True)
    assert job.paused_s == pytest.approx(0.5)
    # a point given up as never reached (a rank that never comes): the held ranks waited for
    # chaos from the first arrival
    given_up = pauses.Point("p1", 6, None)
    assert not job.all_paused(given_up, {"attempt": 0, "rank": 0, "t": T0 + 50.0})
    job.hold_ended(given_up, T0 + 70.0, complete=False)
    assert job.paused_s == pytest.approx(20.5)


def test_a_kill_during_the_recovery_of_the_previous_one_interrupts_it_without_failing() -> None:
    """Rank 1 dies at step 7; attempt 1 starts, and rank 0 dies before attempt 1 restored:
    the first recovery was cut short by the second fault, whose recovery covers both. Not a
    missing recovery (the job came back), so the verdict passes and the report says so."""
    job = _Job()
    t = job.steps(job.start(T0 + 1.0, 0), 0, 1, 7)
    t = _kill(job, t + 0.05, 0, 1, 7)
    second = job.start(t + 1.0, 1)  # started, killed before any restore or step
    t = _kill(job, second + 0.1, 1, 0, 7, fault_index=1)
    t = job.steps(job.start(t + 1.0, 2, restore=6), 2, 7, 12)
    v, (first, last) = _verdict(_finish(job, t, 2), [KILL, {**KILL, "rank": 0}])
    assert first.ended_attempt == 0 and first.recovery_s is None and first.restored_step is None
    assert first.interrupted_by_t == pytest.approx(second + 0.1)
    assert last.ended_attempt == 1 and last.restored_step == 6 and last.recovery_s is not None
    assert v.verdict == "pass", v.reasons


def _interrupted_after(gap_s: float) -> RunRecord:
    """Rank 1 dies at step 7; attempt 1 starts and is still not back at step 7 when rank 0
    dies ``gap_s`` after the first kill; attempt 2 restores step 6 and finishes."""
    job = _Job()
    t = job.steps(job.start(T0 + 1.0, 0), 0, 1, 7)
    first = t + 0.05
    t = _kill(job, first, 0, 1, 7)
    job.start(t + 1.0, 1)
    t = _kill(job, first + gap_s, 1, 0, 7, fault_index=1)
    return _finish(job, job.steps(job.start(t + 1.0, 2, restore=6), 2, 7, 12), 2)


def test_a_recovery_cut_short_after_it_overran_max_recovery_s_fails() -> None:
    """The first recovery was cut short 20 s after its fault, with max_recovery_s 10: it had
    already taken longer than allowed, whatever the second recovery measures. The verdict
    passed, because only measured recoveries were held to the bound."""
    faults = [KILL, {**KILL, "rank": 0}]
    v, (first, _) = _verdict(_interrupted_after(20.0), faults, max_recovery_s=10)
    assert first.recovery_s is None and first.interrupted_by_t is not None
    assert v.verdict == "fail"
    assert any("kill_rank at step 7: recovery had taken 20.0 s > max_recovery_s 10" in r
               and "when the next fault cut it short" in r for r in v.reasons), v.reasons
    v, _ = _verdict(_interrupted_after(3.0), faults, max_recovery_s=10)
    assert v.verdict == "pass", v.reasons


def test_a_recovery_that_trained_no_step_after_its_restore_fails() -> None:
    """A kill after the last step's save committed (an ``at_s`` fault that came late; one at
    the last checkpoint is refused at validation): the job restarts, restores that step and
    has nothing left to train. The final checkpoint compared with the reference is the one
    saved before the kill; what the restore loaded was never saved again, so the run proves
    nothing about the recovery. It passed."""
    job = _Job()
    t = job.steps(job.start(T0 + 1.0, 0), 0, 1, 12)
    t = _kill(job, t + 0.5, 0, 1, 12)
    t = job.start(t + 3.0, 1, restore=12)
    v, (kill,) = _verdict(_finish(job, t, 1), [{"kind": "kill_rank", "rank": 1,
                                                 "at_s": 5.0}])
    assert kill.effect_observed and kill.restored_step == 12 and kill.recovery_s is not None
    assert v.verdict == "fail"
    assert v.reasons == ["kill_rank at step 12: the job restored step 12 and trained no step "
                         "after it: the final state is the checkpoint saved before the fault, "
                         "which proves nothing about the recovery"]


def test_a_random_fault_that_also_struck_after_the_last_step_passes_on_its_earlier_recovery(
        ) -> None:
    """An ``mtbf_s`` kill fires twice: at step 7 (attempt 1 restores step 6 and trains on to
    12) and again after the final save, where the job restores 12 and has nothing to train.
    The fault's recovery was proven by its first firing; where a random arrival lands is not
    the scenario's to choose, so the late one does not fail a nightly run by chance. A fault
    with no recovery followed by training still fails (the test above)."""
    job = _Job()
    t = job.steps(job.start(T0 + 1.0, 0), 0, 1, 7)
    t = _kill(job, t + 0.1, 0, 1, 7)
    t = job.steps(job.start(t + 3.0, 1, restore=6), 1, 7, 12)
    t = _kill(job, t + 0.5, 1, 1, 12)
    t = job.start(t + 3.0, 2, restore=12)
    v, timings = _verdict(_finish(job, t, 2), [{"kind": "kill_rank", "rank": 1, "mtbf_s": 20}])
    assert [k.restored_step for k in timings] == [6, 12]
    assert v.verdict == "pass", v.reasons


def test_a_kill_after_a_restore_and_before_any_step_charges_no_step_twice() -> None:
    """Rank 1 dies at step 9; attempt 1 restores step 8 and a random kill hits it before its
    first step (the runner's step is still 9, the highest it saw). Step 9 is trained twice in
    all, charged to the first fault: the second hit a trainer at step 8 and lost nothing."""
    job = _Job()
    t = job.steps(job.start(T0 + 1.0, 0), 0, 1, 9)
    t = _kill(job, t + 0.05, 0, 1, 9)
    t = _kill(job, job.start(t + 1.0, 1, restore=8) + 0.05, 1, 0, 9, fault_index=1)
    t = job.steps(job.start(t + 1.0, 2, restore=8), 2, 9, 12)
    v, (first, second) = _verdict(_finish(job, t, 2), [
        KILL_AT_9, {"kind": "kill_rank", "rank": "random", "mtbf_s": 30}])
    assert (first.restored_step, first.lost_steps) == (8, 1)
    assert (second.injected_step, second.restored_step, second.lost_steps) == (8, 8, 0)
    assert second.recompute_s == 0.0 and second.recovery_s is not None
    assert v.verdict == "pass", v.reasons


def test_a_kill_during_a_restore_charges_the_steps_of_the_attempt_before_it() -> None:
    """Attempt 0 reaches step 9 (its save of step 8 fails) and loses rank 1; attempt 1
    restores step 6, trains step 7 and is killed; attempt 2 is killed while it restores (the
    runner's step is still 9); attempt 3 restores step 6 and finishes. Trained more than once:
    steps 7-9 of attempt 0 and step 7 of attempt 1, four in all, each charged once."""
    job = _Job()
    t = job.steps(job.start(T0 + 1.0, 0), 0, 1, 9, failing=frozenset({8}))
    t = _kill(job, t + 0.05, 0, 1, 9)
    t = job.steps(job.start(t + 1.0, 1, restore=6), 1, 7, 7)
    t = _kill(job, t + 0.05, 1, 0, 9, fault_index=1)
    t = job.start(t + 1.0, 2)
    for r in range(WORLD):
        job.emit(t + 0.1, r, 2, "restore_begin")
    t = _kill(job, t + 0.2, 2, 1, 9, fault_index=1)
    t = job.steps(job.start(t + 1.0, 3, restore=6), 3, 7, 12)
    v, timings = _verdict(_finish(job, t, 3), [
        KILL_AT_9, {"kind": "kill_rank", "rank": "random", "mtbf_s": 30}])
    assert [k.injected_step for k in timings] == [9, 7, 7]
    assert [k.lost_steps for k in timings] == [3, None, 1]
    assert v.verdict == "pass", v.reasons


def test_what_a_killed_rank_wrote_before_the_kill_took_effect_is_not_going_on() -> None:
    """A kill is timed when its signal is sent (detection counts from there); the rank can
    still write an event before the kernel ends it, a moment later (``done_t``). That event is
    not the rank going on: the kill ended the attempt."""
    job = _Job()
    t = job.steps(job.start(T0 + 1.0, 0), 0, 1, 7)
    t = _kill(job, t + 0.1, 0, 1, 7)
    job.injections[-1].detail["done_t"] = t - 0.6 + 0.05
    job.emit(t - 0.6 + 0.01, 1, 0, "step_begin", step=8)  # written as the signal arrived
    t = job.steps(job.start(t + 3.0, 1, restore=6), 1, 7, 12)
    v, (kill,) = _verdict(_finish(job, t, 1), [KILL])
    assert v.verdict == "pass", v.reasons
    assert kill.detect_s is not None and kill.detect_s > 0.5


def test_a_generation_that_failed_before_it_started_is_not_the_recovery() -> None:
    """Ranks 1 and 2 die at one point; in process, the generation published for the first
    death fails before its members meet (the second death is found meanwhile) and writes no
    event, so the job comes back as generation 2. The recovery is that generation's, not
    "no recovery" for want of a generation 1."""
    job = _Job()
    t = job.steps(job.start(T0 + 1.0, 0), 0, 1, 7)
    for rank in (1, 2):
        job.injections.append(Injection("kill_rank", t + 0.05, step=7, rank=rank,
                                        fault_index=rank - 1, detail={"pid": 1000 + rank}))
    job.attempt_ends[0] = t + 0.6
    t = job.steps(job.start(t + 3.6, 2, restore=6), 2, 7, 12)
    v, timings = _verdict(_finish(job, t, 2), [KILL, {**KILL, "rank": 2}])
    for kill in timings:
        assert kill.ended_attempt == 0 and kill.restored_step == 6, kill
        # to generation 2's restore beginning (0.1 s after its start)
        assert kill.recovery_s is not None and kill.restart_s == pytest.approx(3.1, abs=0.05)
    assert v.verdict == "pass", v.reasons


def test_a_hang_that_a_kill_in_the_same_attempt_masked_is_not_credited() -> None:
    """A kill of rank 1 and a stop of rank 3 at one pause point: the kill ends the attempt
    before any watchdog could see the hang, and the stopped rank writes nothing, which was
    taken for the hang's own effect (it was credited with the kill's restart and recovery)."""
    job = _Job()
    t = job.steps(job.start(T0 + 1.0, 0), 0, 1, 7)
    job.injections.append(Injection("hang_rank", t + 0.04, step=7, rank=3, fault_index=1,
                                    detail={"pid": 1003, "duration_s": 20.0}))
    stopped_t = t + 0.04
    t = _kill(job, t + 0.05, 0, 1, 7, fault_index=0)
    job.events = [e for e in job.events if not (e["rank"] == 3 and e["t"] > stopped_t)]
    t = job.steps(job.start(t + 3.0, 1, restore=6), 1, 7, 12)
    v, (hang, kill) = _verdict(_finish(job, t, 1), [
        KILL, {"kind": "hang_rank", "rank": 3, "at_step": 7, "duration_s": 20}])
    assert kill.effect_observed and kill.ended_attempt == 0
    assert hang.effect_observed is False and hang.recovery_s is None
    assert "masked" in (hang.effect or "") and "kill_rank" in (hang.effect or ""), hang.effect
    assert v.verdict == "fail"


def test_two_random_kills_at_one_point_hit_two_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ``rank: random`` kills at one pause point drew the same rank: the second SIGKILL
    went to the dead, not yet reaped process (it succeeds on a zombie) and counted as made."""
    import signal

    from antifragile.chaos.faults import base
    from antifragile.chaos.faults.kill_rank import KillRank

    sent: list[int] = []
    dead: set[int] = set()

    def kill(pid: int, sig: int) -> None:
        if sig == signal.SIGKILL:
            sent.append(pid)
            dead.add(pid)

    monkeypatch.setattr(base.os, "kill", kill)
    monkeypatch.setattr(base.os, "getpgid", lambda pid: 1)  # not group leaders: os.kill
    monkeypatch.setattr(base, "alive", lambda pid: pid not in dead)
    monkeypatch.setattr(base, "start_time", lambda pid: None if pid in dead else pid)
    for seed in range(20):
        sent.clear()
        dead.clear()
        target = base.Target(pids={0: 100, 1: 101, 2: 102}, coordinates={}, ckpt_url="unused",
                             rng=random.Random(seed))
        fault = KillRank(kind="kill_rank", rank="random", at_step=3)
        made = [fault.inject(target, 3) for _ in range(2)]
        assert [m.missed for m in made] == [None, None], seed
        assert len(set(sent)) == 2 and made[0].rank != made[1].rank, seed
    dead.clear()
    target = base.Target(pids={0: 100}, coordinates={}, ckpt_url="unused", rng=random.Random(0))
    first, again = (KillRank(kind="kill_rank", rank=0, at_step=3).inject(target, 3)
                    for _ in range(2))
    assert first.missed is None and again.missed and "already" in again.missed


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_a_hang_of_a_rank_that_had_exited_is_missed_not_skipped(mode: str) -> None:
    """A rank gone when its hang is due: the fault did not happen (``missed``, the verdict
    fails). A thread hang took ptrace's "No such process" for a mechanism unavailable here
    (``skipped``), and the verdict said ``skipped`` instead of ``fail``."""
    import subprocess

    from antifragile.chaos.faults import base
    from antifragile.chaos.faults.hang_rank import HangRank

    gone = subprocess.Popen(["true"])
    gone.wait()
    target = base.Target(pids={0: gone.pid}, coordinates={}, ckpt_url="unused",
                         rng=random.Random(0))
    made = HangRank(kind="hang_rank", rank=0, at_step=3, mode=mode).inject(target, 3)
    assert made.skipped is None and made.missed and "already exited" in made.missed


def test_a_hang_of_a_rank_another_hang_holds_is_missed() -> None:
    """Two hangs of one rank that overlap (``mtbf_s`` arrivals closer than ``duration_s``,
    which pick a stopped rank: it is alive): the first one's SIGCONT ended the second one's
    hang early, which was reported as lasting its whole ``duration_s``."""
    import signal
    import subprocess

    from antifragile.chaos.faults import base
    from antifragile.chaos.faults.hang_rank import HangRank

    rank = subprocess.Popen(["sleep", "60"])
    try:
        target = base.Target(pids={0: rank.pid}, coordinates={}, ckpt_url="unused",
                             rng=random.Random(0))
        first = HangRank(kind="hang_rank", rank=0, at_step=3, duration_s=0.3).inject(target, 3)
        second = HangRank(kind="hang_rank", rank=0, at_step=4, duration_s=30).inject(target, 4)
        assert first.missed is None
        assert second.missed is not None and "stopped already" in second.missed, second
    finally:
        rank.send_signal(signal.SIGCONT)
        rank.kill()
        rank.wait()


def test_a_corruption_of_a_checkpoint_without_array_shards_is_missed(tmp_path: Path) -> None:
    """A committed checkpoint that holds no shard of an array with dimensions (a script's
    state of 0-d tensors and JSON values): corrupt_shard drew from an empty list and its
    IndexError ended the whole chaos run in a traceback, with no report."""
    from antifragile.chaos.faults import Target
    from antifragile.chaos.faults.corrupt_shard import CorruptShard

    url = str(tmp_path / "ckpt")
    with CheckpointEngine(url) as engine:
        engine.save(5, {"step": 5, "lr": torch.tensor(0.5)}, blocking=True)
    target = Target(pids={}, coordinates={}, ckpt_url=url, rng=random.Random(0))
    made = CorruptShard(kind="corrupt_shard", at_step=6).inject(target, 6)
    assert made.skipped is None
    assert made.missed == "checkpoint 5 has no array shard to corrupt", made
    with CheckpointEngine(url) as engine:
        assert engine.verify(5).ok


@pytest.mark.parametrize(("held_by", "mode"),
                         [("thread", "thread"), ("thread", "process"), ("process", "thread")])
def test_a_hang_of_a_rank_a_hang_of_the_other_mode_holds_is_missed(held_by: str,
                                                                    mode: str) -> None:
    """A rank whose training thread a thread hang holds (ptrace: state ``t``) or that a
    process hang holds (``T``), due for another hang: the fault did not happen. A second
    thread hang was refused by ptrace (EPERM: traced already) and reported *skipped* (the
    scenario's verdict: not tested here); a process hang waited 5 s for a stop the held
    thread never shows and was reported made; a thread hang of a SIGSTOPped rank was reported
    made although the rank was stopped already."""
    import subprocess
    import sys

    from antifragile.chaos.faults import base
    from antifragile.chaos.faults.hang_rank import HangRank

    rank = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.01)"])
    try:
        target = base.Target(pids={0: rank.pid}, coordinates={}, ckpt_url="unused",
                             rng=random.Random(0))
        first = HangRank(kind="hang_rank", rank=0, at_step=3, duration_s=30,
                         mode=held_by).inject(target, 3)
        began = time.monotonic()
        second = HangRank(kind="hang_rank", rank=0, at_step=4, duration_s=30,
                          mode=mode).inject(target, 4)
        assert first.missed is None and first.skipped is None
        assert second.skipped is None, second
        assert second.missed is not None and "stopped already" in second.missed, second
        assert time.monotonic() - began < 2.0
    finally:
        rank.kill()
        rank.wait()


def test_a_signal_to_a_worker_that_leads_its_session_reaches_what_it_started() -> None:
    """A script launched through a wrapper (``command: [./train.sh]``) without the probe: the
    worker torchrun started is the shell, and a SIGKILL of the shell alone left the training
    process running, orphaned, still writing its checkpoints."""
    import signal
    import subprocess

    from antifragile.chaos.faults import base

    wrapper = subprocess.Popen(["bash", "-c", "sleep 60 & echo $!; wait"],
                               start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert wrapper.stdout is not None
    trainer = int(wrapper.stdout.readline())
    target = base.Target(pids={0: wrapper.pid}, coordinates={}, ckpt_url="unused",
                         rng=random.Random(0))
    assert target.signal(0, signal.SIGKILL) is None
    wrapper.wait(10)
    deadline = time.monotonic() + 5.0
    while base.alive(trainer) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not base.alive(trainer), "the wrapped training process outlived the kill"


def test_after_a_storage_fault_a_peer_engines_committed_steps_are_read_back(
        tmp_path: Path) -> None:
    """disk_full on a DCP (or torchsnapshot) run: every committed step left must read back,
    as for our engine. Our engine's verifier sees no COMMIT in a DCP folder, so it verified
    nothing and reported every step intact (``{}``): a torn step 4 went unnoticed."""
    import torch.distributed.checkpoint as dcp

    for step in (4, 8):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"model": {"w": torch.full((256,), float(step))}},
                     checkpoint_id=str(tmp_path / f"step_{step:09d}"))
    url = str(tmp_path)
    assert checker.verify_committed(url, engine="dcp") == {4: [], 8: []}
    data = next((tmp_path / "step_000000004").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:100])  # a save torn by the full disk
    found = checker.verify_committed(url, engine="dcp")
    assert found[8] == [] and found[4] and "could not be read back" in found[4][0]


def test_a_damaged_dcp_final_checkpoint_is_a_failed_comparison_not_a_crash(
        tmp_path: Path) -> None:
    """DCP raises a CheckpointException, a BaseException: ``except Exception`` let it out of
    the verdict, and ``chaos run`` (and the rest of a suite) died with a traceback, no
    report."""
    import torch.distributed.checkpoint as dcp

    for run in ("ref", "faulty"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"model": {"w": torch.ones(256)}},
                     checkpoint_id=str(tmp_path / run / f"step_{STEPS:09d}"))
    data = next((tmp_path / "faulty" / f"step_{STEPS:09d}").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:100])
    comparison = checker.compare_final(str(tmp_path / "faulty"), str(tmp_path / "ref"), STEPS,
                                       engine="dcp")
    assert not comparison.equal and "cannot read the final dcp checkpoint" in (
        comparison.error or "")


def _held_while_recomputing(held_s: float) -> RunRecord:
    """Rank 1 dies at step 9 (its save of step 8 failed); attempt 1 restores step 6 and,
    recomputing, is held ``held_s`` at a pause point at the end of step 7 (a later pass's
    fault due there, or an earlier pass of one, released at once); it catches up at step 9
    and finishes."""
    job = _Job()
    t = job.steps(job.start(T0 + 1.0, 0), 0, 1, 9, failing=frozenset({8}))
    t = _kill(job, t + 0.05, 0, 1, 9)
    t = job.steps(job.start(t + 3.0, 1, restore=6), 1, 7, 7)
    if held_s:
        for r in range(WORLD):
            job.emit(t + 0.01, r, 1, "paused", point="p1", step=7)
            job.emit(t + 0.01 + held_s, r, 1, "resumed", point="p1", held_s=held_s)
    t = job.steps(t + held_s, 1, 8, 12)
    return _finish(job, t, 1)


def test_a_hold_at_a_pause_point_during_a_recovery_is_not_recovery_time() -> None:
    """Time chaos held the trainer at a pause point is the test's, not the job's (goodput
    leaves it out of the wall time): a hold while the next attempt recomputes was counted in
    the fault's recompute and recovery."""
    (plain,) = _verdict(_held_while_recomputing(0.0), [KILL_AT_9])[1]
    v, (held,) = _verdict(_held_while_recomputing(20.0), [KILL_AT_9], max_recovery_s=10)
    assert (held.restored_step, held.lost_steps) == (6, 3)
    assert held.recompute_s == pytest.approx(plain.recompute_s)
    assert held.recovery_s == pytest.approx(plain.recovery_s)
    assert v.verdict == "pass", v.reasons


def test_restore_time_is_the_restore_not_the_start_up_before_it() -> None:
    """The next attempt's ranks start, build their model (2 s), then restore (0.3 s, as
    ``restore_end`` says): the build was counted as restore time, which the timeline plot
    draws as start-up before the restore; it belongs to the re-form/restart."""
    job = _Job()
    t = job.steps(job.start(T0 + 1.0, 0), 0, 1, 7)
    t = _kill(job, t + 0.05, 0, 1, 7)
    started = t + 3.0
    for r in range(WORLD):
        job.emit(started + 0.01 * r, r, 1, "start", pid=1010 + r, world_size=WORLD)
        job.emit(started + 2.0, r, 1, "restore_begin")
        job.emit(started + 2.3, r, 1, "restore_end", step=6, seconds=0.3)
    t = job.steps(started + 2.4, 1, 7, 12)
    v, (kill,) = _verdict(_finish(job, t, 1), [KILL])
    assert v.verdict == "pass", v.reasons
    assert kill.restore_s == pytest.approx(0.3)
    assert kill.detect_s + kill.restart_s == pytest.approx(started + 2.0 - job.injections[0].t)
    assert kill.recovery_s == pytest.approx(kill.detect_s + kill.restart_s + kill.restore_s
                                            + kill.recompute_s)


def test_a_recovery_is_cut_short_only_by_a_fault_that_ended_the_next_attempt() -> None:
    """Rank 1 dies at step 7; attempt 1 restores step 6, a ``corrupt_shard`` damages step 6 on
    storage, and attempt 1 dies on its own before it is back at step 7 (no fault ended it);
    attempt 2 skips the damaged step, restores 4 and finishes. The damage ended nothing, yet
    the kill's recovery was reported "interrupted by the next fault" and the verdict passed
    a restart that no fault caused, with no recovery from the kill ever seen."""
    job = _Job()
    t = job.steps(job.start(T0 + 1.0, 0), 0, 1, 7)
    t = _kill(job, t + 0.05, 0, 1, 7)
    t = job.start(t + 3.0, 1, restore=6)
    job.injections.append(Injection("corrupt_shard", t + 0.1, step=6, fault_index=1, detail={
        "checkpoint_step": 6, "object": "model/w/c.0", "mode": "bitflip"}))
    for r in range(WORLD):
        job.emit(t + 0.3, r, 1, "exit", code=1, error="RuntimeError: CUDA error")
    job.attempt_ends[1] = t + 0.4
    t = job.steps(job.start(t + 3.0, 2, restore=4, skipped=6), 2, 5, 12)
    v, (kill, corrupt) = _verdict(_finish(job, t, 2), [
        KILL, {"kind": "corrupt_shard", "at_s": 5}])
    assert corrupt.effect_observed
    assert kill.ended_attempt == 0 and kill.recovery_s is None
    assert kill.interrupted_by_t is None
    assert v.verdict == "fail"
    assert any(r.startswith("kill_rank at step 7: no recovery was observed") for r in v.reasons)


def test_a_recovery_is_not_cut_short_by_a_storage_fault_the_next_attempt_rode_out() -> None:
    """Rank 1 dies at step 11 (the saves of steps 8 and 10 were refused); attempt 1 restores
    step 6, a storage outage comes and goes while it trains on (its saves commit after it), and
    attempt 1 then dies on its own before it is back at step 11; attempt 2 restores 10 and
    finishes. The outage ended nothing, yet it was taken to have cut the kill's recovery short,
    and the verdict passed a restart that no fault caused, with no recovery from the kill."""
    job = _Job()
    t = job.steps(job.start(T0 + 1.0, 0), 0, 1, 11, failing=frozenset({8, 10}))
    t = _kill(job, t + 0.05, 0, 1, 11)
    t = job.steps(job.start(t + 3.0, 1, restore=6), 1, 7, 7)
    job.injections.append(Injection("storage_outage", t + 0.05, step=7, fault_index=1, detail={
        "mode": "error", "duration_s": 1.0, "latency_s": None, "ended_t": t + 1.05,
        "requests_faulted": 3, "connections_passed": 0, "requests_delayed": 0}))
    t = job.steps(t + 0.5, 1, 8, 10)
    for r in range(WORLD):
        job.emit(t + 0.5, r, 1, "exit", code=1, error="RuntimeError: CUDA error")
    job.attempt_ends[1] = t + 0.6
    t = job.steps(job.start(t + 3.0, 2, restore=10), 2, 11, 12)
    record = _finish(job, t, 2)
    s = parse_scenario({**SCENARIO, "checkpoint": {"url": "s3://b/p", "every_steps": 2},
                        "faults": [{**KILL, "at_step": 11},
                                   {"kind": "storage_outage", "at_s": 5, "duration_s": 1}],
                        "expect": {"bitwise_equal_to_reference": False}})
    kill, outage = [measure.fault_timings(record, i, window_s=measure.detection_window_s(s))
                    for i in record.injections]
    assert outage.effect_observed and outage.outage is not None
    assert outage.outage["training_continued"], outage.outage
    assert kill.ended_attempt == 0 and kill.recovery_s is None
    assert kill.interrupted_by_t is None
    v = checker.judge(s, returncode=0, timings=[kill, outage], final_step=12,
                      faulty_url="unused", reference_url=None, final_committed=True)
    assert v.verdict == "fail"
    assert any(r.startswith("kill_rank at step 11: no recovery was observed")
               for r in v.reasons), v.reasons


def test_an_outage_that_ended_its_attempt_is_not_excused_by_a_corruption_made_meanwhile() -> None:
    """A storage outage at step 5 fails the save of step 6 and the attempt dies of it (a
    script whose failed save raises); a ``corrupt_shard`` of step 4 is made while the outage
    lasts. A fault on the job that ends the attempt excuses the outage; a corruption ends none,
    yet it was taken for one, and the outage passed as one that training went on through."""
    job = _Job()
    t = job.steps(job.start(T0 + 1.0, 0), 0, 1, 5)
    t0 = t + 0.05
    job.injections.append(Injection("storage_outage", t0, step=5, fault_index=0, detail={
        "mode": "error", "duration_s": 1.0, "latency_s": None, "ended_t": t0 + 1.0,
        "requests_faulted": 3, "connections_passed": 0, "requests_delayed": 0}))
    job.injections.append(Injection("corrupt_shard", t0 + 0.3, step=5, fault_index=1, detail={
        "checkpoint_step": 4, "object": "model/w/c.0", "mode": "bitflip"}))
    t = job.steps(t, 0, 6, 6, failing=frozenset({6}))
    for r in range(WORLD):
        job.emit(t + 0.2, r, 0, "exit", code=1, error="OSError: 503 Service Unavailable")
    job.attempt_ends[0] = t + 0.3
    t = job.steps(job.start(t + 3.0, 1, restore=2, skipped=4), 1, 3, 12)
    record = _finish(job, t, 1)
    s = parse_scenario({**SCENARIO, "checkpoint": {"url": "s3://b/p", "every_steps": 2},
                        "faults": [{"kind": "storage_outage", "at_step": 5, "duration_s": 1},
                                   {"kind": "corrupt_shard", "at_s": 5}],
                        "expect": {"bitwise_equal_to_reference": False}})
    outage, corrupt = [measure.fault_timings(record, i, window_s=measure.detection_window_s(s))
                       for i in record.injections]
    assert corrupt.effect_observed, corrupt.effect
    assert outage.outage is not None and outage.outage["steps_during_outage"] == 1
    assert outage.outage["training_continued"] is False, outage.outage
    v = checker.judge(s, returncode=0, timings=[outage, corrupt], final_step=12,
                      faulty_url="unused", reference_url=None, final_committed=True)
    assert v.verdict == "fail"
    assert any("training did not go on during the outage" in r for r in v.reasons), v.reasons


def test_a_step_superseded_by_a_rollback_before_the_fault_is_not_restorable() -> None:
    """A script rolled back in process (a loss spike) from step 6 to step 4 and committed
    step 5: our engine superseded step 6 (the abandoned run's) before committing 5, so after a
    kill the restart's load resumes from 5. The verdict took step 6, committed before the
    fault, for restorable and failed the run ('work lost for no reason')."""
    def run(restore: int) -> RunRecord:
        job = _Job()
        t = job.steps(job.start(T0 + 1.0, 0), 0, 1, 6)
        for r in range(WORLD):  # the rollback, reported as a restore, then step 5 committed
            job.emit(t + 0.1, r, 0, "restore_end", step=4, seconds=0.1)
            job.emit(t + 0.6, r, 0, "step_end", step=5, seconds=0.45)
            job.emit(t + 0.7, r, 0, "ckpt_committed", step=5, bytes=4_000_000,
                     rank_bytes=1_000_000, persist_s=0.3)
        t = _kill(job, t + 1.0, 0, 1, 6)
        t = job.steps(job.start(t + 3.0, 1, restore=restore), 1, restore + 1, 12)
        return _finish(job, t, 1)

    v, (kill,) = _verdict(run(restore=5), [{**KILL, "at_step": 6}], max_lost_steps=4)
    assert kill.restored_step == 5 and kill.restorable_step == 5, kill
    assert v.verdict == "pass", v.reasons
    v, (kill,) = _verdict(run(restore=4), [{**KILL, "at_step": 6}], max_lost_steps=4)
    assert kill.restorable_step == 5 and v.verdict == "fail", v.reasons


def test_recompute_ends_when_every_rank_is_back_past_the_faults_step() -> None:
    """Recompute is to the job being back at the step the fault hit: every rank through it
    again, as restart and restore end when every rank has started and loaded. It ended at the
    first rank's ``step_end``: in a pipeline the stages finish a step apart (0.065 s of a
    1.14 s recompute in kill-rank-3d), so recompute ran from the last rank's restore to the
    first rank's step and left the rest of the redone step out of the recovery."""
    job = _Job()
    t = job.steps(job.start(T0 + 1.0, 0), 0, 1, 7)
    t = _kill(job, t + 0.05, 0, 1, 7)
    restored = job.start(t + 3.0, 1, restore=6)  # every rank loaded by restored - 0.1
    for r in range(WORLD):  # step 7 again: the last stage first, stage 0 0.3 s later
        job.emit(restored + 0.5 + (0.3 if r < 2 else 0.0), r, 1, "step_end", step=7,
                 loss=_loss(7) if r >= 2 else None, seconds=0.45)
    t = job.steps(restored + 0.8, 1, 8, 12)
    v, (kill,) = _verdict(_finish(job, t, 1), [KILL])
    assert v.verdict == "pass", v.reasons
    assert kill.recompute_s == pytest.approx(restored + 0.8 - (restored - 0.1))
    assert kill.recovery_s == pytest.approx(restored + 0.8 - job.injections[0].t)
