"""Bad S3 input at the engine API: a missing bucket, refused credentials and an endpoint that
does not answer are a StorageError (a CheckpointError) naming the URL and the reason, from
``steps()``, ``save()`` and ``load()`` alike, within a bounded time: never a hang, never a
misleading "nothing committed" (issue 12).

The bound: every S3 request the engine makes (through obstore, ``engine/storage/_s3.py``) has a
connect timeout, a read timeout and an overall timeout and is tried once by the client;
``RetryingStorage`` tries an operation ``attempts`` times with backoff. The tests shorten both
to keep the suite fast.
"""

from __future__ import annotations

import contextlib
import re
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from antifragile.engine import CheckpointEngine, CheckpointError, StorageError
from antifragile.engine.storage import RetryingStorage
from antifragile.engine.storage._s3 import (
    CONNECT_TIMEOUT_S,
    READ_TIMEOUT_S,
    S3Storage,
    store_config,
)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def state() -> dict[str, Any]:
    return {"w": torch.arange(8.0), "step": 1}


def _timed(fn: Callable[[], Any]) -> tuple[BaseException, float]:
    start = time.monotonic()
    try:
        fn()
    except BaseException as exc:
        return exc, time.monotonic() - start
    raise AssertionError("no error")


def test_every_request_is_bounded_and_tried_once_by_the_client() -> None:
    """Without options the client gets short timeouts and no retries of its own (the engine
    retries); the caller's config_kwargs win key by key."""
    client = store_config({})["client_options"]
    assert client["connect_timeout"].total_seconds() == CONNECT_TIMEOUT_S <= 5
    assert client["read_timeout"].total_seconds() == READ_TIMEOUT_S <= 10
    assert store_config({})["retry_config"]["max_retries"] == 0
    mine = store_config({"config_kwargs": {"read_timeout": 60, "retries": {"mode": "x"}}})
    assert mine["client_options"]["read_timeout"].total_seconds() == 60
    assert mine["client_options"]["connect_timeout"].total_seconds() == CONNECT_TIMEOUT_S


def test_s3fs_style_options_are_translated() -> None:
    """Storage options written for s3fs keep working: endpoint, credentials, region, anonymous
    access and path style; an http endpoint is allowed as such."""
    got = store_config({"client_kwargs": {"endpoint_url": "http://127.0.0.1:9", "region_name":
                                          "eu-west-1"}, "key": "k", "secret": "s", "token": "t",
                        "anon": True, "skip_instance_cache": True,
                        "config_kwargs": {"s3": {"addressing_style": "virtual"}}})
    assert got["endpoint"] == "http://127.0.0.1:9" and got["region"] == "eu-west-1"
    assert (got["access_key_id"], got["secret_access_key"], got["session_token"]) == (
        "k", "s", "t")
    assert got["skip_signature"] and got["virtual_hosted_style_request"]
    assert got["client_options"]["allow_http"]
    assert not store_config({"endpoint_url": "https://s3.example"})["client_options"][
        "allow_http"]


@pytest.mark.parametrize(("options", "named"), [
    ({"profile": "dev"}, "storage option profile"),
    ({"client_kwargs": {"verify": False}}, "client_kwargs key verify"),
    ({"config_kwargs": {"signature_version": "s3v4"}}, "config_kwargs key signature_version"),
])
def test_an_option_the_client_does_not_know_is_refused_by_name(
        options: dict[str, Any], named: str) -> None:
    with pytest.raises(CheckpointError, match=rf"cannot open s3://bucket/run: unsupported "
                       rf"{named} \(supported: "):
        CheckpointEngine("s3://bucket/run", storage_options=options)


@pytest.mark.parametrize(("options", "named"), [
    ({"config_kwargs": {"s3": "virtual"}}, "config_kwargs['s3'] must be a mapping"),
    ({"client_kwargs": "http://x"}, "client_kwargs must be a mapping"),
    ("endpoint_url", "storage_options must be a mapping"),
    ({"key": 123, "secret": "s"}, "key must be a string"),
    ({"client_kwargs": {"region_name": 7}}, "client_kwargs['region_name'] must be a string"),
    ({"config_kwargs": {"connect_timeout": -1}},
     "config_kwargs['connect_timeout'] must be a positive number of seconds"),
    ({"config_kwargs": {"read_timeout": "soon"}},
     "config_kwargs['read_timeout'] must be a positive number of seconds"),
    ({"config_kwargs": {"timeout": float("nan")}},
     "config_kwargs['timeout'] must be a positive number of seconds"),
    ({"anon": "false"}, "anon must be True or False"),
])
def test_an_option_of_the_wrong_kind_is_refused_by_name(options: Any, named: str) -> None:
    """Each was a TypeError or AttributeError traceback from CheckpointEngine(), a message
    naming no option, or (anon='false') unsigned requests; a value is never echoed (it may
    be a secret)."""
    with pytest.raises(CheckpointError, match=rf"^cannot open s3://bucket/run: "
                       rf"{re.escape(named)}"):
        CheckpointEngine("s3://bucket/run", storage_options=options)


@pytest.mark.parametrize("endpoint", ["127.0.0.1:9000", "localhost:9000/", "ftp://host:9",
                                      "http://", "http://127.0.0.1:port"])
@pytest.mark.parametrize("given_in", ["endpoint_url", "AWS_ENDPOINT_URL"])
def test_an_endpoint_that_is_not_an_http_url_is_refused_naming_it(
        endpoint: str, given_in: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A user mistake: an endpoint without its scheme made obstore's signer panic at the first
    request (a pyo3 PanicException, a BaseException no retry or caller catches)."""
    monkeypatch.delenv("AWS_ENDPOINT", raising=False)
    options: dict[str, Any] = {"key": "k", "secret": "s"}
    if given_in == "endpoint_url":
        options["endpoint_url"] = endpoint
        monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    else:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    try:
        with CheckpointEngine("s3://bucket/run", storage_options=options) as engine:
            engine.steps()
    except CheckpointError as exc:
        assert f"cannot open s3://bucket/run: {given_in}" in str(exc), exc
        assert repr(endpoint) in str(exc) and "http://host:port" in str(exc), exc
    except BaseException as exc:  # the panic (not an Exception) is what this test is about
        pytest.fail(f"{type(exc).__name__}: {exc}")
    else:
        pytest.fail("no error")


@pytest.mark.parametrize(("name", "value"), [
    ("key", "k\n"), ("token", "t\n"), ("client_kwargs['region_name']", "us-east-1\n"),
    ("AWS_ACCESS_KEY_ID", "k\n"), ("AWS_SESSION_TOKEN", "t\r\n"), ("AWS_REGION", "eu-west-1\n"),
    ("AWS_DEFAULT_REGION", "eu\tw\x7f"),
])
def test_a_credential_or_region_with_a_control_character_is_refused_naming_it(
        name: str, value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A user mistake, often a trailing newline (a key read from a file, a mounted secret):
    these go into request headers, and obstore's signer panicked at the first request (a
    pyo3 PanicException with a Rust backtrace, a BaseException no retry or caller catches)
    instead of naming what was wrong. Now the root is refused naming the option or variable,
    never its value."""
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_TOKEN",
                "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    options: dict[str, Any] = {"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s"}
    if name.startswith("AWS_"):
        monkeypatch.setenv(name, value)
        if name == "AWS_ACCESS_KEY_ID":
            del options["key"]
    elif name.startswith("client_kwargs"):
        options["client_kwargs"] = {"region_name": value}
    else:
        options[name] = value
    try:
        with CheckpointEngine("s3://bucket/run", storage_options=options) as engine:
            engine.steps()
    except CheckpointError as exc:
        assert str(exc).startswith(f"cannot open s3://bucket/run: {name} holds a control "
                                   "character"), exc
        assert repr(value) not in str(exc), exc
    except BaseException as exc:  # the panic (not an Exception) is what this test is about
        pytest.fail(f"{type(exc).__name__}: {exc}")
    else:
        pytest.fail("no error")


def test_a_region_variable_the_client_does_not_use_is_not_checked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """AWS_DEFAULT_REGION is used only where AWS_REGION is not set: a bad one beside a good
    AWS_REGION harms nothing and refuses nothing."""
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu\n")
    store_config({"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s"})


@pytest.mark.parametrize(("url", "endpoint", "named"), [
    ("s3://my bucket/run", "http://127.0.0.1:9", "'my bucket'"),
    ("s3://bucket\n/run", "http://127.0.0.1:9", "'bucket\\n'"),
    ("s3://bucket/run", "http://127.0.0.1:9\n", "'http://127.0.0.1:9\\n'"),
])
def test_a_request_the_client_cannot_make_is_a_storage_error_not_a_panic(
        url: str, endpoint: str, named: str) -> None:
    """A bucket name no URL can hold (a space, a newline) or an endpoint with a trailing
    newline (``urlsplit`` drops it, so the endpoint check passed it) made obstore panic at the
    first request: a pyo3 PanicException, a BaseException that escaped ``steps()`` and killed
    the engine's listing thread. Now a StorageError naming the operation, the bucket and the
    endpoint, not retried (the same request fails the same way)."""
    storage = RetryingStorage(S3Storage(url, {"endpoint_url": endpoint, "key": "k",
                                              "secret": "s"}), base_delay_s=0.01)
    for call in (lambda: storage.list_dir(""), lambda: storage.write("k", [b"x"]),
                 lambda: storage.exists("k")):
        try:
            call()
        except StorageError as exc:
            assert "failed" not in str(exc) and named in str(exc), exc
        except BaseException as exc:  # the panic (not an Exception) is what this test is about
            pytest.fail(f"{type(exc).__name__}: {exc}")
        else:
            pytest.fail("no error")


@pytest.mark.parametrize(("given", "missing"), [
    ({"key": "k"}, "SecretAccessKey"), ({"secret": "s"}, "AccessKeyId"),
    ({"AWS_ACCESS_KEY_ID": "k"}, "SecretAccessKey"),
])
def test_half_a_credential_is_refused_when_the_root_is_opened(
        given: dict[str, str], missing: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A user mistake caught by obstore when the client is made: it was its GenericError, out
    of CheckpointEngine() as a traceback, not the CheckpointError open_storage promises."""
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    options = {"endpoint_url": "http://127.0.0.1:9"}
    for name, value in given.items():
        if name.startswith("AWS_"):
            monkeypatch.setenv(name, value)
        else:
            options[name] = value
    with pytest.raises(CheckpointError, match=rf"^cannot open s3://bucket/run: .*Missing "
                       rf"{missing}"):
        CheckpointEngine("s3://bucket/run", storage_options=options)


@pytest.mark.s3
def test_a_missing_bucket_is_a_storage_error(s3_server: dict[str, Any]) -> None:
    url = "s3://no-such-bucket-engine/run"
    with CheckpointEngine(url, storage_options=s3_server) as engine:
        for call in (engine.steps, lambda: engine.load(state()),
                     lambda: engine.load(state(), step=1),
                     lambda: engine.save(1, state(), blocking=True)):
            with pytest.raises(StorageError, match=r"s3://no-such-bucket-engine/run.*bucket "
                               r"'no-such-bucket-engine' does not exist"):
                call()


@pytest.mark.s3
@pytest.mark.parametrize("scheme", ["s3", "s3a"])
def test_a_url_whose_bucket_is_empty_is_refused_not_read_as_its_prefix(
        s3_bucket: tuple[str, dict[str, Any]], scheme: str) -> None:
    """``s3:///name`` (a bucket variable left empty before a joined prefix) names no bucket, as
    chaos and the trainer say; the engine took ``name`` for the bucket and saved into it, at
    its top level: a job whose prefix happened to be another bucket's name wrote into it."""
    import boto3

    url, options = s3_bucket
    bucket = url.removeprefix("s3://").split("/", 1)[0]
    empty = f"{scheme}:///{bucket}"
    with pytest.raises(CheckpointError, match=rf"^cannot open {re.escape(empty)}: "
                       r"s3a?:///\S+ names no bucket"), \
            CheckpointEngine(empty, storage_options=options) as engine:
        engine.save(1, state(), blocking=True)
    client = boto3.client("s3", endpoint_url=options["endpoint_url"], region_name="us-east-1",
                          aws_access_key_id=options["key"],
                          aws_secret_access_key=options["secret"])
    assert client.list_objects_v2(Bucket=bucket).get("KeyCount") == 0


@pytest.mark.s3
def test_a_lookup_in_a_missing_bucket_is_not_a_missing_object(
        s3_server: dict[str, Any], s3_bucket: tuple[str, dict[str, Any]]) -> None:
    """``exists`` and ``size`` are one HEAD, whose 404 has no body to say NoSuchBucket: a
    missing bucket read as "no COMMIT there" (a step not committed, a crash fault that found
    nothing to do) instead of the StorageError every other operation raises."""
    from antifragile.engine.storage import open_storage

    storage = open_storage("s3://no-such-bucket-lookup/run", s3_server)
    for call in (lambda: storage.exists("step_000000001/COMMIT"),
                 lambda: storage.size("step_000000001/COMMIT")):
        with pytest.raises(StorageError, match=r"bucket 'no-such-bucket-lookup' does not exist"):
            call()
    url, options = s3_bucket  # in a bucket that exists: what is not there is not there
    storage = open_storage(url, options)
    assert not storage.exists("step_000000001/COMMIT")
    with pytest.raises(FileNotFoundError):
        storage.size("step_000000001/COMMIT")
    storage.write("k", [b"abc"])
    assert storage.exists("k") and storage.size("k") == 3


@pytest.mark.s3
def test_refused_credentials_are_a_storage_error(s3_bucket: tuple[str, dict[str, Any]]) -> None:
    url, options = s3_bucket
    with CheckpointEngine(url, storage_options=options) as engine:
        engine.save(1, state(), blocking=True)
    bad = {**options, "secret": "wrong"}
    with CheckpointEngine(url, storage_options=bad) as engine:
        for call in (engine.steps, lambda: engine.load(state()),
                     lambda: engine.load(state(), step=1),
                     lambda: engine.save(2, state(), blocking=True)):
            with pytest.raises(StorageError, match=rf"{url}.*PermissionError"):
                call()


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """A port that accepts connections (the kernel does) and never answers."""
    with socket.create_server(("127.0.0.1", 0), backlog=64) as listener:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


def test_an_endpoint_that_does_not_answer_fails_within_the_bound(silent_endpoint: str) -> None:
    options = {"endpoint_url": silent_endpoint, "key": "k", "secret": "s",
               "config_kwargs": {"connect_timeout": 1, "read_timeout": 1}}
    with CheckpointEngine("s3://bucket/run", storage_options=options) as engine:
        assert isinstance(engine.storage, RetryingStorage)
        assert isinstance(engine.storage.inner, S3Storage)
        engine.storage.attempts = 2
        engine.storage.base_delay_s = 0.01
        # one operation: attempts x (connect + read timeout), plus backoff; a failed save
        # also tries (best effort) its error record and the ABORT note's look-up, once each
        # (the storage did not answer: see the next test)
        op_s = 2 * (1 + 1) + 0.5
        for call, bound_s in ((engine.steps, op_s + 2), (lambda: engine.load(state()), op_s + 2),
                              (lambda: engine.save(1, state(), blocking=True), op_s + 4)):
            exc, seconds = _timed(call)
            assert isinstance(exc, StorageError), repr(exc)
            assert isinstance(exc, CheckpointError)
            assert "s3://bucket/run" in str(exc) and "failed 2 times" in str(exc), exc
            assert "timeout" in str(exc).lower() or "timed out" in str(exc).lower(), exc
            assert seconds < bound_s, (seconds, exc)


def test_a_save_against_an_endpoint_that_does_not_answer_fails_within_one_bound(
        silent_endpoint: str) -> None:
    """A save's first request (the COMMIT look-up) spends its retries on a storage that does
    not answer; its failure record and the ABORT note (best effort) then spent the whole
    retry budget each as well: a save failed after three bounds (~185 s with the defaults)
    where ``steps()`` and ``load()`` fail after one. Once a request of the save has gone
    unanswered through its retries, the best-effort writes of that failed save get one try."""
    read_timeout_s, attempts = 1, 5
    options = {"endpoint_url": silent_endpoint, "key": "k", "secret": "s",
               "config_kwargs": {"connect_timeout": 1, "read_timeout": read_timeout_s}}
    with CheckpointEngine("s3://bucket/run", storage_options=options) as engine:
        assert isinstance(engine.storage, RetryingStorage)
        engine.storage.attempts = attempts
        engine.storage.base_delay_s = 0.01
        exc, seconds = _timed(lambda: engine.save(1, state(), blocking=True))
    assert isinstance(exc, StorageError), repr(exc)
    assert str(exc).startswith("step 1, rank 0: exists s3://bucket/run/step_000000001/COMMIT "
                               f"failed {attempts} times, the storage did not answer: "), exc
    assert "timed out" in str(exc), exc
    # one request's retries (each try waits out the read timeout), then one try each for the
    # failure record and the ABORT note's look-up; before, 3 x 5 s
    bound_s = attempts * read_timeout_s + 2 * read_timeout_s + 2.5
    assert seconds < bound_s, (seconds, exc)


def test_a_save_against_an_endpoint_that_answers_errors_retries_its_failure_writes() -> None:
    """The one-try of a failed save's best-effort writes is for a storage that did not
    answer: one that answers (here 503 to everything) gets every try, for the failure
    record and the ABORT note's look-up as for the request that failed the save."""
    with _answering(503, "SlowDown") as (endpoint, requests):
        options = {"endpoint_url": endpoint, "key": "k", "secret": "s"}
        with CheckpointEngine("s3://bucket/run", storage_options=options) as engine:
            assert isinstance(engine.storage, RetryingStorage)
            engine.storage.attempts = 2
            engine.storage.base_delay_s = 0.01
            requests.clear()
            with pytest.raises(StorageError, match=r"^step 1, rank 0: exists s3://bucket/run/"
                               r"step_000000001/COMMIT failed 2 times: OSError: .*503"):
                engine.save(1, state(), blocking=True)
            # the COMMIT look-up, the failure record's PUT, the ABORT's look-up: 2 tries each
            # (the GETs: the engine's listing of the step folders as it starts)
            saved = [r for r in requests if r != "GET"]
            assert saved == ["HEAD", "HEAD", "PUT", "PUT", "HEAD", "HEAD"], requests


@pytest.mark.parametrize(("answer", "raised", "says"), [
    ("403 Forbidden: <Code>AccessDenied</Code>", PermissionError, "403 Forbidden"),
    ("301 Moved Permanently: <Code>PermanentRedirect</Code>", ValueError,
     "set client_kwargs['region_name'] or AWS_REGION"),
    ("503 Service Unavailable: <Code>SlowDown</Code>", OSError, "503"),
])
def test_server_answers_become_the_errors_the_retry_layer_sorts(
        answer: str, raised: type[BaseException], says: str) -> None:
    """A 403 and a wrong region are not retried (PermissionError, ValueError); a 503 is."""
    from obstore.exceptions import GenericError

    storage = S3Storage("s3://bucket/run", {"endpoint_url": "http://127.0.0.1:9"})

    def answers() -> None:
        raise GenericError(f"Generic S3 error: Server returned non-2xx status code: {answer}")

    with pytest.raises(raised, match=re.escape(says)) as caught:
        storage._call("read", "k", answers)
    assert type(caught.value) is raised  # a 503 is a plain OSError: transient, retried


@pytest.fixture
def conflict_endpoint() -> Iterator[str]:
    """An S3 endpoint that answers every request 409 OperationAborted ("a conflicting
    operation is in progress against this resource: try again")."""
    with _answering(409, "OperationAborted") as (endpoint, _):
        yield endpoint


def test_a_conflict_answer_is_retried_not_taken_for_permanent(conflict_endpoint: str) -> None:
    """The engine makes no conditional request, so a 409 is S3's OperationAborted (or
    ConditionalRequestConflict): transient. obstore raises it as "already exists", which was
    sorted with the bad paths (a ValueError: never retried), failing the save at once."""
    storage = RetryingStorage(S3Storage("s3://bucket/run", {
        "endpoint_url": conflict_endpoint, "key": "k", "secret": "s"}), attempts=2,
        base_delay_s=0.01)
    for call in (lambda: storage.write("k", [b"x"]), lambda: storage.read("k"),
                 lambda: storage.exists("k"), lambda: storage.delete("k")):
        with pytest.raises(StorageError, match=r"failed 2 times: OSError: .*409"):
            call()


@contextlib.contextmanager
def _answering(status: int, code: str) -> Iterator[tuple[str, list[str]]]:
    """An S3 endpoint that answers every request ``status`` with the error ``code``; yields
    its URL and the requests it got."""
    import http.server
    import threading

    requests: list[str] = []

    class Answer(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def answer(self) -> None:
            requests.append(self.command)
            self.rfile.read(int(self.headers.get("content-length") or 0))
            body = f"<Error><Code>{code}</Code><Message>no</Message></Error>".encode()
            self.send_response(status)
            self.send_header("content-length", str(0 if self.command == "HEAD" else len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = answer

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", requests
    finally:
        server.shutdown()
        server.server_close()


def test_an_endpoint_without_credentials_says_none_were_found() -> None:
    """With an endpoint and no key, secret or AWS_* variables (the README's snippet as a new
    user copies it), the client asks the instance metadata service for credentials, and the
    error named only a PUT to 169.254.169.254 refused 403: nothing said none were given."""
    from obstore.exceptions import GenericError

    storage = S3Storage("s3://bucket/run", {"endpoint_url": "http://127.0.0.1:9"})

    def metadata_refused() -> None:
        raise GenericError("Generic S3 error: Error performing PUT http://169.254.169.254/"
                           "latest/api/token in 2ms - Server returned non-2xx status code: "
                           "403 Forbidden")

    with pytest.raises(PermissionError, match=r"169\.254\.169\.254.*no S3 credentials were "
                                              r"found: pass storage_options key and secret"):
        storage._call("exists", "k", metadata_refused)


@pytest.mark.parametrize(("status", "code"), [
    (400, "InvalidBucketName"), (400, "InvalidRequest"), (400, "InvalidArgument"),
    (405, "MethodNotAllowed"), (411, "MissingContentLength"), (413, "EntityTooLarge"),
    (501, "NotImplemented"),
])
def test_a_request_the_server_refuses_fails_at_once(status: int, code: str) -> None:
    """A 400 (a bad bucket name, a request S3 will never accept), a 405, 411, 413 or 501 is the
    same answer however often it is asked: it was a plain OSError, retried 6 times (~2.3 s)."""
    with _answering(status, code) as (endpoint, requests):
        storage = RetryingStorage(S3Storage("s3://bucket/run", {
            "endpoint_url": endpoint, "key": "k", "secret": "s"}), attempts=6, base_delay_s=0.05)
        for op, call in (("write", lambda: storage.write("k", [b"x"])),
                         ("read", lambda: storage.read("k")),
                         ("exists", lambda: storage.exists("k")),
                         ("list", lambda: storage.list_dir("a"))):
            requests.clear()
            with pytest.raises(StorageError, match=rf"^{op} s3://bucket/run/\w+: ValueError: "
                               rf".*{status}") as caught:
                call()
            assert "failed" not in str(caught.value)
            assert len(requests) == 1, (op, requests)


@pytest.mark.parametrize(("status", "code"), [(400, "RequestTimeout"), (429, "SlowDown"),
                                              (500, "InternalError"), (503, "SlowDown")])
def test_a_timeout_throttling_or_server_error_answer_is_retried(status: int, code: str) -> None:
    """S3 answers a request whose body came too slowly 400 RequestTimeout: transient, as
    throttling and 5xx are."""
    with _answering(status, code) as (endpoint, requests):
        storage = RetryingStorage(S3Storage("s3://bucket/run", {
            "endpoint_url": endpoint, "key": "k", "secret": "s"}), attempts=2, base_delay_s=0.01)
        with pytest.raises(StorageError, match=rf"failed 2 times: OSError: .*{status}"):
            storage.write("k", [b"x"])
        assert len(requests) == 2


@contextlib.contextmanager
def _tls_endpoint(tmp_path: Any) -> Iterator[str]:
    """An https endpoint whose certificate is self-signed (no CA this host trusts signed it);
    its connections end after the handshake."""
    import shutil
    import ssl
    import subprocess
    import threading

    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "basicConstraints=critical,CA:FALSE"],
                   check=True, capture_output=True)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            with contextlib.suppress(OSError), client:
                context.wrap_socket(client, server_side=True).close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"https://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()


@pytest.mark.parametrize("endpoint", ["untrusted", "plain"])
def test_a_tls_failure_names_its_cause_and_is_not_retried(endpoint: str, tmp_path: Any) -> None:
    """An https endpoint whose certificate this host does not trust (a private CA, a
    self-signed one), or a plain-http endpoint given as https://: the error said only "error
    sending request", the cause cut away with the client's debug dump, after 6 tries of what
    no retry can change."""
    with contextlib.ExitStack() as stack:
        if endpoint == "untrusted":
            url = stack.enter_context(_tls_endpoint(tmp_path))
            says = "TLS certificate was not accepted: UnknownIssuer"
        else:
            plain, _ = stack.enter_context(_answering(400, "BadRequest"))
            url = plain.replace("http://", "https://")
            says = "did not answer in TLS"
        storage = RetryingStorage(S3Storage("s3://bucket/run", {
            "endpoint_url": url, "key": "k", "secret": "s"}), attempts=6, base_delay_s=0.05)
        with pytest.raises(StorageError, match=says) as caught:
            storage.read("k")
        assert "failed" not in str(caught.value) and "s3://bucket/run/k" in str(caught.value)


def test_an_endpoint_whose_host_name_does_not_resolve_says_so() -> None:
    """A typo in the endpoint's host name: the error said only "error sending request" (the
    lookup's failure was in the debug dump cut away), as if the endpoint were down."""
    storage = RetryingStorage(S3Storage("s3://bucket/run", {
        "endpoint_url": "http://no-such-host.invalid:9000", "key": "k", "secret": "s"}),
        attempts=2, base_delay_s=0.01)
    with pytest.raises(StorageError, match=r"failed 2 times: .*error sending request "
                                           r"\(the endpoint's host name did not resolve: "):
        storage.read("k")
