"""``drop_link``, ``host_down`` and emulated hosts: the namespaces really cut and restore TCP
between hosts, silence a failed host and kill what ran on it, leave nothing behind, and a
two-host job survives a cut link, a killed rank and a lost host bit-exactly."""

from __future__ import annotations

import itertools
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from antifragile.chaos.faults import Target
from antifragile.chaos.faults.base import Injection
from antifragile.chaos.faults.drop_link import DropLink
from antifragile.chaos.faults.host_down import HostDown
from antifragile.chaos.infra import netns
from antifragile.chaos.infra.netns import MAX_HOSTS, NetnsError, NetnsUnavailable, Network
from antifragile.chaos.run.pipeline import run
from antifragile.chaos.run.runner import _Agents
from antifragile.chaos.scenario import ScenarioError, load_scenario, parse_scenario

ROOT = Path(__file__).resolve().parent.parent
needs_netns = pytest.mark.skipif(netns.unavailable_reason() is not None,
                                 reason=f"{netns.unavailable_reason()}")

_SERVE = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 7000)); s.listen(16); print("ready", flush=True)
while True:
    c, _ = s.accept(); c.close()
"""
_CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.5).close(); print("ok")
except OSError as e:
    print(f"fail {e}")
"""


def _connect(net: Network, src: int, dst: int | str, port: int = 7000) -> str:
    address = net.hosts[dst].address if isinstance(dst, int) else dst
    done = subprocess.run(net.hosts[src].command(
        [sys.executable, "-S", "-c", _CONNECT, address, str(port)]),
        capture_output=True, text=True, timeout=60)
    return done.stdout.strip()


def _serve(net: Network, host: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(net.hosts[host].command(
        [sys.executable, "-S", "-c", _SERVE, net.hosts[host].address]),
        stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _ours() -> list[str]:
    """This process's namespaces (another xdist worker may be running a network of its own)."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listing.splitlines()
            if line.startswith(f"afnet-{os.getpid()}-")]


@needs_netns
def test_link_down_blocks_tcp_and_up_restores_it_and_close_leaves_nothing() -> None:
    with Network(2) as net:
        names = [net.switch, *(h.namespace for h in net.hosts)]
        assert set(names) <= set(_ours())
        server = _serve(net, 1)
        try:
            assert _connect(net, 0, 1) == "ok"
            how = net.link_down(0, 1)
            assert "down" in how and net.is_down(1, 0)
            assert _connect(net, 0, 1).startswith("fail")
            net.link_up(0, 1)
            assert _connect(net, 0, 1) == "ok"
        finally:
            server.kill()
            server.wait()
    assert not set(names) & set(_ours())


@needs_netns
def test_three_hosts_cut_exactly_the_named_pair() -> None:
    with Network(3) as net:
        servers = [_serve(net, 1), _serve(net, 2)]
        try:
            net.link_down(0, 1)
            assert _connect(net, 0, 1).startswith("fail")
            assert _connect(net, 0, 2) == "ok", "the cut must not touch host 0 <-> host 2"
            assert _connect(net, 2, 1) == "ok", "the cut must not touch host 2 <-> host 1"
            net.link_up(0, 1)
            assert _connect(net, 0, 1) == "ok"
        finally:
            for s in servers:
                s.kill()
                s.wait()


@needs_netns
def test_a_host_that_goes_down_falls_silent_and_everything_on_it_dies() -> None:
    with Network(2) as net:
        server = _serve(net, 1)
        assert _connect(net, 0, 1) == "ok"
        target = Target(pids={0: 1, 1: server.pid}, coordinates={}, ckpt_url="",
                        rng=random.Random(0), network=net)
        injection = HostDown(kind="host_down", at_step=3, node=1).inject(target, 3)
        assert server.wait(timeout=30) == -9
        assert injection.rank == 1 and injection.detail["ranks"] == [1]
        assert injection.detail["lost_node"] == 1 and not injection.missed
        # no reset from a dead host's kernel: the connection attempt times out, as on a
        # powered-off host, instead of being refused
        assert "timed out" in _connect(net, 0, 1)
        # a host already down has nothing left to fail: missed, and why (it was put down to
        # "no rank ran on node 1 (only spares)": a reason that sent the reader to the spares)
        again = HostDown(kind="host_down", at_step=3, node=1).inject(target, 3)
        assert again.missed == ("node 1 was already down (an earlier host_down): nothing "
                                "left on it to fail"), again.missed


def _release_when_over(procs: list[subprocess.Popen[str]], *, lost: int | None) -> _Agents:
    agents = _Agents(procs, linger_s=0.2)
    if lost is not None:
        agents.note(Injection("host_down", 0.0, detail={"lost_node": lost}))
        procs[lost].kill()
        procs[lost].wait()
    assert agents.running(lambda: False)  # not over: the live agents are waited for
    assert agents.running(lambda: True)  # over, host 0's agent idle: the linger starts
    deadline = time.monotonic() + 10
    while agents.running(lambda: True):
        assert time.monotonic() < deadline
    return agents


@pytest.mark.parametrize("lost", [1, None])
def test_once_the_job_is_over_leftover_agents_are_not_waited_for(lost: int | None) -> None:
    """torchrun's agents wait in an exit barrier (300 s) for every agent: a lost host's
    (``lost``: 1), or one the job went on without while it was cut off (None: its agent
    still has workers, which find the job's store gone once the link is back). Once every
    rank has exited normally and host 0's agent has no worker left, the agents still running
    are ended and count as having succeeded; before that they are waited for."""
    procs = [subprocess.Popen(["sleep", "60"], start_new_session=True),
             subprocess.Popen(["sh", "-c", "sleep 60; true"], start_new_session=True)]
    try:
        agents = _release_when_over(procs, lost=lost)
        assert all(p.poll() is not None for p in procs) and agents.returncode == 0
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.parametrize(("trainer", "node", "message"), [
    ({"nodes": 1}, 1, "faults.0.node: host_down needs trainer.nodes >= 2"),
    ({"nodes": 2}, 0, "faults.0.node: node 0 serves the job's stores"),
    ({"nodes": 2}, 2, "faults.0.node: node 2 is outside the 2 nodes"),
    ({"nodes": 2, "mtbf": True}, 1, "faults.0.mtbf_s: a host goes down once"),
    ({"nodes": 2, "recovery": "restart"}, 1, "faults.0.kind: host_down needs trainer.recovery: "
                                             "in_process"),
    ({"nodes": 2, "spares": 0}, 1, r"faults.0.node: node 1 runs 1 rank\(s\) and the other "
                                   r"nodes hold 0 spare\(s\): raise trainer.spares to at "
                                   "least 2"),
])
def test_host_down_is_validated_against_the_job(trainer: dict, node: int, message: str) -> None:
    trigger = {"mtbf_s": 30.0} if trainer.pop("mtbf", False) else {"at_step": 5}
    doc = {"name": "x", "trainer": {"parallel": {"dp": 2}, "recovery": "in_process", **trainer},
           "faults": [{"kind": "host_down", "node": node, **trigger}]}
    with pytest.raises(ScenarioError, match=message):
        parse_scenario(doc, path="x.yaml")


@pytest.mark.parametrize(("trainer", "message"), [
    ({"recovery": "restart", "lease_s": 3}, "trainer: lease_s: leases are held only under "
                                            "recovery in_process"),
    ({"recovery": "in_process", "hang_timeout_s": 2, "lease_s": 6},
     r"trainer: lease_s: 6 s is not below the watchdog's stall escalation, 3 x hang_timeout_s "
     "= 6 s"),
    # validated, then refused by the trainer at launch (its own check, trainer.config)
    ({"recovery": "in_process", "lease_s": 30},
     r"trainer: lease_s: 30 s is not below the watchdog's stall escalation under the adaptive "
     r"hang timeout, 3 x its floor of 10 s = 30 s"),
    ({"recovery": "in_process", "lease_s": 0.5}, "trainer.lease_s: Input should be greater than "
                                                 "or equal to 1"),
    ({"recovery": "in_process", "hang_timeout_s": 0.3},
     r"trainer: hang_timeout_s: 0.3 is too short under recovery in_process: the lease that "
     r"finds a lost host \(at least 1 s\) must be below 3 x it; set hang_timeout_s above 0.33"),
])
def test_a_lease_that_cannot_work_is_refused(trainer: dict, message: str) -> None:
    doc = {"name": "x", "trainer": {"parallel": {"dp": 2}, **trainer}}
    with pytest.raises(ScenarioError, match=message):
        parse_scenario(doc, path="x.yaml")


@needs_netns
def test_hosts_reach_a_service_on_the_bridge_over_their_own_link() -> None:
    """How emulated hosts reach S3: this process listens on the bridge; a host's cut link cuts
    its way there too."""
    with Network(2) as net:
        listener = net.listen()
        address, port = listener.getsockname()[:2]
        assert address == netns.BRIDGE_ADDRESS
        accepted: list[str] = []

        def serve() -> None:
            while True:
                try:
                    conn, peer = listener.accept()
                except OSError:
                    return
                accepted.append(peer[0])
                conn.close()

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        try:
            assert _connect(net, 0, address, port) == "ok"
            assert _connect(net, 1, address, port) == "ok"
            net.link_down(0, 1)
            assert _connect(net, 0, address, port).startswith("fail")
            net.link_up(0, 1)
            assert _connect(net, 0, address, port) == "ok"
        finally:
            listener.close()
        assert sorted(set(accepted)) == [h.address for h in net.hosts]
    with socket.socket() as outside, pytest.raises(OSError):
        outside.settimeout(1)
        outside.connect((address, port))  # the caller's namespace has no route there


@needs_netns
def test_processes_inside_are_killed_and_leftovers_of_dead_runs_are_reaped() -> None:
    net = Network(2)
    net.open()
    server = _serve(net, 0)
    net.close()
    assert server.wait(timeout=30) != 0, "closing the network kills what runs on its hosts"
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"afnet-{dead.pid}-0-sw"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert name in netns.reap_leftovers()
        assert name not in _ours()
    finally:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)


@needs_netns
def test_a_live_network_of_another_pid_namespace_is_never_reaped() -> None:
    """``/var/run/netns`` shared with a container (its own pid namespace): the reaping there
    found no process with the owner's pid and start time, so it deleted a live run's
    namespaces under it (and would kill what it saw inside), as ``weed.reap_orphans`` no
    longer does for a live cluster."""
    if subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot make a pid namespace here (unshare)")
    reap = "from antifragile.chaos.infra import netns; print(netns.reap_leftovers())"
    with Network(2) as net:
        done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable,
                               "-c", reap], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
        assert {net.switch, *(h.namespace for h in net.hosts)} <= set(_ours())


@needs_netns
def test_a_leftover_of_an_earlier_process_with_this_pid_neither_blocks_nor_stays(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """pids are recycled: a chaos SIGKILLed with its network up, and a later chaos given the
    same pid. Named by the pid alone, the leftover was never reaped (its pid is alive: ours)
    and the new network's first name already existed, so it could not be made at all."""
    monkeypatch.setattr(netns, "_counter", itertools.count())  # a fresh process's first network
    monkeypatch.setattr(netns, "start_time", lambda pid: 1, raising=False)  # an earlier start
    earlier = Network(2)
    earlier.open()  # and never closed: its process was SIGKILLed
    left = [earlier.switch, *(h.namespace for h in earlier.hosts)]
    monkeypatch.undo()
    monkeypatch.setattr(netns, "_counter", itertools.count())
    try:
        with Network(2) as net:
            assert net.switch not in left
            assert not set(left) & set(_ours())
    finally:
        for name in left:
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)


@needs_netns
@pytest.mark.parametrize("nodes", [2, 3])
def test_a_cut_of_a_link_already_cut_is_missed(nodes: int) -> None:
    """Two cuts of one link that overlap (two entries, or ``mtbf_s`` arrivals closer than
    ``duration_s``): the second did not happen, and says so. Before, with three hosts its
    blackhole route already existed and the error ended the whole run; with two, the first
    cut's end set the ports up under the second, which was reported as lasting its full
    duration."""
    with Network(nodes) as net:
        target = Target(pids={}, coordinates={}, ckpt_url="", rng=random.Random(0),
                        network=net)
        first = DropLink(kind="drop_link", at_step=3, between=(0, 1), duration_s=0.5)
        assert first.inject(target, 3).missed is None and net.is_down(0, 1)
        second = DropLink(kind="drop_link", at_step=4, between=(1, 0), duration_s=5)
        injection = second.inject(target, 4)
        assert injection.missed is not None and "already down" in injection.missed
        deadline = time.monotonic() + 10
        while net.is_down(0, 1):
            assert time.monotonic() < deadline
            time.sleep(0.05)


@needs_netns
def test_an_interrupted_open_leaves_no_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C (or a SIGTERM, which chaos turns into an exit) while the network is being made:
    the runner never gets the network to close, so open() removes what it made."""
    real, calls = netns._ip, []

    def interrupted(*args: str) -> str:
        calls.append(args)
        if len(calls) == 6:  # the namespaces exist, the bridge is half made
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(netns, "_ip", interrupted)
    with pytest.raises(KeyboardInterrupt):
        Network(2).open()
    assert _ours() == []


@needs_netns
def test_a_namespace_made_as_open_is_interrupted_is_removed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C (or SIGTERM) that lands while ``ip netns add`` runs: the namespace is made,
    but the interrupt comes before open() notes it, and it stayed after the run (a later
    network of the same chaos process does not reap it: its owner is alive)."""
    real = netns._ip

    def interrupted(*args: str) -> str:
        out = real(*args)
        if args[:2] == ("netns", "add") and args[2].endswith("-h0"):
            raise KeyboardInterrupt  # the command has run, its caller is interrupted
        return out

    monkeypatch.setattr(netns, "_ip", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            Network(2).open()
        assert _ours() == []
    finally:
        for name in _ours():
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def test_an_ip_that_cannot_list_namespaces_makes_them_unavailable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Root with ``ip`` installed, in a container that forbids namespaces: ``ip netns list``
    itself fails. Its NetnsError escaped open() (it came from reaping leftovers, before the
    try that turns a failing ``ip`` into NetnsUnavailable), so the run ended in a traceback
    instead of skipping the fault with the reason."""
    def refused(*args: str) -> str:
        raise NetnsError(f"ip {' '.join(args)}: mkdir /run/netns failed: Permission denied")

    monkeypatch.setattr(netns, "unavailable_reason", lambda: None)
    monkeypatch.setattr(netns, "_ip", refused)
    with pytest.raises(NetnsUnavailable, match="ip netns list: mkdir /run/netns failed"):
        Network(2).open()


def test_an_ip_that_is_not_executable_makes_namespaces_unavailable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A missing ``ip`` made namespaces unavailable (the fault skipped with the reason); an
    ``ip`` found on PATH that cannot be run (no execute permission: PermissionError) was a
    traceback instead."""
    (tmp_path / "ip").write_text("#!/bin/sh\n")
    (tmp_path / "ip").chmod(0o644)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(NetnsUnavailable, match=r"'ip' command .*cannot be run"):
        netns._ip("netns", "list")
    monkeypatch.setattr(netns, "unavailable_reason", lambda: None)
    with pytest.raises(NetnsUnavailable, match=r"'ip' command .*cannot be run"):
        Network(2).open()


def test_without_namespaces_the_fault_is_skipped_with_the_reason(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns.shutil, "which", lambda _: None)
    with pytest.raises(NetnsUnavailable, match="'ip' command"):
        Network(2).open()
    fault = DropLink(kind="drop_link", at_step=3, between=(0, 1), duration_s=5)
    target = Target(pids={0: 1, 1: 2}, coordinates={}, ckpt_url="", rng=random.Random(0),
                    network_error="network namespaces unavailable: the 'ip' command ...")
    injection = fault.inject(target, 3)
    assert injection.skipped and "network namespaces unavailable" in injection.skipped


@pytest.mark.parametrize(("nodes", "between", "message"), [
    (1, [0, 1], "faults.0.between: drop_link needs trainer.nodes >= 2"),
    (2, [0, 2], "faults.0.between: node 2 is outside the 2 nodes"),
    (2, [1, 1], "faults.0.between: a link joins two different nodes"),
])
def test_drop_link_is_validated_against_the_nodes(nodes: int, between: list[int],
                                                  message: str) -> None:
    doc = {"name": "x", "trainer": {"nodes": nodes, "parallel": {"dp": 2}},
           "faults": [{"kind": "drop_link", "at_step": 5, "between": between}]}
    with pytest.raises(ScenarioError, match=message):
        parse_scenario(doc, path="x.yaml")


def test_more_nodes_than_the_emulated_network_can_address_are_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine that holds the workers (16 per core, 400 MiB each), nodes: 91 was valid,
    then chaos run ended in a ValueError traceback from ``Network(91)``: the hosts' addresses
    run out at 90."""
    from antifragile.chaos import scenario
    from antifragile.chaos.scenario import trainer

    monkeypatch.setattr(trainer, "max_workers", lambda: 1000)
    doc: dict[str, Any] = {"name": "x", "trainer": {"nodes": 91, "parallel": {"dp": 91},
                                                    "batch_size": 91}}
    with pytest.raises(ScenarioError, match=r"^x.yaml: trainer.nodes: 91 nodes: .* at most "
                       r"90 emulated hosts"):
        parse_scenario(doc, path="x.yaml")
    doc["trainer"] = {"nodes": 90, "parallel": {"dp": 90}, "batch_size": 90}
    assert parse_scenario(doc).trainer.nodes == len(Network(90).hosts) == 90
    assert scenario.MAX_NODES == MAX_HOSTS


def test_s3_on_emulated_hosts_is_valid_and_refused_only_where_it_cannot_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from antifragile.chaos.infra import s3

    doc = {"name": "x", "trainer": {"nodes": 2, "parallel": {"dp": 2}},
           "checkpoint": {"url": "s3://bucket/run"},
           "faults": [{"kind": "drop_link", "at_step": 5}]}
    s = parse_scenario(doc)  # no longer refused by the scenario rules
    monkeypatch.setattr(netns, "unavailable_reason", lambda: "creating network namespaces "
                        "needs root (CAP_NET_ADMIN)")
    with pytest.raises(s3.S3SetupError, match=r"^checkpoint.url s3://bucket/run: trainer.nodes "
                       r"= 2 puts the ranks on emulated hosts, which reach S3 only over the "
                       r"emulated network, and network namespaces are unavailable here "
                       r"\(creating network namespaces needs root"), \
            s3.run_storage(s, tmp_path, progress=lambda _: None):
        pass
    monkeypatch.setattr(netns, "unavailable_reason", lambda: None)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "https://s3.example.com")
    with pytest.raises(s3.S3SetupError, match=r"needs a plain http:// endpoint, not "
                       r"https://s3.example.com"), \
            s3.run_storage(s, tmp_path, progress=lambda _: None):
        pass


def test_shipped_scenario_is_valid() -> None:
    s = load_scenario(ROOT / "scenarios" / "drop-link.yaml")
    assert s.trainer.nodes == 2 and s.faults[0].kind == "drop_link"


def _report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


def _drop_link(name: str) -> dict:
    """The shipped two-host scenario, renamed, for a test to change."""
    doc = yaml.safe_load((ROOT / "scenarios" / "drop-link.yaml").read_text())
    doc["name"] = name
    return doc


def _events(out: Path) -> list[dict]:
    return [json.loads(line) for f in sorted((out / "run" / "events").glob("*"))
            for line in f.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.multiproc
@needs_netns
@pytest.mark.timeout(900)
def test_drop_link_scenario_recovers_and_ends_bitwise_equal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANTIFRAGILE_CACHE", str(tmp_path / "cache"))
    s = load_scenario(ROOT / "scenarios" / "drop-link.yaml")
    outcome = run(s, tmp_path / "out", progress=lambda _: None)
    report = outcome.report
    assert outcome.passed, report["verdict"]
    assert report["verdict"]["bitwise_equal"] is True
    (fault,) = report["faults"]
    assert fault["kind"] == "drop_link" and fault["skipped"] is None
    # the link was down for 10 s: every worker was gone after it went down, and the next
    # attempt could only start once it was back up
    for key in ("detect_s", "restart_s", "restore_s", "recompute_s"):
        assert fault[key] is not None and fault[key] >= 0, key
    assert fault["detect_s"] + fault["restart_s"] >= 10 - 0.5
    assert fault["restored_step"] == 10 and fault["lost_steps"] >= fault["injected_step"] - 10
    assert report["run"]["attempts"] == 2
    events = _events(tmp_path / "out")
    hangs = [e for e in events if e["event"] == "hang_detected"]
    assert hangs and all(e["attempt"] == 0 for e in hangs)
    assert {e["rank"] for e in events if e["event"] == "start" and e["attempt"] == 1} == {0, 1}
    assert not _ours(), "the run's namespaces are gone"


@pytest.mark.slow
@pytest.mark.multiproc
@needs_netns
@pytest.mark.timeout(900)
def test_kill_rank_on_two_hosts_recovers_and_ends_bitwise_equal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The killed rank's agent restarts counted; the other agent restarts because a node
    waits in the rendezvous, uncounted: the attempt number must still agree."""
    monkeypatch.setenv("ANTIFRAGILE_CACHE", str(tmp_path / "cache"))
    doc = _drop_link("kill-rank-two-hosts")
    doc["faults"] = [{"kind": "kill_rank", "rank": 1, "at_step": 12},
                     {"kind": "kill_rank", "rank": 0, "at_step": 22}]
    outcome = run(parse_scenario(doc), tmp_path / "out", progress=lambda _: None)
    assert outcome.passed, outcome.report["verdict"]
    first, second = outcome.report["faults"]
    # the async save before a kill may still be in flight (a loaded machine): then the one
    # before it; the verdict checked that no newer committed step was passed over
    assert first["restored_step"] in (5, 10) and second["restored_step"] in (15, 20)
    assert outcome.report["run"]["attempts"] == 3
    events = _events(tmp_path / "out")
    starts = {(e["attempt"], e["rank"]) for e in events if e["event"] == "start"}
    assert starts == {(a, r) for a in (0, 1, 2) for r in (0, 1)}
    assert not _ours(), "the run's namespaces are gone"


@pytest.mark.slow
@pytest.mark.multiproc
@needs_netns
@pytest.mark.timeout(900)
def test_in_process_recovery_across_two_hosts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 (host 0; its slot's supervisor serves the round's store, so the store outlives
    the training process) and then rank 1 (host 1) are killed: each time the survivor re-forms
    the group over the emulated network with a warm spare, with no torchrun restart."""
    monkeypatch.setenv("ANTIFRAGILE_CACHE", str(tmp_path / "cache"))
    scenario = load_scenario(ROOT / "scenarios" / "nightly" / "kill-rank-2nodes-in-process.yaml")
    outcome = run(scenario, tmp_path / "out", progress=lambda _: None)
    assert outcome.passed, outcome.report["verdict"]
    first, second = outcome.report["faults"]
    # the async save before a kill may still be in flight (a loaded machine): then the one
    # before it; the verdict checked that no newer committed step was passed over
    assert first["restored_step"] in (5, 10) and second["restored_step"] in (15, 20)
    for fault in (first, second):
        assert fault["recovery_mode"] == "in_process" and fault["fallback"] is None, fault
        assert fault["restart_s"] < 2.0, fault  # the group re-formed: no new processes
    events = _events(tmp_path / "out")
    first_attempt = min(e["attempt"] for e in events if e["event"] == "start")
    slots = {e["rank"]: int(e["worker"].split(".")[0]) for e in events
             if e["event"] == "start" and e["attempt"] == first_attempt}
    assert slots[0] // 2 != slots[1] // 2, slots  # 2 slots a host: one rank on each at first
    assert not _ours(), "the run's namespaces are gone"


@pytest.mark.slow
@pytest.mark.multiproc
@needs_netns
@pytest.mark.timeout(900)
def test_a_host_lost_whole_is_found_by_its_leases_and_replaced_in_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Host 1 goes dark and everything on it dies, supervisors and agent too: nobody reports
    its deaths. Before leases, the survivor sat in its collective until its own watchdog
    killed it (6 s), waited 60 s for a re-formation, fell back to a restart and torchrun's
    rendezvous gave up on the lost host after 180 s: the run failed at step 12 after 4.5
    min. Now slot 0's supervisor finds host 1's leases lapsed (3 s: 1.5 x hang_timeout_s),
    and rank 0 re-forms with host 0's spare."""
    monkeypatch.setenv("ANTIFRAGILE_CACHE", str(tmp_path / "cache"))
    scenario = load_scenario(ROOT / "scenarios" / "nightly" / "host-down-2nodes-in-process.yaml")
    events = _went_on_without_host_1(scenario, tmp_path / "out")
    assert not any(e["event"] == "hang_detected" for e in events)


def _went_on_without_host_1(scenario: Any, out: Path) -> list[dict]:
    """Run ``scenario`` (two hosts, a rank and a spare each, host 1 lost at step 12): it must
    pass, with rank 1 and host 1's spare (slots 2 and 3) declared lost after the lease (3 s:
    1.5 x hang_timeout_s) and the group re-formed in process; returns the run's events."""
    outcome = run(scenario, out, progress=lambda _: None)
    assert outcome.passed, outcome.report["verdict"]
    (fault,) = outcome.report["faults"]
    assert fault["recovery_mode"] == "in_process" and fault["fallback"] is None, fault
    assert fault["detect_s"] < 3.0 + 2.0 and fault["restored_step"] == 10, fault
    events = _events(out)
    lost = {(e["rank"], e["slot"]) for e in events if e["event"] == "rank_died" and e.get("lost")}
    # host 1's spare holds a lease once its supervisor is up: on a loaded machine it may not
    # have been by step 12 (a slot never seen is not judged), but then it was not ready either
    spare = out / "run" / "events" / "spare3.jsonl"
    ready = spare.exists() and any(json.loads(line)["t"] < fault["injected_t"]
                                   for line in spare.read_text().splitlines())
    assert (1, 2) in lost and lost <= {(1, 2), (-1, 3)} and ((-1, 3) in lost or not ready), lost
    assert not _ours(), "the run's namespaces are gone"
    return events


@pytest.mark.slow
@pytest.mark.multiproc
@needs_netns
@pytest.mark.timeout(900)
def test_a_cut_link_in_process_goes_on_without_the_cut_off_host(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 10 s cut: host 1's leases lapse after 3 s, its workers are declared lost, and rank 0
    re-forms with host 0's spare and trains on, in process. Before leases both ranks stalled,
    both supervisors killed theirs, and with nobody left the job restarted (18.6 s; 105 s
    before that, waiting 2 x collective_timeout_s for a re-formation). The job ends while host
    1 may still be cut off: its agent is a leftover, not a failure."""
    monkeypatch.setenv("ANTIFRAGILE_CACHE", str(tmp_path / "cache"))
    doc = _drop_link("drop-link-in-process")
    doc["trainer"]["recovery"] = "in_process"
    _went_on_without_host_1(parse_scenario(doc), tmp_path / "out")


@pytest.mark.slow
@pytest.mark.multiproc
@needs_netns
@pytest.mark.timeout(900)
def test_a_cut_too_short_to_notice_is_not_observed_and_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Down for 0.3 s against a 30 s stall bound: TCP retransmits, nobody notices, nothing
    restarts. The cut proved nothing about recovery, so the verdict fails and says so."""
    doc = _drop_link("short-cut")
    doc["trainer"]["hang_timeout_s"] = 10
    doc["faults"] = [{"kind": "drop_link", "at_step": 12, "duration_s": 0.3, "between": [0, 1]}]
    doc["expect"] = {"bitwise_equal_to_reference": False}
    outcome = run(parse_scenario(doc), tmp_path / "out", reference=False,
                  progress=lambda _: None)
    report = outcome.report
    (fault,) = report["faults"]
    assert fault["skipped"] is None and fault["effect_observed"] is False, fault
    assert fault["ended_attempt"] is None and fault["recovery_s"] is None
    assert report["run"]["attempts"] == 1 and report["run"]["returncode"] == 0
    assert outcome.verdict == "fail"
    assert report["verdict"]["reasons"] == [
        f"drop_link at step {fault['injected_step']}: no observable effect: {fault['effect']}"]
    assert fault["effect"].startswith("the cut was not observed")


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.s3
@needs_netns
@pytest.mark.timeout(900)
def test_two_hosts_checkpoint_to_s3_over_the_emulated_network(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hosts reach only the emulated network: S3 (the SeaweedFS cluster chaos starts on
    loopback) is relayed from the bridge. The cut link also cuts both hosts from S3; the job
    restarts and restores from S3."""
    from antifragile.chaos.infra.s3 import ENDPOINT_VARS

    monkeypatch.setenv("ANTIFRAGILE_CACHE", str(tmp_path / "cache"))
    for var in ENDPOINT_VARS:
        monkeypatch.delenv(var, raising=False)
    s = load_scenario(ROOT / "scenarios" / "nightly" / "drop-link-s3-2nodes.yaml")
    outcome = run(s, tmp_path / "out", progress=lambda _: None)
    report = outcome.report
    assert outcome.passed, report["verdict"]
    assert report["run"]["checkpoint_url"].startswith("s3://")
    (fault,) = report["faults"]
    assert fault["kind"] == "drop_link" and fault["skipped"] is None
    assert fault["restored_step"] == 10 and report["run"]["attempts"] == 2
    committed = [c for c in report["checkpoints"] if c["committed"]]
    assert {c["step"] for c in committed} >= {5, 10, 30}
    assert not _ours(), "the run's namespaces are gone"


def test_an_ip_command_that_does_not_answer_does_not_stop_the_cleanup(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``ip`` is given 30 s; past them its TimeoutExpired escaped ``_delete`` (which passes
    over NetnsError only), so ``Network.close`` left the namespaces after it in place."""
    asked: list[list[str]] = []

    def no_answer(cmd: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        asked.append(cmd)
        raise subprocess.TimeoutExpired(cmd, 30)

    monkeypatch.setattr(netns.subprocess, "run", no_answer)
    with pytest.raises(netns.NetnsError, match=r"^ip netns delete x: no answer in 30 s"):
        netns._ip("netns", "delete", "x")
    net = Network.__new__(Network)
    net._created = ["a", "b"]
    net.close()
    assert [c[-1] for c in asked if c[1:3] == ["netns", "delete"]] == ["x", "b", "a"]


def test_a_link_that_cannot_be_restored_says_so() -> None:
    """The restore failing (an ``ip`` command refused or timing out) leaves the link down and
    the job unable to heal: the injection records the error instead of swallowing it."""

    class Unrestorable:
        def is_down(self, a: int, b: int) -> bool:
            return False

        def is_host_down(self, index: int) -> bool:
            return False

        def link_down(self, a: int, b: int) -> str:
            return "blackhole routes"

        def link_up(self, a: int, b: int) -> None:
            raise NetnsError("ip route del: timed out after 10 s")

    target = Target(pids={}, coordinates={}, ckpt_url="", rng=random.Random(0),
                    network=Unrestorable())  # type: ignore[arg-type]
    fault = DropLink(kind="drop_link", at_step=3, between=(0, 1), duration_s=0.01)
    injection = fault.inject(target, 3)
    deadline = time.monotonic() + 10
    while "error" not in injection.detail:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert "timed out" in injection.detail["error"]


def test_a_link_never_restored_fails_the_verdict_naming_why() -> None:
    from antifragile.chaos.observe import measure
    from antifragile.chaos.observe.record import RunRecord

    t0 = 1000.0
    events = [{"t": t0 + 1, "rank": r, "attempt": 0, "event": "worker_started", "pid": 10 + r}
              for r in (0, 1)]
    cut = Injection("drop_link", t0 + 5, step=3, fault_index=0, detail={
        "between": [0, 1], "duration_s": 5.0, "mechanism": "blackhole routes",
        "error": "NetnsError: ip route del: timed out after 10 s"})
    record = RunRecord(1, t0, t0 + 60, events, [cut], {0: t0 + 60})
    timings = measure.fault_timings(record, cut)
    assert not timings.effect_observed
    assert "never restored" in timings.effect and "timed out" in timings.effect


@pytest.mark.parametrize("nodes", [2, 3])
def test_a_cut_that_fails_half_made_is_undone(nodes: int,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The cut is two ``ip`` commands (one port or route per side); the second failing (an
    ``ip`` refused or timing out) raised out of ``link_down`` with the first already made:
    the fault was recorded missed, no end was due, and one side stayed cut for the rest of
    the run, a fault the report said did not happen. The half made is undone."""
    from antifragile.chaos.run.runner import _inject

    made: list[tuple[str, ...]] = []

    def second_fails(*args: str) -> str:
        cuts = args[-1] == "down" or "add" in args
        if cuts and made:
            raise NetnsError(f"ip {' '.join(args)}: no answer in 30 s")
        made.append(args)
        return ""

    monkeypatch.setattr(netns, "_ip", second_fails)
    net = Network(nodes)
    target = Target(pids={}, coordinates={}, ckpt_url="", rng=random.Random(0), network=net)
    injection = _inject(DropLink(kind="drop_link", at_step=3, between=(0, 1), duration_s=60),
                        target, 3)
    assert injection.missed is not None and "no answer" in injection.missed
    cut, undone = made[0], made[1:]
    if nodes == 2:
        assert cut[-1] == "down" and undone == [(*cut[:-1], "up")]
    else:
        assert "add" in cut and undone == [tuple("del" if a == "add" else a for a in cut)]
    assert not net.is_down(0, 1)


@needs_netns
@pytest.mark.parametrize("nodes", [2, 3])
def test_a_cut_of_a_link_to_a_host_down_for_good_is_missed(nodes: int) -> None:
    """After ``host_down`` of node 1, its link is dead for the rest of the run: a
    ``drop_link`` of it acts on nothing the job still has and is missed, saying why. Before,
    it was reported made (with two hosts its end then set the dead host's switch port up
    again)."""
    with Network(nodes) as net:
        target = Target(pids={}, coordinates={}, ckpt_url="", rng=random.Random(0),
                        network=net)
        HostDown(kind="host_down", at_step=3, node=1).inject(target, 3)
        injection = DropLink(kind="drop_link", at_step=4, between=(0, 1),
                             duration_s=5).inject(target, 4)
        assert injection.missed is not None and "node 1" in injection.missed
        assert "down for good" in injection.missed
        assert not net.is_down(0, 1)


@needs_netns
def test_a_cut_that_ends_after_its_host_went_down_leaves_the_host_silent() -> None:
    """A cut of the only link (two hosts: both switch ports down) that ends after
    ``host_down`` of one of its hosts: its end must not set the dead host's port up again,
    or the dead host's kernel answers its peers with resets instead of silence."""
    with Network(2) as net:
        target = Target(pids={}, coordinates={}, ckpt_url="", rng=random.Random(0),
                        network=net)
        cut = DropLink(kind="drop_link", at_step=3, between=(0, 1), duration_s=0.3)
        assert cut.inject(target, 3).missed is None
        HostDown(kind="host_down", at_step=4, node=1).inject(target, 4)
        deadline = time.monotonic() + 10
        while net.is_down(0, 1):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert "timed out" in _connect(net, 0, 1), "the dead host must stay silent"
        assert _connect(net, 0, "10.213.0.1", port=1).startswith("fail [Errno 111]"), \
            "host 0's own port must be up again"


def test_a_process_forked_as_its_host_goes_down_is_killed_too(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``host_down`` (and ``Network.close``) SIGKILLed the processes ``ip netns pids`` listed
    once: one forked after the listing (a torchrun agent starting a worker as the host went
    down) lived on, on a host the report says lost everything, and after ``close`` ran on
    outside any network. The listing is repeated until nothing is left inside."""
    parent = subprocess.Popen([sys.executable, "-S", "-c", "import time; time.sleep(60)"])
    child: list[subprocess.Popen[str]] = []

    def fake_ip(*args: str) -> str:
        if args[:2] != ("netns", "pids"):
            return ""
        listed = [p for p in [parent, *child] if p.poll() is None]
        if not child:  # the parent forks right after this first listing
            child.append(subprocess.Popen([sys.executable, "-S", "-c",
                                           "import time; time.sleep(60)"], text=True))
        return "\n".join(str(p.pid) for p in listed)

    monkeypatch.setattr(netns, "_ip", fake_ip)
    try:
        _, killed = Network(2).host_down(1)
        assert parent.wait(timeout=10) == -9
        assert child[0].wait(timeout=10) == -9, "the process forked after the listing lived on"
        assert sorted(killed) == sorted([parent.pid, child[0].pid])
    finally:
        for p in [parent, *child]:
            p.kill()
            p.wait()
