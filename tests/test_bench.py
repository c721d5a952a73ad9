"""The checkpoint benchmark runs end to end, prints every ratio, and leaves no files behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.engine import RATIOS

pytestmark = pytest.mark.slow  # spawns a 2-rank gloo group and writes ~0.5 GiB: ~20-50 s


def test_quick_benchmark_prints_ratios_and_cleans_up(tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    result_json = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.engine",
            "--quick",
            "--size-gib",
            "0.05",
            "--dir",
            str(scratch),
            "--json",
            str(result_json),
        ],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    ratio_lines = [line for line in proc.stdout.splitlines() if line.strip().startswith("ratio ")]
    assert len(ratio_lines) == len(RATIOS), proc.stdout
    for spec in RATIOS:
        line = next(line for line in ratio_lines if spec.what in line)
        assert spec.target in line
        assert any(verdict in line for verdict in ("PASS", "MISS", "info", "n/a"))

    report = json.loads(result_json.read_text())
    assert {r["key"] for r in report["rows"]} >= {
        "memcpy",
        "stall",
        "persist",
        "direct",
        "dcp_save",
        "load",
        "dcp_load",
        "resharded",
    }
    assert all(r["samples"] and min(r["samples"]) > 0 for r in report["rows"])
    assert list(scratch.iterdir()) == [], "the benchmark left files behind"


@pytest.mark.s3
def test_s3_benchmark_prints_ratios_and_request_counts(tmp_path: Path) -> None:
    result_json = tmp_path / "s3.json"
    proc = subprocess.run([sys.executable, "-m", "bench.s3", "--quick", "--json",
                           str(result_json)], capture_output=True, text=True, timeout=280,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert "SeaweedFS cluster (master, 2 volume servers, filer, S3 gateway) started" in out
    assert "ratio persist / raw s3fs PUT" in out and "ratio load / raw s3fs GET" in out
    assert "ratio persist / raw obstore PUT" in out and "ratio load / raw obstore GET" in out
    assert "requests: save " in out and "engine reports" in out
    (state,) = json.loads(result_json.read_text())["states"]
    assert state["state"] == "quickstart" and state["objects"] > state["tensors"]
    assert state["requests"]["raw_put"] == state["objects"]
    assert state["requests"]["raw_get"] == state["objects"]
    assert state["requests"]["save"] >= state["objects"]
    assert state["persist_ratio"] > 0 and state["load_ratio"] > 0
    assert state["persist_ratio_obstore"] > 0 and state["load_ratio_obstore"] > 0
    for what in ("persist", "load"):  # the verdicts the table prints, in the JSON too
        verdict = "n/a"  # --quick: 2 repetitions, too few for a verdict
        assert state[f"{what}_verdict"] == verdict
        assert f"{state[f'{what}_ratio']:5.2f}x  (target <= 1.5x: {verdict})" in out


@pytest.mark.s3
def test_s3_benchmark_measures_the_trainers_2x2x2_state(tmp_path: Path) -> None:
    """``--mesh 2,2,2``: 8 gloo ranks save and load the trainer's own dp 2 x tp 2 x pp 2 state
    (each rank its shards), each load checked bit for bit in the rank; the row has both
    ratios and every rank's request counts. No timing is asserted."""
    result_json = tmp_path / "s3.json"
    proc = subprocess.run([sys.executable, "-m", "bench.s3", "--quick", "--only-ranks",
                           "--mesh", "2,2,2", "--json", str(result_json)],
                          capture_output=True, text=True, timeout=400, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "quickstart 2x2x2 (dp x tp x pp, 8 ranks):" in proc.stdout
    (state,) = json.loads(result_json.read_text())["states"]
    assert state["state"] == "quickstart 2x2x2 (dp x tp x pp, 8 ranks)"
    assert state["objects"] > 0 and state["object_bytes"] > state["payload_bytes"] / 2
    assert {f"rank{r}_{k}" for r in range(8) for k in ("save", "load")} == set(state["requests"])
    for key in ("persist", "load", "raw_put", "raw_get", "raw_put_obstore", "raw_get_obstore"):
        assert len(state["samples"][key]) == 2
    assert state["persist_verdict"] == state["load_verdict"] == "n/a"


def test_save_cost_benchmark_prints_the_engine_against_dcp_and_memcpy(tmp_path: Path) -> None:
    out = tmp_path / "cost.json"
    done = subprocess.run([sys.executable, "-m", "bench.save_cost", "--saves", "2",
                           "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "engine save() return / DCP async_save return" in done.stdout
    assert "engine persist / DCP persist" in done.stdout
    result = json.loads(out.read_text())
    from antifragile.trainer.model import GPT, ModelConfig

    params = len(list(GPT(ModelConfig(layers=2, d_model=64, heads=4, vocab=256,
                                      seq_len=32)).parameters()))
    # every parameter, and AdamW's exp_avg, exp_avg_sq and step for each
    assert result["entries_per_rank"] == 4 * params
    assert all(v > 0 for v in result["median_s"].values())


def test_bench_gpu_says_it_measured_nothing_without_a_device() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: tests/test_gpu.py runs the bench")
    done = subprocess.run([sys.executable, "-m", "bench.gpu"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 3 and "no CUDA device here; nothing measured" in done.stdout
