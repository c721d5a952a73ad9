"""S3 (``s3://bucket/prefix``) through obstore, the Python binding of Rust's ``object_store``.

Why not s3fs: a checkpoint is hundreds of small objects, and s3fs (aiobotocore) spends ~2.4 ms
of Python CPU on each request, all on one event-loop thread. Measured on a loopback SeaweedFS
cluster on 2 cores: 180 small PUTs from 8 threads took s3fs 0.55-0.7 s wall and 0.43 s of CPU,
obstore 0.14-0.19 s wall and 0.06 s of CPU (180 GETs: 0.45 s against 0.10 s). obstore's calls
block the calling thread without the GIL, so the engine's I/O pool drives them directly.

Options are s3fs's, so existing ``storage_options`` keep working: ``endpoint_url`` (or
``client_kwargs['endpoint_url']``), ``key``, ``secret``, ``token``, ``anon``,
``client_kwargs['region_name']``, ``config_kwargs`` (``connect_timeout``, ``read_timeout``,
``timeout``, ``s3.addressing_style``; ``retries`` is ignored), and s3fs's cache switches
(ignored: nothing is cached here). Anything else is refused by name. What is not given comes
from the usual ``AWS_*`` environment variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``...).

Every request is bounded and tried once by the client: a connect timeout (5 s), a read timeout
(10 s without a byte while waiting for or reading a response: also an endpoint that accepts
connections and never answers) and an overall bound per request (900 s). The only retries are
``RetryingStorage``'s (6 attempts, jittered backoff of at most ~2.3 s in all). So an operation
against an endpoint that does not answer fails within ~62 s (a StorageUnansweredError: a save
then fails within about that too, its best-effort failure writes tried once each), a refused
connection within ~3 s, as a StorageError naming the URL, the key and the cause, never a hang.

A missing bucket is not a missing object: every operation that meets ``NoSuchBucket`` raises a
StorageError saying which bucket does not exist at which endpoint, so that a listing is not
mistaken for "nothing committed". A 403 is a PermissionError, a 301 (a bucket in another
region than the one configured: obstore does not follow it) an error that says to set the
region, a failed TLS handshake (a certificate this host does not trust, a plain-http endpoint
given as https://) an error that says which; none is retried.

Objects of at least ``MULTIPART_MIN_BYTES`` go up as a multipart upload of ``PART_BYTES`` parts,
sent concurrently (``PART_CONCURRENCY``). obstore aborts one whose part failed; one begun by a
request whose answer was lost is aborted once a retry of its write succeeds; one whose abort
failed too (an outage) or whose process was killed is aborted when ``delete_tree`` deletes its
folder (a step's, by retention).

obstore runs its requests on a tokio runtime, which does not survive ``fork()``: a process
forked after its parent made S3 requests would hang on its first request. Such a process gets
a StorageError saying so instead (use the ``spawn`` or ``forkserver`` start method).
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import re
import threading
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from ..errors import StorageAccessError, StorageError
from ._base import (
    Late,
    byte_views,
    exists_error,
    look_then_write,
    scatter,
    warn_no_atomic_create,
)

T = TypeVar("T")
log = logging.getLogger("antifragile.engine.storage")

CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 10.0
REQUEST_TIMEOUT_S = 900.0
PART_BYTES = 8 * 2**20  # S3's minimum part is 5 MiB
MULTIPART_MIN_BYTES = 2 * PART_BYTES
PART_CONCURRENCY = 10

# s3fs options that only steer s3fs's own caches: nothing to do here
_IGNORED = {"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths",
            "asynchronous", "loop", "default_cache_type", "default_block_size"}
_OPTIONS = {"endpoint_url", "key", "secret", "token", "anon", "client_kwargs", "config_kwargs"}
_CLIENT_KWARGS = {"endpoint_url", "region_name"}
_CONFIG_KWARGS = {"connect_timeout", "read_timeout", "timeout", "retries", "s3"}

_used_in_pid: int | None = None  # the process that made this module's first request
# what a request header cannot hold: the client's signer panicked on it (see _check_headers)
_NOT_IN_HEADERS = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def _refuse(where: str, names: set[str], known: set[str]) -> None:
    if names:
        raise ValueError(f"unsupported {where} {', '.join(sorted(names))} "
                         f"(supported: {', '.join(sorted(known))})")


def _env_endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT")


def _check_endpoint(endpoint: str, source: str) -> None:
    """A ValueError naming ``source`` unless ``endpoint`` is an http(s) URL with a host and a
    numeric port, if any: obstore's signer panics on one without a scheme (a BaseException
    that no caller catches) and builds no request from another scheme."""
    url = urllib.parse.urlsplit(endpoint)
    try:
        url.port  # noqa: B018 - raises ValueError for a port that is not a number
        valid = url.scheme in ("http", "https") and bool(url.hostname)
    except ValueError:
        valid = False
    if not valid:
        raise ValueError(f"{source} {endpoint!r} is not an endpoint URL (give http://host:port "
                         "or https://host)")


def _check_headers(kwargs: dict[str, Any]) -> None:
    """A ValueError naming the option or variable (never its value: a secret) whose value
    goes into every request's headers (the key and region in the signature, the token) and
    holds a control character, often a trailing newline (a key read from a file, a mounted
    secret): obstore's signer panicked on it at the first request (a BaseException that no
    caller catches, with a Rust backtrace)."""
    env = os.environ
    # AWS_DEFAULT_REGION only where AWS_REGION is not set (the client does not use it then)
    regions = [v for v in ("AWS_REGION", "AWS_DEFAULT_REGION") if v in env][:1]
    fields = [("client_kwargs['region_name']", "region", regions)]
    if not kwargs.get("skip_signature"):
        fields += [("key", "access_key_id", ["AWS_ACCESS_KEY_ID"]),
                   ("token", "session_token", ["AWS_SESSION_TOKEN", "AWS_TOKEN"])]
    for name, field, variables in fields:
        given = ([(name, kwargs[field])] if field in kwargs
                 else [(v, env[v]) for v in variables if v in env])
        for source, value in given:
            if _NOT_IN_HEADERS.search(value):
                raise ValueError(f"{source} holds a control character (a trailing newline?), "
                                 "which no request header can carry")


def store_config(storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """obstore ``S3Store`` keyword arguments from s3fs-style options (see the module docstring);
    a ValueError names an option it does not know."""
    options = _mapping(storage_options, "storage_options")
    _refuse("storage option", set(options) - _OPTIONS - _IGNORED, _OPTIONS)
    client = _mapping(options.get("client_kwargs"), "client_kwargs")
    _refuse("client_kwargs key", set(client) - _CLIENT_KWARGS, _CLIENT_KWARGS)
    config = _mapping(options.get("config_kwargs"), "config_kwargs")
    _refuse("config_kwargs key", set(config) - _CONFIG_KWARGS, _CONFIG_KWARGS)
    style = _mapping(config.get("s3"), "config_kwargs['s3']").get("addressing_style")

    kwargs: dict[str, Any] = {}
    endpoint = options.get("endpoint_url") or client.get("endpoint_url")
    if endpoint:
        kwargs["endpoint"] = str(endpoint)
        _check_endpoint(kwargs["endpoint"], "endpoint_url")
    elif _env_endpoint():
        _check_endpoint(str(_env_endpoint()), "AWS_ENDPOINT_URL")
    for ours, theirs in (("key", "access_key_id"), ("secret", "secret_access_key"),
                         ("token", "session_token")):
        if options.get(ours):
            kwargs[theirs] = _text(options[ours], ours)
    if options.get("anon") not in (None, True, False):
        raise ValueError(f"anon must be True or False, not a {type(options['anon']).__name__}")
    if options.get("anon"):
        kwargs["skip_signature"] = True
    if client.get("region_name"):
        kwargs["region"] = _text(client["region_name"], "client_kwargs['region_name']")
    if style == "virtual":
        kwargs["virtual_hosted_style_request"] = True
    _check_headers(kwargs)
    endpoint = endpoint or _env_endpoint()
    kwargs["client_options"] = {
        "allow_http": str(endpoint or "").startswith("http://"),
        **{name: _seconds(config.get(name), default, name) for name, default in (
            ("connect_timeout", CONNECT_TIMEOUT_S), ("read_timeout", READ_TIMEOUT_S),
            ("timeout", REQUEST_TIMEOUT_S))},
    }
    zero = datetime.timedelta(0)
    kwargs["retry_config"] = {"max_retries": 0, "retry_timeout": zero,
                              "backoff": {"init_backoff": zero, "max_backoff": zero, "base": 2}}
    return kwargs


def _mapping(value: Any, name: str) -> dict[str, Any]:
    if value is not None and not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a mapping, not a {type(value).__name__}")
    return dict(value or {})


def _text(value: Any, name: str) -> str:
    """``value``, a string; a ValueError naming ``name`` (never the value: a secret) if not."""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, not a {type(value).__name__}")
    return value


def _seconds(value: Any, default: float, name: str) -> datetime.timedelta:
    try:
        seconds = float(default if value is None else value)
    except (TypeError, ValueError):
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise ValueError(f"config_kwargs[{name!r}] must be a positive number of seconds, "
                         f"not {value!r}")
    return datetime.timedelta(seconds=seconds)


def _brief(exc: BaseException) -> str:
    """obstore's message on one line, without its multi-line debug dump but with the cause
    found in it (a timeout, a refused connection, a host name that does not resolve, a failed
    TLS handshake: each reads as "error sending request")."""
    full = str(exc)
    text = re.sub(r"\s+", " ", full.split("Debug source", 1)[0]).strip()[:400]
    if "TimedOut" in full or "kind: Timeout" in full:
        return f"{text} (timed out)"
    tls = _tls_failure(full)
    if tls:
        return f"{text} ({tls})"
    if "ConnectionRefused" in full:
        return f"{text} (connection refused)"
    dns = re.search(r'ConnectError\(\s*"dns error",.*?error: "([^"]*)"', full, re.DOTALL)
    if dns:
        return f"{text} (the endpoint's host name did not resolve: {dns.group(1)})"
    return text


def _tls_failure(text: str) -> str | None:
    """What failed in a TLS handshake that no retry can change, from obstore's debug dump
    (rustls's error names), or None."""
    cert = re.search(r"InvalidCertificate\(\s*(?:\w+\(\s*)*(\w+)", text)
    if cert:
        return (f"the endpoint's TLS certificate was not accepted: {cert.group(1)}; is it "
                "signed by a CA this host trusts, for this host name?")
    if "InvalidContentType" in text:
        return "the endpoint did not answer in TLS: is it http://, not https://?"
    return None


class S3Storage:
    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        from obstore.exceptions import BaseError
        from obstore.store import S3Store

        _, _, root = url.partition("://")
        self.url = url.rstrip("/")
        # split before stripping: in s3:///name, "name" is a prefix, not the bucket
        self.bucket, _, prefix = root.partition("/")
        if not self.bucket:
            raise ValueError(f"{url} names no bucket")
        prefix = self.prefix = prefix.strip("/")
        kwargs = self._config = store_config(storage_options)
        self.endpoint = kwargs.get("endpoint") or _env_endpoint() or "the default endpoint"
        self._bucket_seen = False  # a request answered: a HEAD's 404 is then a missing object
        self._admin: Any = None
        self._admin_lock = threading.Lock()
        self._unanswered_uploads: set[str] = set()  # keys: see ``write``
        self._unanswered_lock = threading.Lock()
        # None until the first ``create``; then whether the server takes conditional PUTs
        self.conditional_puts: bool | None = None
        try:
            self.store = S3Store(self.bucket, prefix=prefix or None, **kwargs)
        except BaseError as exc:  # options obstore refuses (half a credential): user input
            raise ValueError(_brief(exc)) from None

    def _call(self, op: str, key: str, fn: Callable[[], T]) -> T:
        """Run one obstore call, its errors in the kinds RetryingStorage sorts: FileNotFoundError
        (no such object), PermissionError (403), ValueError (a bad path, a request the server
        refuses as such: see ``_refused``; a request the client cannot make, where it panics),
        StorageError (no such bucket, a forked process), TimeoutError (no answer in time:
        retried), OSError (anything else, a 409 too: retried)."""
        global _used_in_pid
        if _used_in_pid is None:
            _used_in_pid = os.getpid()
        elif _used_in_pid != os.getpid():
            raise StorageError(
                f"{op} {self.url}/{key}: this process was forked after its parent made S3 "
                "requests; obstore's runtime does not survive fork (start it with the 'spawn' "
                "or 'forkserver' method)")
        from obstore.exceptions import (
            AlreadyExistsError,
            BaseError,
            GenericError,
            PermissionDeniedError,
            UnauthenticatedError,
        )

        try:
            result = fn()
        except (FileNotFoundError, GenericError) as exc:
            text = _brief(exc)
            if "169.254.169.254" in text:  # asked the instance metadata service: none given
                text += (" (no S3 credentials were found: pass storage_options key and secret, "
                         "or set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY; without them the "
                         "client asks this host's instance metadata service)")
            if "NoSuchBucket" in text:
                raise StorageAccessError(f"{op} {self.url}/{key}: bucket {self.bucket!r} does "
                                         f"not exist at {self.endpoint} (NoSuchBucket)") from exc
            if isinstance(exc, FileNotFoundError):
                raise FileNotFoundError(f"{self.url}/{key}: no such object") from exc
            if " 403 " in text:
                raise PermissionError(text) from exc
            if " 301 " in text:  # AWS answers a request sent to the wrong region so
                raise ValueError(f"{text} (the bucket is in another region: set "
                                 "client_kwargs['region_name'] or AWS_REGION)") from exc
            if " 416 " in text:
                raise _RangeNotSatisfiable(text) from exc
            if _refused(str(exc)) or _tls_failure(str(exc)):  # whole: the brief text may be
                raise ValueError(text) from exc  # cut before the code
            if text.endswith("(timed out)"):  # no answer: retried, then StorageUnansweredError
                raise TimeoutError(text) from exc
            raise OSError(text) from exc
        except (PermissionDeniedError, UnauthenticatedError) as exc:
            raise PermissionError(_brief(exc)) from exc
        except AlreadyExistsError as exc:  # a 409: no request here is conditional, so S3's
            raise OSError(_brief(exc)) from exc  # OperationAborted ("try again"): transient
        except BaseError as exc:  # a bad path, an unsupported operation: retrying cannot help
            raise ValueError(_brief(exc)) from exc
        except BaseException as exc:  # pyo3's PanicException: the client could not make the
            if type(exc).__name__ != "PanicException":  # request (an invalid URI); a panic
                raise  # is a BaseException, which nothing above this layer catches
            raise ValueError(f"the S3 client could not make the request ({_brief(exc)}): "
                             f"check the bucket name {self.bucket!r} and the endpoint "
                             f"{self.endpoint!r}") from None
        self._bucket_seen = True
        return result

    def write(self, key: str, parts: Sequence[Any], *, durable: bool = False,
              late: Late | None = None) -> None:
        import obstore

        if late is not None:  # an object is written once, whole
            late()
        data = b"".join(memoryview(p).cast("B") for p in parts)
        multipart = len(data) >= MULTIPART_MIN_BYTES
        try:
            self._call("write", key, lambda: obstore.put(
                self.store, key, data, use_multipart=multipart, chunk_size=PART_BYTES,
                max_concurrency=PART_CONCURRENCY))
        except Exception as exc:
            # the request that begins an upload failed: the storage may have begun one whose
            # id never came back (its answer lost); the retry begins another
            if multipart and any("?uploads" in str(e) for e in (exc, exc.__cause__)):
                with self._unanswered_lock:
                    self._unanswered_uploads.add(key)
            raise
        with self._unanswered_lock:
            unanswered = key in self._unanswered_uploads
            self._unanswered_uploads.discard(key)
        if unanswered:  # aborted once the endpoint answers again
            self._abort_uploads(key, exact=True)

    def create(self, key: str, parts: Sequence[Any]) -> None:
        """One conditional PUT (``If-None-Match: *``, never multipart): S3 writes the object
        only if ``key`` holds none and answers 412 otherwise (ObjectExistsError here). A 409
        (a conditional write of the key in flight beside this one) is retried like other
        409s: the next try meets the object that won. ``RetryingStorage.create`` tells a
        first try that landed, answer lost, from another writer's object. A server that does
        not implement conditional writes (501 NotImplemented) gets a look-up then a plain PUT
        from then on, said once in a warning: two creates racing there may both succeed. A
        server that ignores the header (not refusing it) overwrites, and nothing here can
        tell."""
        import obstore
        from obstore.exceptions import AlreadyExistsError, NotSupportedError, PreconditionError

        data = b"".join(memoryview(p).cast("B") for p in parts)
        if self.conditional_puts is not False:

            def put() -> None:
                try:
                    obstore.put(self.store, key, data, mode="create", use_multipart=False)
                except (AlreadyExistsError, PreconditionError) as exc:
                    if " 409 " in _brief(exc):
                        raise  # ``_call``: a transient 409, retried
                    raise exists_error(self, key) from None
                except (NotSupportedError, NotImplementedError) as exc:
                    raise _NoConditionalPut(_brief(exc)) from exc
                except Exception as exc:
                    if _NOT_IMPLEMENTED.search(str(exc)):
                        raise _NoConditionalPut(_brief(exc)) from exc
                    raise

            try:
                self._call("write", key, put)
                self.conditional_puts = True
                return
            except _NoConditionalPut as exc:
                with self._unanswered_lock:
                    if self.conditional_puts is None:
                        warn_no_atomic_create(self.url, "the S3 server refuses conditional "
                                              "PUTs", exc)
                    self.conditional_puts = False
        look_then_write(self, key, [data])

    def _get(self, key: str, start: int, end: int | None) -> memoryview:
        """The bytes of ``key`` from ``start`` to ``end`` (or its end): one GET; empty past the
        end of the object."""
        import obstore

        if end is not None and end <= start:
            return memoryview(b"")
        try:
            if end is not None:
                return memoryview(self._call("read", key, lambda: obstore.get_range(
                    self.store, key, start=start, end=end)))
            options: Any = {"range": {"offset": start}} if start else None
            return memoryview(self._call("read", key, lambda: obstore.get(
                self.store, key, options=options).bytes()))
        except _RangeNotSatisfiable:
            return memoryview(b"")

    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes | bytearray:
        return bytes(self._get(key, start, end))

    def read_into(self, key: str, start: int, buffers: Sequence[Any]) -> int:
        """Scatter one ranged GET into ``buffers`` (one copy, out of obstore's buffer)."""
        views = byte_views(buffers)
        return scatter(self._get(key, start, start + sum(map(len, views))), views)

    def size(self, key: str) -> int:
        """One HEAD. Its 404 has no body to tell a missing bucket from a missing object: until
        a request of this storage was answered, a GET (whose 404 says which) asks again."""
        import obstore

        try:
            return int(self._call("size", key, lambda: obstore.head(self.store, key))["size"])
        except FileNotFoundError:
            if self._bucket_seen:
                raise
        try:
            return int(self._call("size", key, lambda: obstore.get(self.store, key).meta["size"]))
        except FileNotFoundError:
            self._bucket_seen = True  # the GET's 404 said NoSuchKey
            raise

    def exists(self, key: str) -> bool:
        """One HEAD (see ``size``)."""
        try:
            self.size(key)
        except FileNotFoundError:
            return False
        return True

    def list_dir(self, prefix: str) -> list[str]:
        import obstore

        prefix = prefix.strip("/")
        found = self._call("list", prefix, lambda: obstore.list_with_delimiter(
            self.store, prefix or None))
        names = [*found["common_prefixes"], *(o["path"] for o in found["objects"])]
        # SeaweedFS lists a folder that ``delete_tree`` left empty (it removes them lazily)
        # as an object named as the folder itself: what is inside ``prefix`` is all that counts
        return sorted({n.rsplit("/", 1)[-1] for n in (n.rstrip("/") for n in names)
                       if n and n != prefix})

    def delete(self, key: str) -> None:
        import obstore

        self._call("delete", key, lambda: obstore.delete(self.store, key))

    def delete_tree(self, prefix: str) -> bool:
        """A listing, then S3's batched delete of what it found; then the multipart uploads
        in progress under ``prefix`` are aborted (see ``_abort_uploads``)."""
        import obstore

        prefix = prefix.strip("/")
        paths = self._call("delete", prefix, lambda: [
            o["path"] for batch in obstore.list(self.store, prefix) for o in batch])
        if paths:
            self._call("delete", prefix, lambda: obstore.delete(self.store, paths))
        aborted = self._abort_uploads(prefix)
        with self._unanswered_lock:  # a failed save's keys: their uploads went with it
            self._unanswered_uploads = {k for k in self._unanswered_uploads
                                        if not k.startswith(f"{prefix}/")}
        return aborted > 0 or bool(paths)

    def _abort_uploads(self, prefix: str, *, exact: bool = False) -> int:
        """Abort the multipart uploads in progress under the folder ``prefix`` (``exact``: of
        the object ``prefix``); how many.

        Listings and reads never show such an upload, but S3 keeps (and bills) its parts
        until it is completed or aborted. obstore aborts an upload whose part failed, but in
        an outage that abort fails too, and a process killed mid-upload aborts nothing: such
        uploads go when their step's folder is deleted. Best effort (a failure is logged):
        obstore cannot make these requests, so they go through botocore (s3fs's client, in
        the same ``s3`` extra), which a store's IAM policy may also deny.

        A multipart write whose request to begin the upload failed aborts its object's uploads
        (``exact``) once it succeeds: obstore aborts an upload whose part failed, but cannot
        abort one whose id it never received (the answer to the request that began it lost)."""
        folder = "/".join(p for p in (self.prefix, prefix) if p) + ("" if exact else "/")
        try:
            client = self._admin_client()
            found = [(u["Key"], u["UploadId"])
                     for page in client.get_paginator("list_multipart_uploads").paginate(
                         Bucket=self.bucket, Prefix=folder)
                     for u in page.get("Uploads", []) if not exact or u["Key"] == folder]
            for key, upload_id in found:
                client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
        except Exception as exc:  # best effort: it never fails the delete or the write
            what = "of it" if exact else "under it"
            log.warning("%s %s/%s: could not abort the multipart uploads %s: %s: %s",
                        "write" if exact else "delete", self.url, prefix, what,
                        type(exc).__name__, exc)
            return 0
        return len(found)

    def _admin_client(self) -> Any:
        """A botocore client with the store's endpoint, credentials, region, addressing style
        and timeouts, which, like the store, does not retry; made on first use."""
        with self._admin_lock:
            if self._admin is None:
                import botocore
                import botocore.config
                import botocore.session

                c = self._config
                timeouts = c["client_options"]
                config = botocore.config.Config(
                    connect_timeout=timeouts["connect_timeout"].total_seconds(),
                    read_timeout=timeouts["read_timeout"].total_seconds(),
                    retries={"total_max_attempts": 1},
                    s3={"addressing_style": "virtual" if c.get("virtual_hosted_style_request")
                        else "path"},
                    signature_version=botocore.UNSIGNED if c.get("skip_signature") else None)
                self._admin = botocore.session.get_session().create_client(
                    "s3", endpoint_url=c.get("endpoint") or _env_endpoint(),
                    region_name=(c.get("region") or os.environ.get("AWS_REGION")
                                 or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"),
                    aws_access_key_id=c.get("access_key_id"),
                    aws_secret_access_key=c.get("secret_access_key"),
                    aws_session_token=c.get("session_token"), config=config)
            return self._admin

    def sync(self) -> None:
        return None


# Answers that asking again cannot change: a malformed request or bad bucket name (400), a
# method, a missing length, a body too large (405, 411, 413, 414), an unsupported operation
# (501). Not a 400 RequestTimeout (the body came too slowly) or IncompleteBody (it was cut):
# those, throttling (429, 503 SlowDown), other 5xx and 409 are retried.
_REFUSED = re.compile(r"status code: (400|405|411|413|414|501) ")
_TRANSIENT_400 = ("<Code>RequestTimeout</Code>", "<Code>IncompleteBody</Code>")


def _refused(text: str) -> bool:
    return bool(_REFUSED.search(text)) and not any(code in text for code in _TRANSIENT_400)


# a conditional PUT the server does not implement (rather than a malformed request)
_NOT_IMPLEMENTED = re.compile(r"status code: 501 |<Code>NotImplemented</Code>")


class _NoConditionalPut(Exception):
    """The server answered a conditional PUT "not implemented": ``create`` falls back."""


class _RangeNotSatisfiable(OSError):
    """A 416: a read that starts at or past the end of the object (or any range of an empty
    object)."""
