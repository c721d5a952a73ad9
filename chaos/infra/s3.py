"""S3 for ``chaos run``: the endpoint the environment names, or a moto server started for the run.

s3fs (through botocore) takes the endpoint and credentials from the environment
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...), and so does every rank of the trainer. With
no endpoint in the environment, the run is a local demo: a moto server on loopback lives for the
whole ``chaos run``, the bucket is created, and the trainer is told the endpoint through the
environment of its torchrun process. With a ``storage_outage`` fault, the trainer is told the
address of a fault proxy in front of the endpoint instead, so every request it makes crosses the
proxy; the chaos process itself (checker, ``corrupt_shard``) talks to the endpoint directly.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from antifragile.chaos.infra.proxy import FaultProxy
from antifragile.chaos.scenario import Scenario
from antifragile.engine.storage import open_storage

ENDPOINT_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")  # botocore's order of precedence
DEMO_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "antifragile", "AWS_SECRET_ACCESS_KEY": "antifragile",
                    "AWS_DEFAULT_REGION": "us-east-1"}


class S3SetupError(Exception):
    """The S3 side of a run cannot be set up; the message is meant for the user as is."""


@dataclass(slots=True)
class S3Endpoint:
    url: str
    env: dict[str, str]  # what an S3 client in a fresh process needs to reach it
    moto: bool  # a moto server this process started (a local demo)


@dataclass(slots=True)
class RunStorage:
    """Where a run's checkpoints go, and what the trainer must be told to reach them."""

    url: str
    trainer_env: dict[str, str] = field(default_factory=dict)
    proxy: FaultProxy | None = None
    proxy_unavailable: str | None = None  # why a storage_outage cannot be made here
    endpoint: str | None = None  # the S3 endpoint (not the proxy), for the report
    moto: bool = False


def configured_endpoint() -> str | None:
    for var in ENDPOINT_VARS:
        if os.environ.get(var):
            return os.environ[var]
    return None


def is_s3(url: str | None) -> bool:
    return bool(url) and str(url).startswith("s3://")


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` -> (bucket, prefix)."""
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    return bucket, prefix.strip("/")


@contextlib.contextmanager
def environ(env: dict[str, str]) -> Iterator[None]:
    """Set ``env`` in this process, restoring what was there on exit."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def endpoint() -> Iterator[S3Endpoint]:
    """The configured endpoint, or a moto server on 127.0.0.1 (a free port) until exit."""
    configured = configured_endpoint()
    if configured:
        yield S3Endpoint(configured, {}, moto=False)
        return
    try:
        from moto.moto_server.threaded_moto_server import ThreadedMotoServer
    except ImportError:
        raise S3SetupError("no AWS_ENDPOINT_URL is set and moto is not installed to start a "
                           "local S3 (pip install 'moto[server]'), so s3:// cannot be "
                           "used") from None
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        url = f"http://{host}:{port}"
        yield S3Endpoint(url, {**DEMO_CREDENTIALS, "AWS_ENDPOINT_URL": url}, moto=True)
    finally:
        server.stop()


def _client() -> Any:
    """A botocore S3 client for quick set-up checks: short timeouts, one retry (the engine's
    patient retrying is for checkpoints, not for telling a user the endpoint is down)."""
    import botocore.session
    from botocore.config import Config

    return botocore.session.get_session().create_client("s3", config=Config(
        connect_timeout=3, read_timeout=10, retries={"total_max_attempts": 2}))


def prepare(url: str, ep: S3Endpoint) -> None:
    """Make sure ``url`` can take a fresh run: the bucket exists (created on a demo server) and
    the prefix holds no checkpoints, which the trainer would otherwise resume from."""
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, prefix = split_url(url)
    client = _client()
    try:
        try:
            client.head_bucket(Bucket=bucket)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket"):
                raise
            if not ep.moto:
                raise S3SetupError(f"checkpoint.url {url}: bucket {bucket!r} does not exist at "
                                   f"{ep.url}") from None
            client.create_bucket(Bucket=bucket)
        listing = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/" if prefix else "",
                                         Delimiter="/", MaxKeys=10)
    except (BotoCoreError, ClientError) as exc:
        raise S3SetupError(f"checkpoint.url {url}: cannot use {ep.url}: {exc}") from None
    leftovers = sorted({p["Prefix"].rstrip("/").rsplit("/", 1)[-1]
                        for p in listing.get("CommonPrefixes", [])}
                       | {o["Key"].rsplit("/", 1)[-1] for o in listing.get("Contents", [])})
    if leftovers:
        raise S3SetupError(f"checkpoint.url {url} already holds {', '.join(leftovers[:3])}"
                           f"{' ...' if len(leftovers) > 3 else ''}; the trainer would resume "
                           "from it: give the run a fresh prefix")


def clear(url: str) -> None:
    """Remove what a demo run stored (moto keeps objects in this process's memory)."""
    with contextlib.suppress(Exception):
        open_storage(url).delete_tree("")


@contextlib.contextmanager
def run_storage(s: Scenario, out: Path, progress: Callable[[str], None] = print
                ) -> Iterator[RunStorage]:
    """The checkpoint storage of one run of ``s``: a folder in ``out`` by default, or S3.

    For S3, this process's environment names the endpoint until exit (the checker and the
    faults read checkpoints directly), and a fault proxy runs if the scenario has a
    ``storage_outage``.
    """
    url = s.checkpoint.url
    if not is_s3(url):
        yield RunStorage(url or str(out / "ckpt"))
        return
    assert url is not None
    with endpoint() as ep, environ(ep.env):
        prepare(url, ep)
        if ep.moto:
            progress(f"s3: no AWS_ENDPOINT_URL set; started a local moto server at {ep.url} "
                     "for this run (a demo: its data go when the run ends)")
        storage = RunStorage(url, trainer_env=dict(ep.env), endpoint=ep.url, moto=ep.moto)
        if any(f.kind == "storage_outage" for f in s.faults):
            try:
                storage.proxy = FaultProxy.in_front_of(ep.url)
            except ValueError as exc:
                storage.proxy_unavailable = str(exc)
        trainer_endpoint = storage.proxy.endpoint_url if storage.proxy else ep.url
        storage.trainer_env.update({var: trainer_endpoint for var in ENDPOINT_VARS})
        try:
            yield storage
        finally:
            if storage.proxy is not None:
                storage.proxy.close()
            if ep.moto:
                clear(url)
