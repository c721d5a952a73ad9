"""``chaos tune``: Young and Daly against published values, the seeded simulator against the
analytic model, the scale projection against Meta's cluster figures, the CLI, and (slow) the
measured mode and the real sweep on small scenarios."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from antifragile.chaos import tune
from antifragile.chaos.cli import main
from antifragile.chaos.faults import Injection
from antifragile.chaos.observe.record import RunRecord

MIN = 60.0
HOUR = 3600.0


@pytest.mark.parametrize(("mtbf_min", "published_min"), [(24 * 60, 116.7), (6 * 60, 56.7),
                                                         (15, 9.1)])
def test_daly_interval_reproduces_dalys_published_values(mtbf_min: float,
                                                         published_min: float) -> None:
    """Daly (2006): a 5-minute checkpoint at MTBF 24 h, 6 h and 15 min."""
    tau = tune.daly_interval(5 * MIN, mtbf_min * MIN)
    assert tau / MIN == pytest.approx(published_min, abs=0.05)


def test_daly_is_close_to_the_exact_optimum_and_young_is_first_order() -> None:
    assert tune.young_interval(5 * MIN, 24 * HOUR) == pytest.approx(120 * MIN)
    assert tune.young_interval(2.0, 50.0) == pytest.approx(math.sqrt(2 * 2.0 * 50.0))
    for mtbf in (24 * HOUR, 6 * HOUR, 15 * MIN):
        exact = tune.optimal_interval(5 * MIN, mtbf)
        assert tune.daly_interval(5 * MIN, mtbf) == pytest.approx(exact, rel=5e-3)
        assert tune.young_interval(5 * MIN, mtbf) > exact  # Young overshoots: no -C term
    assert tune.daly_interval(30.0, 10.0) == 10.0  # C >= 2M: checkpoint every MTBF


@pytest.mark.parametrize("ratio", [1e-8, 1e-12, 1e-15, 1e-17, 1e-100])
def test_the_exact_optimum_holds_when_checkpoints_are_cheap_against_the_mtbf(ratio: float) -> None:
    """(1 - u) e^u = e^(-C/M) was solved as written: both sides round to 1 once C/M is below
    ~1e-16, so the optimum came out ~0 s (3e-61 s at C/M = 1e-17) and chaos tune refused
    C = 10 s, M = 1e18 s as a job that 'makes almost no progress at any interval'. Daly's
    series is exact to far better than 1e-6 there."""
    assert tune.optimal_interval(ratio, 1.0) == pytest.approx(tune.daly_interval(ratio, 1.0),
                                                              rel=1e-6)
    result = _invoke(["--ckpt-cost-s", "10", "--mtbf-s", str(10 / ratio), "--schedules", "50",
                      "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["model_goodput"] > 0.99
    assert doc["model_optimum_s"] == pytest.approx(doc["daly_interval_s"], rel=1e-6)


def test_expected_goodput_matches_the_first_order_waste_model_when_failures_are_rare() -> None:
    c, r, m = 1.0, 5.0, 10_000.0
    tau = tune.young_interval(c, m)
    first_order = 1 - c / tau - (tau + c) / (2 * m) - r / m
    assert tune.expected_goodput(tau, c, r, m) == pytest.approx(first_order, abs=2e-4)
    grid = [tau * f for f in (0.25, 0.5, 0.9, 1.0, 1.1, 2.0, 4.0)]
    best = max(grid, key=lambda x: tune.expected_goodput(x, c, r, m))
    assert best == pytest.approx(tune.optimal_interval(c, m), rel=0.1)


@pytest.mark.parametrize("costs", [tune.Costs(ckpt_s=5.0, restart_s=10.0, mtbf_s=100.0),
                                   tune.Costs(ckpt_s=30.0, restart_s=0.0, mtbf_s=60.0)])
def test_exponential_simulation_agrees_with_the_analytic_model(costs: tune.Costs) -> None:
    """The simulator plays Daly's process; for exponential failures the formula is exact,
    so the two must agree within SIM_TOLERANCE (absolute goodput) on the whole grid."""
    intervals = tune.candidate_intervals(costs)
    curve = tune.simulate(intervals, costs, schedules=1500, seed=11)
    model = [tune.expected_goodput(x, costs.ckpt_s, costs.restart_s, costs.mtbf_s)
             for x in intervals]
    gaps = [abs(g - m) for g, m in zip(curve.goodput, model)]
    assert max(gaps) <= tune.SIM_TOLERANCE, max(gaps)
    inside = sum(lo <= m <= hi for lo, m, hi in zip(curve.ci_low, model, curve.ci_high))
    assert inside >= 0.85 * len(intervals), (inside, len(intervals))
    assert curve.intervals_s[curve.best()] == pytest.approx(
        tune.optimal_interval(costs.ckpt_s, costs.mtbf_s), rel=0.35)


def test_one_runs_spread_brackets_the_expected_wall_and_narrows_as_the_run_grows() -> None:
    """A sweep run lasts about three MTBFs: its goodput scatters widely around the expected
    one, and a gap to the model inside that scatter says nothing about the model."""
    from antifragile.chaos.tune.simulate import run_spread

    costs = tune.Costs(ckpt_s=1.0, restart_s=2.0, mtbf_s=20.0)
    tau = tune.optimal_interval(costs.ckpt_s, costs.mtbf_s)
    expected_wall = {}
    spreads = {}
    for work in (60.0, 6000.0):
        expected_wall[work] = work / tune.expected_goodput(tau, costs.ckpt_s, costs.restart_s,
                                                            costs.mtbf_s)
        spreads[work] = run_spread(work, tau, costs, seed=3)
        low, high = spreads[work]
        assert work < low < expected_wall[work] < high, (work, spreads[work])
    assert spreads[60.0] == run_spread(60.0, tau, costs, seed=3)  # seeded
    short, long = (spreads[w][1] / spreads[w][0] for w in (60.0, 6000.0))
    assert short > 1.3 and long < 1.1, (short, long)  # three MTBFs: wide; 300: narrow
    assert run_spread(1e6, 1e5, costs, schedules=100) is None  # a segment never completes

def test_weibull_path_is_deterministic_per_seed_and_shape_one_is_exponential() -> None:
    costs = tune.Costs(ckpt_s=5.0, restart_s=10.0, mtbf_s=100.0)
    intervals = [10.0, 30.0, 90.0]
    a = tune.simulate(intervals, costs, dist="weibull", shape=0.7, schedules=400, seed=5)
    b = tune.simulate(intervals, costs, dist="weibull", shape=0.7, schedules=400, seed=5)
    c = tune.simulate(intervals, costs, dist="weibull", shape=0.7, schedules=400, seed=6)
    assert a.goodput == b.goodput and a.ci_low == b.ci_low
    assert a.goodput != c.goodput
    one = tune.simulate(intervals, costs, dist="weibull", shape=1.0, schedules=1500, seed=5)
    for x, g in zip(intervals, one.goodput):
        assert g == pytest.approx(tune.expected_goodput(x, 5.0, 10.0, 100.0),
                                  abs=tune.SIM_TOLERANCE)
    exp = tune.simulate(intervals, costs, schedules=400, seed=5)
    assert a.goodput != exp.goodput  # shape 0.7 is a different law, not a relabelled one
    with pytest.raises(tune.TuneError, match="shape"):
        tune.simulate(intervals, costs, dist="weibull", shape=0.0)


def _replay(times: list[float], interval_s: float, segments: int, ckpt_s: float,
            restart_s: float) -> float:
    """One schedule played failure by failure: work starts at 0, and R after each failure."""
    period, start, done = interval_s + ckpt_s, 0.0, 0.0
    for f in times:
        if start + (segments - done) * period <= f:
            return start + (segments - done) * period
        done += math.floor(max(f - start, 0.0) / period)
        start = f + restart_s
    return math.inf


@pytest.mark.parametrize(("dist", "shape", "restart_s"), [
    ("exponential", 1.0, 0.0), ("weibull", 0.7, 3.0), ("weibull", 20.0, 0.0),
    ("weibull", 0.05, 40.0)])
def test_the_whole_schedule_wall_times_match_a_failure_by_failure_replay(
        dist: tune.Distribution, shape: float, restart_s: float) -> None:
    """The simulation computes a schedule in array operations over stretches of failures
    (it took 60 s for k = 0.01 one failure at a time); it must give the replay's numbers."""
    sim = importlib.import_module("antifragile.chaos.tune.simulate")
    failures = sim._FailureTimes(dist, shape, 100.0, 300, seed=3)  # two sets of 256 or less
    for interval_s, segments in ((10.0, 40), (90.0, 5), (300.0, 3)):
        wall = sim._wall_times(interval_s, segments, 5.0, restart_s, failures)
        times = failures.upto(sim.MAX_FAILURES - 1)[:, :sim.MAX_FAILURES]
        replayed: list[float] | None = []
        for row in times:  # None once a schedule is given up, as the simulation answers
            replayed.append(_replay(row.tolist(), interval_s, segments, 5.0, restart_s))
            if replayed[-1] == math.inf:
                replayed = None
                break
        assert replayed == (None if wall is None else wall.tolist())


def test_recommendation_is_the_best_simulated_interval_in_whole_steps() -> None:
    costs = tune.Costs(ckpt_s=2.0, restart_s=20.0, mtbf_s=600.0, step_s=0.5)
    result = tune.tune(costs, schedules=600, seed=1)
    doc = result.as_dict()
    assert doc["recommended_every_steps"] == round(doc["recommended_interval_s"] / 0.5)
    assert doc["recommended_interval_s"] / 0.5 == pytest.approx(doc["recommended_every_steps"])
    curve = result.curves["exponential"]
    assert doc["expected_goodput"] == max(curve.goodput)
    optimum = tune.expected_goodput(result.model_optimum_s, 2.0, 20.0, 600.0)
    assert doc["model_goodput"] >= optimum - tune.SIM_TOLERANCE
    assert doc["simulation"]["max_gap_vs_model"] <= tune.SIM_TOLERANCE


def test_an_optimum_shorter_than_one_step_is_said_to_be_so() -> None:
    """Young, Daly and the optimum (1.4 s here) are shorter than a step (10 s): the table
    printed every_steps 1 beside their goodput at 1.4 s (0.986), above the recommended row's
    every_steps 1 at 0.950, with nothing saying a checkpoint every step is the shortest
    interval there is, nor that the goodput shown for those rows cannot be had."""
    costs = tune.Costs(ckpt_s=0.01, restart_s=0.0, mtbf_s=100.0, step_s=10.0)
    doc = tune.tune(costs, schedules=50).as_dict()
    assert doc["recommended_every_steps"] == 1
    (note,) = [n for n in doc["notes"] if "one step" in n]
    assert "1.41 s" in note and "10 s" in note and "every step" in note


def test_scale_projection_against_metas_cluster_figures() -> None:
    """Meta (Kokolis et al. 2024): job MTTF ~7.9 h at 1,024 GPUs, ~1.8 h at 16,384.

    Honest result: with failures independent per GPU (job MTBF = per-GPU MTBF / N), a per-GPU
    MTBF fitted to 7.9 h at 1,024 GPUs (8,090 GPU-hours) projects 0.49 h at 16,384, 3.6x
    below the reported 1.8 h; fitted to 1.8 h at 16,384 it projects 28.8 h at 1,024, 3.6x
    above 7.9 h. The two figures scale as N^-0.53, not N^-1, so the projection is pessimistic
    for large jobs by that factor; this test pins the size of the miss.
    """
    costs = tune.Costs(ckpt_s=60.0, restart_s=300.0, mtbf_s=1.0)  # mtbf replaced per scale
    fitted_h = tune.META_MTTF_H[1024] * 1024
    rows = {r["gpus"]: r for r in tune.project(costs, fitted_h)}
    assert set(rows) == {1024, 16384, 100_000}
    assert rows[1024]["mtbf_h"] == pytest.approx(7.9)
    projected = rows[16384]["mtbf_h"]
    assert projected == pytest.approx(0.494, abs=0.001)
    assert 3.5 < tune.META_MTTF_H[16384] / projected < 3.8
    back = {r["gpus"]: r for r in tune.project(costs, tune.META_MTTF_H[16384] * 16384)}
    assert 3.5 < back[1024]["mtbf_h"] / tune.META_MTTF_H[1024] < 3.8
    goodputs = [rows[n]["expected_goodput"] for n in (1024, 16384, 100_000)]
    intervals = [rows[n]["recommended_interval_s"] for n in (1024, 16384, 100_000)]
    assert goodputs == sorted(goodputs, reverse=True) and intervals == sorted(intervals,
                                                                              reverse=True)
    assert rows[16384]["meta_reported_mtbf_h"] == 1.8


def _invoke(args: list[str]) -> Any:
    return CliRunner().invoke(main, ["tune", *args])


def test_cli_model_only_json_is_one_object_with_the_answer(tmp_path: Path) -> None:
    result = _invoke(["--ckpt-cost-s", "300", "--mtbf-s", "900", "--restart-s", "60",
                      "--step-s", "2", "--schedules", "300", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["daly_interval_s"] / MIN == pytest.approx(9.1, abs=0.05)
    assert doc["young_interval_s"] == pytest.approx(math.sqrt(2 * 300 * 900))
    assert 0 < doc["expected_goodput"] < 1
    assert doc["recommended_every_steps"] == round(doc["recommended_interval_s"] / 2)
    assert doc["mode"] == "model only" and doc["measurement"] is None


def test_cli_table_projection_and_out_folder(tmp_path: Path) -> None:
    out = tmp_path / "tune"
    result = _invoke(["--ckpt-cost-s", "60", "--restart-s", "300", "--gpus", "2048",
                      "--gpu-mtbf-h", "50000", "--schedules", "300", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "Daly (higher order)" in result.stdout and "16,384" in result.stdout
    assert "2,048" in result.stdout  # the job's own scale is in the projection
    doc = json.loads((out / "tune.json").read_text())
    assert doc["mtbf_s"] == pytest.approx(50000 * HOUR / 2048)
    assert [r["gpus"] for r in doc["projection"]] == [1024, 2048, 16384, 100_000]
    assert (out / "goodput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("args", "message"), [
    (["--ckpt-cost-s", "-5", "--mtbf-s", "100"], "--ckpt-cost-s must be"),
    (["--ckpt-cost-s", "5", "--mtbf-s", "100", "--restart-s", "-1"], "--restart-s must be"),
    (["--ckpt-cost-s", "5", "--mtbf-s", "-100"], "--mtbf-s must be a finite number > 0"),
    (["--ckpt-cost-s", "5"], "needs --mtbf-s"),
    (["--mtbf-s", "100"], "--ckpt-cost-s"),
    (["--ckpt-cost-s", "5", "--mtbf-s", "100", "--sweep"], "give SCENARIO.yaml"),
    (["--ckpt-cost-s", "5", "--gpus", "8"], "--gpus needs --gpu-mtbf-h"),
    (["--ckpt-cost-s", "5", "--mtbf-s", "100", "--sweep-every", "0,x"], "--sweep-every"),
    # accepted and ignored: the model alone answered, as if there had been no such option
    (["--ckpt-cost-s", "5", "--mtbf-s", "100", "--sweep-every", "5,10"],
     "error: --sweep-every: only with --sweep (it chooses the sweep's runs)"),
    (["--ckpt-cost-s", "5", "--mtbf-s", "100", "--sweep-steps", "50"],
     "error: --sweep-steps: only with --sweep (it chooses the sweep's runs)"),
    # the model's floats overflowed: numpy's RuntimeWarning, then a 'no interval completes'
    # about intervals of 1e152 s; C/M rounding to 0 was a ZeroDivisionError traceback
    (["--ckpt-cost-s", "10", "--mtbf-s", "1e200"], "MTBF must be between"),
    (["--ckpt-cost-s", "1e-300", "--mtbf-s", "1e8"],
     "--ckpt-cost-s: the checkpoint cost must be between"),
    (["--ckpt-cost-s", "5", "--mtbf-s", "1e8", "--restart-s", "1e300"],
     "--restart-s: the restart cost must be"),
    # a finite --gpu-mtbf-h whose job MTBF at a projected scale overflows (x 3600 s) or rounds
    # to 0: NaN intervals and goodputs in tune.json (a traceback with --step-s), and a
    # ZeroDivisionError traceback
    (["--ckpt-cost-s", "10", "--mtbf-s", "100", "--step-s", "1", "--gpu-mtbf-h", "1e306"],
     "--gpu-mtbf-h 1e+306: the job MTBF at 1,024 GPUs"),
    (["--ckpt-cost-s", "10", "--mtbf-s", "100", "--gpu-mtbf-h", "5e-324"],
     "--gpu-mtbf-h 4.94066e-324: the job MTBF at 1,024 GPUs"),
])
def test_cli_bad_input_exits_2_with_a_message(args: list[str], message: str) -> None:
    result = _invoke(args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr and "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit)


def test_cli_out_folder_that_cannot_be_made_and_a_negative_seed_exit_2(tmp_path: Path) -> None:
    """Both were tracebacks (exit 1): NotADirectoryError after the simulation, numpy's
    "expected non-negative integer" for the seed."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = _invoke(["--ckpt-cost-s", "5", "--mtbf-s", "100", "--schedules", "50",
                      "--out", str(blocker / "tune")])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert (f"error: --out {blocker / 'tune'}: cannot create the folder: Not a directory"
            in result.stderr)
    result = _invoke(["--ckpt-cost-s", "5", "--mtbf-s", "100", "--seed", "-1"])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "'--seed'" in result.output


def test_cli_an_empty_out_is_bad_input_not_a_run_that_writes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--out ""`` (an unset variable, ``--out "$OUT"``) was taken as no --out: the
    simulation ran, exit 0, and neither tune.json nor goodput.png was written anywhere, though
    the user asked for them. ``chaos run``, ``suite`` and ``crashcheck`` refuse it: so does
    tune, before the simulation."""
    monkeypatch.chdir(tmp_path)
    result = _invoke(["--ckpt-cost-s", "5", "--mtbf-s", "100", "--schedules", "50",
                      "--out", ""])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "error: --out: empty; leave the option out" in result.stderr
    assert "simulating" not in result.output and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["tune.json", "goodput.png"])
def test_cli_an_out_file_that_cannot_be_written_exits_2_naming_it(tmp_path: Path,
                                                                  name: str) -> None:
    """A folder in --out where tune.json or goodput.png goes was an IsADirectoryError
    traceback, after the simulation (and, on a scenario, after its measuring runs)."""
    out = tmp_path / "tune"
    (out / name).mkdir(parents=True)
    result = _invoke(["--ckpt-cost-s", "5", "--mtbf-s", "100", "--schedules", "50",
                      "--out", str(out)])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert f"error: {out / name}: cannot be written: Is a directory" in result.stderr


def test_cli_an_out_that_cannot_be_written_whole_keeps_none_of_it(tmp_path: Path) -> None:
    """goodput.png that could not be written (a full disk; here a folder in its place) was
    exit 2, but tune.json, written just before it, stayed: a document saying it wrote
    goodput.png to that folder, beside an earlier tune's files or none, read as this tune's."""
    out = tmp_path / "tune"
    (out / "goodput.png").mkdir(parents=True)
    result = _invoke(["--ckpt-cost-s", "5", "--mtbf-s", "100", "--schedules", "50",
                      "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert not (out / "tune.json").exists(), "a tune.json without its plot was left behind"


def test_cli_a_job_that_can_never_finish_a_checkpoint_interval_is_refused() -> None:
    """C = 5000 s against M = 10 s: the simulation waited for a failure-free stretch of
    5000 s (e^500 failures) and never ended, its failure table growing without bound; past
    C/M ~ 710 the model overflowed (a traceback). Refused at once, saying why."""
    import time

    for cost in ("100", "5000", "20000"):
        start = time.monotonic()
        result = _invoke(["--ckpt-cost-s", cost, "--mtbf-s", "10", "--schedules", "50"])
        assert time.monotonic() - start < 10, cost
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        assert "goodput" in result.stderr and "at best" in result.stderr, result.stderr


@pytest.mark.parametrize("shape", ["20", "1000", "0.01"])
def test_cli_a_weibull_shape_that_makes_intervals_infeasible_ends(shape: str) -> None:
    """k = 20 makes failures nearly periodic (every ~M): a candidate interval longer than M
    never finished and the simulation never ended (2 GB after 60 s); k = 0.01 makes almost
    every gap ~0. A schedule is now given up after a bounded number of failures: that
    interval's goodput is 0, the others are still compared."""
    import time

    start = time.monotonic()
    result = _invoke(["--ckpt-cost-s", "5", "--mtbf-s", "100", "--weibull-shape", shape,
                      "--dist", "weibull", "--json"])
    # it never ended before; k = 0.01 (every schedule meets MAX_FAILURES) took 60 s played
    # failure by failure, 4 s in stretches of failures (it stops at the first given up)
    assert time.monotonic() - start < 180, shape
    assert "Traceback" not in result.output, result.output
    if result.exit_code == 0:
        doc = json.loads(result.stdout)
        curve = doc["simulation"]["curves"]["weibull"]
        assert all(math.isfinite(g) for g in curve["goodput"] + curve["ci_high"])
        assert 0 < doc["expected_goodput"] <= 1
    else:
        assert result.exit_code == 2 and "at any interval" in result.stderr, result.output


def test_cli_an_infinite_weibull_shape_is_bad_input() -> None:
    result = _invoke(["--ckpt-cost-s", "5", "--mtbf-s", "100", "--weibull-shape", "inf"])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == "error: --weibull-shape must be a finite number > 0, got inf"


def test_cli_projection_to_a_scale_where_nothing_gets_done_is_goodput_zero() -> None:
    """At 100,000 GPUs of 1 h MTBF (job MTBF 0.036 s) a 300 s checkpoint never completes:
    the model's exp() overflowed (a traceback); the goodput there is 0."""
    result = _invoke(["--ckpt-cost-s", "300", "--mtbf-s", "36000", "--gpu-mtbf-h", "1",
                      "--schedules", "50", "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["gpus"]: r for r in json.loads(result.stdout)["projection"]}
    assert rows[100_000]["expected_goodput"] == 0.0
    assert math.isfinite(rows[1024]["expected_goodput"])


def _tiny(tmp_path: Path, faults: list[dict[str, Any]], steps: int = 12) -> Path:
    doc = {"name": "tune-tiny", "seed": 5,
           "trainer": {"parallel": {"dp": 2, "tp": 1, "pp": 1}, "steps": steps,
                       "batch_size": 4, "collective_timeout_s": 30,
                       "model": {"layers": 1, "d_model": 32, "heads": 2, "vocab": 64,
                                 "seq_len": 8}},
           "checkpoint": {"every_steps": 3, "keep_last": 2}, "faults": faults}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_cli_scenario_without_mtbf_or_with_model_options_exits_2(tmp_path: Path) -> None:
    path = _tiny(tmp_path, [{"kind": "kill_rank", "rank": 1, "at_step": 6}])
    result = _invoke([str(path)])
    assert result.exit_code == 2 and f"{path}: no fault with mtbf_s" in result.stderr
    result = _invoke([str(path), "--mtbf-s", "60", "--ckpt-cost-s", "1"])
    assert result.exit_code == 2 and "--ckpt-cost-s" in result.stderr
    result = _invoke([str(tmp_path / "missing.yaml"), "--mtbf-s", "60"])
    assert result.exit_code == 2 and "cannot read" in result.stderr


@pytest.mark.parametrize(("args", "says"), [
    (["--schedules", "0"], "--schedules must be >= 2, got 0"),
    # numpy's _ArrayMemoryError traceback (95.4 GiB at 10^8), after measuring
    (["--schedules", str(10**12)], "--schedules 1000000000000: the failure times can grow "
     "to 1000000000000 x 10112 floats (7.53e+07 GiB, twice while they grow); this machine "
     "has "),
    (["--weibull-shape", "nan"], "--weibull-shape must be a finite number > 0, got nan"),
    # every tuning simulates the Weibull law: k < 0.00586 was an OverflowError traceback in
    # math.gamma, after measuring
    (["--weibull-shape", "0.005"], "--weibull-shape 0.005 is too small to simulate (the "
     "scale that gives its gaps a mean of M overflows a float); give k >= 0.006"),
    # infinite passed "> 0": refused only by the model or the projection, after measuring
    (["--mtbf-s", "inf"], "--mtbf-s must be a finite number > 0 seconds, got inf"),
    (["--gpu-mtbf-h", "inf"], "--gpu-mtbf-h must be a finite number > 0 hours, got inf"),
    # finite, but its job MTBF at a projected scale is infinite: NaN rows, after measuring
    (["--gpu-mtbf-h", "1e306"], "--gpu-mtbf-h 1e+306: the job MTBF at 1,024 GPUs (inf s)"),
    # finite, but past the model's range: refused by the model, after measuring
    (["--mtbf-s", "1e200"],
     "--mtbf-s: the MTBF must be between 1e-06 and 1e+120 seconds, got 1e+200"),
    (["--mtbf-s", "1e-9"],
     "--mtbf-s: the MTBF must be between 1e-06 and 1e+120 seconds, got 1e-09"),
])
def test_cli_bad_simulation_options_are_refused_before_measuring(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], says: str) -> None:
    """They were checked only by the simulation, after the scenario had been run to measure
    C and R (minutes), and after a "simulating 0 failure schedules" line."""
    from antifragile.chaos.tune import recommend

    def must_not_run(*_: object, **__: object) -> None:
        raise AssertionError("nothing may run")

    monkeypatch.setattr(recommend, "measure_costs", must_not_run)
    path = _tiny(tmp_path, [{"kind": "kill_rank", "rank": 1, "at_step": 6}])
    result = _invoke([str(path), "--mtbf-s", "60", *args])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().startswith(f"error: {says}"), result.stderr
    assert "\n" not in result.stderr.strip()


def test_refused_input_leaves_no_temporary_folder(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --out the measuring run goes to a temporary folder, kept only when a run
    failed (its log is there). A scenario refused on the way in (too short to time a
    restart: TuneError) left an empty chaos-tune-measure-* folder behind on every try."""
    import tempfile

    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    path = _tiny(tmp_path, [], steps=1)
    result = _invoke([str(path), "--mtbf-s", "60"])
    assert result.exit_code == 2 and "too short to time a restart" in result.stderr
    assert list(temp.iterdir()) == []


@pytest.mark.parametrize("blocked", ["out", "temp"])
def test_a_folder_for_the_measuring_run_that_cannot_be_made_is_bad_input(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, blocked: str) -> None:
    """The measuring run goes to ``OUT/measure`` (or a temporary folder without --out): a
    file there (a reused --out), or a temporary folder that cannot be made, was a
    FileExistsError or FileNotFoundError traceback with exit 1, as if a run had failed."""
    import tempfile

    from antifragile.chaos.tune import recommend

    def must_not_run(*_: object, **__: object) -> None:
        raise AssertionError("nothing may run")

    monkeypatch.setattr(recommend, "measure_costs", must_not_run)
    out = tmp_path / "out"
    out.mkdir()
    (out / "measure").write_text("not a folder")
    args = ["--out", str(out)]
    if blocked == "temp":
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-such-folder"))
        args = []
    result = _invoke([str(_tiny(tmp_path, [])), "--mtbf-s", "60", *args])
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output
    named = str(out / "measure") if blocked == "out" else str(tmp_path / "no-such-folder")
    assert result.stderr.startswith(f"error: {named}"), result.stderr
    assert "cannot be made" in result.stderr, result.stderr

def test_scenario_mtbf_adds_the_rates_of_faults_that_stop_the_job(tmp_path: Path) -> None:
    from antifragile.chaos.scenario import load_scenario

    s = load_scenario(_tiny(tmp_path, [
        {"kind": "kill_rank", "rank": "random", "mtbf_s": 60},
        {"kind": "hang_rank", "rank": 0, "mtbf_s": 30, "duration_s": 5},
        {"kind": "corrupt_shard", "mtbf_s": 1, "checkpoint": "latest", "mode": "bitflip"},
    ]))
    assert tune.scenario_mtbf_s(s) == pytest.approx(20.0)  # 1/60 + 1/30; corruption ignored
    killed = tune.with_kill(load_scenario(_tiny(tmp_path, [])))
    assert [(f.kind, f.rank, f.at_step) for f in killed.faults] == [("kill_rank", 1, 6)]


def test_the_kill_added_to_time_a_restart_comes_after_a_checkpoint(tmp_path: Path) -> None:
    """A restart restores the newest checkpoint: tune's kill at the middle step came before
    the first one where ``checkpoint.every_steps`` is over half the run (12 steps, every 8: a
    kill at step 6). The restart had nothing to restore, and R was measured as detect +
    restart with no restore in it. A run with no checkpoint before its last step leaves no
    room for one: refused before anything runs."""
    from antifragile.chaos.scenario import load_scenario

    def kill_step(every: int) -> int | None:
        doc = yaml.safe_load(_tiny(tmp_path, []).read_text())
        doc["checkpoint"]["every_steps"] = every
        path = tmp_path / f"every-{every}.yaml"
        path.write_text(yaml.safe_dump(doc))
        return tune.with_kill(load_scenario(path)).faults[-1].at_step

    assert [kill_step(every) for every in (3, 6, 8, 10)] == [6, 7, 9, 11]
    with pytest.raises(tune.TuneError, match=r"with checkpoint\.every_steps 11 of 12 steps no "
                                             "step after a checkpoint comes before the last"):
        kill_step(11)


def _event(t: float, attempt: int, rank: int, event: str, **fields: Any) -> dict[str, Any]:
    return {"t": t, "attempt": attempt, "rank": rank, "event": event, **fields}


def _killed_run_events() -> tuple[list[dict[str, Any]], float]:
    """A hand-written event log (what two ranks would emit) with known answers: steps of
    1 s, 1.5 s right after each checkpoint, 0.1 s stalls, a kill at t=10.5 torn down at
    11.0, the new attempt started at 13.0 and restored at 14.0. Returns the events and the
    time of the last one."""
    events = []
    for attempt, first, t0 in ((0, 1, 0.0), (1, 5, 13.0)):
        for rank in (0, 1):
            events.append(_event(t0, attempt, rank, "start", pid=100 * attempt + rank))
        t = t0 + 1.0
        if attempt == 1:
            events += [_event(14.0, 1, r, "restore_end", step=4, seconds=1.0) for r in (0, 1)]
            t = 14.0
        for step in range(first, first + 6 if attempt == 0 else 9):
            seconds = 1.5 if step in (3, 5, 7) and not (attempt == 1 and step == 5) else 1.0
            if attempt == 1 and step == first:
                seconds = 3.0  # warm-up, left out
            t += seconds + 0.01
            for rank in (0, 1):
                events.append(_event(t, attempt, rank, "step_end", step=step, loss=1.0,
                                     seconds=seconds))
            if step % 2 == 0:
                t += 0.1
                for rank in (0, 1):
                    events.append(_event(t, attempt, rank, "ckpt_staged", step=step,
                                         stall_s=0.1))
    events.sort(key=lambda e: e["t"])
    return events, t


def _killed_run(events: list[dict[str, Any]], t: float) -> RunRecord:
    return RunRecord(returncode=0, started_t=-0.5, ended_t=t + 2.0, events=events,
                     injections=[Injection("kill_rank", 10.5, step=6, rank=1)],
                     attempt_ends={0: 11.0, 1: t + 2.0})


def test_costs_from_record_reads_c_r_and_step_time_from_the_events() -> None:
    events, t = _killed_run_events()
    m = tune.costs_from_record(_killed_run(events, t))
    assert m.stall_s == pytest.approx(0.1)
    assert m.step_effect_s == pytest.approx(0.5)
    assert m.ckpt_s == pytest.approx(0.6)
    assert m.ckpt_cycle_s == pytest.approx(0.6)
    assert m.restart_s == pytest.approx(0.5 + 2.0 + 1.0)
    assert m.step_s == pytest.approx(1.0) and m.failures == 1
    assert m.startup_s == pytest.approx(1.51)
    assert m.tail_s == pytest.approx(2.1)  # the final checkpoint's stall is in the tail


def test_the_final_blocking_save_is_not_part_of_the_checkpoint_cost() -> None:
    """The run's last save waits for its whole persist (``ckpt_blocked``): the job's
    shutdown, already in the tail, not a stall the loop pays every interval. Counted in the
    mean stall, one 2 s final write beside four 0.1 s stalls made C 1.0 s instead of 0.6 s."""
    events, t = _killed_run_events()
    events += [_event(t + 1.0, 1, r, "ckpt_blocked", step=8, seconds=2.0) for r in (0, 1)]
    m = tune.costs_from_record(_killed_run(events, t + 1.0))
    assert m.stall_s == pytest.approx(0.1)
    assert m.ckpt_s == pytest.approx(0.6)
    assert m.tail_s == pytest.approx(3.1)  # where the final write belongs


def test_a_run_whose_only_checkpoint_is_its_final_one_has_no_checkpoint_cost_to_measure(
        ) -> None:
    """A scenario checkpointing only at its end (``every_steps`` >= ``steps``) stages no save
    the loop pays every interval: C cannot be measured. It was measured as 0 s, and the run
    ended in "checkpoint cost must be a finite number > 0 seconds, got 0.0", an input the
    user never gave."""
    events, t = _killed_run_events()
    events = [e for e in events if e["event"] != "ckpt_staged"]
    events += [_event(t + 1.0, 1, r, "ckpt_staged", step=8, stall_s=0.1) for r in (0, 1)]
    events += [_event(t + 2.0, 1, r, "ckpt_blocked", step=8, seconds=1.0) for r in (0, 1)]
    with pytest.raises(tune.MeasureError, match="only its final checkpoint"):
        tune.costs_from_record(_killed_run(events, t + 2.0))


def test_a_run_that_checkpoints_every_step_has_no_step_without_a_checkpoint_to_compare(
        ) -> None:
    """With ``every_steps: 1`` every step follows a checkpoint: none shows the step time
    without one, so the checkpoint's slowdown of the next step cannot be told apart. The run
    ended in "too few steps to time one (need > 1 per attempt)" after 13 steps."""
    events, t = _killed_run_events()
    events = [e for e in events if e["event"] != "ckpt_staged"]
    events += [_event(e["t"] + 0.1, e["attempt"], e["rank"], "ckpt_staged", step=e["step"],
                      stall_s=0.1) for e in events if e["event"] == "step_end"]
    events.sort(key=lambda e: e["t"])
    with pytest.raises(tune.MeasureError, match="every step followed a checkpoint"):
        tune.costs_from_record(_killed_run(events, t))


def test_a_scenario_that_checkpoints_every_step_is_refused_before_measuring(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its run could never measure C (see above): refused before it runs (minutes), as bad
    input (exit 2), not after it as a failed run (exit 1)."""
    from antifragile.chaos.run import runner

    def must_not_run(*_: object, **__: object) -> None:
        raise AssertionError("nothing may run")

    monkeypatch.setattr(runner, "run_scenario", must_not_run)
    path = _tiny(tmp_path, [])
    doc = yaml.safe_load(path.read_text())
    doc["checkpoint"]["every_steps"] = 1
    path.write_text(yaml.safe_dump(doc))
    result = _invoke([str(path), "--mtbf-s", "60"])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (
        "error: scenario tune-tiny: with checkpoint.every_steps 1 every step follows a "
        "checkpoint, so no step shows the step time without one and the checkpoint's cost "
        "cannot be measured; give it checkpoint.every_steps 2 or more")


@pytest.mark.slow
@pytest.mark.multiproc
def test_measured_mode_on_a_tiny_scenario(tmp_path: Path) -> None:
    """Runs the trainer once (tune adds a kill to time the restart) and tunes on the result."""
    path = _tiny(tmp_path, [])
    out = tmp_path / "out"
    result = _invoke([str(path), "--mtbf-s", "300", "--schedules", "500", "--json",
                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    m = doc["measurement"]
    assert m["injected_kill"] is True and m["failures"] == 1
    assert m["checkpoints"] >= 4 and 0 < m["stall_s"] <= m["ckpt_s"]
    assert doc["ckpt_cost_s"] == m["ckpt_s"] and doc["restart_s"] == m["restart_s"] > 0
    assert doc["step_s"] == m["step_s"] > 0
    assert doc["recommended_every_steps"] >= 1 and 0 < doc["expected_goodput"] < 1
    assert (out / "tune.json").exists() and (out / "goodput.png").exists()
    assert (out / "measure" / "run" / "events" / "rank0.jsonl").exists()


@pytest.mark.slow
@pytest.mark.multiproc
def test_sweep_measures_real_goodput_and_its_gap_to_the_model(tmp_path: Path) -> None:
    from antifragile.chaos.run.draws import Draws

    path = _tiny(tmp_path, [{"kind": "kill_rank", "rank": "random", "mtbf_s": 12}])
    doc = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**doc, "seed": 26}))  # its first arrival: 10.3 s
    out = tmp_path / "out"
    result = _invoke([str(path), "--sweep", "--sweep-every", "2,10", "--sweep-steps", "300",
                      "--schedules", "300", "--json", "--out", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["mtbf_s"] == 12 and "mtbf_s" in doc["mtbf_source"]
    assert doc["measurement"]["injected_kill"] is True  # random arrivals alone may miss
    rows = doc["sweep"]
    assert [r["every_steps"] for r in rows] == [2, 10]
    # The runner draws the fault's arrivals from a generator of its own (Draws), from the
    # launch; the first (10.3 s) falls inside a 300-step run's training on a 2-core machine
    # (~19 s, the last ~2 s its final save and exit, where an arrival is drawn again), but a
    # fast machine may finish first: then no kill may come early either.
    first_arrival = Draws(26).arrivals(0).expovariate(1 / 12)
    tail_s = doc["measurement"]["tail_s"]
    for r in rows:
        assert 0 < r["measured_goodput"] < 1 and 0 < r["predicted_goodput"] < 1
        assert r["gap"] == pytest.approx(r["measured_goodput"] - r["predicted_goodput"])
        assert r["interval_s"] == pytest.approx(r["every_steps"] * doc["step_s"])
        assert (out / "sweep" / f"every_{r['every_steps']}" / "run" / "events").is_dir()
        if r["wall_s"] - tail_s > first_arrival + 2:  # it arrived while the job trained
            assert r["failures"] >= 1, r
        elif r["wall_s"] < first_arrival:
            assert r["failures"] == 0, r


def _no_run(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, list[str]]]:
    """``run_scenario`` replaced by a run of one step that takes no checkpoint; returns, per
    call, the checkpoint url it got and what that folder held when the run started."""
    from antifragile.chaos.run import runner

    seen: list[tuple[str, list[str]]] = []

    def fake(s: Any, run_dir: Path, ckpt_url: str, **_: Any) -> RunRecord:
        held = sorted(p.name for p in Path(ckpt_url).iterdir()) \
            if Path(ckpt_url).is_dir() else []
        seen.append((ckpt_url, held))
        return RunRecord(returncode=0, started_t=0.0, ended_t=1.0, injections=[],
                         events=[_event(0.5, 0, 0, "step_end", step=1, loss=1.0, seconds=0.25)])

    monkeypatch.setattr(runner, "run_scenario", fake)
    return seen


def _measured_faking_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             faults: list[dict[str, Any]]) -> tuple[Any, Any]:
    """``measure_costs`` of a tiny scenario with ``faults``, its run faked (a kill, a restart):
    the measurement, and the scenario the measuring run was given."""
    from antifragile.chaos.run import runner
    from antifragile.chaos.scenario import load_scenario

    ran: list[Any] = []

    def fake(s: Any, run_dir: Path, ckpt_url: str, **_: Any) -> RunRecord:
        ran.append(s)
        events, t = _killed_run_events()
        return _killed_run(events, t)

    monkeypatch.setattr(runner, "run_scenario", fake)
    s = load_scenario(_tiny(tmp_path, faults))
    return tune.measure_costs(s, tmp_path / "measure", progress=lambda _: None), ran[0]


def test_a_kill_at_a_time_the_measuring_run_may_not_reach_is_no_certain_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``at_s`` fires only if the job is still running then: a 12-step run is long over by
    3600 s. Counted as a certain failure, tune added no kill of its own, the run had no
    restart to time, and it ended in "no failure of the run was followed by a restart"."""
    m, ran = _measured_faking_the_run(
        tmp_path, monkeypatch, [{"kind": "kill_rank", "rank": 1, "at_s": 3600}])
    assert m.injected_kill is True
    assert [(f.kind, f.at_s, f.at_step) for f in ran.faults] == \
        [("kill_rank", 3600, None), ("kill_rank", None, 6)]


def test_a_kill_on_a_later_pass_only_is_no_certain_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``on_pass: 2`` lands only when a recovery has brought the job back over its step, which
    nothing in a run without another failure does. Counted as a certain failure, tune added no
    kill of its own, the measuring run had no restart to time, and it ended in "no failure of
    the run was followed by a restart" after the whole run."""
    # the random kill (no certain failure either) is what makes pass 2 possible at all: a
    # scenario without another fault that ends an attempt is refused (chaos validate)
    m, ran = _measured_faking_the_run(tmp_path, monkeypatch, [
        {"kind": "kill_rank", "rank": 1, "at_step": 8, "on_pass": 2},
        {"kind": "kill_rank", "rank": 0, "mtbf_s": 1000}])
    assert m.injected_kill is True
    assert [(f.kind, f.at_step, f.on_pass) for f in ran.faults] == \
        [("kill_rank", 8, 2), ("kill_rank", None, 1), ("kill_rank", 6, 1)]


def test_a_failure_found_late_by_a_long_hang_timeout_still_times_the_restart(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``hang_timeout_s: 40`` a stopped rank is found hung up to 120 s later, and
    ``chaos run`` waits that long (its detection window, 150 s) before it calls a fault
    effectless. Measuring judged every failure with a fixed 90 s window: this hang, found after
    100 s, caused no restart for it, and the run ended in "no failure of the run was followed
    by a restart and restore"."""
    from antifragile.chaos.run import runner
    from antifragile.chaos.scenario import load_scenario

    def fake(s: Any, run_dir: Path, ckpt_url: str, **_: Any) -> RunRecord:
        events, t = _killed_run_events()
        events = [{**e, "t": e["t"] + 100.0} if e["attempt"] == 1 else e for e in events]
        hang = Injection("hang_rank", 10.5, step=6, rank=1,
                         detail={"pid": 1, "duration_s": 300.0, "mode": "process"})
        return RunRecord(returncode=0, started_t=-0.5, ended_t=t + 102.0, events=events,
                         injections=[hang], attempt_ends={0: 111.0, 1: t + 102.0})

    monkeypatch.setattr(runner, "run_scenario", fake)
    doc = yaml.safe_load(_tiny(tmp_path, [{"kind": "hang_rank", "rank": 1, "at_step": 6,
                                           "duration_s": 300}]).read_text())
    doc["trainer"]["hang_timeout_s"] = 40
    path = tmp_path / "slow-hang.yaml"
    path.write_text(yaml.safe_dump(doc))
    m = tune.measure_costs(load_scenario(path), tmp_path / "measure", progress=lambda _: None)
    assert m.failures == 1 and m.injected_kill is False
    assert m.restart_s == pytest.approx(100.5 + 2.0 + 1.0)


def test_a_measuring_run_never_resumes_from_an_earlier_tunes_checkpoints(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``chaos tune S --out X`` run again: the first run's checkpoints in ``X/measure/ckpt``
    would be resumed from (its final step: nothing left to train or time), as ``chaos run``
    never lets a run do."""
    from antifragile.chaos.scenario import load_scenario

    seen = _no_run(monkeypatch)
    folder = tmp_path / "out" / "measure"
    (folder / "ckpt" / "step_000000012").mkdir(parents=True)  # the earlier tune's
    s = load_scenario(_tiny(tmp_path, []))
    with pytest.raises(tune.MeasureError, match="took no checkpoint"):  # the fake run's
        tune.measure_costs(s, folder, progress=lambda _: None)
    assert seen == [(str(folder / "ckpt"), [])]


def test_a_local_checkpoint_url_that_holds_checkpoints_is_refused_before_measuring(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As ``chaos run`` refuses it (exit 2): the trainer would resume from them."""
    import torch

    from antifragile.engine import CheckpointEngine

    url = tmp_path / "fixed"
    with CheckpointEngine(str(url), keep_last=None) as ckpt:
        ckpt.save(10, {"model": {"w": torch.ones(3)}}).wait()
    seen = _no_run(monkeypatch)
    doc = yaml.safe_load(_tiny(tmp_path, []).read_text())
    doc["checkpoint"]["url"] = str(url)
    path = tmp_path / "fixed.yaml"
    path.write_text(yaml.safe_dump(doc))
    result = _invoke([str(path), "--mtbf-s", "60"])
    assert result.exit_code == 2, result.output
    assert f"checkpoint.url {url} already holds committed antifragile checkpoints" \
        in result.stderr
    assert seen == []


def test_a_measuring_run_past_its_time_limit_ends_with_a_message_not_a_traceback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``run_scenario`` raises ``RunTimeout`` (a ``ChaosRunError``: its message is for the
    user) when a run goes past its time limit; ``chaos tune`` let it out as a traceback."""
    from antifragile.chaos.run import runner

    def too_long(s: Any, run_dir: Path, ckpt_url: str, **_: Any) -> RunRecord:
        raise runner.RunTimeout(f"the faulty run of {s.name} went past its time limit of "
                                "3600 s and was killed")

    monkeypatch.setattr(runner, "run_scenario", too_long)
    result = _invoke([str(_tiny(tmp_path, [])), "--mtbf-s", "60"])
    assert result.exit_code == 1 and result.exception is not None, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert "went past its time limit of 3600 s" in result.stderr


def test_the_sweep_runs_an_s3_scenario_with_storage_options_on_its_own_folders(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweep's runs checkpoint to folders of their own (url null); the scenario's S3
    ``storage_options`` went with them and made every edited scenario invalid ("only for an
    s3:// url"), exit 2 after the measuring run had been made."""
    from antifragile.chaos.scenario import load_scenario

    seen = _no_run(monkeypatch)
    doc = yaml.safe_load(_tiny(tmp_path, []).read_text())
    doc["checkpoint"].update(url="s3://bucket/run", storage_options={
        "endpoint_url": "http://127.0.0.1:9"})
    path = tmp_path / "s3.yaml"
    path.write_text(yaml.safe_dump(doc))
    s = load_scenario(path)
    costs = tune.Costs(ckpt_s=0.1, restart_s=1.0, mtbf_s=10.0, step_s=0.05)
    measured = tune.Measured(ckpt_s=0.1, stall_s=0.1, step_effect_s=0.0, ckpt_cycle_s=None,
                             restart_s=1.0, step_s=0.05, startup_s=1.0, tail_s=0.1,
                             failures=1, checkpoints=2, injected_kill=False, wall_s=2.0,
                             goodput=0.5, run_dir="")
    rows = tune.sweep(s, costs, measured, tmp_path / "sweep", every=[4], steps=20,
                      mtbf_from_scenario=False, progress=lambda _: None)
    assert [r["every_steps"] for r in rows] == [4]
    assert seen == [(str(tmp_path / "sweep" / "every_4" / "ckpt"), [])]


def test_the_sweep_measures_goodput_as_the_model_counts_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's useful work is the steps at the undisturbed step time; the slower steps
    beside a persisting save and a restart's warm-up step are costs in it (C, R). The sweep
    compared it with the report's goodput, which counts those steps' whole time as useful:
    swept runs measured above the model (0.70 and 0.75 against ranges topping at 0.62 and
    0.68, runs without a failure), called outside the range they fall in."""
    from antifragile.chaos.observe import figures
    from antifragile.chaos.scenario import load_scenario
    from antifragile.chaos.tune import measure

    events, t = _killed_run_events()
    record = _killed_run(events, t)
    monkeypatch.setattr(measure, "_run", lambda s, folder, progress: record)
    # the measuring run's steps took 1.25 s; this run's 1 s (its median, warm-ups left out)
    costs = tune.Costs(ckpt_s=0.6, restart_s=3.5, mtbf_s=20.0, step_s=1.25)
    measured = tune.costs_from_record(record)
    (row,) = tune.sweep(load_scenario(_tiny(tmp_path, [])), costs, measured,
                        tmp_path / "sweep", every=[2], steps=8, mtbf_from_scenario=False,
                        progress=lambda _: None)
    # steps 1-8 count, at this run's 1 s each: 8 s of work over the wall time
    assert row["measured_goodput"] == pytest.approx(8 * 1.0 / record.wall_s)
    assert row["report_goodput"] == pytest.approx(figures.goodput(record))
    assert row["report_goodput"] > row["measured_goodput"]


def test_a_swept_interval_the_model_gives_no_goodput_is_predicted_zero(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--sweep-every`` may name an interval so long against the MTBF that the model's
    expected wall time overflows (goodput 0): the prediction for that run divided by it, a
    ZeroDivisionError traceback after every sweep run had been made."""
    from antifragile.chaos.tune import measure

    events, t = _killed_run_events()
    monkeypatch.setattr(measure, "_run", lambda s, folder, progress: _killed_run(events, t))
    path = _tiny(tmp_path, [{"kind": "kill_rank", "rank": "random", "mtbf_s": 4}])
    result = _invoke([str(path), "--sweep", "--sweep-every", "2,5000", "--sweep-steps", "12",
                      "--schedules", "100", "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["every_steps"]: row for row in json.loads(result.stdout)["sweep"]}
    assert rows[5000]["model_goodput"] == 0.0 and rows[5000]["predicted_goodput"] == 0.0
    assert rows[5000]["gap"] == rows[5000]["measured_goodput"]
    # the spread is of the run as made: one checkpoint, at its end
    assert 0 < rows[5000]["spread_goodput"][0] < rows[5000]["spread_goodput"][1]
    assert 0 < rows[2]["predicted_goodput"] < 1
    low, high = rows[2]["spread_goodput"]
    assert 0 < low < rows[2]["predicted_goodput"] < high < 1
    assert rows[2]["within_spread"] == (low <= rows[2]["measured_goodput"] <= high)
    assert rows[2]["spread_coverage"] == 0.9
    text = _invoke([str(path), "--sweep", "--sweep-every", "2,5000", "--sweep-steps", "12",
                    "--schedules", "100"])
    assert text.exit_code == 0, text.output
    assert "90% of runs" in text.output and f"{low:.4f}-{high:.4f}" in text.output


@pytest.mark.parametrize("extra", [[], ["--sweep-steps", "100000"]])
def test_a_sweep_whose_runs_would_pass_the_run_time_limit_is_refused_before_they_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: list[str]) -> None:
    """The default sweep run lasts about three MTBFs (4000 s here, at 1 s a step), and
    ``--sweep-steps`` may ask for any length: such a run went past chaos run's time limit
    and failed only then, after the runs before it had been made. Refused once the step
    time is measured, before any sweep run, naming the option to change."""
    from antifragile.chaos.tune import measure

    events, t = _killed_run_events()
    runs: list[Path] = []

    def run(s: Any, folder: Path, progress: Any) -> RunRecord:
        runs.append(folder)
        return _killed_run(events, t)

    monkeypatch.setattr(measure, "_run", run)
    path = _tiny(tmp_path, [{"kind": "kill_rank", "rank": "random", "mtbf_s": 4000}])
    result = _invoke([str(path), "--sweep", "--schedules", "100", *extra])
    assert result.exit_code == 2, result.output
    assert "time limit" in result.output and "--sweep-steps" in result.output
    assert "Traceback" not in result.output
    assert len(runs) == 1  # the measuring run only


def test_a_sweep_length_no_step_time_fits_is_refused_before_the_measuring_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--sweep-steps 99999999999999999999`` was refused (time limit) only after the
    measuring run, minutes on a real scenario: at the model's shortest step (1e-06 s) no run
    of 3.6e9 steps or more fits the hour, whatever the step time measured."""
    from antifragile.chaos.tune import measure

    runs: list[Path] = []

    def run(s: Any, folder: Path, progress: Any) -> RunRecord:
        runs.append(folder)
        raise AssertionError("a run was started")

    monkeypatch.setattr(measure, "_run", run)
    path = _tiny(tmp_path, [{"kind": "kill_rank", "rank": "random", "mtbf_s": 4}])
    for steps in ("99999999999999999999", "3600000001"):
        result = _invoke([str(path), "--sweep", "--sweep-steps", steps, "--schedules", "100"])
        assert result.exit_code == 2, result.output
        assert f"--sweep-steps {steps}: " in result.stderr
        assert "give --sweep-steps 3600000000 or fewer" in result.stderr
        assert "Traceback" not in result.output
    assert runs == []


@pytest.mark.parametrize(("args", "says"), [
    (["--ckpt-cost-s", "-5"], "--ckpt-cost-s must be a finite number > 0 seconds, got -5"),
    (["--ckpt-cost-s", "1e-300"], "--ckpt-cost-s: the checkpoint cost must be between 1e-06 "
     "and 1e+120 seconds, got 1e-300"),
    (["--ckpt-cost-s", "5", "--restart-s", "-1"],
     "--restart-s must be a finite number >= 0 seconds, got -1"),
    (["--ckpt-cost-s", "5", "--restart-s", "1e300"],
     "--restart-s: the restart cost must be between"),
    (["--ckpt-cost-s", "5", "--step-s", "0"],
     "--step-s must be a finite number > 0 seconds, got 0"),
    (["--ckpt-cost-s", "5", "--step-s", "nan"],
     "--step-s must be a finite number > 0 seconds, got nan"),
    (["--ckpt-cost-s", "5", "--schedules", "1"], "--schedules must be >= 2, got 1"),
    (["--ckpt-cost-s", "5", "--weibull-shape", "0"],
     "--weibull-shape must be a finite number > 0, got 0"),
    (["--ckpt-cost-s", "5", "--weibull-shape", "0.005"], "--weibull-shape 0.005 is too small"),
])
def test_cli_a_bad_option_value_is_refused_naming_the_option(args: list[str],
                                                             says: str) -> None:
    """The model's own checks said "checkpoint cost must be ...", "step time must be ...",
    "schedules must be >= 2", "the Weibull shape must be ...": which option to change was
    left to the user to guess."""
    result = _invoke(["--mtbf-s", "100", *args])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().startswith(f"error: {says}"), result.stderr


def _measured(**changes: Any) -> Any:
    values: dict[str, Any] = dict(
        ckpt_s=0.1, stall_s=0.1, step_effect_s=0.0, ckpt_cycle_s=None, restart_s=1.0,
        step_s=0.05, startup_s=1.0, tail_s=0.1, failures=1, checkpoints=2,
        injected_kill=False, wall_s=2.0, goodput=0.5, run_dir="/runs/measure")
    values.update(changes)
    return tune.Measured(**values)


def test_a_measured_value_the_model_cannot_take_is_not_called_bad_input(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A measured step time out of the model's range was refused as "step time must be
    between ..." with exit 2 (bad input), though the user gave no step time: it was measured."""
    from antifragile.chaos.tune import recommend

    monkeypatch.setattr(recommend, "measure_costs",
                        lambda *_: _measured(step_s=1e-9))
    result = _invoke([str(_tiny(tmp_path, [])), "--mtbf-s", "60", "--schedules", "50"])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert "measured" in result.stderr and "/runs/measure" in result.stderr, result.stderr
    assert "step time" in result.stderr and "--step-s" not in result.stderr


@pytest.mark.parametrize("ckpt_s", [2e-7, 0.0])
def test_a_measured_checkpoint_cost_below_the_models_bound_is_tuned_at_the_bound(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ckpt_s: float) -> None:
    """A checkpoint measured cheaper than a microsecond (a stall that rounds to nothing) was
    "checkpoint cost must be between 1e-06 and ..." with exit 2, bad input, after a real run
    and though the user gave no cost. Tuned with the bound instead, saying so."""
    from antifragile.chaos.tune import recommend
    from antifragile.chaos.tune.model import MIN_SECONDS

    monkeypatch.setattr(recommend, "measure_costs",
                        lambda *_: _measured(ckpt_s=ckpt_s, stall_s=ckpt_s))
    result = _invoke([str(_tiny(tmp_path, [])), "--mtbf-s", "60", "--schedules", "50",
                      "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["ckpt_cost_s"] == MIN_SECONDS
    assert doc["measurement"]["ckpt_s"] == ckpt_s  # what was measured, as measured
    assert any(f"measured checkpoint cost {ckpt_s:g} s" in n for n in doc["notes"]), doc["notes"]


@pytest.mark.parametrize(("startup_s", "tail_s"), [(3500.0, 150.0), (3590.0, 9.5)])
def test_a_sweep_no_run_of_which_fits_the_time_limit_does_not_advise_one_that_does_not(
        startup_s: float, tail_s: float) -> None:
    """With start-up plus tail near or past the run time limit the refusal said "give
    --sweep-steps 2 or fewer" (the advice floored at 2), which would not fit either."""
    from antifragile.chaos.tune.recommend import _check_sweep_length

    limit_s = 3600.0  # a scenario's time_limit_s, by default

    measured = _measured(startup_s=startup_s, tail_s=tail_s, step_s=1.0)
    assert startup_s + 2 * 1.0 + tail_s > limit_s
    with pytest.raises(tune.TuneError) as refused:
        _check_sweep_length(100, 1.0, measured, explicit=True, limit_s=limit_s)
    message = str(refused.value)
    assert "--sweep-steps 2 or fewer" not in message, message
    assert "no sweep run fits" in message and "start-up" in message, message


def test_the_sweep_length_advised_when_one_is_too_long_fits_the_time_limit() -> None:
    from antifragile.chaos.tune.recommend import _check_sweep_length

    limit_s = 3600.0  # a scenario's time_limit_s, by default

    measured = _measured(startup_s=10.0, tail_s=5.0, step_s=0.7)
    with pytest.raises(tune.TuneError, match=r"give --sweep-steps (\d+) or fewer") as refused:
        _check_sweep_length(100_000, 0.7, measured, explicit=True,
                            limit_s=limit_s)
    advised = int(str(refused.value).split("give --sweep-steps ")[1].split()[0])
    _check_sweep_length(advised, 0.7, measured, explicit=True,
                        limit_s=limit_s)  # fits: no error
    assert 10.0 + (advised + 1) * 0.7 + 5.0 > limit_s  # and is the most that does


@pytest.mark.parametrize(("seconds", "shown"), [(999.4, "999 s"), (999.5, "1,000 s (0.28 h)"),
                                                (999.9, "1,000 s (0.28 h)"),
                                                (1000.0, "1,000 s (0.28 h)"), (0.25, "0.25 s")])
def test_the_table_shows_seconds_near_a_thousand_without_an_exponent(seconds: float,
                                                                     shown: str) -> None:
    """999.5 s up to 1000 s rounded to 3 significant digits printed as "1e+03 s"."""
    from antifragile.chaos.cli.tune import _fmt_s

    assert _fmt_s(seconds) == shown


def test_the_table_states_the_projections_mtbf_in_hours_per_gpu() -> None:
    """--gpu-mtbf-h is one GPU's MTBF in hours; the table called it "GPU-hours" (a product of
    GPUs and hours, the wrong unit)."""
    result = _invoke(["--ckpt-cost-s", "60", "--mtbf-s", "3600", "--gpu-mtbf-h", "50000",
                      "--schedules", "50"])
    assert result.exit_code == 0, result.output
    assert "GPU-hours" not in result.stdout
    assert "job MTBF = one GPU's MTBF (50000 h) / GPUs" in result.stdout, result.stdout


def test_schedules_whose_failure_table_could_outgrow_memory_are_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The check sized one block of failure times (schedules x 128 floats), but a schedule
    that meets many failures grows the table to schedules x MAX_FAILURES floats: on a 1 GiB
    machine 100,000 schedules passed (195 MiB a block) though the table can reach 7.5 GiB,
    a MemoryError traceback mid-simulation."""
    simulate = importlib.import_module("antifragile.chaos.tune.simulate")
    monkeypatch.setattr(simulate, "memory_mib", lambda: 1024)
    with pytest.raises(tune.TuneError, match=r"^--schedules 100000: .*this machine has 1 GiB"):
        simulate.check_simulation(100_000, 0.7)
    simulate.check_simulation(5_000, 0.7)  # 386 MiB at most: taken


def test_the_time_a_save_takes_to_commit_is_measured_without_the_final_one() -> None:
    """An asynchronous save's stall is its cost C, but a failure before it commits rolls back
    one checkpoint further, and a save asked for while one persists is refused: the commit
    time is measured (committed periodic saves, slowest rank; the final blocking one is the
    job's shutdown). It was not measured at all."""
    events, t = _killed_run_events()
    committed = {(0, 2): 0.4, (0, 4): 0.6, (1, 6): 0.8, (1, 8): 0.6}
    for (attempt, step), persist_s in committed.items():
        at = next(e["t"] for e in events if e["event"] == "ckpt_staged" and e["step"] == step
                  and e["attempt"] == attempt) + 0.05
        events += [_event(at, attempt, r, "ckpt_committed", step=step, bytes=10,
                          persist_s=persist_s - 0.1 * r) for r in (0, 1)]
    events += [_event(t + 1.0, 1, r, "ckpt_blocked", step=8, seconds=2.0) for r in (0, 1)]
    events.sort(key=lambda e: e["t"])
    m = tune.costs_from_record(_killed_run(events, t + 1.0))
    assert m.persist_s == pytest.approx((0.4 + 0.6 + 0.8) / 3)
    assert m.ckpt_s == pytest.approx(0.6)  # C stays the stall and its effect


@pytest.mark.parametrize(("persist_s", "said"), [(30.0, True), (0.5, False), (None, False)])
def test_a_recommended_interval_shorter_than_a_saves_commit_time_is_said_to_be_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, persist_s: float | None,
        said: bool) -> None:
    """C = 0.1 s and M = 60 s recommend ~3.5 s; a save that takes 30 s to commit cannot be
    taken that often (the engine refuses a save while one persists, so most are skipped, and
    a failure before the commit loses an interval more): the model's interval was printed as
    the answer with nothing said."""
    from antifragile.chaos.tune import recommend

    monkeypatch.setattr(recommend, "measure_costs",
                        lambda *_: _measured(persist_s=persist_s))
    result = _invoke([str(_tiny(tmp_path, [])), "--mtbf-s", "60", "--schedules", "50",
                      "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["measurement"]["persist_s"] == persist_s
    notes = [n for n in doc["notes"] if "commit" in n]
    assert bool(notes) == said, doc["notes"]
    if said:
        assert "30 s" in notes[0] and "refuse" in notes[0], notes


def _persisting_run(slow_s: float) -> RunRecord:
    """Steps of 1 s (the first of an attempt 3 s, warm-up), a save after steps 3, 6 and 9
    stalling 0.1 s and persisting 1.8 s, the two steps that run while it persists ``slow_s``
    longer each (its threads take the cores); a kill after step 8, a new attempt restoring
    step 6 that runs steps 7-10 with no save."""
    events: list[dict[str, Any]] = []

    def emit(t: float, attempt: int, event: str, **fields: Any) -> None:
        events.extend(_event(t, attempt, r, event, **fields) for r in (0, 1))

    t = 0.0
    emit(t, 0, "start", pid=1)
    persisting_until = -1.0
    for step in range(1, 9):
        seconds = 3.0 if step == 1 else 1.0 + (slow_s if t < persisting_until else 0.0)
        t += seconds
        emit(t, 0, "step_end", step=step, loss=1.0, seconds=seconds)
        if step % 3 == 0:
            t += 0.1
            emit(t, 0, "ckpt_staged", step=step, stall_s=0.1)
            emit(t + 1.8, 0, "ckpt_committed", step=step, bytes=10, persist_s=1.8)
            persisting_until = t + 1.8
    killed = t + 0.2
    t += 3.0
    emit(t, 1, "start", pid=2)
    t += 1.0
    emit(t, 1, "restore_end", step=6, seconds=1.0)
    for step in range(7, 11):
        seconds = 3.0 if step == 7 else 1.0
        t += seconds
        emit(t, 1, "step_end", step=step, loss=1.0, seconds=seconds)
    events.sort(key=lambda e: e["t"])
    return RunRecord(returncode=0, started_t=-0.5, ended_t=t + 1.0, events=events,
                     injections=[Injection("kill_rank", killed, step=8, rank=1)],
                     attempt_ends={0: killed + 0.5, 1: t + 1.0})


def test_the_checkpoint_cost_counts_every_step_its_persist_slowed() -> None:
    """An asynchronous save's threads slow every step that runs while it persists (on 2 cores
    the step after a save took 265 ms against 44 ms, and the persist outlasts it), not only
    the next one: C took the next step's excess over the other steps' mean, those slowed too,
    so two steps slowed 0.3 s each gave 0.1 + 0.15 s instead of 0.1 + 0.6 s."""
    m = tune.costs_from_record(_persisting_run(0.3))
    assert m.stall_s == pytest.approx(0.1)
    assert m.ckpt_s == pytest.approx(0.1 + 2 * 0.3)
    # nothing slowed: nothing charged
    assert tune.costs_from_record(_persisting_run(0.0)).ckpt_s == pytest.approx(0.1)


def _best_whole_steps(ckpt_s: float, mtbf_s: float, step_s: float, around: int) -> int:
    """The whole step count near ``around`` with the highest model goodput (R only scales it)."""
    candidates = range(max(1, around - 3), around + 4)
    return max(candidates, key=lambda k: tune.expected_goodput(k * step_s, ckpt_s, 0.0, mtbf_s))


def test_the_model_optimum_in_whole_steps_is_the_best_whole_step_count() -> None:
    """The optimum (1.45 steps here) was rounded to the nearest step, 1, but the goodput falls
    faster below the optimum than above it: 2 steps do better (0.9537 against 0.9530). The
    best whole step count is the floor or the ceiling, whichever the model prefers."""
    ckpt_s, mtbf_s = 1.0, 1000.0
    step_s = tune.optimal_interval(ckpt_s, mtbf_s) / 1.45
    costs = tune.Costs(ckpt_s=ckpt_s, restart_s=0.0, mtbf_s=mtbf_s, step_s=step_s)
    doc = tune.tune(costs, schedules=50).as_dict()
    assert doc["model_optimum_every_steps"] == 2 == _best_whole_steps(ckpt_s, mtbf_s, step_s, 1)
    assert 2 * step_s in tune.candidate_intervals(costs)


@settings(max_examples=200, deadline=None)
@given(ckpt_s=st.floats(1e-3, 1e3), step_s=st.floats(1e-2, 1e3),
       gpu_mtbf_h=st.floats(1e3, 1e7))
def test_projected_every_steps_maximise_the_model_goodput_over_whole_steps(
        ckpt_s: float, step_s: float, gpu_mtbf_h: float) -> None:
    costs = tune.Costs(ckpt_s=ckpt_s, restart_s=10.0, mtbf_s=1.0, step_s=step_s)
    for row in tune.project(costs, gpu_mtbf_h):
        k = row["recommended_every_steps"]
        assert k == _best_whole_steps(ckpt_s, row["mtbf_s"], step_s, k) or math.isclose(
            tune.expected_goodput(k * step_s, ckpt_s, 0.0, row["mtbf_s"]),
            tune.expected_goodput(_best_whole_steps(ckpt_s, row["mtbf_s"], step_s, k)
                                  * step_s, ckpt_s, 0.0, row["mtbf_s"]), rel_tol=1e-12)


def test_the_projected_goodput_is_the_goodput_of_the_projected_every_steps() -> None:
    """At 100,000 GPUs the optimum (1.41 s) is shorter than a step (10 s): the row said
    every_steps 1 beside the goodput at 1.41 s (0.986), which a checkpoint every step (0.950)
    cannot have. Where the step time is known, the row's interval is its whole steps and its
    goodput that interval's."""
    costs = tune.Costs(ckpt_s=0.01, restart_s=0.0, mtbf_s=1.0, step_s=10.0)
    rows = {r["gpus"]: r for r in tune.project(costs, 100.0 * 100_000 / HOUR)}
    row = rows[100_000]
    assert row["mtbf_s"] == pytest.approx(100.0)
    assert row["recommended_every_steps"] == 1
    assert row["recommended_interval_s"] == 10.0
    assert row["expected_goodput"] == pytest.approx(
        tune.expected_goodput(10.0, 0.01, 0.0, row["mtbf_s"]))
    assert row["expected_goodput"] < 0.96
    for r in rows.values():
        assert r["recommended_interval_s"] == r["recommended_every_steps"] * 10.0


def _runner_wall(rng: Any, segments: int, period_s: float, mtbf_s: float, down_s: float,
                 restore_s: float) -> float:
    """One run as ``chaos run`` makes it, failure by failure: ``mtbf_s`` arrivals in wall
    time, and one that comes while the job is down (from a failure until every rank of the
    next attempt has started: ``down_s``) is drawn again; the restore after it can fail."""
    t, done = 0.0, 0
    failure = rng.exponential(mtbf_s)
    while done < segments:
        if failure >= t + period_s:
            t, done = t + period_s, done + 1
            continue
        while True:  # down, then restored unless an arrival comes first
            t = failure + down_s
            failure = t + rng.exponential(mtbf_s)
            if failure >= t + restore_s:
                t += restore_s
                break
    return t


def test_the_sweeps_prediction_is_of_the_runs_it_makes_where_no_failure_comes_while_down(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner draws again an arrival that comes while the job is down (detect + restart:
    2.5 s of the 3.5 s R here), but the sweep predicted its runs with Daly's model, where a
    failure may come during all of R: at an MTBF of 4 s that is a wall time 15% longer than
    such runs take on average, and their spread shifted as far."""
    from antifragile.chaos.scenario import load_scenario
    from antifragile.chaos.tune import measure

    events, t = _killed_run_events()
    record = _killed_run(events, t)
    monkeypatch.setattr(measure, "_run", lambda s, folder, progress: record)
    measured = tune.costs_from_record(record)
    assert measured.restart_s == pytest.approx(3.5)
    costs = tune.Costs(ckpt_s=0.6, restart_s=3.5, mtbf_s=4.0, step_s=1.0)
    (row,) = tune.sweep(load_scenario(_tiny(tmp_path, [])), costs, measured,
                        tmp_path / "sweep", every=[2], steps=8, mtbf_from_scenario=False,
                        progress=lambda _: None)
    rng = np.random.default_rng(7)
    walls = np.array([_runner_wall(rng, 4, 2.0 + 0.6, 4.0, 2.5, 1.0) for _ in range(20_000)])
    overhead = measured.startup_s + measured.tail_s
    predicted_wall = 8.0 / row["predicted_goodput"] - overhead
    assert predicted_wall == pytest.approx(walls.mean(), rel=0.02)
    spread_walls = [8.0 / g - overhead for g in reversed(row["spread_goodput"])]
    assert spread_walls == pytest.approx(np.quantile(walls, [0.05, 0.95]).tolist(), rel=0.06)
