"""``storage_node_down``: a SeaweedFS volume server killed (or stopped) under a running job.

Layers: the scenario rules (no processes); the fault against a real cluster (kill and restart,
stop and continue, which server); what the report makes of it (from events) and the checks that
can fail the verdict (a server that never came back, a committed step that does not read back);
then the shipped scenario as a whole ``chaos run`` (slow): saves in flight commit intact or fail,
training goes on, a restore afterwards ends bit-identical.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from antifragile.chaos.cli import main
from antifragile.chaos.faults import Injection, Target
from antifragile.chaos.faults.storage_node_down import StorageNodeDown
from antifragile.chaos.infra import s3
from antifragile.chaos.infra.seaweedfs import SeaweedCluster, SeaweedError, find_weed
from antifragile.chaos.observe import checker
from antifragile.chaos.observe.measure import FaultTimings, fault_timings
from antifragile.chaos.observe.record import RunRecord
from antifragile.chaos.scenario import ScenarioError, load_scenario, parse_scenario

ROOT = Path(__file__).resolve().parent.parent
NODE = {"kind": "storage_node_down", "at_step": 5, "duration_s": 3}


def _doc(url: str | None, faults: list[dict[str, Any]]) -> dict[str, Any]:
    return {"name": "node", "trainer": {"parallel": {"dp": 2}, "steps": 16},
            "checkpoint": {"url": url, "every_steps": 4}, "faults": faults}


# -- scenario rules ----------------------------------------------------------------------------


@pytest.mark.parametrize("url", [None, "/tmp/ckpt"])
def test_it_needs_s3(url: str | None) -> None:
    with pytest.raises(ScenarioError, match=r"^x.yaml: faults.0.kind: storage_node_down stops a "
                       r"volume server of the SeaweedFS cluster chaos starts for S3, but "
                       r"checkpoint.url .*: set checkpoint.url: s3://bucket/prefix"):
        parse_scenario(_doc(url, [NODE]), path="x.yaml")


def test_fields_are_validated() -> None:
    for bad, key in (({"mode": "pause"}, "mode"), ({"duration_s": 0}, "duration_s"),
                     ({"server": -1}, "server"), ({"server": "idlest"}, "server")):
        with pytest.raises(ScenarioError, match=rf"faults\.0\.{key}"):
            parse_scenario(_doc("s3://b/p", [{**NODE, **bad}]))
    s = parse_scenario(_doc("s3://b/p", [NODE]))
    fault = s.faults[0]
    assert isinstance(fault, StorageNodeDown)
    assert (fault.mode, fault.server, fault.duration_s) == ("kill", "busiest", 3)


def test_shipped_scenarios_are_valid() -> None:
    for path in (ROOT / "scenarios" / "storage-node-down.yaml",
                 ROOT / "scenarios" / "nightly" / "storage-node-down-s3-dp2.yaml"):
        s = load_scenario(path)
        assert s.faults[0].kind == "storage_node_down" and s.checkpoint.async_


def test_an_external_endpoint_is_refused_before_anything_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fault needs the cluster chaos starts; with AWS_ENDPOINT_URL there is none."""
    import yaml

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(_doc("s3://b/p", [{"kind": "kill_rank", "at_step": 3},
                                                      NODE])))
    start = time.monotonic()
    result = CliRunner().invoke(main, ["run", str(path), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and time.monotonic() - start < 5
    assert result.output.startswith(f"error: {path}: faults.1.kind: storage_node_down stops a "
                                    "volume server of the SeaweedFS cluster chaos starts, but "
                                    "the endpoint http://127.0.0.1:9 comes from AWS_ENDPOINT_URL; "
                                    "leave it out")


def test_without_a_cluster_it_is_reported_skipped() -> None:
    target = Target(pids={}, coordinates={}, ckpt_url="s3://b/p", rng=random.Random(0))
    injection = StorageNodeDown(kind="storage_node_down", at_step=3).inject(target, 3)
    assert injection.skipped and "not a SeaweedFS cluster started by chaos" in injection.skipped


# -- against a real cluster --------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[SeaweedCluster]:
    try:
        find_weed()
    except SeaweedError as exc:
        pytest.skip(str(exc))
    with SeaweedCluster() as c:
        c.client().create_bucket(Bucket="node-data")
        yield c


def _target(cluster: SeaweedCluster) -> Target:
    return Target(pids={}, coordinates={}, ckpt_url="s3://node-data/p", rng=random.Random(0),
                  storage_cluster=cluster)


def _process_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _until(condition: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


@pytest.mark.s3
def test_kill_mode_kills_then_restarts_the_busiest_server(cluster: SeaweedCluster) -> None:
    client = cluster.client()
    for i in range(6):
        client.put_object(Bucket="node-data", Key=f"k{i}", Body=b"x" * 100_000)
    busiest = cluster.busiest_volume()
    old = cluster.volume_servers[busiest].pid
    fault = StorageNodeDown(kind="storage_node_down", at_step=1, duration_s=0.5)
    injection = fault.inject(_target(cluster), 1)
    d = injection.detail
    assert injection.skipped is None and d["server"] == busiest and d["pid"] == old
    assert not cluster.volume_servers[busiest].alive()
    _until(lambda: d["ended_t"] is not None)
    assert d["error"] is None and d["restarted_pid"] not in (None, old)
    assert d["ended_t"] - injection.t >= 0.5
    assert cluster.volume_servers[busiest].alive()


@pytest.mark.s3
def test_stop_mode_freezes_then_continues_the_named_server(cluster: SeaweedCluster) -> None:
    server = cluster.volume_servers[1]
    fault = StorageNodeDown(kind="storage_node_down", at_step=1, duration_s=0.5, mode="stop",
                            server=1)
    injection = fault.inject(_target(cluster), 1)
    assert server.pid is not None and _process_state(server.pid) == "T"
    _until(lambda: injection.detail["ended_t"] is not None)
    assert _process_state(server.pid) in "RS" and injection.detail["restarted_pid"] is None
    assert injection.detail["pid"] == server.pid


@pytest.mark.s3
def test_a_server_outside_the_cluster_is_skipped(cluster: SeaweedCluster) -> None:
    fault = StorageNodeDown(kind="storage_node_down", at_step=1, server=7)
    injection = fault.inject(_target(cluster), 1)
    assert injection.skipped == "server 7: the cluster has 2 volume servers"


@pytest.mark.s3
@pytest.mark.parametrize("mode", ["kill", "stop"])
def test_a_server_another_fault_holds_down_is_missed_not_a_crash(
        cluster: SeaweedCluster, mode: str) -> None:
    """Two faults on one server that overlap (two entries, or ``mtbf_s`` arrivals closer
    than ``duration_s``): the second finds it down. That fault did not happen, and says so;
    an exception here would end the whole run with a traceback (the job killed, no report).
    ``busiest`` picks among the servers still up."""
    first = StorageNodeDown(kind="storage_node_down", at_step=1, duration_s=1.0, server=0)
    held = first.inject(_target(cluster), 1)
    try:
        second = StorageNodeDown(kind="storage_node_down", at_step=2, duration_s=1.0,
                                 server=0, mode=mode).inject(_target(cluster), 2)
        assert second.missed is not None and "volume server 0" in second.missed, second
        busiest = StorageNodeDown(kind="storage_node_down", at_step=2, duration_s=0.5,
                                  mode=mode).inject(_target(cluster), 2)
        assert busiest.missed is None and busiest.detail["server"] == 1
        _until(lambda: busiest.detail["ended_t"] is not None)
    finally:
        _until(lambda: held.detail["ended_t"] is not None)
    assert held.detail["error"] is None
    assert all(s.alive() for s in cluster.volume_servers)


@pytest.mark.s3
def test_a_server_that_does_not_stop_is_missed_saying_so(
        cluster: SeaweedCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """A running server that was sent SIGSTOP and did not show as stopped (asleep in
    uninterruptible I/O) was reported missed "... : it was down when this fault was due",
    the reason of a server another fault held down: the report named the wrong cause."""
    from antifragile.chaos.infra import seaweedfs

    monkeypatch.setattr(seaweedfs, "wait_stopped", lambda pid: False)
    injection = StorageNodeDown(kind="storage_node_down", at_step=1, duration_s=0.5,
                                mode="stop", server=0).inject(_target(cluster), 1)
    assert injection.missed is not None and "did not stop" in injection.missed, injection
    assert "was down" not in injection.missed, injection.missed
    assert _process_state(cluster.volume_servers[0].pid or 0) in "RS"


# -- the report and the verdict ----------------------------------------------------------------


def _ev(t: float, event: str, rank: int = 0, attempt: int = 0, **kw: Any) -> dict[str, Any]:
    return {"t": t, "event": event, "rank": rank, "attempt": attempt, **kw}


def test_the_report_says_what_failed_and_what_recovered() -> None:
    events = [_ev(0.0, "start", pid=1)]
    events += [_ev(float(t), "step_end", step=t, seconds=0.5, loss=1.0) for t in range(1, 21)]
    events += [
        _ev(2.0, "ckpt_staged", step=2, stall_s=0.01),
        _ev(3.0, "ckpt_committed", step=2, persist_s=1.0, bytes=10),
        _ev(6.0, "ckpt_staged", step=6, stall_s=0.01),  # in flight when the node went down
        _ev(9.0, "ckpt_failed", step=6, error="step 6, rank 0: read ... failed 6 times"),
        _ev(14.0, "ckpt_staged", step=14, stall_s=0.01),
        _ev(15.0, "ckpt_committed", step=14, persist_s=1.0, bytes=10),
    ]
    events.sort(key=lambda e: e["t"])
    injection = Injection("storage_node_down", 7.0, step=7, detail={
        "mode": "kill", "duration_s": 5.0, "server": 1, "pid": 100, "ended_t": 12.5,
        "restarted_pid": 200, "error": None})
    t = fault_timings(RunRecord(0, 0.0, 21.0, events, [injection]), injection)
    o = t.outage
    assert o is not None and t.recovery_s is None
    assert (o["server"], o["pid"], o["restarted_pid"], o["mode"]) == (1, 100, 200, "kill")
    assert o["checkpoints_failed"] == [6] and o["first_commit_after_step"] == 14
    assert o["training_continued"] and o["outage_s"] == 5.5
    assert "requests_faulted" not in o, "the proxy's counts belong to storage_outage"


def test_a_save_lost_with_an_earlier_attempt_was_not_in_flight_during_the_window() -> None:
    """Attempt 0's save of step 4 never committed nor failed: a kill ended the attempt at
    4.6 s. The volume server went down from 10 s to 12 s, when no save ran: that proves
    nothing, and the lost save, over before the window opened, is no evidence."""
    events = [_ev(0.0, "start", pid=1)]
    events += [_ev(float(t), "step_end", step=t, seconds=0.5, loss=1.0) for t in range(1, 5)]
    events += [_ev(2.0, "ckpt_staged", step=2, stall_s=0.01),
               _ev(3.0, "ckpt_committed", step=2, persist_s=1.0, bytes=10),
               _ev(4.0, "ckpt_staged", step=4, stall_s=0.01)]
    events += [_ev(6.0, "start", attempt=1, pid=2),
               _ev(6.2, "restore_end", attempt=1, step=2, seconds=0.1)]
    events += [_ev(6.0 + t, "step_end", attempt=1, step=t, seconds=0.5, loss=1.0)
               for t in range(3, 15)]
    events.sort(key=lambda e: e["t"])
    kill = Injection("kill_rank", 4.1, step=4, rank=0, fault_index=0, detail={"pid": 1})
    injection = Injection("storage_node_down", 10.0, step=4, fault_index=1, detail={
        "mode": "kill", "duration_s": 2.0, "server": 1, "pid": 100, "ended_t": 12.0,
        "restarted_pid": 200, "error": None})
    record = RunRecord(0, 0.0, 21.0, events, [kill, injection], {0: 4.6, 1: 20.5})
    t = fault_timings(record, injection)
    assert t.outage is not None and t.outage["checkpoints"] == []
    assert t.outage["checkpoints_failed"] == []
    assert t.effect_observed is False and "no save ran" in (t.effect or "")


def _judge(timings: list[FaultTimings], committed: dict[int, list[str]] | None) -> Any:
    s = parse_scenario({**_doc("s3://b/p", [NODE]),
                        "expect": {"bitwise_equal_to_reference": False}})
    return checker.judge(s, returncode=0, timings=timings, final_step=16, faulty_url="unused",
                         reference_url=None, final_committed=True, committed=committed)


def test_the_verdict_fails_on_a_torn_commit_or_a_server_that_stayed_down() -> None:
    outage = {"training_continued": True, "steps_during_outage": 3, "error": None}
    fine = FaultTimings("storage_node_down", 1.0, 5, None, fault_index=0, outage=outage,
                        effect_observed=True, effect="volume server 1 down for 5.5 s")
    assert _judge([fine], {4: [], 8: []}).verdict == "pass"
    torn = _judge([fine], {4: [], 8: ["model/w/c.0: crc32c mismatch"]})
    assert torn.verdict == "fail"
    assert torn.reasons == ["committed step 8 does not verify: model/w/c.0: crc32c mismatch"]
    stuck = FaultTimings("storage_node_down", 1.0, 5, None, fault_index=0, effect_observed=True,
                         outage={**outage, "error": "SeaweedError: volume server 0 did not "
                                 "come back within 30 s"})
    v = _judge([stuck], {})
    assert v.verdict == "fail" and "storage did not come back: SeaweedError" in v.reasons[0]


def test_a_server_still_down_when_the_run_ended_fails() -> None:
    """A down window longer than the rest of the run: the server was never brought back while
    the job ran (its timer had not fired: no ``ended_t``, no error yet), so nothing shows that
    it came back. Saves ran while it was down all the same; that is not a pass."""
    events = [_ev(0.0, "start", pid=1)]
    events += [_ev(float(t), "step_end", step=t, seconds=0.5, loss=1.0) for t in range(1, 17)]
    events += [_ev(6.0, "ckpt_staged", step=6, stall_s=0.01),
               _ev(9.0, "ckpt_failed", step=6, error="step 6, rank 0: write failed"),
               _ev(14.0, "ckpt_staged", step=14, stall_s=0.01),
               _ev(15.0, "ckpt_committed", step=14, persist_s=1.0, bytes=10)]
    events.sort(key=lambda e: e["t"])
    injection = Injection("storage_node_down", 7.0, step=7, fault_index=0, detail={
        "mode": "kill", "duration_s": 30.0, "server": 1, "pid": 100, "ended_t": None,
        "restarted_pid": None, "error": None})
    t = fault_timings(RunRecord(0, 0.0, 17.0, events, [injection]), injection)
    assert t.effect_observed is False and "still down when the run ended" in (t.effect or "")
    assert _judge([t], {14: []}).verdict == "fail"


@pytest.mark.s3
def test_verify_committed_reads_every_committed_step_back(
        s3_bucket: tuple[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    from antifragile.engine import CheckpointEngine

    url, options = s3_bucket
    monkeypatch.setenv("AWS_ENDPOINT_URL", options["endpoint_url"])
    with CheckpointEngine(url, storage_options=options, keep_last=None) as engine:
        for step in (4, 8):
            engine.save(step, {"w": torch.full((64,), float(step))}, blocking=True)
    assert checker.verify_committed(url) == {4: [], 8: []}
    bucket, prefix = s3.split_url(url)
    client = s3._client(options["endpoint_url"], options)
    key = f"{prefix}/step_000000008/w/c.0"
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[0] ^= 0xFF
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    found = checker.verify_committed(url)
    assert found[4] == [] and found[8] and "w/c.0" in found[8][0]


# -- the shipped scenario, whole ---------------------------------------------------------------


@pytest.mark.s3
@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(900)
def test_shipped_scenario_saves_commit_intact_or_fail_and_the_run_ends_bitwise_equal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANTIFRAGILE_CACHE", str(tmp_path / "cache"))
    for var in s3.ENDPOINT_VARS:
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["run", str(ROOT / "scenarios" / "storage-node-down.yaml"),
                                       "--out", str(out)])
    report = json.loads((out / "report.json").read_text())
    assert result.exit_code == 0, result.output
    assert report["verdict"] == {"verdict": "pass", "reasons": [], "bitwise_equal": True}
    node, kill = report["faults"]
    o = node["outage"]
    assert node["kind"] == "storage_node_down" and node["skipped"] is None
    assert o["mode"] == "kill" and o["error"] is None and o["restarted_pid"] not in (None, o["pid"])
    assert o["training_continued"] and o["steps_during_outage"] > 0
    # the fault hit saves: at least one was in flight, and each committed, failed or was lost
    # with its process; none half-committed (every committed step left reads back whole)
    assert o["checkpoints"], o
    assert {c["outcome"] for c in o["checkpoints"]} <= {"committed", "failed", "skipped", "lost"}
    assert o["first_commit_after_step"] is not None
    verified = report["committed_verified"]
    assert verified and all(problems == [] for problems in verified.values()), verified
    # the restore came after the server was back, from S3, and the run ended bit-identical
    assert kill["injected_t"] > node["injected_t"] + o["outage_s"]
    assert kill["restored_step"] is not None and kill["restored_step"] > 0
    assert "storage_node_down (volume server" in result.output
