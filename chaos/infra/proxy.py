"""A fault-injecting TCP proxy in front of an HTTP (S3) endpoint.

The trainer is given the proxy's address as its S3 endpoint, so every request it makes crosses
the proxy, and the faults are made here, outside the trainer: its real client stack (s3fs,
aiobotocore, aiohttp) sees real resets, real 503 answers and real silence. Fault kinds:

- ``reset``: accept a connection, then close it with RST.
- ``http503``: read the request (for up to 5 s), answer ``503 Service Unavailable`` with an
  S3 error document (what S3 does when it sheds load), and close.
- ``blackhole``: accept, read, never answer. Held connections are severed (RST) when the fault
  ends, as a network partition healing would; until then the client waits on its own timeout.
- ``latency``: pass everything, but hold each request back ``latency_s`` before forwarding it.

When a fault starts, connections already open are severed, so pooled keep-alive connections
cannot slip past it. The proxy speaks TCP, not TLS: it sits in front of plain-HTTP endpoints
(SeaweedFS, MinIO, a local gateway).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from urllib.parse import urlparse

FAULT_KINDS = ("reset", "http503", "blackhole", "latency")

log = logging.getLogger("antifragile.chaos.proxy")

# accept() errors that pass: out of file descriptors or buffers until connections close, and
# a connection that failed in the backlog (Linux hands its network error to accept(); the
# man page says to retry them). Anything else (EBADF, EINVAL: the listener closed or shut
# down) ends the accept loop.
_ACCEPT_TRANSIENT = frozenset({
    errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED, errno.EPERM,
    errno.EPROTO, errno.ENOPROTOOPT, errno.EHOSTDOWN, errno.ENONET, errno.EHOSTUNREACH,
    errno.EOPNOTSUPP, errno.ENETDOWN, errno.ENETUNREACH, errno.ETIMEDOUT,
})

_BODY_503 = (
    b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>ServiceUnavailable</Code>"
    b"<Message>injected by the antifragile fault proxy</Message></Error>"
)
_HEAD_LIMIT = 64 * 1024
_REQUEST_READ_S = 5.0  # how long a 503 waits for the request it answers (see _answer_503)
_METHODS = {b"GET", b"PUT", b"POST", b"HEAD", b"DELETE", b"PATCH", b"OPTIONS"}


@dataclass(slots=True)
class ProxyStats:
    """Counts since the proxy started. ``faulted`` counts connections that were reset, answered
    503 or blackholed; each carries one request, since the client never gets an answer it could
    reuse the connection after. ``passed`` counts connections forwarded (a pooled connection
    carries many requests); ``delayed`` counts requests held back by ``latency``; ``requests``
    counts the HTTP requests forwarded (``bench.s3`` counts a save's requests with it)."""

    passed: int = 0
    faulted: int = 0
    delayed: int = 0
    requests: int = 0

    def since(self, earlier: ProxyStats) -> ProxyStats:
        return ProxyStats(self.passed - earlier.passed, self.faulted - earlier.faulted,
                          self.delayed - earlier.delayed, self.requests - earlier.requests)


@dataclass(slots=True)
class _Fault:
    kind: str
    left: int | None  # connections still to fault; None: until heal()
    latency_s: float
    over: threading.Event  # set when this fault ends: wakes requests held by latency


class FaultProxy:
    """Listens on ``host`` (a free port); forwards to ``upstream`` (host, port).

    Thread-safe: ``fault`` and ``heal`` may be called from any thread while traffic flows.
    ``fault(kind, count)`` faults the next ``count`` connections (``None``: everything until
    ``heal()``). ``latency`` applies to every request until ``heal()``.
    """

    def __init__(self, upstream: tuple[str, int], *, host: str = "127.0.0.1",
                 listener: socket.socket | None = None) -> None:
        """``listener``: a listening socket to serve instead of a new one on ``host`` (e.g.
        one on an emulated network's bridge, made by ``Network.listen``); closed with it."""
        self.upstream = upstream
        self.stats = ProxyStats()
        self._lock = threading.Lock()
        self._fault: _Fault | None = None
        self._started = 0  # faults started so far: a connection accepted before one is severed
        self._open: set[socket.socket] = set()  # passed-through sockets, both sides
        # blackholed client sockets: their fault, and an event set once heal() severed them
        self._held: dict[socket.socket, tuple[_Fault, threading.Event]] = {}
        self._listener = listener if listener is not None else socket.create_server((host, 0))
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="fault-proxy", daemon=True)
        self._thread.start()

    @classmethod
    def in_front_of(cls, endpoint_url: str, *, listener: socket.socket | None = None
                    ) -> FaultProxy:
        """A proxy for ``http://host:port``; TLS endpoints cannot be proxied byte for byte."""
        url = urlparse(endpoint_url)
        if url.scheme != "http" or not url.hostname:
            raise ValueError(f"the fault proxy needs a plain http:// endpoint, not {endpoint_url}")
        return cls((url.hostname, url.port or 80), listener=listener)

    @property
    def endpoint_url(self) -> str:
        host, port = self._listener.getsockname()[:2]
        return f"http://{host}:{port}"

    def snapshot(self) -> ProxyStats:
        with self._lock:
            return dataclasses.replace(self.stats)

    @property
    def faulting(self) -> bool:
        """Whether a fault is on (started, not healed, its count not used up)."""
        with self._lock:
            return self._fault is not None

    def fault(self, kind: str, count: int | None = None, *, latency_s: float = 2.0) -> object:
        """Start faulting with ``kind``; sever the connections open now. Returns a token for
        ``heal`` (a fault started later is not ended by an earlier one's heal). Requests
        held by an earlier ``latency`` are released only once their connections are severed:
        released first, they would reach the upstream in the outage."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {kind!r} (known: {', '.join(FAULT_KINDS)})")
        if kind == "latency" and count is not None:
            raise ValueError("latency applies to every request until heal(); give no count")
        with self._lock:
            earlier = self._fault
            self._fault = token = _Fault(kind, count, latency_s, threading.Event())
            self._started += 1
            victims, self._open = self._open, set()
        for sock in victims:
            _hard_close(sock)
        if earlier is not None:
            earlier.over.set()
        return token

    def heal(self, token: object | None = None) -> None:
        """End the fault (only if it is still ``token``'s): pass everything again; blackholed
        connections are severed (only ``token``'s, if a later fault is on)."""
        with self._lock:
            current = token is None or token is self._fault
            if current:
                if self._fault is not None:
                    self._fault.over.set()
                self._fault = None
            elif isinstance(token, _Fault):  # a later fault is on, or its count was used up
                token.over.set()
            held = [(sock, severed) for sock, (fault, severed) in self._held.items()
                    if current or fault is token]
            for sock, _ in held:
                del self._held[sock]
        for sock, severed in held:
            _hard_close(sock)
            severed.set()

    def close(self) -> None:
        """Stop serving and sever every connection, then heal: a request held by
        ``latency`` is not forwarded by a proxy that is gone."""
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() on Linux
        self._listener.close()
        self._thread.join(timeout=5)
        with self._lock:
            victims, self._open = self._open, set()
        for sock in victims:
            _hard_close(sock)
        self.heal()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _take(self) -> tuple[_Fault | None, int]:
        """The fault to apply to a new connection (None: pass it), counting it down, and how
        many faults had started."""
        with self._lock:
            fault = self._fault
            if fault is None or fault.kind == "latency":
                return None, self._started
            if fault.left is not None:
                fault.left -= 1
                if fault.left <= 0:
                    self._fault = None
            self.stats.faulted += 1
            return fault, self._started

    def _latency(self) -> _Fault | None:
        with self._lock:
            fault = self._fault
            return fault if fault is not None and fault.kind == "latency" else None

    def _accept_loop(self) -> None:
        while (client := accept(self._listener, self._closed, "fault proxy")) is not None:
            fault, started = self._take()
            if fault is None:
                threading.Thread(target=self._serve, args=(client, started), daemon=True).start()
            else:
                threading.Thread(target=self._inject, args=(client, fault), daemon=True).start()

    def _inject(self, client: socket.socket, fault: _Fault) -> None:
        if fault.kind == "reset":
            _hard_close(client)
        elif fault.kind == "http503":
            _answer_503(client)
        else:
            self._blackhole(client, fault)

    def _blackhole(self, client: socket.socket, fault: _Fault) -> None:
        """Swallow what ``client`` sends and answer nothing until ``heal()`` or ``close()``
        severs it; a client that half-closes (its request sent) is held on in silence too:
        closing at its FIN would answer it with an end of stream, which no partition gives."""
        severed = threading.Event()
        with self._lock:
            if fault.over.is_set() or self._closed.is_set():  # healed since accept()
                held = False
            else:
                self._held[client] = (fault, severed)
                held = True
        if not held:
            _hard_close(client)
            return
        try:
            while client.recv(65536):
                pass
        except OSError:
            pass
        severed.wait()  # set by heal() (close() heals), right after it severed the client
        with self._lock:
            self._held.pop(client, None)
        client.close()

    def _serve(self, client: socket.socket, started: int) -> None:
        """Forward ``client``, accepted when ``started`` faults had started: a fault started
        since (while this connected to the upstream) severs it, as it severed those open, and
        so does ``close()``."""
        try:
            upstream = socket.create_connection(self.upstream, timeout=10)
        except OSError:
            _hard_close(client)
            return
        upstream.settimeout(None)
        with self._lock:
            severed = self._started != started or self._closed.is_set()
            if not severed:
                self.stats.passed += 1
                self._open.update((client, upstream))
        if severed:
            _hard_close(client)
            upstream.close()
            return
        answered = threading.Event()  # the upstream answered (finally) the last request
        answered.set()

        def on_answer(chunk: bytes) -> None:
            if not _interim(chunk):
                answered.set()

        back = threading.Thread(target=_pump, args=(upstream, client, on_answer), daemon=True)
        back.start()
        _pump(client, upstream, lambda chunk: self._before_request(answered, chunk))
        back.join()
        with self._lock:
            self._open.difference_update((client, upstream))
        client.close()
        upstream.close()

    def _before_request(self, answered: threading.Event, chunk: bytes) -> None:
        """Called with each chunk from the client: the first one after an answer (or the first
        on the connection) begins a new request (HTTP/1.1 clients do not pipeline), which
        ``latency`` holds back. (A body sent after ``100 Continue`` is not counted again, nor
        held back again: an interim answer is no answer, see ``_interim``.)"""
        if not answered.is_set():
            return
        answered.clear()
        if chunk.split(b" ", 1)[0] in _METHODS:
            with self._lock:
                self.stats.requests += 1
        fault = self._latency()
        if fault is not None:
            with self._lock:
                self.stats.delayed += 1
            fault.over.wait(fault.latency_s)


def accept(listener: socket.socket, closed: threading.Event, name: str
           ) -> socket.socket | None:
    """The next connection to ``listener``; None once ``closed`` is set (or the listener is
    broken). A transient failure (out of file descriptors, a connection aborted in the
    backlog) is logged and waited out with a backoff, not taken for the end: a proxy whose
    accept loop ends stops serving for good, which no heal() ends."""
    delay = 0.01
    while not closed.is_set():
        try:
            return listener.accept()[0]
        except OSError as exc:
            if closed.is_set():
                return None
            if exc.errno not in _ACCEPT_TRANSIENT:
                log.error("%s on %s: accept() failed (%s); it accepts no more connections",
                          name, listener, exc)
                return None
            log.warning("%s: accept() failed (%s); trying again in %.2f s", name, exc, delay)
            closed.wait(delay)
            delay = min(delay * 2, 1.0)
    return None


def _interim(chunk: bytes) -> bool:
    """Whether ``chunk`` from the upstream is interim answers only (``100 Continue``, which
    asks for the body of the request still in flight): the body that follows is the same
    request, not a new one that ``latency`` would hold back a second time."""
    while chunk.startswith((b"HTTP/1.1 1", b"HTTP/1.0 1")):
        _, found, chunk = chunk.partition(b"\r\n\r\n")
        if not found:
            return True  # the rest of its head comes in the next chunk
    return not chunk


def _pump(src: socket.socket, dst: socket.socket, on_chunk: Callable[[bytes], None]) -> None:
    """Copy ``src`` to ``dst`` until ``src`` ends. Its end (a half-close: the request sent,
    the answer still to come) is passed on as one; a failure (a reset, a severed connection)
    shuts both down, which ends the other direction's pump too."""
    try:
        while data := src.recv(65536):
            on_chunk(data)
            dst.sendall(data)
    except OSError:
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
    else:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


def _answer_503(client: socket.socket) -> None:
    """Read the request head (and a declared body, unless the client waits for 100-continue)
    for up to ``_REQUEST_READ_S``, answer 503 with an S3 error document, and close. The bound:
    a client that sends part of a request and stops (a stalled upload, a slow client) would
    otherwise hold this thread, and wait for its answer, as long as it keeps the connection."""
    deadline = time.monotonic() + _REQUEST_READ_S

    def recv(size: int) -> bytes:
        client.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            return client.recv(size)
        except TimeoutError:
            return b""  # answered as it is: what was read is enough to tell a HEAD

    head = b""
    try:
        while b"\r\n\r\n" not in head and len(head) < _HEAD_LIMIT:
            chunk = recv(65536)
            if not chunk:
                break
            head += chunk
        header, _, body = head.partition(b"\r\n\r\n")
        fields = {k.strip().lower(): v.strip()
                  for k, _, v in (line.partition(b":") for line in header.split(b"\r\n")[1:])}
        if fields.get(b"expect", b"").lower() != b"100-continue":
            remaining = int(fields.get(b"content-length", b"0") or 0) - len(body)
            while remaining > 0:
                chunk = recv(min(remaining, 65536))
                if not chunk:
                    break
                remaining -= len(chunk)
        body_503 = b"" if header.startswith(b"HEAD ") else _BODY_503
        client.settimeout(_REQUEST_READ_S)  # nor may a client that does not read hold it
        client.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\n"
                       + f"Content-Length: {len(body_503)}\r\n".encode()
                       + b"Connection: close\r\n\r\n" + body_503)
        client.shutdown(socket.SHUT_WR)
    except (OSError, ValueError):
        pass
    finally:
        client.close()


def _hard_close(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0) so the peer sees a reset; wakes threads blocked on it."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
