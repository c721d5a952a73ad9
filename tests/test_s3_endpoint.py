"""Bad S3 input is a one-line error, within a bounded time, never a hang: an endpoint that does
not answer (or refuses connections), a missing bucket, refused credentials, a prefix that already
holds someone else's checkpoints; for ``chaos run`` and ``chaos ckpt`` (exit 2)."""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from click.testing import CliRunner

from antifragile.chaos.cli import main
from antifragile.chaos.infra import s3
from antifragile.chaos.infra.s3 import CHECK_BOUND_S, S3SetupError, check_bucket
from antifragile.chaos.scenario import load_scenario


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """A port that accepts connections (the kernel does) and never answers."""
    with socket.create_server(("127.0.0.1", 0), backlog=64) as listener:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


@pytest.fixture
def closed_endpoint() -> str:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens there any more


def _timed(fn: Any) -> tuple[Exception, float]:
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:
        return exc, time.monotonic() - start
    raise AssertionError("no error")


OPTIONS = {"key": "testing", "secret": "testing"}


def test_an_endpoint_that_does_not_answer(silent_endpoint: str) -> None:
    exc, seconds = _timed(lambda: check_bucket("s3://bucket/p", silent_endpoint, OPTIONS))
    assert isinstance(exc, S3SetupError) and seconds < CHECK_BOUND_S
    assert str(exc).startswith(f"s3://bucket/p: cannot use {silent_endpoint}: the endpoint does "
                               "not answer"), exc


def test_an_endpoint_that_refuses_connections(closed_endpoint: str) -> None:
    exc, seconds = _timed(lambda: check_bucket("s3://bucket/p", closed_endpoint, OPTIONS))
    assert isinstance(exc, S3SetupError) and seconds < CHECK_BOUND_S
    assert f"cannot use {closed_endpoint}: the endpoint cannot be reached" in str(exc)


@pytest.mark.s3
def test_a_url_without_a_bucket() -> None:
    """was botocore's ParamValidationError with its two bucket-name regexes"""
    with pytest.raises(S3SetupError, match=r"^s3://: no bucket in the URL \(give "
                       r"s3://bucket/prefix\)$"):
        check_bucket("s3://", "http://127.0.0.1:1", OPTIONS)


def test_a_missing_bucket(s3_server: dict[str, Any]) -> None:
    with pytest.raises(S3SetupError, match=r"^s3://no-such-bucket-x/p: bucket 'no-such-bucket-x' "
                       r"does not exist at http://127\.0\.0\.1:\d+$"):
        check_bucket("s3://no-such-bucket-x/p", s3_server["endpoint_url"], OPTIONS)


@pytest.mark.s3
def test_refused_credentials(s3_bucket: tuple[str, dict[str, Any]]) -> None:
    url, options = s3_bucket
    check_bucket(url, options=options)
    with pytest.raises(S3SetupError, match=r"the endpoint refused the credentials \(access key "
                       r"'testing': .*"):
        check_bucket(url, options={**options, "secret": "wrong"})
    with pytest.raises(S3SetupError, match=r"refused the credentials \(access key 'nobody'"):
        check_bucket(url, options={**options, "key": "nobody"})


# -- chaos run: exit 2 before anything starts --------------------------------------------------


def _scenario(tmp_path: Path, url: str, storage_options: dict[str, str] | None = None) -> Path:
    path = tmp_path / "s.yaml"
    checkpoint: dict[str, Any] = {"url": url, "every_steps": 4}
    if storage_options:
        checkpoint["storage_options"] = storage_options
    path.write_text(yaml.safe_dump({
        "name": "bad-s3", "trainer": {"parallel": {"dp": 2}, "steps": 8},
        "checkpoint": checkpoint, "expect": {"bitwise_equal_to_reference": False}}))
    return path


def _chaos(args: list[str]) -> tuple[int, str, float]:
    start = time.monotonic()
    result = CliRunner().invoke(main, args)
    return result.exit_code, result.output, time.monotonic() - start


def _run(tmp_path: Path, url: str) -> tuple[int, str, float]:
    path = _scenario(tmp_path, url)
    return _chaos(["run", str(path), "--out", str(tmp_path / "out"), "--no-reference"])


def test_chaos_run_with_an_endpoint_that_does_not_answer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, silent_endpoint: str) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", silent_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "a")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "b")
    code, output, seconds = _run(tmp_path, "s3://bucket/run")
    assert code == 2 and seconds < CHECK_BOUND_S + 5, (code, seconds, output)
    assert output.strip().splitlines() == [
        f"error: {tmp_path / 's.yaml'}: checkpoint.url s3://bucket/run: cannot use "
        f"{silent_endpoint}: " + output.split(f"{silent_endpoint}: ", 1)[1].strip()]
    assert "the endpoint does not answer" in output
    assert not (tmp_path / "out" / "run").exists(), "nothing was launched"


@pytest.mark.parametrize("command", ["run", "ckpt"])
def test_an_endpoint_that_is_not_a_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       command: str) -> None:
    """botocore refuses it with a ValueError when the client is made: that was a traceback
    (exit 1) for ``chaos run`` (AWS_ENDPOINT_URL) and ``chaos ckpt`` (--endpoint-url)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "a")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "b")
    if command == "run":
        monkeypatch.setenv("AWS_ENDPOINT_URL", "not-a-url")
        code, output, _ = _run(tmp_path, "s3://bucket/run")
        prefix = f"error: {tmp_path / 's.yaml'}: checkpoint.url s3://bucket/run: "
        says = "Invalid endpoint: "
    else:  # the option is checked (and named) before botocore sees it
        code, output, _ = _chaos(["ckpt", "ls", "s3://bucket/p", "--endpoint-url", "http://"])
        prefix, says = "error: --endpoint-url http://: ", "not an endpoint URL"
    assert code == 2, output
    assert output.strip().splitlines() == [output.strip()], output
    assert output.startswith(prefix) and says in output, output


@pytest.mark.s3
@pytest.mark.parametrize("case", ["missing bucket", "wrong secret", "used prefix"])
def test_chaos_run_refuses_bad_s3_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        s3_bucket: tuple[str, dict[str, Any]],
                                        case: str) -> None:
    url, options = s3_bucket
    monkeypatch.setenv("AWS_ENDPOINT_URL", options["endpoint_url"])
    bucket, _ = s3.split_url(url)
    expected = {
        "missing bucket": "bucket 'no-such-bucket-y' does not exist at",
        "wrong secret": "the endpoint refused the credentials (access key 'testing'",
        "used prefix": "already holds step_000000004; the trainer would resume from it",
    }[case]
    if case == "missing bucket":
        url = "s3://no-such-bucket-y/run"
    elif case == "wrong secret":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    else:  # someone else's run left its checkpoints there
        s3._client(options["endpoint_url"], options).put_object(
            Bucket=bucket, Key="ckpt/step_000000004/COMMIT", Body=b"{}")
    code, output, seconds = _run(tmp_path, url)
    assert code == 2 and expected in output and seconds < CHECK_BOUND_S, output
    assert output.startswith(f"error: {tmp_path / 's.yaml'}: checkpoint.url {url}")


@pytest.mark.s3
def test_a_scenarios_storage_options_name_the_endpoint_and_credentials(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        s3_bucket: tuple[str, dict[str, Any]]) -> None:
    """``checkpoint.storage_options`` reach S3 without AWS_* variables (no local cluster is
    started), for chaos's own checks and the trainer's environment; wrong credentials there
    are the same one-line error as in the environment."""
    url, options = s3_bucket
    for var in (*s3.ENDPOINT_VARS, "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var, raising=False)
    given = {"endpoint_url": options["endpoint_url"], "key": options["key"],
             "secret": options["secret"]}
    scenario = load_scenario(_scenario(tmp_path, url, given))
    with s3.run_storage(scenario, tmp_path / "out", progress=lambda line: None) as storage:
        assert storage.cluster is None and storage.endpoint == options["endpoint_url"]
        assert storage.trainer_env["AWS_ENDPOINT_URL"] == options["endpoint_url"]
        assert storage.trainer_env["AWS_SECRET_ACCESS_KEY"] == options["secret"]
    assert "AWS_ENDPOINT_URL" not in os.environ  # only for the run
    path = _scenario(tmp_path, url, {**given, "secret": "wrong"})
    code, output, _ = _chaos(["run", str(path), "--out", str(tmp_path / "out2"),
                              "--no-reference"])
    assert code == 2 and "the endpoint refused the credentials (access key" in output, output


# -- chaos ckpt --------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["s3", "s3a"])
def test_chaos_ckpt_with_an_endpoint_that_does_not_answer(
        silent_endpoint: str, monkeypatch: pytest.MonkeyPatch, scheme: str) -> None:
    """One line within the quick set-up check's bound. ``s3a://`` is S3 to the engine, but the
    check was made for ``s3://`` alone: an ``s3a://`` root took the engine's patient retrying
    (a minute a request) and printed every retry."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "a")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "b")
    url = f"{scheme}://bucket/p"
    code, output, seconds = _chaos(["ckpt", "ls", url, "--endpoint-url", silent_endpoint])
    assert code == 2 and seconds < CHECK_BOUND_S + 5, (code, seconds, output)
    assert output.startswith(f"error: {url}: cannot use {silent_endpoint}: the endpoint does "
                             "not answer"), output


@pytest.mark.s3
@pytest.mark.parametrize("command", ["ls", "verify"])
def test_chaos_ckpt_refuses_a_missing_bucket_and_bad_credentials(
        s3_server: dict[str, Any], command: str) -> None:
    endpoint = s3_server["endpoint_url"]
    missing = f"s3://missing-{uuid.uuid4().hex[:8]}/p"
    code, output, _ = _chaos(["ckpt", command, missing, "--endpoint-url", endpoint])
    assert code == 2 and "does not exist at" in output, output
    code, output, _ = _chaos(["ckpt", command, missing, "--endpoint-url", endpoint,
                              "--storage-option", "key=testing",
                              "--storage-option", "secret=wrong"])
    assert code == 2 and "refused the credentials (access key 'testing'" in output, output


@pytest.mark.parametrize("given", ["key", "secret", "profile"])
def test_chaos_ckpt_with_credentials_that_cannot_make_a_client(
        given: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An access key without its secret (or a secret without its key), and an AWS_PROFILE
    that is not configured, were botocore's PartialCredentialsError and ProfileNotFound,
    raised as the set-up check made its client: a traceback (exit 1), not a one-line error.
    (With the other half in the environment, it is taken from there, as the engine does.)"""
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var, raising=False)
    options = []
    if given == "profile":
        monkeypatch.setenv("AWS_PROFILE", "no-such-profile")
        monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    else:
        options = ["--storage-option", f"{given}=x"]
    code, output, _ = _chaos(["ckpt", "ls", "s3://bucket/p", "--endpoint-url",
                              "http://127.0.0.1:1", *options])
    assert code == 2, output
    assert output.strip().splitlines() == [output.strip()], output
    assert output.startswith("error: s3://bucket/p: "), output
    assert ("config profile (no-such-profile) could not be found" if given == "profile"
            else "the access key and secret key go together") in output, output


def test_chaos_ckpt_checks_the_bucket_signed_as_the_engine_signs(
        closed_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine takes ``anon`` (unsigned requests: a public bucket) and ``token`` (temporary
    credentials); the set-up check before it took neither, so ``--storage-option anon=true``
    without credentials was refused as "no credentials", and a session's key and secret were
    sent without their token (refused by the server as bad credentials)."""
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    code, output, _ = _chaos(["ckpt", "ls", "s3://bucket/p", "--endpoint-url", closed_endpoint,
                              "--storage-option", "anon=true"])
    assert code == 2 and "the endpoint cannot be reached" in output, output

    sent: list[dict[str, str]] = []

    class Empty:  # the body of the answer the hook gives instead of the endpoint's
        def stream(self, **kwargs: Any) -> Iterator[bytes]:
            yield b""

    def capture(request: Any, **kwargs: Any) -> Any:
        from botocore.awsrequest import AWSResponse

        sent.append(dict(request.headers))
        return AWSResponse(request.url, 200, {}, Empty())

    for options in ({"anon": True}, {"key": "k", "secret": "s", "token": "session-t"}):
        client = s3._client(closed_endpoint, options)
        client.meta.events.register("before-send.s3.HeadBucket", capture)
        client.head_bucket(Bucket="bucket")
    assert "Authorization" not in sent[0], sent[0]
    assert sent[1].get("X-Amz-Security-Token") in ("session-t", b"session-t"), sent[1]


@pytest.mark.s3
@pytest.mark.parametrize("given", ["key", "secret"])
def test_chaos_ckpt_takes_the_other_half_of_a_credential_from_the_environment(
        s3_bucket: tuple[str, dict[str, Any]], given: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--storage-option secret=...`` with the access key in AWS_ACCESS_KEY_ID (or the key
    given, the secret in the environment) is what the engine signs with; the set-up check
    before it made its client of the given half alone and refused it as "partial
    credentials", so the checkpoints the engine wrote that way could not be listed."""
    from antifragile.engine import CheckpointEngine

    url, options = s3_bucket
    other = {"key": "AWS_SECRET_ACCESS_KEY", "secret": "AWS_ACCESS_KEY_ID"}[given]
    monkeypatch.setenv(other, options["key" if given == "secret" else "secret"])
    monkeypatch.delenv({"key": "AWS_ACCESS_KEY_ID", "secret": "AWS_SECRET_ACCESS_KEY"}[given])
    half = {"endpoint_url": options["endpoint_url"], given: options[given]}
    with CheckpointEngine(url, storage_options=half) as engine:
        engine.save(3, {"w": torch.ones(2)}, blocking=True)
    code, output, _ = _chaos(["ckpt", "ls", url, "--endpoint-url", options["endpoint_url"],
                              "--storage-option", f"{given}={options[given]}"])
    assert code == 0 and output.split("\n")[1].split()[0] == "3", output
    monkeypatch.setenv(other, "wrong")  # the half from the environment is the one checked
    code, output, _ = _chaos(["ckpt", "ls", url, "--endpoint-url", options["endpoint_url"],
                              "--storage-option", f"{given}={options[given]}"])
    assert code == 2 and "refused the credentials" in output, output
