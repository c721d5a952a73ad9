"""The benchmarks time the engine and its peers under the same conditions: what one side's
figure includes (a barrier, a window of steps), the other's includes too. Fast: no disk-sized
states, at most one in-process gloo rank."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist


def _save_cost_times(tmp_path: Path, *, saves: int) -> dict[str, list[float]]:
    """``bench.save_cost``'s one rank, in this process, ``saves`` timed saves: its times."""
    from bench import save_cost

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    threads = torch.get_num_threads()
    try:
        save_cost._worker(0, 1, port, str(tmp_path), saves, str(tmp_path))
    finally:
        torch.set_num_threads(threads)
    times: dict[str, list[float]] = json.loads((tmp_path / "rank0.json").read_text())["times"]
    return times


def test_save_cost_times_the_engine_save_without_the_barrier_before_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A barrier that takes 0.2 s is no part of the engine's save() return, as none is of DCP's
    async_save return: each figure starts after the ranks met (so do both persists)."""

    barrier_s = 0.2
    real_barrier = dist.barrier

    def slow_barrier(*args: object, **kwargs: object) -> object:
        time.sleep(barrier_s)
        return real_barrier(*args, **kwargs)

    monkeypatch.setattr(dist, "barrier", slow_barrier)
    times = _save_cost_times(tmp_path, saves=1)
    assert max(times["engine_return"]) < barrier_s, times
    assert max(times["dcp_async_return"]) < barrier_s, times


def test_save_cost_dcp_persist_makes_its_folders_durable_as_the_engine_does(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """For a small state a persist is file-system metadata: the engine's ends once its files
    and the folders holding their entries are fsynced, so DCP's (its future done) ends once
    its own are too, as bench.engine's DCP peers do; DCP's writer fsyncs only its files."""
    import os

    synced: set[str] = set()
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.add(os.path.realpath(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    _save_cost_times(tmp_path, saves=1)
    for i in range(3):  # two untimed saves, one timed
        dcp_dir = tmp_path / f"dcp-{i}"
        written = {str(dcp_dir)} | {str(p) for p in dcp_dir.rglob("*")}
        assert written <= synced, sorted(written - synced)
    assert str(tmp_path) in synced


def _trainer_events(steps: int, every: int | None, stall_s: float,
                    refused: frozenset[int] = frozenset()) -> list[dict[str, object]]:
    """One rank's step_end events: steps of 1 s, and with checkpoints every ``every`` steps
    the step after each save ``stall_s`` longer (the loop pays the stall after step_end); a
    save at a step in ``refused`` is refused (busy) and costs nothing."""
    events: list[dict[str, object]] = []
    t = 0.0
    for step in range(1, steps + 1):
        saved_before = every and step > 1 and (step - 1) % every == 0
        t += 1.0 + (stall_s if saved_before and step - 1 not in refused else 0.0)
        events.append({"event": "step_end", "rank": 0, "step": step, "t": t})
        if every and step % every == 0 and step in refused:
            events.append({"event": "ckpt_failed", "rank": 0, "step": step,
                           "error": "the previous save is still in flight"})
        elif every and step % every == 0:
            events.append({"event": "ckpt_staged", "rank": 0, "step": step, "stall_s": stall_s})
            events.append({"event": "ckpt_committed", "rank": 0, "step": step,
                           "persist_s": 0.1})
    return events


@pytest.mark.parametrize(("steps", "every", "warmup"), [(60, 10, 11), (120, 20, 21),
                                                         (60, 10, 5)])
def test_trainer_bench_times_whole_checkpoint_periods(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, steps: int, every: int,
        warmup: int) -> None:
    """With a stall of half a step per 10 steps the overhead is 5%: the timed steps hold as
    many saves per step as the run makes (``bench.trainer``'s defaults, and ``bench.gpu``'s)."""
    import argparse
    import subprocess

    from bench import trainer as bench_trainer

    def fake_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(bench_trainer.subprocess, "run", fake_run)
    monkeypatch.setattr(bench_trainer, "read_events", lambda run_dir: _trainer_events(
        steps, every if "ckpt" in run_dir.name else None, 0.5 * every / 10))
    args = argparse.Namespace(dp=1, tp=1, pp=1, steps=steps, every=every, warmup=warmup,
                              layers=1, d_model=64, device="cpu")
    base = bench_trainer._run(args, tmp_path / "none-0", None)
    ckpt = bench_trainer._run(args, tmp_path / "ckpt-0", every)
    assert ckpt["mean_step_s"] / base["mean_step_s"] - 1.0 == pytest.approx(0.05)


def test_trainer_bench_overhead_misses_when_saves_in_the_timed_steps_were_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save refused (the previous one still persisting) or failed costs the loop nothing:
    with a stall of 0.1 s per 1 s step every 10 steps (+1% when every save is made, a PASS),
    a run whose timed steps made 1 of their 4 saves shows +0.25%, which says nothing of the
    2% target: a MISS that says how many were made."""
    import argparse
    import subprocess

    from bench import trainer as bench_trainer

    def fake_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(cmd, 0)

    args = argparse.Namespace(dp=1, tp=1, pp=1, steps=60, every=10, warmup=11, layers=1,
                              d_model=64, device="cpu")
    monkeypatch.setattr(bench_trainer.subprocess, "run", fake_run)
    for refused, made, overhead, verdict in ((frozenset(), 4, 0.01, "PASS"),
                                             (frozenset({20, 30, 40}), 1, 0.0025,
                                              "MISS (1 of 4 saves")):
        monkeypatch.setattr(bench_trainer, "read_events", lambda run_dir, refused=refused: (
            _trainer_events(60, 10 if "ckpt" in run_dir.name else None, 0.1, refused)))
        base = bench_trainer._run(args, tmp_path / "none-0", None)
        ckpt = bench_trainer._run(args, tmp_path / "ckpt-0", args.every)
        assert (ckpt["timed_saves"], ckpt["expected_saves"]) == (made, 4)
        assert ckpt["mean_step_s"] / base["mean_step_s"] - 1.0 == pytest.approx(overhead)
        made_all = {"timed_saves": 4.0, "expected_saves": 4.0}  # two more pairs: a verdict
        assert bench_trainer.overhead_verdict(overhead, [ckpt, made_all, made_all]
                                              ).startswith(verdict)


def test_engine_bench_times_no_peer_on_its_first_call(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's first save (plan, staging area) and DCP async_save's first call are not
    timed; nor is any peer's first call (imports, planners, thread pools): a peer whose first
    call takes 0.3 s longer is timed at its later calls only."""
    from bench import engine as bench_engine
    from bench._peers import single_rank_group
    from bench._state import gpt_like_state, map_tensors, state_nbytes

    first_call_s = 0.3
    calls: dict[str, int] = {}

    def peer(name: str) -> object:
        def write(state: object, path: str) -> None:
            calls[name] = calls.get(name, 0) + 1
            if calls[name] == 1:
                time.sleep(first_call_s)
            Path(path).write_bytes(b"x")
        return write

    for name in ("torch_save_fsync", "dcp_save_sync", "torchsnapshot_take_sync"):
        monkeypatch.setattr(bench_engine, name, peer(name))
    with single_rank_group(str(tmp_path)):
        state = gpt_like_state(64)
        bench = bench_engine.Bench(root=str(tmp_path), reps=2, peer_budget_s=60.0,
                                   report=bench_engine.Report(config={}), state=state,
                                   target=map_tensors(state, torch.empty_like),
                                   nbytes=state_nbytes(state))
        bench.write_phase()
    for key in ("torch_save", "dcp_save", "torchsnapshot"):
        row = bench.report.row(key)
        assert len(row.samples) == 2 and max(row.samples) < first_call_s, (key, row.samples)


def test_recovery_bench_checks_miss_when_the_run_did_not_pass(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A recovery time, a detection time or a goodput is a figure of a recovery that worked:
    an in-process recovery of 0.4 s whose run failed its chaos checks (state not bitwise equal
    to the fault-free run's) is no PASS of the 1 s target, nor its ratio to the restart's."""
    from bench import recovery

    def row(scenario: str, verdict: str, recovery_s: float) -> dict[str, object]:
        return {"scenario": scenario, "verdict": verdict, "bitwise_equal": verdict == "pass",
                "recovery_mode": [], "faults": 1, "recovered": 1, "detect_s": 0.1,
                "reform_s": 0.1, "restore_s": 0.1, "recompute_s": 0.1,
                "recovery_s": recovery_s, "lost_steps": 0, "goodput": 0.9,
                "goodput_vs_reference": 0.95, "reference_goodput": 0.95, "wall_s": 10.0}

    runs = {"quickstart.yaml": row("quickstart", "pass", 4.0),
            "quickstart-in-process.yaml": row("quickstart-in-process", "fail", 0.4)}
    monkeypatch.setattr(recovery, "_run", lambda name, out: runs[name])
    recovery.main(["--only", "quickstart", "--out", str(tmp_path), "--cached-reference"])
    checks = [line for line in capsys.readouterr().out.splitlines()
              if line.startswith(("PASS", "MISS"))]
    assert len(checks) == 2 and all(line.startswith("MISS") for line in checks), checks
    assert all("quickstart-in-process: fail" in line for line in checks), checks


def test_engine_bench_o_direct_peer_makes_its_file_durable_in_its_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The O_DIRECT baseline writes a new file each repetition: its persist ends once the file
    and its entry in the parent folder are fsynced, as the engine's (and every other peer's)
    ends once its files and folders are; a baseline spared the folder's fsync is timed doing
    less than the engine it is held against."""
    import mmap
    import os

    from bench._peers import DirectWriter

    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.path.realpath(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    region = mmap.mmap(-1, 2 * 4096)  # page-aligned, as the engine's staging arena
    buffer = memoryview(region)
    out = tmp_path / "direct-0"
    monkeypatch.setattr(os, "fsync", fsync)
    try:
        DirectWriter(buffer, len(buffer)).write(str(out))
    finally:
        buffer.release()
        region.close()
    assert out.stat().st_size == 2 * 4096
    assert {str(out), str(tmp_path)} <= set(synced), synced


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("peer", ["torch_save_fsync", "dcp_save_sync", "torchsnapshot_take_sync"])
def test_engine_bench_peers_make_their_own_writes_durable_and_no_one_elses(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, peer: str) -> None:
    """A peer's persist ends once every file and folder it wrote (and its entry in the parent
    folder) is fsynced, as the engine's ends once its own files and folders are: not with an
    ``os.sync()`` that also waits for whatever else the machine has dirty (256 MiB another
    process wrote took 0.16 s more on this VM's disk)."""
    import os

    from bench import _peers
    from bench._peers import single_rank_group
    from bench._state import gpt_like_state

    synced: set[str] = set()
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.add(os.path.realpath(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    def machine_wide_sync() -> None:
        raise AssertionError("os.sync() flushes every process's dirty pages")

    out = tmp_path / "ckpt"
    with single_rank_group(str(tmp_path)):
        state = gpt_like_state(64)
        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "sync", machine_wide_sync)
        getattr(_peers, peer)(state, str(out))
    written = {str(out), str(tmp_path)} | {
        os.path.join(folder, name) for folder, dirs, files in os.walk(out)
        for name in (*dirs, *files)}
    assert written <= synced, sorted(written - synced)


def test_gpu_bench_alternates_which_trainer_run_of_a_pair_goes_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """As in ``bench.trainer``: a device that warms up (or slows down) over a pair favours
    neither side every time, so the run without checkpoints goes first in one pair in two."""
    from bench import gpu
    from bench import trainer as bench_trainer

    order: list[str] = []

    def fake_run(args: object, run_dir: Path, every: int | None) -> dict[str, float]:
        order.append(run_dir.name.split("-")[0])
        return {"mean_step_s": 1.0, "timed_saves": 5, "expected_saves": 5}

    monkeypatch.setattr(bench_trainer, "_run", fake_run)
    gpu.trainer(2)
    assert order == ["none", "ckpt", "ckpt", "none"], order


def test_gpu_bench_json_carries_the_staging_share_and_verdict_it_prints(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The staging share of the link and its PASS/MISS are in the JSON as in the text (here
    a stall of 0.5 s against a link of 0.2 s: 0.4x, a MISS), with the measurements faked."""
    from bench import gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake device")
    monkeypatch.setattr(gpu, "_state", lambda gib: {"model": {"w": torch.ones(4), "norms": []}})
    monkeypatch.setattr(gpu, "link", lambda nbytes, reps: 0.2)
    monkeypatch.setattr(gpu, "per_tensor", lambda tensors, reps: 0.3)
    monkeypatch.setattr(gpu, "engine", lambda state, reps, root: {
        "stall_s": 0.5, "persist_s": 1.0, "load_s": 1.0, "loaded_step": 3,
        "bitwise_equal": True})
    out = tmp_path / "gpu.json"
    assert gpu.main(["--trainer-pairs", "0", "--json", str(out)]) == 0
    assert "0.40x the link (target >= 0.8x) MISS" in capsys.readouterr().out
    figures = json.loads(out.read_text())
    assert figures["staging_share"] == pytest.approx(0.4)
    assert figures["staging_verdict"] == "MISS"


@pytest.mark.parametrize(("reps", "verdict"), [(1, "n/a"), (2, "n/a"), (3, "PASS")])
def test_gpu_bench_gives_the_staging_target_no_verdict_on_fewer_than_three_samples(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        reps: int, verdict: str) -> None:
    """The staging share is a median of ``--reps`` stalls over a median of as many link
    copies: from one or two a side it is neither PASS nor MISS, as in bench.engine, bench.s3
    and the trainer's overhead (here a stall of 0.2 s on a link of 0.2 s: 1.0x)."""
    from bench import gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake device")
    monkeypatch.setattr(gpu, "_state", lambda gib: {"model": {"w": torch.ones(4), "norms": []}})
    monkeypatch.setattr(gpu, "link", lambda nbytes, reps: 0.2)
    monkeypatch.setattr(gpu, "per_tensor", lambda tensors, reps: 0.2)
    monkeypatch.setattr(gpu, "engine", lambda state, reps, root: {
        "stall_s": 0.2, "persist_s": 1.0, "load_s": 1.0, "loaded_step": reps,
        "bitwise_equal": True})
    out = tmp_path / "gpu.json"
    assert gpu.main(["--reps", str(reps), "--trainer-pairs", "0", "--json", str(out)]) == 0
    assert f"1.00x the link (target >= 0.8x) {verdict}" in capsys.readouterr().out
    assert json.loads(out.read_text())["staging_verdict"].startswith(verdict)


def test_trainer_bench_json_carries_the_stall_share_it_prints(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """What the loop waits for (mean stall / (every x mean step)) is in the JSON as in the text:
    a stall of 0.05 s per 10 steps of 1 s is 0.50%."""
    from bench import trainer as bench_trainer

    def fake_run(args: object, run_dir: Path, every: int | None) -> dict[str, float]:
        return {"mean_step_s": 1.0, "median_step_s": 1.0, "checkpoints": 5,
                "expected_saves": 4, "timed_saves": 4, "mean_stall_s": 0.05 if every else 0.0,
                "mean_persist_s": 0.1 if every else 0.0}

    monkeypatch.setattr(bench_trainer, "_run", fake_run)
    monkeypatch.setattr(bench_trainer, "gpu_stall", lambda: None)
    out = tmp_path / "trainer.json"
    assert bench_trainer.main(["--pairs", "1", "--json", str(out)]) == 0
    assert "= 0.50% (the rest" in capsys.readouterr().out
    assert json.loads(out.read_text())["stall_share"] == pytest.approx(0.005)


def test_gpu_bench_engine_persist_excludes_deleting_older_checkpoints(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's persist is its save until committed, as in ``bench.engine``: no deletion of
    an older checkpoint (retention, which ``wait()`` also waits for) is timed. On a clock that
    moves only while a checkpoint folder is deleted (100 s each), the persist is 0 s; the
    device's synchronize is a no-op and the state on the CPU."""
    import types

    from antifragile.engine.storage._local import LocalStorage
    from bench import gpu

    clock = [0.0]
    real_delete_tree = LocalStorage.delete_tree

    def slow_delete_tree(self: LocalStorage, prefix: str) -> bool:
        clock[0] += 100.0
        return real_delete_tree(self, prefix)

    monkeypatch.setattr(LocalStorage, "delete_tree", slow_delete_tree)
    monkeypatch.setattr(gpu, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    state = {"model": {"w": torch.randn(64, 64), "norms": [torch.ones(8)],
                       "step": torch.tensor(7)}}
    e = gpu.engine(state, 3, str(tmp_path / "ckpt"))
    assert e["persist_s"] == 0.0, e
    assert e["loaded_step"] == 3 and e["bitwise_equal"] is False  # CPU, not on the device


@pytest.mark.parametrize(("reps", "verdicts"), [(1, {"n/a"}), (2, {"n/a"}),
                                                (3, {"PASS", "MISS"})])
def test_engine_bench_gives_a_target_no_verdict_on_fewer_than_three_samples(
        reps: int, verdicts: set[str]) -> None:
    """A median of one or two samples (``--quick``: one repetition; a slow peer cut short by
    its budget) has no spread to judge by: a target checked on it is neither PASS nor MISS,
    and the ratio says how many samples it rests on."""
    from bench import engine as bench_engine

    report = bench_engine.Report(config={})
    for key, (section, what, throughput) in bench_engine.ROWS.items():
        report.rows.append(bench_engine.Row(key=key, section=section, what=what,
                                            samples=[1.0] * reps, nbytes=2**30 * throughput))
    bench_engine.add_ratios(report)
    targeted = [r for r in report.ratios if r.target]
    assert targeted and {r.verdict for r in targeted} <= verdicts, [
        (r.what, r.verdict) for r in targeted]
    assert all(r.n == reps for r in report.ratios)


def test_engine_bench_sweep_json_carries_the_ratios_and_verdicts_it_prints(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--sweep``: each size's ratio to O_DIRECT, s/GiB and peak RSS over state + staging
    with its PASS/MISS, and the s/GiB growth with its verdict, are in the JSON as in the text
    (the points faked: 1 GiB at 1 s, 2 GiB at 4 s: 2x s/GiB, a MISS)."""
    from bench import engine as bench_engine
    from bench.scale import ScalePoint

    gib = 2**30

    def fake_point(size_gib: float, parent: str, reps: int) -> ScalePoint | str:
        if size_gib > 2:
            return "4 GiB skipped: no memory"
        n = int(size_gib * gib)
        return ScalePoint(size_gib=size_gib, nbytes=n, staging_nbytes=n,
                          stall_s=[0.1] * 3, persist_s=[size_gib**2] * 3,
                          direct_s=[size_gib] * 3,
                          base_rss=gib, peak_rss=gib + int(2.5 * n))

    monkeypatch.setattr(bench_engine, "scale_point", fake_point)
    out = tmp_path / "sweep.json"
    assert bench_engine.main(["--sweep", "1,2,4", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "+25.0%, target <= 10% MISS" in text and "2.000x  target <= 1.5x" in text
    doc = json.loads(out.read_text())
    one, two, skipped = doc["points"]
    assert one["direct_ratio"] == pytest.approx(1.0) and two["direct_ratio"] == pytest.approx(0.5)
    assert two["s_per_gib"] == pytest.approx(2.0) and two["persist_gib_s"] == pytest.approx(0.5)
    assert one["rss_extra"] == pytest.approx(0.25) and one["rss_verdict"] == "MISS"
    assert skipped == "4 GiB skipped: no memory"
    assert doc["s_per_gib_growth"] == pytest.approx(2.0) and doc["growth_verdict"] == "MISS"


@pytest.mark.parametrize(("reps", "verdict"), [(1, "n/a"), (2, "n/a"), (3, "PASS")])
def test_s3_bench_gives_a_target_no_verdict_on_fewer_than_three_samples(
        reps: int, verdict: str) -> None:
    """As ``bench.engine``'s: a median of one or two samples (``--quick``: 2 repetitions) is
    neither PASS nor MISS of the 1.5x target."""
    from bench.s3 import Figures

    fig = Figures("quickstart", 1, 4, samples={"persist": [1.0] * reps, "raw_put": [1.0] * reps})
    assert fig.ratio("persist", "raw_put") == 1.0
    assert fig.verdict("persist", "raw_put") == verdict


def test_trainer_bench_stall_is_that_of_the_saves_its_timed_steps_pay(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stall share divides the mean stall by the timed steps' time, but the mean took
    every save of the run: the first (untimed: it plans and allocates the staging area, 5 s
    here against 0.1 s) and the last step's. Only the saves the timed steps pay count."""
    import argparse
    import subprocess

    from bench import trainer as bench_trainer

    def fake_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(cmd, 0)

    def events(run_dir: Path) -> list[dict[str, object]]:
        out = _trainer_events(60, 10, 0.1)
        return [{**e, "stall_s": 5.0} if e["event"] == "ckpt_staged" and e["step"] == 10
                else e for e in out]

    monkeypatch.setattr(bench_trainer.subprocess, "run", fake_run)
    monkeypatch.setattr(bench_trainer, "read_events", events)
    args = argparse.Namespace(dp=1, tp=1, pp=1, steps=60, every=10, warmup=11, layers=1,
                              d_model=64, device="cpu")
    ckpt = bench_trainer._run(args, tmp_path / "ckpt-0", args.every)
    assert ckpt["timed_saves"] == 4
    assert ckpt["mean_stall_s"] == pytest.approx(0.1)


@pytest.mark.parametrize(("pairs", "verdict"), [(1, "n/a"), (2, "n/a"), (3, "PASS")])
def test_trainer_bench_gives_the_overhead_target_no_verdict_on_fewer_than_three_pairs(
        pairs: int, verdict: str) -> None:
    """The overhead is a median over pairs, and one pair is noise (8 processes on the
    machine's cores): ``--pairs 1`` (or bench.gpu's 2) was a PASS or MISS all the same, where
    bench.engine and bench.s3 give a target no verdict on fewer than 3 samples."""
    from bench import trainer as bench_trainer

    run = {"timed_saves": 4.0, "expected_saves": 4.0}
    assert bench_trainer.overhead_verdict(0.01, [run] * pairs).startswith(verdict)


@pytest.mark.parametrize(("reps", "verdict"), [(1, "n/a"), (2, "n/a"), (3, "MISS")])
def test_engine_bench_sweep_gives_growth_no_verdict_on_fewer_than_three_samples(
        reps: int, verdict: str) -> None:
    """``--sweep`` times one save per size unless ``--reps`` says otherwise: the s/GiB growth
    (a ratio of medians) was PASS or MISS on one sample a size."""
    from bench.scale import ScalePoint, growth

    gib = 2**30
    points: list[ScalePoint | str] = [
        ScalePoint(size_gib=s, nbytes=s * gib, staging_nbytes=s * gib, stall_s=[0.1] * reps,
                   persist_s=[float(s * s)] * reps, direct_s=[float(s)] * reps,
                   base_rss=gib, peak_rss=gib + 2 * s * gib) for s in (1, 2)]
    grown = growth(points)
    assert grown is not None and grown[0] == pytest.approx(2.0)
    assert grown[1].startswith(verdict), grown


def test_save_cost_engine_persist_excludes_deleting_older_checkpoints(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's persist was its save plus retention's delete of an older checkpoint
    (``keep_last=2``: ``wait()`` waits for it), compared with DCP's persist, which deletes
    nothing. With a delete that takes 1.5 s the engine's persist stays below it, as in
    bench.engine and bench.gpu (a save of this state persists in ~0.1 s, 0.35 s seen on a
    loaded machine)."""
    from antifragile.engine.storage._local import LocalStorage

    delete_s = 1.5
    real_delete_tree = LocalStorage.delete_tree

    def slow_delete_tree(self: LocalStorage, prefix: str) -> bool:
        time.sleep(delete_s)
        return real_delete_tree(self, prefix)

    monkeypatch.setattr(LocalStorage, "delete_tree", slow_delete_tree)
    times = _save_cost_times(tmp_path, saves=2)
    assert len(times["engine_persist"]) == 2
    assert max(times["engine_persist"]) < delete_s, times
    engine_steps = sorted(p.name for p in (tmp_path / "engine").iterdir()
                          if p.name.startswith("step_"))
    assert len(engine_steps) <= 2, engine_steps  # older ones still go, untimed


def test_engine_bench_sweep_leaves_no_folder_when_a_size_fails_before_its_saves(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweep's folder was made before the state and the engine, outside the cleanup: a
    state that could not be built (MemoryError) left an antifragile-scale-* folder behind."""
    from bench import scale

    def no_memory(d: int) -> dict[str, object]:
        raise MemoryError

    monkeypatch.setattr(scale, "gpt_like_state", no_memory)
    with pytest.raises(MemoryError):
        scale.scale_point(0.001, str(tmp_path), 1)
    assert list(tmp_path.iterdir()) == []


def test_engine_bench_reports_a_failed_peer_as_skipped_with_its_reason(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer that cannot run (torchsnapshot not importable; a file system that refuses
    O_DIRECT, as tmpfs did) is reported as skipped, with the reason, in the text and the JSON:
    the run goes on for the others, and no ratio against it gets a figure or a verdict. The
    O_DIRECT baseline is not replaced by a buffered write under its name."""
    import errno
    import os

    from bench import engine as bench_engine
    from bench._peers import single_rank_group
    from bench._state import gpt_like_state, map_tensors, state_nbytes

    real_open = os.open

    def no_direct_open(path: object, flags: int, *args: object, **kwargs: object) -> int:
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]

    def no_torchsnapshot(state: object, path: str) -> None:
        raise ModuleNotFoundError("No module named 'torchsnapshot'")

    monkeypatch.setattr(os, "open", no_direct_open)
    monkeypatch.setattr(bench_engine, "torchsnapshot_take_sync", no_torchsnapshot)
    with single_rank_group(str(tmp_path)):
        state = gpt_like_state(64)
        report = bench_engine.Report(config={"payload_gib": 0.0, "tensors": 30, "d": 64,
                                             "reps": 3, "dir": str(tmp_path), "fstype": "x"})
        bench = bench_engine.Bench(root=str(tmp_path), reps=3, peer_budget_s=60.0,
                                   report=report, state=state,
                                   target=map_tensors(state, torch.empty_like),
                                   nbytes=state_nbytes(state))
        bench.write_phase()
    for key in ("memcpy", "stall", "persist", "dcp_save", "torch_save"):
        assert len(report.row(key).samples) == 3, key
    assert {r.key for r in report.rows}.isdisjoint({"direct", "torchsnapshot"})
    for key in ("load", "dcp_load", "resharded"):  # no load phase here
        report.rows.append(bench_engine.Row(key=key, section="load", what=key,
                                            samples=[1.0] * 3, nbytes=1))
    bench_engine.add_ratios(report)
    by_peer = {r.theirs: r for r in report.ratios}
    assert by_peer["direct"].verdict == "skipped", by_peer["direct"]
    assert "O_DIRECT" in by_peer["direct"].skipped
    assert by_peer["torchsnapshot"].verdict == "skipped"
    assert "No module named 'torchsnapshot'" in by_peer["torchsnapshot"].skipped
    assert by_peer["dcp_save"].verdict in ("PASS", "MISS")
    text = bench_engine.render(report)
    assert "No module named 'torchsnapshot'" in text
    doc = json.loads(json.dumps(bench_engine.to_json(report)))
    assert set(doc["skipped"]) == {"direct", "torchsnapshot"}
    assert {r["theirs"]: r["verdict"] for r in doc["ratios"]}["direct"] == "skipped"


def test_engine_bench_rotates_the_order_of_the_writers_across_repetitions(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As the loads' order cycles (a load right after a DCP load ran 20-27% slower on this
    VM), no writer runs in the same slot of every repetition: the engine was always first
    after its memcpy, the O_DIRECT baseline always right after DCP's async_save and
    torchsnapshot always last. The memcpy stays right before the engine save it is paired
    with."""
    from bench import engine as bench_engine
    from bench._peers import DirectWriter, single_rank_group
    from bench._state import gpt_like_state, map_tensors, state_nbytes

    calls: list[str] = []

    def peer(name: str) -> object:
        def write(*args: object) -> None:
            path = str(args[-1])
            if "warm-up" not in path:
                calls.append(name)
            Path(path).write_bytes(b"x")
        return write

    for name in ("torch_save_fsync", "dcp_save_sync", "torchsnapshot_take_sync"):
        monkeypatch.setattr(bench_engine, name, peer(name))
    direct = peer("direct")
    monkeypatch.setattr(DirectWriter, "write", lambda self, path: direct(path))
    real_engine_save = bench_engine.Bench._engine_save
    real_dcp_async = bench_engine.Bench._dcp_async

    def engine_save(self: object, ckpt: object, step: int) -> object:
        if step:
            calls.append("engine")
        return real_engine_save(self, ckpt, step)  # type: ignore[arg-type]

    def dcp_async(self: object, tag: str) -> object:
        if tag != "warm-up":
            calls.append("dcp_async")
        return real_dcp_async(self, tag)  # type: ignore[arg-type]

    monkeypatch.setattr(bench_engine.Bench, "_engine_save", engine_save)
    monkeypatch.setattr(bench_engine.Bench, "_dcp_async", dcp_async)
    reps = 3
    with single_rank_group(str(tmp_path)):
        state = gpt_like_state(64)
        bench = bench_engine.Bench(root=str(tmp_path), reps=reps, peer_budget_s=60.0,
                                   report=bench_engine.Report(config={}), state=state,
                                   target=map_tensors(state, torch.empty_like),
                                   nbytes=state_nbytes(state))
        bench.write_phase()
    per_rep = len(calls) // reps
    assert per_rep == 6 and len(calls) == 6 * reps, calls
    slots: dict[str, set[int]] = {}
    for i, name in enumerate(calls):
        slots.setdefault(name, set()).add(i % per_rep)
    assert all(len(s) == reps for s in slots.values()), calls
    assert len(bench.report.row("memcpy").samples) == reps


def test_s3_bench_raw_baseline_uploads_the_bytes_the_engine_saved(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The raw PUT moves the objects the engine's save left, not zero-filled buffers of their
    sizes: zeros compress to nothing where fp32 shards do not (a store that compresses, as
    SeaweedFS's filer gzips an upload whose first bytes compress, would do other work), so
    the two sides would not move the same bytes. The cluster is faked: no S3 here."""
    import zlib
    from unittest.mock import MagicMock

    from bench import s3

    rng = torch.Generator().manual_seed(0)
    stored = {f"b/quickstart/engine/step_000000001/a/c.{i}":
              torch.randn(8192, generator=rng).numpy().tobytes() for i in range(3)}
    stored["b/quickstart/engine/step_000000001/zarr.json"] = b'{"zarr_format": 3}' * 2
    bench = MagicMock()
    bench.bucket = "b"
    bench.save.return_value = (0.1, MagicMock(), 1)
    bench.objects.return_value = {k: len(v) for k, v in stored.items()}
    bench.contents.side_effect = lambda objects: s3.Bench.contents(bench, objects)
    bench.fs.cat_file.side_effect = lambda path, *a, **k: stored[path]
    bench.raw_put.return_value = bench.raw_put_obstore.return_value = 0.1
    proxy_fs = MagicMock()
    bench.through_proxy.return_value.__enter__.return_value = ({}, proxy_fs, MagicMock())
    s3.measure(bench, "quickstart", s3.STATES["quickstart"], 1)
    (_, uploaded), _ = bench.raw_put.call_args
    assert sorted(uploaded) == sorted(stored.values())
    assert all(len(zlib.compress(b)) > 0.8 * len(b) for b in uploaded if len(b) > 16384)
    put = sorted(c.args[1] for c in proxy_fs.pipe_file.call_args_list)
    assert put == sorted(stored.values())


def test_dcp_writes_on_as_many_threads_as_the_engine(tmp_path: Path) -> None:
    """DCP's FileSystemWriter writes one file per thread, on 1 thread by default: the bench
    compared the engine's 8 I/O threads with DCP on one, which a DCP user sets otherwise."""
    import inspect

    from antifragile.engine import CheckpointEngine
    from bench._peers import dcp_save_sync, single_rank_group

    threads = inspect.signature(CheckpointEngine).parameters["io_threads"].default
    state = {"model": {f"w{i}": torch.ones(64, 64) for i in range(2 * threads)}}
    with single_rank_group(str(tmp_path)):
        dcp_save_sync(state, str(tmp_path / "dcp"))
    assert len(list((tmp_path / "dcp").glob("*.distcp"))) == threads


@pytest.mark.parametrize("mesh", [None, (1, 1, 1)], ids=["replicas", "trainer-state"])
def test_s3_bench_ranks_check_what_each_load_returned(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mesh: tuple[int, int, int] | None
        ) -> None:
    """``--ranks N`` and ``--mesh``: each rank's timed load is checked bit for bit (and for its
    step), as the one-process loads are: a load that fills the state with zeros is no figure
    of a load. One rank in this process, on a local folder (the worker does not care where
    the engine writes); the engine's load is made to return zeros. ``mesh``: the trainer's
    own state (a 1x1x1 layout: one rank)."""
    import queue

    from antifragile.engine import CheckpointEngine
    from bench import s3

    real_load = CheckpointEngine.load

    def zeroing_load(self: CheckpointEngine, state: object, *args: object, **kwargs: object
                     ) -> int:
        step = real_load(self, state, *args, **kwargs)  # type: ignore[arg-type]
        for t in s3._tensors(state):
            t.zero_()
        return step

    def free_port() -> int:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port: int = sock.getsockname()[1]
            return port

    out: queue.Queue[object] = queue.Queue()
    threads = torch.get_num_threads()
    try:  # the real load passes the check: a row of figures
        s3._rank_worker(0, 1, free_port(), str(tmp_path / "ok"), {}, 2, 1, out, mesh)
        assert out.qsize() == 1
        monkeypatch.setattr(CheckpointEngine, "load", zeroing_load)
        with pytest.raises(RuntimeError, match="load returned different values"):
            s3._rank_worker(0, 1, free_port(), str(tmp_path / "zeroed"), {}, 2, 1, out, mesh)
        assert not dist.is_initialized()
    finally:
        torch.set_num_threads(threads)
        if dist.is_initialized():
            dist.destroy_process_group()
    assert out.qsize() == 1
