"""The verdict cannot pass by accident: the comparison is of bits, a reference is needed to claim
bitwise equality, and every fault must have been made and have had its effect.

Checkpoints are written by the real engine in this process; runs are synthetic ``RunRecord``s
(as in test_report.py) unless a test says it runs ``chaos run``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from antifragile.chaos.observe import checker
from antifragile.chaos.scenario import parse_scenario
from antifragile.engine import CheckpointEngine

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
