"""Record what the storage saw: an HTTP proxy in front of the S3 server that logs every
mutating request with its key, body digest, issue time and acknowledgement time.

Unlike :class:`chaos.infra.proxy.FaultProxy` (which pumps bytes), this proxy parses HTTP/1.1:
it reads a whole request (head and body: ``Content-Length``, ``chunked``; ``Expect:
100-continue`` is answered here, and the ``Expect`` header is not part of a SigV4 signature),
forwards it on a connection of its own, reads the whole answer and passes it back. A request is
*issued* once its head has reached the proxy (the server cannot apply it before the proxy
forwards it; timing from the first byte instead would date a request on a kept-alive
connection from the end of the one before) and *acknowledged* once its whole answer has come
back from the server, just before it is handed to the client: the server applied it somewhere
inside that interval, which is all the crash model needs (``enumerate.py``), and a request
the client sends once it has the answer is issued after it (dated after handing the answer
back, a proxy thread that ran late dated it after such a request: the two overlapped, and the
model built states the client's order rules out). ``latency_s`` holds each request back before it is
forwarded, as a real object store's latency would, so that concurrent requests overlap.

Mutations (one :class:`Mutation` per key changed): ``PUT`` (object, or ``COPY`` with
``x-amz-copy-source``), ``DELETE``, ``POST ?delete`` (one mutation per key: S3's multi-object
delete is not atomic; a key its answer lists under ``<Error>`` is not one), ``POST ?uploads`` /
``PUT ?partNumber`` / ``POST ?uploadId`` (multipart: the object appears, with its parts
concatenated, when the completion is applied; ``DELETE ?uploadId``, an abort, changes no object
and is not one). Requests the server refused (not 2xx) change nothing and are not recorded as
mutations, nor are those answered 2xx with an ``<Error>`` body (a completion or a copy that
failed after S3 had sent its 200).
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import select
import socket
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse
from xml.etree import ElementTree

from antifragile.chaos.infra.proxy import accept

_HEAD_LIMIT = 64 * 1024
#: how long ``start`` and ``stop`` wait for the threads still serving requests
NOTE_WAIT_S = 10.0
#: an answer whose body is an ``<Error>`` document: S3 answers a multipart completion and a copy
#: 200 before it has done them (keeping the connection alive with spaces), so one that failed
#: says so only in its body, and changed nothing
_LATE_ERROR = re.compile(rb"\s*(<\?xml[^>]*\?>)?\s*<Error[\s>]")


@dataclass(slots=True)
class Mutation:
    """One change the storage may have applied. ``key`` is relative to the recorded root;
    ``digest`` is the sha256 of the object's bytes after the change (None: deleted, or a
    multipart create/part that makes nothing visible). ``source``: a COPY's source key."""

    index: int
    kind: str
    key: str
    issued_s: float
    acked_s: float
    digest: str | None = None
    size: int = 0
    source: str | None = None
    status: int = 200

    @property
    def visible(self) -> bool:
        """Whether applying it changes what a reader of the bucket sees."""
        return self.kind in ("put", "copy", "delete", "multipart_complete")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class Recording:
    """The mutations of one save (times relative to the save's start), and the bodies of
    every object written (by digest), so any state can be rebuilt."""

    mutations: list[Mutation] = field(default_factory=list)
    bodies: dict[str, bytes] = field(default_factory=dict)
    requests: int = 0  # every request the proxy saw (reads and listings included)


class RecordingIncomplete(RuntimeError):
    """``stop()`` found requests still unanswered: what they change is not in the recording."""


class RecordingProxy:
    """Listens on 127.0.0.1 (a free port), forwards to ``upstream``; records the mutations of
    keys under ``bucket/root`` between ``start()`` and ``stop()``. Thread-safe."""

    def __init__(self, upstream_url: str, *, bucket: str, root: str,
                 latency_s: float = 0.0) -> None:
        url = urlparse(upstream_url)
        if url.scheme != "http" or not url.hostname:
            raise ValueError(f"the recording proxy needs a plain http:// endpoint, "
                             f"not {upstream_url}")
        self.upstream = (url.hostname, url.port or 80)
        self.bucket, self.root = bucket, root.strip("/")
        self.latency_s = latency_s
        self._lock = threading.Lock()
        # requests read but not yet noted: a client may have its answer (and call stop())
        # before the thread that served it has noted it
        self._serving = 0
        self._noted = threading.Condition(self._lock)
        self._recording: Recording | None = None
        self._t0 = 0.0
        self._uploads: dict[str, dict[int, bytes]] = {}  # upload id -> part number -> body
        # writes forwarded whole whose answer never came back (the storage hung up, or the
        # socket timed out): the storage may have applied them, the recording cannot say
        self._unanswered: list[str] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._closed = threading.Event()
        threading.Thread(target=self._accept_loop, name="recording-proxy", daemon=True).start()

    @property
    def endpoint_url(self) -> str:
        host, port = self._listener.getsockname()[:2]
        return f"http://{host}:{port}"

    def start(self) -> None:
        """Record from now on; requests answered before this call are not in the recording
        (waits, up to ``NOTE_WAIT_S``, for the threads still noting them)."""
        with self._lock:
            self._noted.wait_for(lambda: self._serving == 0, timeout=NOTE_WAIT_S)
            self._recording = Recording()
            self._unanswered = []
            self._t0 = time.monotonic()

    def stop(self) -> Recording:
        """The recording; every request answered before this call is in it (waits, up to
        ``NOTE_WAIT_S``, for the threads still serving requests). Raises RecordingIncomplete
        when some are still unanswered then: the storage may yet apply them (a client that
        gave up on one), and no crash state would hold what they change."""
        with self._lock:
            settled = self._noted.wait_for(lambda: self._serving == 0, timeout=NOTE_WAIT_S)
            recording, self._recording = self._recording, None
            unanswered = self._serving
            lost = self._unanswered
        if recording is None:
            raise RuntimeError("stop() without start()")
        if not settled:
            raise RecordingIncomplete(
                f"{unanswered} request(s) still unanswered by the storage {NOTE_WAIT_S:g} s "
                "after the save ended: the recording would miss what they change")
        if lost:
            raise RecordingIncomplete(
                f"{len(lost)} write(s) got no answer from the storage (it closed the "
                f"connection or timed out), so they may or may not have been applied: "
                f"{', '.join(lost[:3])}{' ...' if len(lost) > 3 else ''}")
        recording.mutations.sort(key=lambda m: (m.issued_s, m.acked_s, m.key))
        for i, m in enumerate(recording.mutations):
            m.index = i
        return recording

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()

    def __enter__(self) -> RecordingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- serving ------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while (client := accept(self._listener, self._closed, "recording proxy")) is not None:
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream: list[socket.socket] = []  # one connection, opened at the first request
        reader = _Reader(client)
        try:
            while True:
                head = reader.head()
                if head is None:
                    return
                issued = time.monotonic()  # storage cannot apply it before it is forwarded
                with self._lock:
                    self._serving += 1
                try:
                    if not self._forward(client, reader, head, issued, upstream):
                        return
                finally:
                    with self._lock:
                        self._serving -= 1
                        self._noted.notify_all()
        except (OSError, ValueError, IndexError):
            return
        finally:
            for sock in (client, *upstream):
                with contextlib.suppress(OSError):
                    sock.close()

    def _forward(self, client: socket.socket, reader: _Reader, head: bytes, issued: float,
                 upstream: list[socket.socket]) -> bool:
        """Forward one request upstream and its answer back, then note it; False when the
        connection ends after it."""
        request_line, headers = _parse_head(head)
        method, target = request_line.split(" ")[:2]
        if headers.get("expect", "").lower() == "100-continue":
            client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            head = _drop_header(head, b"expect")
        body, raw = reader.body(headers)
        if self.latency_s:
            time.sleep(self.latency_s)
        if upstream and _dropped(upstream[0]):  # closed while idle: it saw no request
            with contextlib.suppress(OSError):
                upstream.pop().close()
        if not upstream:
            upstream.append(socket.create_connection(self.upstream, timeout=60))
        upstream[0].sendall(head + raw)
        try:
            answer = _Reader(upstream[0])
            response_head = answer.head()
            if response_head is None:
                raise OSError("the upstream closed the connection")
            status_line, response_headers = _parse_head(response_head)
            status = int(status_line.split(" ")[1])
            if method == "HEAD" or status in (204, 304):
                response_body, response_raw = b"", b""
            else:
                response_body, response_raw = answer.body(response_headers, response=True)
        except (OSError, ValueError, IndexError):
            self._no_answer(method, target)
            raise
        acked = time.monotonic()  # before the client has it: see the module docstring
        # noted before the client has the answer: a part's body must be kept before the
        # completion that the answer lets the client send
        self._note(method, target, headers, body, status, response_body, issued, acked)
        client.sendall(response_head + response_raw)
        return response_headers.get("connection", "").lower() != "close"

    def _no_answer(self, method: str, target: str) -> None:
        """A request the storage had whole but never answered: a write of the recorded
        bucket may have been applied, so the recording is incomplete (``stop`` says so)."""
        bucket = unquote(urlparse(target).path).lstrip("/").partition("/")[0]
        if method in ("PUT", "POST", "DELETE") and bucket == self.bucket:
            with self._lock:
                if self._recording is not None:
                    self._unanswered.append(f"{method} {target}")

    # -- what a request changed ---------------------------------------------------------------

    def _note(self, method: str, target: str, headers: dict[str, str], body: bytes, status: int,
              response: bytes, issued: float, acked: float) -> None:
        with self._lock:
            recording, t0 = self._recording, self._t0
            if recording is None:
                return
            recording.requests += 1
        url = urlparse(target)
        query = parse_qs(url.query, keep_blank_values=True)
        bucket, _, key = unquote(url.path).lstrip("/").partition("/")
        if bucket != self.bucket or method not in ("PUT", "POST", "DELETE"):
            return
        if 200 <= status < 300 and _LATE_ERROR.match(response):
            return  # failed after its 200 was sent: see _LATE_ERROR
        ok = 200 <= status < 300
        times = (issued - t0, acked - t0)
        found: list[Mutation] = []
        if method == "POST" and "delete" in query:
            found = [Mutation(0, "delete", k, *times, status=status)
                     for k in _multi_deleted(body, response)]
        elif method == "POST" and "uploads" in query:
            upload = re.search(rb"<UploadId>(.*?)</UploadId>", response)
            if ok and upload:
                with self._lock:
                    self._uploads[upload.group(1).decode()] = {}
            found = [Mutation(0, "multipart_create", key, *times, status=status)]
        elif method == "POST" and "uploadId" in query:
            numbers = [int(n) for n in re.findall(rb"<PartNumber>(\d+)</PartNumber>", body)]
            with self._lock:
                parts = self._uploads.get(query["uploadId"][0], {})
                data = b"".join(parts.get(n, b"") for n in sorted(numbers))
            found = [self._put(recording, "multipart_complete", key, data, times, status)]
        elif method == "PUT" and "uploadId" in query:
            if ok:
                with self._lock:
                    self._uploads.setdefault(query["uploadId"][0], {})[
                        int(query["partNumber"][0])] = body
            found = [Mutation(0, "multipart_part", key, *times, size=len(body), status=status)]
        elif method == "PUT" and "x-amz-copy-source" in headers:
            source = unquote(headers["x-amz-copy-source"]).lstrip("/").partition("/")[2]
            found = [Mutation(0, "copy", key, *times, source=self._relative(source),
                              status=status)]
        elif method == "PUT" and key:
            found = [self._put(recording, "put", key, body, times, status)]
        elif method == "DELETE" and "uploadId" in query:  # an abort: the key is untouched
            with self._lock:
                self._uploads.pop(query["uploadId"][0], None)
        elif method == "DELETE" and key:
            found = [Mutation(0, "delete", key, *times, status=status)]
        kept = [m for m in found if 200 <= m.status < 300 and m.key.startswith(f"{self.root}/")]
        for m in kept:
            m.key = self._relative(m.key)
        with self._lock:
            recording.mutations.extend(kept)

    def _put(self, recording: Recording, kind: str, key: str, data: bytes,
             times: tuple[float, float], status: int) -> Mutation:
        digest = hashlib.sha256(data).hexdigest()
        with self._lock:
            recording.bodies.setdefault(digest, data)
        return Mutation(0, kind, key, *times, digest=digest, size=len(data), status=status)

    def _relative(self, key: str) -> str:
        return key.removeprefix(f"{self.root}/")


def _multi_deleted(request: bytes, response: bytes) -> list[str]:
    """The keys a multi-object delete deleted: those of its request less those its (2xx)
    answer lists under ``<Error>``. S3 answers such a delete 200 whatever became of each key,
    and a quiet one lists only the failures; an answer that is no XML lists none. Parsed as
    XML, not matched: a key's text may hold any entity or character reference."""
    try:
        keys = [k.text or "" for k in
                ElementTree.fromstring(request).iterfind("{*}Object/{*}Key")]
    except ElementTree.ParseError:
        return []  # the server cannot have understood it either
    try:
        failed = {k.text or "" for k in
                  ElementTree.fromstring(response).iterfind("{*}Error/{*}Key")}
    except ElementTree.ParseError:
        failed = set()
    return [k for k in keys if k not in failed]


def _dropped(sock: socket.socket) -> bool:
    """Whether a kept-alive connection was closed (or broke) by the peer while idle: readable
    with nothing to read. A request sent on it would fail unseen by the storage, which is no
    request without an answer; a new connection is opened instead."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and not sock.recv(1, socket.MSG_PEEK)
    except OSError:
        return True


def _parse_head(head: bytes) -> tuple[str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return lines[0], headers


def _drop_header(head: bytes, name: bytes) -> bytes:
    lines = head.split(b"\r\n")
    return b"\r\n".join(line for line in lines
                        if line.split(b":", 1)[0].strip().lower() != name)


class _Reader:
    """Buffered reads of HTTP messages from one socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def _more(self) -> bool:
        chunk = self.sock.recv(1 << 20)
        self.buffer += chunk
        return bool(chunk)

    def head(self) -> bytes | None:
        """The head (with its blank line), or None if the peer closed before sending one."""
        while b"\r\n\r\n" not in self.buffer:
            if len(self.buffer) > _HEAD_LIMIT:
                raise ValueError("HTTP head too long")
            if not self._more():
                if self.buffer:
                    raise ValueError("connection closed inside an HTTP head")
                return None
        end = self.buffer.index(b"\r\n\r\n") + 4
        head, self.buffer = self.buffer[:end], self.buffer[end:]
        return head

    def _exactly(self, n: int) -> bytes:
        while len(self.buffer) < n:
            if not self._more():
                raise ValueError("connection closed inside an HTTP body")
        data, self.buffer = self.buffer[:n], self.buffer[n:]
        return data

    def _line(self) -> bytes:
        while b"\r\n" not in self.buffer:
            if not self._more():
                raise ValueError("connection closed inside a chunked body")
        end = self.buffer.index(b"\r\n") + 2
        line, self.buffer = self.buffer[:end], self.buffer[end:]
        return line

    def body(self, headers: dict[str, str], *, response: bool = False) -> tuple[bytes, bytes]:
        """(the decoded body, the raw bytes to forward)."""
        if "chunked" in headers.get("transfer-encoding", "").lower():
            raw, data = b"", b""
            while True:
                line = self._line()
                raw += line
                size = int(line.split(b";")[0].strip(), 16)
                if size == 0:
                    while (trailer := self._line()) != b"\r\n":
                        raw += trailer
                    raw += b"\r\n"
                    return _decode(data, headers), raw
                chunk = self._exactly(size + 2)
                raw += chunk
                data += chunk[:-2]
        if "content-length" in headers:
            raw = self._exactly(int(headers["content-length"]))
            return _decode(raw, headers), raw
        if response:  # no length: the body runs to the end of the connection
            while self._more():
                pass
            raw, self.buffer = self.buffer, b""
            return raw, raw
        return b"", b""


def _decode(data: bytes, headers: dict[str, str]) -> bytes:
    """The payload of an ``aws-chunked`` body (botocore's streaming checksums), else as is."""
    if "aws-chunked" not in headers.get("content-encoding", "").lower():
        return data
    out, rest = b"", data
    while rest:
        line, _, rest = rest.partition(b"\r\n")
        size = int(line.split(b";")[0].strip(), 16)
        if size == 0:
            break
        out, rest = out + rest[:size], rest[size + 2:]
    return out
