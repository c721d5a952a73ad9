"""A tiny fault-injecting TCP proxy for S3 tests: sits between s3fs and the moto server.

Each client connection is either passed through byte for byte or faulted. Faults are injected
per connection: ``reset`` (accept, then RST) or ``http503`` (read the request, answer
``503 Service Unavailable`` as S3 does when it sheds load, and close). When a fault starts,
connections already open are severed, so pooled keep-alive connections cannot slip past it.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from dataclasses import dataclass

_BODY_503 = (
    b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>ServiceUnavailable</Code>"
    b"<Message>injected by the test proxy</Message></Error>"
)
_HEAD_LIMIT = 64 * 1024


@dataclass(slots=True)
class ProxyStats:
    passed: int = 0
    faulted: int = 0


class FaultProxy:
    """Listens on 127.0.0.1 (a free port); forwards to ``upstream`` (host, port).

    Thread-safe. ``fault(kind, count)`` faults the next ``count`` connections (``None``: every
    connection until ``heal()``). ``stats`` counts connections passed and faulted.
    """

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.stats = ProxyStats()
        self._lock = threading.Lock()
        self._kind: str | None = None
        self._left: int | None = 0
        self._open: set[socket.socket] = set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="fault-proxy", daemon=True)
        self._thread.start()

    @property
    def endpoint_url(self) -> str:
        host, port = self._listener.getsockname()[:2]
        return f"http://{host}:{port}"

    def fault(self, kind: str, count: int | None = None) -> None:
        """Fault the next ``count`` connections with ``kind``; sever the open ones."""
        if kind not in ("reset", "http503"):
            raise ValueError(f"unknown fault {kind!r}")
        with self._lock:
            self._kind, self._left = kind, count
            victims, self._open = self._open, set()
        for sock in victims:
            _hard_close(sock)

    def heal(self) -> None:
        with self._lock:
            self._kind, self._left = None, 0

    def close(self) -> None:
        self._closed.set()
        self.heal()
        self._listener.close()
        with self._lock:
            victims, self._open = self._open, set()
        for sock in victims:
            _hard_close(sock)

    def _next_fault(self) -> str | None:
        with self._lock:
            if self._kind is None:
                return None
            kind = self._kind
            if self._left is not None:
                self._left -= 1
                if self._left <= 0:
                    self._kind = None
            self.stats.faulted += 1
            return kind

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            kind = self._next_fault()
            target = self._serve if kind is None else self._inject
            threading.Thread(target=target, args=(client, kind), daemon=True).start()

    def _track(self, *socks: socket.socket) -> None:
        with self._lock:
            self._open.update(socks)

    def _inject(self, client: socket.socket, kind: str) -> None:
        if kind == "reset":
            _hard_close(client)
        else:
            _answer_503(client)

    def _serve(self, client: socket.socket, _: str | None) -> None:
        try:
            upstream = socket.create_connection(self.upstream, timeout=10)
        except OSError:
            _hard_close(client)
            return
        upstream.settimeout(None)
        with self._lock:
            self.stats.passed += 1
        self._track(client, upstream)
        back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
        back.start()
        _pump(client, upstream)
        back.join()
        with self._lock:
            self._open.difference_update((client, upstream))
        client.close()
        upstream.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def _answer_503(client: socket.socket) -> None:
    """Read the request head (and a declared body, unless the client waits for 100-continue),
    answer 503 with an S3 error document, and close."""
    head = b""
    try:
        while b"\r\n\r\n" not in head and len(head) < _HEAD_LIMIT:
            chunk = client.recv(65536)
            if not chunk:
                break
            head += chunk
        header, _, body = head.partition(b"\r\n\r\n")
        fields = {
            k.strip().lower(): v.strip()
            for k, _, v in (line.partition(b":") for line in header.split(b"\r\n")[1:])
        }
        if fields.get(b"expect", b"").lower() != b"100-continue":
            remaining = int(fields.get(b"content-length", b"0") or 0) - len(body)
            while remaining > 0:
                chunk = client.recv(min(remaining, 65536))
                if not chunk:
                    break
                remaining -= len(chunk)
        body_503 = b"" if header.startswith(b"HEAD ") else _BODY_503
        client.sendall(
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\n"
            + f"Content-Length: {len(body_503)}\r\n".encode()
            + b"Connection: close\r\n\r\n"
            + body_503
        )
        client.shutdown(socket.SHUT_WR)
    except OSError:
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
