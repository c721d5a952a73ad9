"""S3 in ``chaos run`` and the ``storage_outage`` fault.

Layers: the fault proxy's modes against a real S3 (the session's SeaweedFS cluster) through
botocore (quick); the S3 set-up of a run (a self-started SeaweedFS cluster, the endpoint from the
environment); the scenario rules
and the outage measurements from events (pure); then whole ``chaos run`` scenarios on S3,
one per outage mode, the faulty run checked bit-identical to the fault-free reference.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import json
import os
import socket
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml
from click.testing import CliRunner

from antifragile.chaos.cli import main
from antifragile.chaos.faults import Injection, Target
from antifragile.chaos.faults.storage_outage import StorageOutage
from antifragile.chaos.infra import s3
from antifragile.chaos.infra.proxy import FaultProxy
from antifragile.chaos.observe.measure import fault_timings, outage_effects
from antifragile.chaos.observe.record import RunRecord
from antifragile.chaos.scenario import ScenarioError, parse_scenario

# -- the proxy against S3 ------------------------------------------------------------------------


@pytest.fixture
def proxy(s3_server: dict[str, Any]) -> Iterator[FaultProxy]:
    with FaultProxy.in_front_of(s3_server["endpoint_url"]) as fault_proxy:
        yield fault_proxy


def _client(endpoint_url: str, read_timeout: float = 10.0, *, key: str = "testing",
            secret: str = "testing") -> Any:
    """A boto3 client with its own retries off: every failure the proxy makes is seen."""
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint_url, aws_access_key_id=key,
                        aws_secret_access_key=secret, region_name="us-east-1",
                        config=Config(retries={"total_max_attempts": 1, "mode": "standard"},
                                      connect_timeout=2, read_timeout=read_timeout))


@pytest.fixture
def bucket(s3_bucket: tuple[str, dict[str, Any]]) -> str:
    return s3.split_url(s3_bucket[0])[0]


@pytest.mark.s3
def test_proxy_passes_requests_through(proxy: FaultProxy, bucket: str) -> None:
    client = _client(proxy.endpoint_url)
    client.put_object(Bucket=bucket, Key="k", Body=b"x" * 100_000)
    assert client.get_object(Bucket=bucket, Key="k")["Body"].read() == b"x" * 100_000
    assert proxy.stats.passed >= 1 and proxy.stats.faulted == 0
    assert proxy.stats.requests == 2, "one PUT, one GET (a body after 100-continue is no request)"


@pytest.mark.s3
def test_error_mode_answers_503_until_healed(proxy: FaultProxy, bucket: str) -> None:
    from botocore.exceptions import ClientError

    client = _client(proxy.endpoint_url)
    client.put_object(Bucket=bucket, Key="k", Body=b"before")
    proxy.fault("http503")
    for _ in range(3):
        with pytest.raises(ClientError) as info:
            client.put_object(Bucket=bucket, Key="k", Body=b"during")
        assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
        assert info.value.response["Error"]["Code"] == "ServiceUnavailable"
    assert proxy.stats.faulted == 3
    proxy.heal()
    assert client.get_object(Bucket=bucket, Key="k")["Body"].read() == b"before"


@pytest.mark.s3
def test_reset_mode_faults_exactly_count_connections(proxy: FaultProxy, bucket: str) -> None:
    from botocore.exceptions import BotoCoreError

    client = _client(proxy.endpoint_url)
    proxy.fault("reset", count=2)
    for _ in range(2):
        with pytest.raises(BotoCoreError, match=r"(?i)connect|closed|reset|aborted"):
            client.list_objects_v2(Bucket=bucket)
    assert "Contents" not in client.list_objects_v2(Bucket=bucket)
    assert proxy.stats.faulted == 2


class _KeepAlive(BaseHTTPRequestHandler):
    """Answers every GET with 200 and keeps the connection open."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        body = b"ok"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def keep_alive_proxy() -> Iterator[FaultProxy]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _KeepAlive)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    with FaultProxy(server.server_address[:2]) as fault_proxy:  # type: ignore[arg-type]
        yield fault_proxy
    server.shutdown()
    server.server_close()


def _get(conn: http.client.HTTPConnection) -> int:
    conn.request("GET", "/")
    response = conn.getresponse()
    response.read()
    assert not response.will_close
    return response.status


def test_a_fault_severs_pooled_keep_alive_connections(keep_alive_proxy: FaultProxy) -> None:
    """A connection opened before the outage must not carry requests through it."""
    url = urlparse(keep_alive_proxy.endpoint_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=5)
    assert _get(conn) == 200 and _get(conn) == 200
    keep_alive_proxy.fault("http503")
    with pytest.raises((ConnectionError, http.client.HTTPException)):
        _get(conn)
    conn.close()
    assert keep_alive_proxy.stats.passed == 1


def _act_while_connecting(proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch,
                          act: Callable[[], Any]) -> list[socket.socket]:
    """Connect a client and ``act`` while the proxy's thread for it is still connecting to the
    upstream; the client's first request must then fail. Returns the upstream connections
    that thread made."""
    connect, upstream = socket.create_connection, proxy.upstream
    connecting, go_on = threading.Event(), threading.Event()
    connected: list[socket.socket] = []

    def slow_upstream(address: Any, *args: Any, **kwargs: Any) -> socket.socket:
        if tuple(address) == tuple(upstream):
            connecting.set()
            go_on.wait(5)
            connected.append(connect(address, *args, **kwargs))
            return connected[-1]
        return connect(address, *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", slow_upstream)
    url = urlparse(proxy.endpoint_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=5)
    conn.connect()
    assert connecting.wait(5)
    act()
    go_on.set()
    with pytest.raises((ConnectionError, http.client.HTTPException)):
        _get(conn)
    conn.close()
    return connected


def test_a_connection_accepted_as_a_fault_starts_does_not_slip_past_it(
        keep_alive_proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection accepted just before ``fault()`` whose thread was still connecting to the
    upstream: it joined the open connections after the fault had severed them, so it (a
    pooled keep-alive connection) carried requests through the whole outage."""
    _act_while_connecting(keep_alive_proxy, monkeypatch,
                          lambda: keep_alive_proxy.fault("http503"))


def test_a_connection_accepted_as_the_proxy_closes_is_not_forwarded(
        keep_alive_proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection accepted just before ``close()`` whose thread was still connecting to the
    upstream: it joined the open connections after ``close()`` had severed them, and was
    forwarded on by a proxy that no longer existed (its thread and both sockets left behind)."""
    connected = _act_while_connecting(keep_alive_proxy, monkeypatch, keep_alive_proxy.close)
    deadline = time.monotonic() + 5  # closed by the thread just after it reset the client
    while connected and connected[0].fileno() != -1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert connected and connected[0].fileno() == -1, "the upstream connection is closed"


def test_a_client_that_half_closes_still_gets_the_answer() -> None:
    """A client that ends its request with a half-close (``shutdown(SHUT_WR)``, as ``nc -N``
    or an HTTP/1.0 tool does) still reads the answer through the proxy. The proxy shut the
    upstream connection down both ways at the client's FIN, so the answer was lost."""
    upstream = socket.create_server(("127.0.0.1", 0))

    def answer_after_eof() -> None:
        conn, _ = upstream.accept()
        with conn:
            request = b""
            while chunk := conn.recv(1024):
                request += chunk
            conn.sendall(b"echo: " + request)

    server = threading.Thread(target=answer_after_eof, daemon=True)
    server.start()
    with FaultProxy(upstream.getsockname()[:2]) as fault_proxy:
        url = urlparse(fault_proxy.endpoint_url)
        with socket.create_connection((url.hostname, url.port), timeout=5) as client:
            client.sendall(b"hello")
            client.shutdown(socket.SHUT_WR)
            answer = b""
            while chunk := client.recv(1024):
                answer += chunk
    server.join(5)
    upstream.close()
    assert answer == b"echo: hello"


class _AcceptFailsOnce:
    """A listening socket whose first ``accept()`` fails with ``code`` (a process out of file
    descriptors: EMFILE; a connection reset while it waited in the backlog: ECONNABORTED)."""

    def __init__(self, code: int) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.code: int | None = code

    def accept(self) -> tuple[socket.socket, Any]:
        code, self.code = self.code, None
        if code is not None:
            raise OSError(code, os.strerror(code))
        return self.sock.accept()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE, errno.ENOBUFS,
                                  errno.ECONNABORTED], ids=errno.errorcode.get)
def test_the_proxy_goes_on_accepting_after_a_failed_accept(code: int) -> None:
    """A failed ``accept()`` ended the accept loop: the proxy stopped serving for good (an
    outage that never healed), though it had not been closed."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _KeepAlive)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    listener = _AcceptFailsOnce(code)
    try:
        with FaultProxy(server.server_address[:2],  # type: ignore[arg-type]
                        listener=listener) as fault_proxy:  # type: ignore[arg-type]
            url = urlparse(fault_proxy.endpoint_url)
            conn = http.client.HTTPConnection(url.hostname, url.port, timeout=3)
            assert _get(conn) == 200
            conn.close()
        assert listener.sock.fileno() == -1  # and close() still ends it
        assert not fault_proxy._thread.is_alive()
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("sent", [b"", b"PUT /b/k HTTP/1.1\r\nHost: x\r\n",
                                  b"PUT /b/k HTTP/1.1\r\nContent-Length: 9\r\n\r\npart"],
                         ids=["nothing", "half-a-head", "half-a-body"])
def test_a_503_answers_a_client_that_stops_sending_within_the_bound(
        keep_alive_proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch, sent: bytes) -> None:
    """The 503 fault read the request with blocking recv() calls: a client that sent nothing,
    part of a head or part of a declared body (a slow client, a stalled upload) held the
    proxy's thread, and never got its answer, for as long as it kept the connection open."""
    from antifragile.chaos.infra import proxy as proxy_module

    monkeypatch.setattr(proxy_module, "_REQUEST_READ_S", 0.2)
    keep_alive_proxy.fault("http503")
    url = urlparse(keep_alive_proxy.endpoint_url)
    with socket.create_connection((url.hostname, url.port), timeout=3) as client:
        client.sendall(sent)
        answer = b""
        while chunk := client.recv(1024):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 503 Service Unavailable\r\n"), answer


def test_latency_delays_each_request_of_a_keep_alive_connection(
        keep_alive_proxy: FaultProxy) -> None:
    url = urlparse(keep_alive_proxy.endpoint_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    assert _get(conn) == 200
    keep_alive_proxy.fault("latency", latency_s=0.3)  # severs it: the client reconnects once
    conn.close()
    for _ in range(3):
        start = time.monotonic()
        assert _get(conn) == 200 and time.monotonic() - start >= 0.3
    assert keep_alive_proxy.stats.delayed == 3 and keep_alive_proxy.stats.passed == 2
    keep_alive_proxy.heal()
    start = time.monotonic()
    assert _get(conn) == 200 and time.monotonic() - start < 0.3
    assert keep_alive_proxy.stats.delayed == 3


@pytest.mark.parametrize("end", ["a-new-fault", "close"])
def test_a_request_held_by_latency_does_not_reach_storage_when_an_outage_replaces_it(
        monkeypatch: pytest.MonkeyPatch, end: str) -> None:
    """A request held back by ``latency`` when an ``http503`` outage replaced the fault (or
    the proxy closed) was released before its connection was severed: it reached the
    upstream, a mutation (this DELETE) made in the outage, or after the proxy had gone, while
    its client saw its connection severed. Severing is slowed here to show the order."""
    from antifragile.chaos.infra import proxy as proxy_module

    upstream = socket.create_server(("127.0.0.1", 0))
    received: list[bytes] = []

    def record() -> None:
        with contextlib.suppress(OSError):
            conn, _ = upstream.accept()
            with conn:
                while chunk := conn.recv(1024):
                    received.append(chunk)

    threading.Thread(target=record, daemon=True).start()
    sever = proxy_module._hard_close

    def slow_sever(sock: socket.socket) -> None:
        time.sleep(0.2)
        sever(sock)

    monkeypatch.setattr(proxy_module, "_hard_close", slow_sever)
    fault_proxy = FaultProxy(upstream.getsockname()[:2])
    try:
        fault_proxy.fault("latency", latency_s=30)
        url = urlparse(fault_proxy.endpoint_url)
        with socket.create_connection((url.hostname, url.port), timeout=5) as client:
            client.sendall(b"DELETE /b/k HTTP/1.1\r\nHost: x\r\n\r\n")
            deadline = time.monotonic() + 5
            while fault_proxy.snapshot().delayed == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert fault_proxy.snapshot().delayed == 1, "the request is held"
            if end == "close":
                fault_proxy.close()
            else:
                fault_proxy.fault("http503")
            time.sleep(0.3)
        assert received == [], "the held request reached the upstream"
    finally:
        fault_proxy.close()
        upstream.close()


def test_a_counted_blackhole_holds_its_last_connection_too_until_healed(
        keep_alive_proxy: FaultProxy) -> None:
    """``fault("blackhole", count=1)``: the one connection it faults is held, not reset, and
    ``heal(token)`` severs it. The connection that used up the count found the fault gone,
    took that for a heal and reset it at once; and ``heal`` of a fault whose count was used
    up returned without severing what it held."""
    url = urlparse(keep_alive_proxy.endpoint_url)
    token = keep_alive_proxy.fault("blackhole", count=1)
    held = socket.create_connection((url.hostname, url.port), timeout=1.0)
    held.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    with pytest.raises(TimeoutError):  # held: no answer, no reset
        held.recv(100)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=5)
    assert _get(conn) == 200  # the count is used up: the next connection passes
    keep_alive_proxy.heal(token)
    held.settimeout(5.0)
    with contextlib.suppress(ConnectionResetError):  # severed at the heal (FIN, then RST)
        assert held.recv(100) == b""
    held.close()
    conn.close()
    assert keep_alive_proxy.stats.faulted == 1


def test_a_blackholed_client_that_half_closes_is_held_until_healed(
        keep_alive_proxy: FaultProxy) -> None:
    """A blackholed client that ends its request with a half-close (``shutdown(SHUT_WR)``, as
    ``nc -N`` or an HTTP/1.0 tool does) must get silence, as a partition gives, until the heal
    severs it. The proxy took the client's FIN for the end of the connection and closed it at
    once: the client read an immediate end of stream, an answer no partition gives."""
    url = urlparse(keep_alive_proxy.endpoint_url)
    keep_alive_proxy.fault("blackhole")
    with socket.create_connection((url.hostname, url.port), timeout=0.5) as held:
        held.sendall(b"GET / HTTP/1.0\r\n\r\n")
        held.shutdown(socket.SHUT_WR)
        with pytest.raises(TimeoutError):  # held: no answer, no end of stream
            held.recv(100)
        keep_alive_proxy.heal()
        held.settimeout(5.0)
        with contextlib.suppress(ConnectionResetError):  # severed at the heal
            assert held.recv(100) == b""


@pytest.mark.s3
def test_blackhole_holds_requests_and_severs_them_when_healed(proxy: FaultProxy,
                                                              bucket: str) -> None:
    client = _client(proxy.endpoint_url, read_timeout=30)
    proxy.fault("blackhole")
    outcome: dict[str, Any] = {}

    def request() -> None:
        start = time.monotonic()
        try:
            client.list_objects_v2(Bucket=bucket)
            outcome["result"] = "answered"
        except Exception as exc:
            outcome["result"] = type(exc).__name__
        outcome["seconds"] = time.monotonic() - start

    worker = threading.Thread(target=request)
    worker.start()
    worker.join(1.5)
    assert worker.is_alive(), "a blackholed request must get no answer"
    proxy.heal()
    worker.join(10)
    assert not worker.is_alive()
    assert outcome["result"] != "answered" and 1.4 < outcome["seconds"] < 10, outcome
    assert proxy.stats.faulted == 1
    assert "Contents" not in client.list_objects_v2(Bucket=bucket)  # healed: answered again


@pytest.mark.s3
def test_latency_mode_delays_s3_requests(proxy: FaultProxy, bucket: str) -> None:
    url = urlparse(proxy.endpoint_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    proxy.fault("latency", latency_s=0.4)
    for _ in range(3):
        start = time.monotonic()
        conn.request("GET", f"/{bucket}?list-type=2")
        response = conn.getresponse()
        response.read()
        # an unsigned request: S3 (and SeaweedFS) refuse it with 403, moto answered 200; the
        # answer's delay is what this test is about
        assert response.status in (200, 403) and time.monotonic() - start >= 0.4
    assert proxy.stats.delayed == 3 and proxy.stats.faulted == 0
    proxy.heal()
    start = time.monotonic()
    conn.request("GET", f"/{bucket}?list-type=2")
    conn.getresponse().read()
    assert time.monotonic() - start < 0.4 and proxy.stats.delayed == 3
    conn.close()


@pytest.mark.s3
def test_heal_of_an_earlier_fault_leaves_a_later_one_alone(proxy: FaultProxy) -> None:
    first = proxy.fault("http503")
    proxy.fault("blackhole")
    proxy.heal(first)
    assert proxy._fault is not None and proxy._fault.kind == "blackhole"
    proxy.heal()
    assert proxy._fault is None


def test_proxy_refuses_tls_endpoints_and_unknown_kinds() -> None:
    with pytest.raises(ValueError, match="plain http"):
        FaultProxy.in_front_of("https://s3.amazonaws.com")
    with FaultProxy(("127.0.0.1", 9)) as fault_proxy:
        with pytest.raises(ValueError, match="unknown fault"):
            fault_proxy.fault("flaky")
        with pytest.raises(ValueError, match="give no count"):
            fault_proxy.fault("latency", count=3)


# -- S3 set-up of a run ------------------------------------------------------------------------

TRAINER = {"parallel": {"dp": 2, "tp": 1, "pp": 1}, "steps": 16, "batch_size": 8,
           "model": {"layers": 2, "d_model": 32, "heads": 4, "vocab": 64, "seq_len": 16},
           "collective_timeout_s": 30}


def _scenario(name: str, url: str | None, faults: list[dict[str, Any]]) -> dict[str, Any]:
    return {"name": name, "seed": 5, "trainer": TRAINER,
            "checkpoint": {"url": url, "every_steps": 4, "keep_last": 3}, "faults": faults,
            "expect": {"bitwise_equal_to_reference": True}}


OUTAGE = {"kind": "storage_outage", "at_step": 5, "duration_s": 3, "mode": "error"}


def _fresh_url() -> str:
    return f"s3://chaos-{uuid.uuid4().hex[:10]}/run"


def test_run_storage_is_a_run_folder_by_default(tmp_path: Path) -> None:
    s = parse_scenario(_scenario("local", None, []))
    with s3.run_storage(s, tmp_path, progress=lambda _: None) as storage:
        assert storage.url == str(tmp_path / "ckpt")
        assert storage.trainer_env == {} and storage.proxy is None


def _collections(cluster: Any) -> set[str]:
    """The collections (one per bucket) the SeaweedFS master has volumes for."""
    master = f"http://{cluster.host}:{cluster.servers['master'].port}/vol/status"
    with urllib.request.urlopen(master, timeout=5) as answer:
        status = json.load(answer)
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("Collection"), str):
                found.add(node["Collection"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(status)
    return found


@pytest.mark.s3
def test_run_storage_starts_seaweedfs_when_no_endpoint_is_configured(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in s3.ENDPOINT_VARS:
        monkeypatch.delenv(var, raising=False)
    url = _fresh_url()
    s = parse_scenario(_scenario("demo", url, [OUTAGE]))
    lines: list[str] = []
    with s3.run_storage(s, tmp_path, progress=lines.append) as storage:
        assert storage.cluster is not None and storage.url == url and "SeaweedFS" in lines[0]
        assert storage.proxy is not None
        # the trainer goes through the proxy; this process talks to the cluster directly
        assert storage.trainer_env["AWS_ENDPOINT_URL"] == storage.proxy.endpoint_url
        assert os.environ["AWS_ENDPOINT_URL"] == storage.endpoint != storage.proxy.endpoint_url
        assert storage.endpoint == storage.cluster.endpoint_url
        client = _client(storage.trainer_env["AWS_ENDPOINT_URL"],
                         key=storage.trainer_env["AWS_ACCESS_KEY_ID"],
                         secret=storage.trainer_env["AWS_SECRET_ACCESS_KEY"])
        bucket, prefix = s3.split_url(url)
        # the new bucket's volumes are grown before the trainer starts (the first write into
        # a new bucket would: ~0.7 s, taken from the run's first checkpoint save), and the
        # write that grew them left nothing behind
        assert bucket in _collections(storage.cluster)
        assert "Contents" not in client.list_objects_v2(Bucket=bucket)
        client.put_object(Bucket=bucket, Key=f"{prefix}/x", Body=b"through the proxy")
        assert storage.proxy.stats.passed >= 1
    assert "AWS_ENDPOINT_URL" not in os.environ
    with pytest.raises(Exception, match=r"Could not connect|Connect timeout|refused"):
        client.list_objects_v2(Bucket=bucket)  # the demo cluster is gone with the run
    assert storage.cluster.root is None and not storage.cluster.servers["s3"].alive()


@pytest.mark.s3
def test_run_storage_uses_the_configured_endpoint_and_checks_the_prefix(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, s3_server: dict[str, Any],
        s3_bucket: tuple[str, dict[str, Any]]) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server["endpoint_url"])
    url, _ = s3_bucket
    s = parse_scenario(_scenario("external", url, []))
    with s3.run_storage(s, tmp_path, progress=lambda _: None) as storage:
        assert storage.cluster is None and storage.proxy is None
        assert storage.trainer_env["AWS_ENDPOINT_URL"] == s3_server["endpoint_url"]
    bucket, prefix = s3.split_url(url)
    client = _client(s3_server["endpoint_url"])
    client.put_object(Bucket=bucket, Key=f"{prefix}/step_000000004/x", Body=b"old")
    with pytest.raises(s3.S3SetupError, match=r"already holds step_000000004.*fresh prefix"), \
            s3.run_storage(s, tmp_path, progress=lambda _: None):
        pass
    missing = parse_scenario(_scenario("missing", "s3://no-such-bucket-here/x", []))
    with pytest.raises(s3.S3SetupError, match="bucket 'no-such-bucket-here' does not exist"), \
            s3.run_storage(missing, tmp_path, progress=lambda _: None):
        pass


def test_an_interrupt_as_run_storage_is_set_up_closes_its_fault_proxy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C or SIGTERM landing between the fault proxy's start and the block that closes
    it (here as the trainer's endpoint is read from it) left the proxy listening, its thread
    accepting, until chaos exited: a ``chaos suite`` ran every later scenario beside it."""
    made: list[FaultProxy] = []
    real_in_front_of = FaultProxy.in_front_of

    def in_front_of(endpoint_url: str, **kwargs: Any) -> FaultProxy:
        made.append(real_in_front_of(endpoint_url, **kwargs))
        return made[-1]

    def interrupted(self: FaultProxy) -> str:
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def given(_: str | None = None) -> Iterator[s3.S3Endpoint]:
        yield s3.S3Endpoint("http://127.0.0.1:9", {})

    monkeypatch.setattr(s3, "endpoint", given)
    monkeypatch.setattr(s3, "prepare", lambda url, ep: None)
    monkeypatch.setattr(FaultProxy, "in_front_of", in_front_of)
    monkeypatch.setattr(FaultProxy, "endpoint_url", property(interrupted))
    s = parse_scenario(_scenario("outage", _fresh_url(), [OUTAGE]))
    try:
        with pytest.raises(KeyboardInterrupt), \
                s3.run_storage(s, tmp_path, progress=lambda _: None):
            pass
        assert len(made) == 1
        assert made[0]._listener.fileno() == -1, "the fault proxy still listens"
    finally:
        for proxy in made:
            proxy.close()


# -- scenario rules and measurements (no processes) --------------------------------------------


@pytest.mark.parametrize("url", [None, "/tmp/ckpt"])
def test_a_storage_outage_needs_s3(url: str | None) -> None:
    with pytest.raises(ScenarioError, match=r"x.yaml: faults.0.kind: storage_outage acts on S3"
                       r".*set checkpoint.url: s3://bucket/prefix"):
        parse_scenario(_scenario("x", url, [OUTAGE]), path="x.yaml")


def test_storage_outage_fields_are_validated() -> None:
    with pytest.raises(ScenarioError, match=r"faults\.0\.mode: Input should be 'error', 'latency' "
                       r"or 'blackhole'"):
        parse_scenario(_scenario("x", "s3://b/p", [{**OUTAGE, "mode": "flaky"}]))
    with pytest.raises(ScenarioError, match=r"faults\.0\.duration_s"):
        parse_scenario(_scenario("x", "s3://b/p", [{**OUTAGE, "duration_s": 0}]))
    for mode in ("error", "blackhole"):  # accepted and ignored, the outage not as written
        with pytest.raises(ScenarioError, match=r"x\.yaml: faults\.0\.latency_s: only mode "
                           f"latency holds requests back; mode {mode} ignores it"):
            parse_scenario(_scenario("x", "s3://b/p", [{**OUTAGE, "mode": mode,
                                                         "latency_s": 5.0}]), path="x.yaml")
    s = parse_scenario(_scenario("x", "s3://b/p", [OUTAGE]))
    assert isinstance(s.faults[0], StorageOutage) and s.faults[0].latency_s == 2.0
    s = parse_scenario(_scenario("x", "s3://b/p", [{**OUTAGE, "mode": "latency",
                                                     "latency_s": 5.0}]))
    assert isinstance(s.faults[0], StorageOutage) and s.faults[0].latency_s == 5.0


def test_without_a_proxy_the_outage_is_reported_skipped() -> None:
    import random

    target = Target(pids={}, coordinates={}, ckpt_url="s3://b/p", rng=random.Random(0),
                    storage_proxy_unavailable="the fault proxy needs a plain http:// endpoint")
    injection = StorageOutage(kind="storage_outage", at_step=3).inject(target, 3)
    assert injection.skipped == "the fault proxy needs a plain http:// endpoint"


def _ev(t: float, event: str, rank: int = 0, attempt: int = 0, **kw: Any) -> dict[str, Any]:
    return {"t": t, "event": event, "rank": rank, "attempt": attempt, **kw}


def test_outage_effects_from_events() -> None:
    """Outage 10..20 s: the save of step 4 (staged at 9 s) is in flight and commits late, the
    one of step 8 is skipped while it persists, step 12's commits after; steps go on."""
    events = [_ev(0.0, "start", pid=1)]
    events += [_ev(float(t), "step_end", step=t, seconds=0.5, loss=1.0) for t in range(1, 25)]
    events += [
        _ev(1.0, "ckpt_staged", step=1, stall_s=0.01),
        _ev(3.0, "ckpt_committed", step=1, persist_s=1.0, bytes=10),
        _ev(9.0, "ckpt_staged", step=4, stall_s=0.01),
        _ev(12.0, "ckpt_failed", step=8, error="step 8 skipped: the save of step 4 is still "
            "persisting"),
        _ev(23.0, "ckpt_committed", step=4, persist_s=13.0, bytes=10),
        _ev(22.0, "ckpt_staged", step=12, stall_s=0.01),
        _ev(24.0, "ckpt_committed", step=12, persist_s=1.0, bytes=10),
    ]
    events.append(_ev(15.5, "step_end", step=15, seconds=0.5, loss=1.0))  # a slow step
    events.sort(key=lambda e: e["t"])
    record = RunRecord(0, 0.0, 25.0, events, [])
    injection = Injection("storage_outage", 10.0, step=10, detail={
        "mode": "error", "duration_s": 10.0, "latency_s": None, "ended_t": 20.0,
        "requests_faulted": 40, "connections_passed": 2, "requests_delayed": 0})
    o = outage_effects(record, injection)
    assert o["checkpoints_delayed"] == [4] and o["checkpoints_skipped"] == [8]
    assert o["checkpoints_failed"] == [] and o["first_commit_after_step"] == 12
    (delayed, skipped) = o["checkpoints"]
    assert delayed["delay_s"] == pytest.approx(12.0) and o["baseline_persist_s"] == 1.0
    assert skipped["outcome"] == "skipped"
    assert o["training_continued"] and o["steps_during_outage"] == 12
    assert o["step_pace_s"] == 1.0 and o["extra_stall_s"] == pytest.approx(0.0)
    assert o["outage_s"] == 10.0 and o["requests_faulted"] == 40
    assert fault_timings(record, injection).outage == o


def test_an_outage_that_stops_training_is_reported() -> None:
    events = [_ev(0.0, "start", pid=1)]
    events += [_ev(float(t), "step_end", step=t, seconds=0.5, loss=1.0) for t in range(1, 10)]
    events += [_ev(25.0, "start", attempt=1, pid=2)]
    record = RunRecord(0, 0.0, 30.0, events, [])
    injection = Injection("storage_outage", 10.0, step=9, detail={
        "mode": "blackhole", "duration_s": 10.0, "ended_t": 20.0})
    o = outage_effects(record, injection)
    assert not o["training_continued"] and o["steps_during_outage"] == 0


def test_an_outage_shorter_than_a_step_is_judged_over_two_steps() -> None:
    """0.3 s of outage between two steps a second apart: no step could end inside it, and the
    verdict said training did not go on (a false failure, for any outage shorter than a
    step). Two steps' time from its start: one ended, at the usual pace."""
    events = [_ev(0.0, "start", pid=1)]
    events += [_ev(float(t), "step_end", step=t, seconds=0.5, loss=1.0) for t in range(1, 20)]
    record = RunRecord(0, 0.0, 20.0, events, [])
    injection = Injection("storage_outage", 10.2, step=10, detail={
        "mode": "error", "duration_s": 0.3, "ended_t": 10.5})
    o = outage_effects(record, injection)
    assert o["training_continued"] and o["steps_during_outage"] == 2
    assert o["extra_stall_s"] == pytest.approx(0.0)



def test_the_hold_at_the_outages_pause_point_is_not_extra_stall() -> None:
    """An ``at_step`` outage is made while chaos holds the ranks at its pause point (here 2 s:
    the step after it ends 3 s after the one before, at a 1 s pace). That hold is chaos's, not
    the loop's (goodput leaves it out too), yet it was counted as the outage's extra stall."""
    events = [_ev(0.0, "start", pid=1)]
    events += [_ev(float(t), "step_end", step=t, seconds=0.5, loss=1.0) for t in range(1, 11)]
    events += [_ev(10.01, "paused", point="p0", step=10),
               _ev(12.0, "resumed", point="p0", held_s=1.99)]
    events += [_ev(float(t + 2), "step_end", step=t, seconds=0.5, loss=1.0)
               for t in range(11, 21)]
    events.sort(key=lambda e: e["t"])
    record = RunRecord(0, 0.0, 23.0, events, [], paused_s=2.0)
    injection = Injection("storage_outage", 10.5, step=10, detail={
        "mode": "error", "duration_s": 5.0, "ended_t": 15.5, "requests_faulted": 3,
        "paused_s": 0.5})
    o = outage_effects(record, injection)
    assert o["step_pace_s"] == 1.0
    assert o["extra_stall_s"] == pytest.approx(0.01)

# -- whole scenarios on S3 ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("reference-cache")


def _chaos_run(tmp_path: Path, doc: dict[str, Any]) -> tuple[dict[str, Any], str, float]:
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(doc))
    start = time.monotonic()
    result = CliRunner().invoke(main, ["run", str(path), "--out", str(tmp_path / "out")])
    wall_s = time.monotonic() - start
    assert result.exit_code in (0, 1), result.output
    return json.loads((tmp_path / "out" / "report.json").read_text()), result.output, wall_s


def _outage_run(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch,
                **outage: Any) -> dict[str, Any]:
    monkeypatch.setenv("ANTIFRAGILE_CACHE", str(cache))
    for var in s3.ENDPOINT_VARS:
        monkeypatch.delenv(var, raising=False)
    fault = {"kind": "storage_outage", "at_checkpoint": 1, "duration_s": 3, **outage}
    report, output, wall_s = _chaos_run(tmp_path, _scenario("outage", _fresh_url(), [fault]))
    print(f"storage_outage {outage}: wall {wall_s:.1f} s")
    assert report["verdict"] == {"verdict": "pass", "reasons": [], "bitwise_equal": True}, output
    (f,) = report["faults"]
    o = f["outage"]
    assert f["kind"] == "storage_outage" and f["skipped"] is None
    assert o["mode"] == outage["mode"] and o["outage_s"] == pytest.approx(3, abs=0.5)
    assert o["training_continued"] and o["steps_during_outage"] > 0
    # the save of step 4 was persisting when the outage began: it is late, failed or lost
    assert 4 in o["checkpoints_delayed"] + o["checkpoints_failed"], o
    assert o["first_commit_after_step"] is not None
    assert report["run"]["attempts"] == 1 and report["run"]["checkpoint_url"].startswith("s3://")
    assert "training went on: True" in output
    return o


@pytest.mark.s3
@pytest.mark.multiproc
@pytest.mark.slow
def test_error_outage_run_ends_bitwise_equal(tmp_path: Path, cache: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    o = _outage_run(tmp_path, cache, monkeypatch, mode="error")
    assert o["requests_faulted"] > 0


@pytest.mark.s3
@pytest.mark.multiproc
@pytest.mark.slow
def test_latency_outage_run_ends_bitwise_equal(tmp_path: Path, cache: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    o = _outage_run(tmp_path, cache, monkeypatch, mode="latency", latency_s=0.5)
    assert o["requests_delayed"] > 0 and o["requests_faulted"] == 0


@pytest.mark.s3
@pytest.mark.multiproc
@pytest.mark.slow
def test_blackhole_outage_run_ends_bitwise_equal(tmp_path: Path, cache: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    o = _outage_run(tmp_path, cache, monkeypatch, mode="blackhole")
    assert o["requests_faulted"] > 0


@pytest.mark.s3
@pytest.mark.multiproc
@pytest.mark.slow
def test_an_outage_before_the_first_save_faults_nothing_and_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 0.3 s outage at step 20 of a run that first saves at step 50 (about 2 s later here):
    the trainer sends no request while it lasts, so it proved nothing and the verdict fails."""
    for var in s3.ENDPOINT_VARS:
        monkeypatch.delenv(var, raising=False)
    doc = _scenario("quiet-outage", _fresh_url(), [
        {"kind": "storage_outage", "at_step": 20, "duration_s": 0.3, "mode": "error"}])
    doc["trainer"] = {**TRAINER, "steps": 60}
    doc["checkpoint"]["every_steps"] = 50
    doc["expect"]["bitwise_equal_to_reference"] = False
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(doc))
    result = CliRunner().invoke(main, ["run", str(path), "--no-reference",
                                       "--out", str(tmp_path / "out")])
    assert result.exit_code == 1, result.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    (f,) = report["faults"]
    assert f["outage"]["requests_faulted"] == 0 and f["outage"]["outage_s"] is not None
    assert f["effect_observed"] is False
    assert report["verdict"]["reasons"] == [
        f"storage_outage at step {f['injected_step']}: no observable effect: no request "
        "reached the proxy during the 0.3 s outage"]


def test_latency_holds_an_upload_that_waits_for_100_continue_back_once() -> None:
    """A PUT with ``Expect: 100-continue`` (botocore's uploads of a file object) crosses the
    proxy in two parts: its head, then, after the upstream's ``100 Continue``, its body.
    ``latency`` took the body for a new request and held it back again: each upload was
    delayed twice ``latency_s`` and counted twice in ``requests_delayed``."""
    upstream = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = upstream.accept()
        with conn:
            head = b""
            while b"\r\n\r\n" not in head:
                head += conn.recv(1024)
            conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            body = head.partition(b"\r\n\r\n")[2]
            while len(body) < 4:
                body += conn.recv(1024)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    with FaultProxy(upstream.getsockname()[:2]) as fault_proxy:
        fault_proxy.fault("latency", latency_s=1.0)
        url = urlparse(fault_proxy.endpoint_url)
        start = time.monotonic()
        with socket.create_connection((url.hostname, url.port), timeout=10) as client:
            client.sendall(b"PUT /b/k HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
                           b"Expect: 100-continue\r\n\r\n")
            answer = client.recv(1024)
            assert answer.startswith(b"HTTP/1.1 100 Continue"), answer
            client.sendall(b"data")
            while b"200 OK" not in answer:
                chunk = client.recv(1024)
                assert chunk, answer
                answer += chunk
        took = time.monotonic() - start
        stats = fault_proxy.snapshot()
    server.join(5)
    upstream.close()
    assert stats.requests == 1 and stats.delayed == 1, stats
    assert 1.0 <= took < 1.9, took


def test_an_outage_due_while_another_is_on_is_missed_and_cuts_the_other_nothing_short(
        ) -> None:
    """Two outages that overlap (two entries, or ``mtbf_s`` arrivals closer than
    ``duration_s``): the second replaced the first's fault in the proxy, and its end healed
    the proxy while the first was meant to last on: S3 came back early and the first was
    reported as lasting its whole ``duration_s``. The second did not happen (S3 was out
    already): missed, saying why, and the first lasts its time."""
    import random

    upstream = socket.create_server(("127.0.0.1", 0))
    with FaultProxy(upstream.getsockname()[:2]) as proxy:
        target = Target(pids={}, coordinates={}, ckpt_url="s3://b/p", rng=random.Random(0),
                        storage_proxy=proxy)
        first = StorageOutage(kind="storage_outage", at_step=3, duration_s=30.0)
        assert first.inject(target, 3).missed is None
        second = StorageOutage(kind="storage_outage", at_step=4, duration_s=0.05,
                               mode="latency", latency_s=1.0)
        injection = second.inject(target, 4)
        assert injection.missed is not None and "already" in injection.missed
        time.sleep(0.3)
        assert proxy._fault is not None and proxy._fault.kind == "http503", \
            "the first outage must last its duration_s"
        target.endings.end_now()
    upstream.close()
