"""One ``chaos crashcheck``: the S3 endpoint and a bucket of its own (deleted at the end on a
user's endpoint), one checker pool, every case, the report document."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from antifragile.chaos.crashcheck.check import CheckerPool
from antifragile.chaos.crashcheck.pipeline import (
    SaveError,
    Settings,
    _s3_client,
    run_case,
    summarize,
)
from antifragile.chaos.infra.s3 import S3SetupError, check_bucket, endpoint


@contextlib.contextmanager
def s3_endpoint(endpoint_url: str | None, progress: Callable[[str], None]
                ) -> Iterator[tuple[str, dict[str, str], bool]]:
    """(endpoint, environment for clients, whether it is a local SeaweedFS cluster started here
    for the run): the one given, ``AWS_ENDPOINT_URL``, or that cluster."""
    with endpoint(endpoint_url) as ep:
        env = {k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                          "AWS_DEFAULT_REGION", "AWS_SESSION_TOKEN")
               if k in os.environ}
        env.update(ep.env)
        env.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        if ep.cluster is not None:
            progress(f"s3: started a local SeaweedFS cluster at {ep.url} in "
                     f"{ep.cluster.start_s:.1f} s")
        yield ep.url, env, ep.local


def crashcheck(settings: Settings, *, endpoint_url: str | None = None,
               progress: Callable[[str], None] = print,
               on_case: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Record, enumerate and check every case of ``settings``; the report document. Raises
    S3SetupError (a one-line reason) when the endpoint cannot be used, CheckerError when the
    checkers cannot start, SaveError (naming the case) when a saving job fails. ``on_case``
    gets the document after each case (a long run that is stopped keeps its finished cases)."""
    began = time.monotonic()
    with s3_endpoint(endpoint_url, progress) as (endpoint, env, local):
        if not endpoint.startswith("http://"):
            raise S3SetupError(f"{endpoint}: the recording proxy needs a plain http:// "
                               "endpoint (it reads every request)")
        bucket = f"crashcheck-{uuid.uuid4().hex[:12]}"
        options = {"endpoint_url": endpoint, "key": env.get("AWS_ACCESS_KEY_ID"),
                   "secret": env.get("AWS_SECRET_ACCESS_KEY")}
        check_bucket(f"s3://{bucket}", endpoint, options, create=True)
        bodies = Path(tempfile.mkdtemp(prefix="crashcheck-bodies-"))
        cases: list[dict[str, Any]] = []
        doc = {"engine": settings.engine, "ranks": settings.ranks,
               "settings": {"cases": list(settings.cases), "max_states": settings.max_states,
                            "max_inflight_exhaustive": settings.max_inflight_exhaustive,
                            "latency_s": settings.latency_s, "checkers": settings.checkers,
                            "seed": settings.seed},
               "endpoint": endpoint, "bucket": bucket, "cases": cases, "wall_s": None}
        try:
            with CheckerPool(engine=settings.engine, bucket=bucket, bodies=bodies,
                             env={**env, "AWS_ENDPOINT_URL": endpoint,
                                  "AWS_ENDPOINT_URL_S3": endpoint},
                             workers=settings.checkers) as pool:
                for name in settings.cases:
                    try:
                        result = run_case(settings, name, endpoint_url=endpoint, env=env,
                                          bucket=bucket, bodies=bodies, pool=pool,
                                          progress=progress)
                    except SaveError as exc:
                        raise SaveError(f"case {name}: {exc}") from exc
                    cases.append(summarize(settings, result))
                    doc["wall_s"] = round(time.monotonic() - began, 1)
                    if on_case is not None:
                        on_case(doc)
        finally:
            shutil.rmtree(bodies, ignore_errors=True)
            if not local:  # a local cluster goes, its buckets with it
                _delete_bucket(endpoint, env, bucket, progress)
    return doc


def _delete_bucket(endpoint: str, env: dict[str, str], bucket: str,
                   progress: Callable[[str], None]) -> None:
    """Empty and delete ``bucket``, which this run made (a fresh random name: nothing else is
    in it): on the user's endpoint it would stay, holding every recorded save and rebuilt
    state, run after run. A failure is said, not raised: the report matters more."""
    from botocore.exceptions import BotoCoreError, ClientError

    client = _s3_client(endpoint, env)
    try:
        for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket):
            for upload in page.get("Uploads", []):
                client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"],
                                              UploadId=upload["UploadId"])
        keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(
            Bucket=bucket) for o in page.get("Contents", [])]
        for i in range(0, len(keys), 1000):  # a multi-object delete takes 1000 keys
            answer = client.delete_objects(Bucket=bucket, Delete={
                "Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True})
            if answer.get("Errors"):
                error = answer["Errors"][0]
                raise ClientError({"Error": {"Code": error.get("Code"), "Message": (
                    f"{len(answer['Errors'])} object(s) not deleted, the first "
                    f"{error.get('Key')}: {error.get('Message')}")}}, "DeleteObjects")
        client.delete_bucket(Bucket=bucket)
    except (BotoCoreError, ClientError) as exc:
        progress(f"s3: the bucket {bucket} this run made at {endpoint} could not be deleted "
                 f"({exc}); delete it by hand")

