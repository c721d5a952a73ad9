"""S3 for ``chaos run``: the endpoint the environment names, or a SeaweedFS cluster started
for the run.

s3fs (through botocore) takes the endpoint and credentials from the environment
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...), and so does every rank of the trainer. With
no endpoint in the environment, the run is a local demo: a SeaweedFS cluster on loopback
(``chaos/infra/seaweedfs.py``: master, volume servers, filer, S3 gateway) lives for the whole
``chaos run``, the bucket is created, and the trainer is told the endpoint through the
environment of its torchrun process. With a ``storage_outage`` fault, the trainer is told the
address of a fault proxy in front of the endpoint instead, so every request it makes crosses
the proxy; the chaos process itself (checker, ``corrupt_shard``) talks to the endpoint directly.
``storage_node_down`` acts on the cluster's volume servers, so it needs the local cluster.
Emulated hosts (``trainer.nodes > 1``) reach the endpoint through a relay on their network's
bridge (``chaos/run/runner.py``), so they need namespaces and a plain ``http://`` endpoint.

Before anything runs, :func:`check_bucket` asks the endpoint once with short timeouts, so a bad
endpoint is a one-line error (exit 2) within :data:`CHECK_BOUND_S` seconds, not a hang: an
endpoint that does not answer, a missing bucket, refused credentials; :func:`prepare` also
refuses a prefix that already holds checkpoints (and :func:`check_local` a local folder that
holds committed ones).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from antifragile.chaos.infra.proxy import FaultProxy
from antifragile.chaos.infra.seaweedfs import SeaweedCluster, SeaweedError
from antifragile.chaos.infra.volume import Volume, checkpoint_volume
from antifragile.chaos.scenario import Scenario

ENDPOINT_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")  # botocore's order of precedence
DEMO_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "antifragile", "AWS_SECRET_ACCESS_KEY": "antifragile",
                    "AWS_DEFAULT_REGION": "us-east-1"}
# One set-up request: connect <= 3 s, answer <= 5 s, 2 attempts (+ botocore's short backoff).
_CONNECT_S, _READ_S, _ATTEMPTS = 3, 5, 2
CHECK_BOUND_S = _ATTEMPTS * max(_CONNECT_S, _READ_S) + 5


class StorageSetupError(Exception):
    """A run's checkpoint storage cannot be used; the message is meant for the user as is."""


class S3SetupError(StorageSetupError):
    """The S3 side of a run cannot be set up; the message is meant for the user as is."""


@dataclass(slots=True)
class S3Endpoint:
    url: str
    env: dict[str, str]  # what an S3 client in a fresh process needs to reach it
    cluster: SeaweedCluster | None = None  # a SeaweedFS cluster this process started (a demo)

    @property
    def local(self) -> bool:
        return self.cluster is not None


@dataclass(slots=True)
class RunStorage:
    """Where a run's checkpoints go, and what the trainer must be told to reach them."""

    url: str
    trainer_env: dict[str, str] = field(default_factory=dict)
    proxy: FaultProxy | None = None
    proxy_unavailable: str | None = None  # why a storage_outage cannot be made here
    endpoint: str | None = None  # the S3 endpoint (not the proxy), for the report
    cluster: SeaweedCluster | None = None  # the local cluster, for storage_node_down
    cluster_unavailable: str | None = None  # why there is none
    volume: Volume | None = None  # a file system of the run's own, for disk_full
    volume_unavailable: str | None = None  # why there is none


def configured_endpoint() -> str | None:
    for var in ENDPOINT_VARS:
        if os.environ.get(var):
            return os.environ[var]
    return None


def is_s3(url: str | None) -> bool:
    return bool(url) and str(url).startswith("s3://")


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` (or ``s3a://``, S3 to the engine too) -> (bucket, prefix)."""
    bucket, _, prefix = url.partition("://")[2].partition("/")
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
def endpoint(given: str | None = None) -> Iterator[S3Endpoint]:
    """``given``, else the configured endpoint, else a SeaweedFS cluster on 127.0.0.1 (free
    ports) until exit."""
    configured = given or configured_endpoint()
    if configured:
        yield S3Endpoint(configured, {})
        return
    cluster = SeaweedCluster(access_key=DEMO_CREDENTIALS["AWS_ACCESS_KEY_ID"],
                             secret_key=DEMO_CREDENTIALS["AWS_SECRET_ACCESS_KEY"])
    try:
        cluster.start()
    except SeaweedError as exc:
        raise S3SetupError(f"no S3 endpoint given (AWS_ENDPOINT_URL) and a local SeaweedFS "
                           f"cluster could not start: {exc}") from None
    try:
        yield S3Endpoint(cluster.endpoint_url, {**DEMO_CREDENTIALS, **cluster.env}, cluster)
    finally:
        cluster.close()


def _client(endpoint_url: str | None = None, options: dict[str, Any] | None = None) -> Any:
    """A botocore S3 client for quick set-up checks: short timeouts, one retry (the engine's
    patient retrying is for checkpoints, not for telling a user the endpoint is down).
    ``options``: s3fs-style ``key``/``secret``/``token`` and ``anon`` (unsigned), as the engine
    takes them; else the standard AWS variables apply. Half a credential (the key, or the
    secret) takes its other half from AWS_SECRET_ACCESS_KEY or AWS_ACCESS_KEY_ID, as the
    engine's client does: botocore took the given half alone and refused it as partial."""
    import botocore.session
    from botocore import UNSIGNED
    from botocore.config import Config

    options = options or {}
    key, secret = options.get("key"), options.get("secret")
    if key and not secret:
        secret = os.environ.get("AWS_SECRET_ACCESS_KEY")
    elif secret and not key:
        key = os.environ.get("AWS_ACCESS_KEY_ID")
    return botocore.session.get_session().create_client(
        "s3", endpoint_url=endpoint_url or options.get("endpoint_url"),
        aws_access_key_id=key, aws_secret_access_key=secret,
        aws_session_token=options.get("token"),
        config=Config(connect_timeout=_CONNECT_S, read_timeout=_READ_S,
                      retries={"total_max_attempts": _ATTEMPTS},
                      signature_version=UNSIGNED if options.get("anon") is True else None))


def _access_key(options: dict[str, Any] | None) -> str | None:
    """The access key a client made with ``options`` signs with (never the secret)."""
    if options and options.get("key"):
        return str(options["key"])
    if options and options.get("secret"):  # see ``_client``
        return os.environ.get("AWS_ACCESS_KEY_ID")
    import botocore.session

    credentials = botocore.session.get_session().get_credentials()
    return credentials.access_key if credentials else None


def _why(exc: Exception, access_key: str | None) -> str:
    """What a failed set-up request means, in words."""
    from botocore.exceptions import (
        ClientError,
        ConnectionClosedError,
        ConnectTimeoutError,
        EndpointConnectionError,
        NoCredentialsError,
        ReadTimeoutError,
    )

    if isinstance(exc, NoCredentialsError):
        return "no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
    if isinstance(exc, ReadTimeoutError | ConnectionClosedError):
        return f"the endpoint does not answer ({exc})"
    if isinstance(exc, EndpointConnectionError | ConnectTimeoutError):
        return f"the endpoint cannot be reached ({exc})"
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch") \
                or status == 403:
            return (f"the endpoint refused the credentials (access key {access_key!r}: "
                    f"{error.get('Message') or code or status})")
    return f"{type(exc).__name__}: {exc}"


def check_bucket(url: str, endpoint_url: str | None = None,
                 options: dict[str, Any] | None = None, *, create: bool = False) -> None:
    """One quick request to the bucket of ``url``: raise S3SetupError naming the URL, the
    endpoint and the reason (no answer, no such bucket, refused credentials) within
    :data:`CHECK_BOUND_S` seconds. ``create``: make the bucket if it is missing."""
    from botocore.exceptions import BotoCoreError, ClientError, PartialCredentialsError

    bucket, _ = split_url(url)
    if not bucket:
        raise S3SetupError(f"{url}: no bucket in the URL (give s3://bucket/prefix)")
    try:
        client = _client(endpoint_url, options)
    except ValueError as exc:  # botocore: "Invalid endpoint: <url>" (given or AWS_ENDPOINT_URL)
        raise S3SetupError(f"{url}: {exc} (give http://host:port or https://host)") from None
    except BotoCoreError as exc:  # a key without its secret, an AWS_PROFILE that is not there
        hint = (" (the access key and secret key go together: give both, or neither)"
                if isinstance(exc, PartialCredentialsError) else "")
        raise S3SetupError(f"{url}: {exc}{hint}") from None
    where = client.meta.endpoint_url
    try:
        try:
            client.head_bucket(Bucket=bucket)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket"):
                raise
            if not create:
                raise S3SetupError(f"{url}: bucket {bucket!r} does not exist at "
                                   f"{where}") from None
            client.create_bucket(Bucket=bucket)
    except (BotoCoreError, ClientError) as exc:
        raise S3SetupError(f"{url}: cannot use {where}: "
                           f"{_why(exc, _access_key(options))}") from None


def prepare(url: str, ep: S3Endpoint) -> None:
    """Make sure ``url`` can take a fresh run: the endpoint answers, the bucket exists
    (created, and its volumes grown, on a local cluster) and the prefix holds no checkpoints,
    which the trainer would otherwise resume from."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        check_bucket(url, ep.url, create=ep.local)
    except S3SetupError as exc:
        raise S3SetupError(f"checkpoint.url {exc}") from None
    bucket, prefix = split_url(url)
    client = _client(ep.url)
    try:
        if ep.cluster is not None:
            ep.cluster.warm(bucket)
        # objects, not common prefixes: SeaweedFS lists an emptied "folder" for minutes
        listing = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/" if prefix else "",
                                         MaxKeys=100)
    except (BotoCoreError, ClientError) as exc:
        raise S3SetupError(f"checkpoint.url {url}: cannot use {ep.url}: "
                           f"{_why(exc, _access_key(None))}") from None
    start = len(prefix) + 1 if prefix else 0
    leftovers = sorted({o["Key"][start:].split("/", 1)[0] for o in listing.get("Contents", [])})
    if leftovers:
        raise S3SetupError(f"checkpoint.url {url} already holds {', '.join(leftovers[:3])}"
                           f"{' ...' if len(leftovers) > 3 else ''}; the trainer would resume "
                           "from it: give the run a fresh prefix")


def check_local(url: str, engine: str) -> None:
    """Refuse a local ``checkpoint.url`` that already holds committed ``engine`` checkpoints
    (an earlier run's): the trainer would resume from them, as from a used S3 prefix."""
    from antifragile.engine import CheckpointError
    from antifragile.trainer.ckpt_backends import committed_steps

    try:
        steps = committed_steps(engine, url)
    except CheckpointError as exc:
        raise StorageSetupError(f"checkpoint.url {url}: {exc}") from None
    if steps:
        shown = ", ".join(str(step) for step in steps[:3]) + (" ..." if len(steps) > 3 else "")
        raise StorageSetupError(
            f"checkpoint.url {url} already holds committed {engine} checkpoints (step"
            f"{'s' if len(steps) > 1 else ''} {shown}); the trainer would resume from them: "
            "give the run a fresh folder, delete this one, or set url: null (a folder in the "
            "run's --out)")


@contextlib.contextmanager
def run_storage(s: Scenario, out: Path, progress: Callable[[str], None] = print
                ) -> Iterator[RunStorage]:
    """The checkpoint storage of one run of ``s``: a folder in ``out`` by default (on a tmpfs
    chaos mounts there for the run when it has a ``disk_full``: ``chaos/infra/volume.py``), or
    S3.

    For S3, this process's environment names the endpoint until exit (the checker and the
    faults read checkpoints directly), and a fault proxy runs if the scenario has a
    ``storage_outage``. The scenario's ``checkpoint.storage_options`` (endpoint, credentials)
    go over the environment's AWS_* variables, for this process and the trainer alike.
    """
    url = s.checkpoint.url
    if not is_s3(url):
        if url:  # a folder chaos does not own: never cleared, so it must hold no run yet
            check_local(url, s.checkpoint.engine)
        sizes = [f.volume_mib for f in s.faults if f.kind == "disk_full"]
        if url or not sizes:
            yield RunStorage(url or str(out / "ckpt"))
            return
        with checkpoint_volume(out / "volume", sizes[0]) as volume:  # one size (validation)
            if isinstance(volume, Volume):
                yield RunStorage(str(volume.path / "ckpt"), volume=volume)
            else:
                yield RunStorage(str(out / "ckpt"), volume_unavailable=volume)
        return
    assert url is not None
    given = s.checkpoint.s3_environment()
    with environ(given), _s3_run_storage(s, url, progress) as storage:
        storage.trainer_env = {**given, **storage.trainer_env}
        yield storage


@contextlib.contextmanager
def _s3_run_storage(s: Scenario, url: str, progress: Callable[[str], None]
                    ) -> Iterator[RunStorage]:
    if s.trainer.nodes > 1:
        from antifragile.chaos.infra.netns import unavailable_reason

        if reason := unavailable_reason():
            raise S3SetupError(f"checkpoint.url {url}: trainer.nodes = {s.trainer.nodes} puts "
                               "the ranks on emulated hosts, which reach S3 only over the "
                               f"emulated network, and network namespaces are unavailable "
                               f"here ({reason}); use trainer.nodes: 1 or a local folder")
        configured = configured_endpoint()
        if configured and not configured.startswith("http://"):
            raise S3SetupError(f"checkpoint.url {url}: emulated hosts (trainer.nodes = "
                               f"{s.trainer.nodes}) reach S3 through a TCP relay on their "
                               f"network, which needs a plain http:// endpoint, not "
                               f"{configured}")
    node_faults = [i for i, f in enumerate(s.faults) if f.kind == "storage_node_down"]
    source = ("checkpoint.storage_options.endpoint_url"
              if "endpoint_url" in (s.checkpoint.storage_options or {}) else "AWS_ENDPOINT_URL")
    if node_faults and configured_endpoint():
        raise S3SetupError(f"faults.{node_faults[0]}.kind: storage_node_down stops a volume "
                           "server of the SeaweedFS cluster chaos starts, but the endpoint "
                           f"{configured_endpoint()} comes from {source}; leave it out")
    with endpoint() as ep, environ(ep.env):
        prepare(url, ep)
        if ep.cluster is not None:
            progress(f"s3: no AWS_ENDPOINT_URL set; started a local SeaweedFS cluster at "
                     f"{ep.url} in {ep.cluster.start_s:.1f} s ({ep.cluster.volumes} volume "
                     "servers; a demo: its data go when the run ends)")
        storage = RunStorage(url, trainer_env=dict(ep.env), endpoint=ep.url,
                             cluster=ep.cluster)
        try:  # the proxy is closed however the run ends, also as it is being set up
            if any(f.kind == "storage_outage" for f in s.faults):
                try:
                    storage.proxy = FaultProxy.in_front_of(ep.url)
                except ValueError as exc:
                    storage.proxy_unavailable = str(exc)
            trainer_endpoint = storage.proxy.endpoint_url if storage.proxy else ep.url
            storage.trainer_env.update({var: trainer_endpoint for var in ENDPOINT_VARS})
            yield storage
        finally:
            if storage.proxy is not None:
                storage.proxy.close()
