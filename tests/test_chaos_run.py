"""``chaos run`` end to end on a small world: faults done from outside, recovery measured,
the faulty run proven bit-identical to the fault-free reference."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from antifragile.chaos.cli import main
from antifragile.chaos.run.pipeline import run
from antifragile.chaos.scenario import parse_scenario
from tests._reports import check_restored

pytestmark = pytest.mark.multiproc

TRAINER = {"parallel": {"dp": 2, "tp": 1, "pp": 1}, "steps": 20, "batch_size": 8,
           "model": {"layers": 2, "d_model": 32, "heads": 4, "vocab": 64, "seq_len": 16},
           "collective_timeout_s": 30}


@pytest.fixture(scope="session")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fault-free references of this run, made once: under xdist one folder for every
    worker (its entries are made under a lock, for caches that chaos runs share), so a test
    does not run again the reference another worker's test already made."""
    base = tmp_path_factory.getbasetemp()  # under xdist: the run's folder / popen-<worker>
    if base.name == f"popen-{os.environ.get('PYTEST_XDIST_WORKER')}":
        folder = base.parent / "reference-cache"
        folder.mkdir(exist_ok=True)
        return folder
    return tmp_path_factory.mktemp("reference-cache")


def _scenario(name: str, faults: list[dict[str, Any]], **expect: Any) -> dict[str, Any]:
    return {"name": name, "seed": 3, "trainer": TRAINER,
            "checkpoint": {"every_steps": 4, "keep_last": 3}, "faults": faults,
            "expect": {"bitwise_equal_to_reference": True, **expect}}


def test_kill_rank_recovers_and_ends_bitwise_equal(tmp_path: Path, cache: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANTIFRAGILE_CACHE", str(cache))
    doc = _scenario("kill", [{"kind": "kill_rank", "rank": 1, "at_step": 10}],
                    max_recovery_s=120, max_lost_steps=6)
    path = tmp_path / "kill.yaml"
    path.write_text(yaml.safe_dump(doc))
    result = CliRunner().invoke(main, ["run", str(path), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["verdict"] == {"verdict": "pass", "reasons": [], "bitwise_equal": True}
    (fault,) = report["faults"]
    # held at the end of step 10 (a pause point), killed there: exactly where the scenario says
    assert fault["kind"] == "kill_rank" and fault["rank"] == 1 and fault["injected_step"] == 10
    check_restored(report, fault, saved=(4, 8))  # 8 unless its async save was in flight
    assert fault["recovery_mode"] == "restart" and fault["paused_s"] >= 0
    for key in ("detect_s", "restart_s", "restore_s", "recompute_s"):
        assert fault[key] is not None and fault[key] >= 0
    assert fault["recovery_s"] == pytest.approx(sum(fault[k] for k in (
        "detect_s", "restart_s", "restore_s", "recompute_s")))
    run = report["run"]
    assert run["attempts"] == 2 and 0 < run["goodput"] < 1
    # the fault-free run's goodput, recorded with its cache entry: what the faults cost
    assert 0 < run["reference_goodput"] < 1
    assert run["goodput_vs_reference"] == pytest.approx(run["goodput"] / run["reference_goodput"])
    assert {c["step"] for c in report["checkpoints"] if c["committed"]} >= {4, 8, 20}
    assert (tmp_path / "out" / "report.md").read_text().startswith("# kill: PASS")


def test_corrupt_latest_checkpoint_falls_back_and_still_ends_equal(
        tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANTIFRAGILE_CACHE", str(cache))
    # Both land at the pause point at the end of step 13, corrupt first, then the kill. The
    # damaged checkpoint is the newest committed one then (12, or 8 if 12 was still
    # persisting); restore must skip it for the one before. The pause point holds the trainer
    # at step 13, so the 20 steps and saves of the other tests' scenario do (and share their
    # cached fault-free reference where they run in the same session).
    doc = _scenario("corrupt", [
        {"kind": "corrupt_shard", "at_step": 13, "checkpoint": "latest", "mode": "bitflip"},
        {"kind": "kill_rank", "rank": 0, "at_step": 13},
    ])
    outcome = run(parse_scenario(doc), tmp_path / "out", progress=lambda _: None)
    corrupt, kill = outcome.report["faults"]
    damaged = corrupt["checkpoint_step"]
    assert corrupt["kind"] == "corrupt_shard" and damaged % 4 == 0 and damaged >= 8
    assert kill["restored_step"] == damaged - 4, f"the damaged step {damaged} must be skipped"
    assert outcome.report["verdict"]["bitwise_equal"] is True
    assert outcome.passed, outcome.report["verdict"]
    events = [json.loads(line) for line in
              (tmp_path / "out" / "run" / "events" / "rank0.jsonl").read_text().splitlines()]
    skipped = [e for e in events if e["event"] == "restore_skipped"]
    assert skipped and f"step {damaged}" in skipped[0]["reason"]


def test_faults_that_did_nothing_fail_even_when_the_state_is_equal(
        tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two corruptions that prove nothing: one finds no checkpoint to damage yet (at 0.1 s,
    when the ranks have just started; saves every 4: a step-triggered fault before the first
    save, or a named step the trainer never saves, is refused at validation), the other
    damages the newest checkpoint but no restart ever reads it. The run ends equal
    to the reference, and the verdict still fails, saying why."""
    monkeypatch.setenv("ANTIFRAGILE_CACHE", str(cache))
    doc = _scenario("no-effect", [
        {"kind": "corrupt_shard", "at_s": 0.1, "checkpoint": "latest"},
        {"kind": "corrupt_shard", "at_step": 9, "checkpoint": "latest"},
    ])
    path = tmp_path / "no-effect.yaml"
    path.write_text(yaml.safe_dump(doc))
    result = CliRunner().invoke(main, ["run", str(path), "--out", str(tmp_path / "out")])
    assert result.exit_code == 1, result.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    missed, unread = report["faults"]
    assert missed["missed"] == "no committed checkpoint to corrupt"
    assert missed["effect_observed"] is False and unread["effect_observed"] is False
    damaged = unread["checkpoint_step"]
    assert damaged is not None and damaged % 4 == 0 and unread["recovery_s"] is None
    verdict = report["verdict"]
    assert verdict["verdict"] == "fail" and verdict["bitwise_equal"] is True
    assert len(verdict["reasons"]) == 2, verdict
    assert "no observable effect: not made: no committed checkpoint to corrupt" in \
        verdict["reasons"][0]
    assert f"no restore read the damaged step {damaged}" in verdict["reasons"][1]
    assert "NO EFFECT" in result.output


def test_a_fault_that_cannot_be_made_here_is_skipped_not_passed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without network namespaces the two-node run goes on one host and its drop_link is not
    made: verdict ``skipped``, exit 3, although everything else holds."""
    from antifragile.chaos.infra import netns

    reason = "creating network namespaces needs root (CAP_NET_ADMIN)"
    monkeypatch.setattr(netns, "unavailable_reason", lambda: reason)
    doc = _scenario("no-netns", [{"kind": "drop_link", "at_step": 6, "duration_s": 2}],
                    bitwise_equal_to_reference=False)
    doc["trainer"] = {**TRAINER, "nodes": 2, "steps": 12}
    path = tmp_path / "no-netns.yaml"
    path.write_text(yaml.safe_dump(doc))
    result = CliRunner().invoke(main, ["run", str(path), "--no-reference",
                                       "--out", str(tmp_path / "out")])
    assert result.exit_code == 3, result.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    (fault,) = report["faults"]
    assert fault["skipped"] == f"network namespaces unavailable: {reason}"
    assert fault["effect_observed"] is None
    assert report["verdict"]["verdict"] == "skipped"
    assert report["verdict"]["reasons"] == [
        f"drop_link at step {fault['injected_step']}: skipped: {fault['skipped']}"]
    assert report["run"]["final_step"] == 12 and report["run"]["returncode"] == 0
    assert "no-netns: SKIPPED" in result.output
    assert (tmp_path / "out" / "report.md").read_text().startswith("# no-netns: SKIPPED")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_hung_rank_is_detected_and_recovered(tmp_path: Path, cache: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Lost work is the newest save committed before the hang: on a loaded machine the first
    save (its plan, its buffers) can still be persisting six 25 ms steps later, when rank 1
    stops and no commit can follow (seen in the slow tier: restored 0, 10 steps lost), so
    step 0 counts as a right restore when nothing had committed by then."""
    monkeypatch.setenv("ANTIFRAGILE_CACHE", str(cache))
    doc = _scenario("hang", [{"kind": "hang_rank", "rank": 1, "at_step": 10, "duration_s": 90}])
    doc["trainer"] = {**TRAINER, "hang_timeout_s": 5}
    outcome = run(parse_scenario(doc), tmp_path / "out", progress=lambda _: None)
    assert outcome.passed, outcome.report["verdict"]
    (fault,) = outcome.report["faults"]
    check_restored(outcome.report, fault, saved=(0, 4, 8))
    assert outcome.report["verdict"]["bitwise_equal"] is True
    # Found by rank 1's supervisor while it was still stopped, within the timeout + 1 s.
    assert fault["detect_s"] < 5 + 1.5, fault
    events = [json.loads(line) for line in
              (tmp_path / "out" / "run" / "events" / "supervisor1.jsonl").read_text().splitlines()]
    assert any(e["event"] == "hang_detected" and e["rank"] == 1 and e["how"] == "stopped"
               for e in events)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_crash_during_save_never_exposes_the_torn_checkpoint(
        tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANTIFRAGILE_CACHE", str(cache))
    doc = _scenario("crash", [{"kind": "crash_during_save", "rank": 0, "at_checkpoint": 3}])
    doc["trainer"] = {**TRAINER, "model": {**TRAINER["model"], "d_model": 128, "layers": 4}}
    outcome = run(parse_scenario(doc), tmp_path / "out", progress=lambda _: None)
    (fault,) = outcome.report["faults"]
    assert fault["checkpoint_step"] == 12 and fault["recovery_s"] is not None
    if fault["restored_step"] == 8:  # killed before COMMIT: step 12 must not have been loaded
        assert outcome.passed, outcome.report["verdict"]
        assert fault["effect_observed"] is True
        assert fault["lost_steps"] == fault["injected_step"] - 8
    else:  # the small checkpoint committed before the signal landed: no crash during a save
        # happened, and the verdict must say so rather than pass (issue 11's pause points
        # will make the crash land before COMMIT every time)
        assert fault["restored_step"] == 12 and fault["effect_observed"] is False
        assert outcome.verdict == "fail"
        assert any("step 12" in r and ("won the race" in r or "committed after" in r)
                   for r in outcome.report["verdict"]["reasons"])
    first_attempt = [c for c in outcome.report["checkpoints"] if c["attempt"] == 0]
    assert any(c["step"] == 12 for c in first_attempt)


def _started_by(marker: str, but: int) -> dict[int, str]:
    """Processes whose command line names ``marker`` (a test's folder), except pid ``but``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == but:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # gone meanwhile
            continue
        if marker in cmdline:
            found[int(entry.name)] = cmdline
    return found


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_an_ended_chaos_leaves_no_process_behind(tmp_path: Path, sig: signal.Signals) -> None:
    """torchrun runs in a session of its own (faults signal a rank's group), so it hears
    nothing of what ends chaos: a CI timeout's SIGTERM, or a SIGKILL, left the job running
    (an in-process job with nobody to end it re-forms forever)."""
    doc = _scenario("long", [{"kind": "kill_rank", "rank": 1, "at_step": 1900}])
    doc["trainer"] = {**TRAINER, "steps": 2000}
    path = tmp_path / "long.yaml"
    path.write_text(yaml.safe_dump(doc))
    chaos = subprocess.Popen(
        [sys.executable, "-c", "from antifragile.chaos.cli import entry; entry()", "run",
         str(path), "--out", str(tmp_path / "out")],
        env={**os.environ, "ANTIFRAGILE_CACHE": str(tmp_path / "cache")},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    marker = str(tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not any("antifragile.trainer" in c for c in _started_by(marker, chaos.pid).values()):
            assert chaos.poll() is None and time.monotonic() < deadline, chaos.stderr
            time.sleep(0.2)
        time.sleep(1.0)  # the ranks are up
        chaos.send_signal(sig)
        _, err = chaos.communicate(timeout=60)
        if sig == signal.SIGTERM:
            assert chaos.returncode == 128 + signal.SIGTERM, err
            assert "terminated (SIGTERM)" in err and "Traceback" not in err, err
        deadline = time.monotonic() + 30
        while _started_by(marker, chaos.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _started_by(marker, chaos.pid)
    finally:
        chaos.kill()
        for pid in _started_by(marker, chaos.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


_CLEANUP_SCRIPT = """
import sys, time
import antifragile.chaos.cli as cli

def main():  # a command whose cleanup takes a while (stopping a job, unmounting a tmpfs)
    try:
        print("running", flush=True)
        time.sleep(60)
    finally:
        print("cleaning", flush=True)
        time.sleep(1.5)
        print("cleaned", flush=True)

cli.main = main
cli.entry()
"""


def test_a_second_ctrl_c_does_not_cut_the_cleanup_short(tmp_path: Path) -> None:
    """Ctrl-C pressed twice (the first seems to do nothing for a second) raised a second
    KeyboardInterrupt inside the first one's cleanup, which stopped there: a tmpfs left
    mounted, an emulated host left up, until a later run reaped them. SIGTERM was already
    taken once only."""
    chaos = subprocess.Popen([sys.executable, "-c", _CLEANUP_SCRIPT], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert chaos.stdout is not None
        assert chaos.stdout.readline().strip() == "running"
        chaos.send_signal(signal.SIGINT)
        assert chaos.stdout.readline().strip() == "cleaning"
        chaos.send_signal(signal.SIGINT)
        out, err = chaos.communicate(timeout=30)
    finally:
        chaos.kill()
    assert "cleaned" in out, err
    assert "still stopping what it started" in err, err


_HANGUP_SCRIPT = """
import sys, time
import antifragile.chaos.cli as cli

def main():  # a command whose cleanup prints as it goes (stopping a job, unmounting a tmpfs)
    try:
        print("running", flush=True)
        time.sleep(60)
    finally:
        print("cleaning", flush=True)
        time.sleep(0.5)
        print("cleaned", flush=True)
        with open(sys.argv[1], "w") as f:
            f.write("cleaned")

cli.main = main
cli.entry()
"""


def test_a_closed_terminal_still_runs_the_cleanup(tmp_path: Path) -> None:
    """Closing the terminal (an ssh session dropped, a tmux window killed) sends chaos SIGHUP,
    whose default ends it at once, without its ``finally`` blocks: a disk_full tmpfs stayed
    mounted, a SeaweedFS folder and emulated hosts stayed, as after a SIGKILL. The terminal is
    gone too, so the cleanup's own output (a hung-up tty answers writes with EIO) must not cut
    it short either."""
    import fcntl
    import termios

    master, slave = os.openpty()

    def controlling_tty() -> None:  # the terminal's session leader, as a login shell's job is
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    done = tmp_path / "cleaned"
    chaos = subprocess.Popen([sys.executable, "-c", _HANGUP_SCRIPT, str(done)], stdin=slave,
                             stdout=slave, stderr=slave, start_new_session=True,
                             preexec_fn=controlling_tty)
    os.close(slave)
    try:
        seen = b""
        deadline = time.monotonic() + 60
        while b"running" not in seen and time.monotonic() < deadline:
            seen += os.read(master, 1024)
        os.close(master)  # the terminal closes: the kernel sends its session leader SIGHUP
        assert chaos.wait(timeout=30) == 128 + signal.SIGHUP
    finally:
        chaos.kill()
    assert done.exists(), "the cleanup did not run to its end"


def test_an_interrupt_while_the_faults_end_still_stops_the_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner's cleanup undoes the faults first (a killed volume server restarted: up to
    30 s), then stops the job, then takes the emulated hosts down. A Ctrl-C or SIGTERM that
    lands in the first step (here raised from it, as ``lifetime.stop_once`` raises it) ended
    the cleanup there: the job ran on, its hosts stayed up."""
    from antifragile.chaos.faults.base import Endings
    from antifragile.chaos.infra import launch as launching
    from antifragile.chaos.run import runner

    jobs: list[subprocess.Popen[str]] = []

    def launch(*args: Any, **kwargs: Any) -> subprocess.Popen[str]:
        jobs.append(launching.launch(*args, **kwargs))
        return jobs[-1]

    def interrupted(self: Endings) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "launch", launch)
    monkeypatch.setattr(Endings, "end_now", interrupted)
    s = parse_scenario({"name": "tiny", "trainer": {
        "command": ["python", "-c", "import time; time.sleep(60)"], "probe": False},
        "expect": {"bitwise_equal_to_reference": False}})
    try:
        with pytest.raises(KeyboardInterrupt):
            runner.run_scenario(s.model_copy(update={"time_limit_s": 2.0}),
                                tmp_path / "run", str(tmp_path / "ckpt"))
        assert len(jobs) == 1 and jobs[0].poll() is not None, "the job still runs"
    finally:
        runner._Agents(jobs).kill()


def test_a_relay_that_cannot_be_made_leaves_no_socket_listening(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Emulated hosts reach S3 through a relay on their network's bridge: the socket
    ``Network.listen`` opened for it stayed open (listening, until chaos exited) when the
    relay could not be made on it (an endpoint the relay cannot carry)."""
    import socket

    from antifragile.chaos.infra.s3 import RunStorage
    from antifragile.chaos.run import runner

    opened: list[socket.socket] = []

    class Bridge:
        def listen(self) -> socket.socket:
            opened.append(socket.create_server(("127.0.0.1", 0)))
            return opened[-1]

        def close(self) -> None:
            pass

    monkeypatch.setattr(runner._Hosts, "open", classmethod(lambda cls, nodes: cls(Bridge())))
    s = parse_scenario({"name": "tiny", "trainer": {
        "command": ["python", "-c", "pass"], "probe": False},
        "expect": {"bitwise_equal_to_reference": False}})
    storage = RunStorage("s3://b/p", trainer_env={"AWS_ENDPOINT_URL": "https://s3.example"},
                         endpoint="https://s3.example")
    try:
        with pytest.raises(ValueError, match="plain http"):
            runner.run_scenario(s, tmp_path / "run", "s3://b/p", storage=storage)
        assert len(opened) == 1 and opened[0].fileno() == -1, "the relay's socket is open"
    finally:
        for sock in opened:
            sock.close()


def test_a_launched_job_leaves_no_temporary_folder(tmp_path: Path) -> None:
    """torchrun keeps its per-worker folders (error files, log redirects) under a
    ``torchelastic_*`` folder it makes in the temporary folder and never deletes: every run
    chaos launched left one there (thousands on a CI machine), and a rank's error file was
    not where the run's logs are."""
    from antifragile.chaos.infra.launch import launch

    s = parse_scenario({"name": "tiny", "trainer": {"command": ["python", "-c", "pass"],
                                                    "probe": False},
                        "expect": {"bitwise_equal_to_reference": False}})
    temp = tmp_path / "temp"
    temp.mkdir()
    job = launch(s, tmp_path / "run", str(tmp_path / "ckpt"), max_restarts=0,
                 env={"TMPDIR": str(temp)})
    assert job.wait(120) == 0, (tmp_path / "run" / "torchrun.log").read_text()
    assert [p.name for p in temp.iterdir() if p.name.startswith("torchelastic_")] == []


def test_torchruns_options_in_the_callers_environment_do_not_change_the_launch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun reads each option its command line does not give from ``PET_<OPTION>``. A
    shell with ``PET_NNODES=2`` (a Kubeflow PyTorchJob pod sets it) made chaos's one-host job
    wait for a second host, until the run's time limit."""
    from antifragile.chaos.infra.launch import launch

    monkeypatch.setenv("PET_NNODES", "2")
    s = parse_scenario({"name": "tiny", "trainer": {"command": ["python", "-c", "pass"],
                                                    "probe": False},
                        "expect": {"bitwise_equal_to_reference": False}})
    job = launch(s, tmp_path / "run", str(tmp_path / "ckpt"), max_restarts=0)
    try:
        assert job.wait(60) == 0, (tmp_path / "run" / "torchrun.log").read_text()
    except subprocess.TimeoutExpired:
        pytest.fail("the job waited for a second host: "
                    + (tmp_path / "run" / "torchrun.log").read_text()[-500:])
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()


def test_wall_time_is_the_jobs_not_the_emulated_hosts_set_up_and_taken_down(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``wall_s`` (goodput's denominator) is launch to the end of the last worker: making the
    emulated hosts' network before the launch and taking it down after the job (or undoing
    a fault that lasts, e.g. restarting a volume server) is chaos's time, not the job's. Both
    were counted, which lowered goodput by however long they took."""
    from antifragile.chaos.run import runner

    class Network:
        def close(self) -> None:
            time.sleep(0.8)

    def hosts(cls: Any, nodes: int) -> Any:
        time.sleep(0.8)
        return cls(Network())

    def launch_hosts(*_: Any, **__: Any) -> list[subprocess.Popen[str]]:
        return [subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True,
                                 text=True)]

    monkeypatch.setattr(runner._Hosts, "open", classmethod(hosts))
    monkeypatch.setattr(runner, "launch_hosts", launch_hosts)
    s = parse_scenario({"name": "tiny", "trainer": {
        "command": ["python", "-c", "pass"], "probe": False},
        "expect": {"bitwise_equal_to_reference": False}})
    began = time.time()
    record = runner.run_scenario(s.model_copy(update={"time_limit_s": 30.0}),
                                 tmp_path / "run", str(tmp_path / "ckpt"))
    assert record.started_t >= began + 0.8
    assert record.wall_s < 0.8, record.wall_s
    assert time.time() - record.ended_t >= 0.8


def test_a_command_trainers_env_does_not_route_its_ranks_around_the_runs_s3_endpoint(
        tmp_path: Path) -> None:
    """With S3 checkpoints the run tells the ranks its endpoint (the fault proxy's, when a
    ``storage_outage`` is due, or a relay's); a scenario's ``trainer.env`` naming another
    endpoint won over it, so the script went around the proxy (an outage that reached no
    request) and wrote where chaos neither looked nor faulted."""
    from antifragile.chaos.infra.launch import launch

    seen = tmp_path / "seen"
    script = ("import os; open(os.environ['SEEN'], 'w').write("
              "os.environ['AWS_ENDPOINT_URL'] + ' ' + os.environ['AWS_ENDPOINT_URL_S3'])")
    s = parse_scenario({"name": "tiny", "trainer": {
        "command": ["python", "-c", script], "probe": False,
        "env": {"SEEN": str(seen), "AWS_ENDPOINT_URL": "http://elsewhere:9000",
                "AWS_ENDPOINT_URL_S3": "http://elsewhere:9000"}},
        "expect": {"bitwise_equal_to_reference": False}})
    proxy = "http://127.0.0.1:45678"
    job = launch(s, tmp_path / "run", "s3://bucket/run", max_restarts=0,
                 env={"AWS_ENDPOINT_URL": proxy, "AWS_ENDPOINT_URL_S3": proxy})
    assert job.wait(120) == 0, (tmp_path / "run" / "torchrun.log").read_text()
    assert seen.read_text() == f"{proxy} {proxy}"
