"""One ``chaos crashcheck``: the S3 endpoint and a bucket of its own, one checker pool, every
case, the report document."""

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
from antifragile.chaos.crashcheck.pipeline import Settings, run_case, summarize
from antifragile.chaos.infra.s3 import S3SetupError, check_bucket, endpoint


@contextlib.contextmanager
def s3_endpoint(endpoint_url: str | None,
                progress: Callable[[str], None]) -> Iterator[tuple[str, dict[str, str]]]:
    """(endpoint, environment for clients): the one given, ``AWS_ENDPOINT_URL``, or a local
    SeaweedFS cluster started here for the run."""
    with endpoint(endpoint_url) as ep:
        env = {k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                          "AWS_DEFAULT_REGION", "AWS_SESSION_TOKEN")
               if k in os.environ}
        env.update(ep.env)
        env.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        if ep.cluster is not None:
            progress(f"s3: started a local SeaweedFS cluster at {ep.url} in "
                     f"{ep.cluster.start_s:.1f} s")
        yield ep.url, env


def crashcheck(settings: Settings, *, endpoint_url: str | None = None,
               progress: Callable[[str], None] = print,
               on_case: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Record, enumerate and check every case of ``settings``; the report document. Raises
    S3SetupError (a one-line reason) when the endpoint cannot be used. ``on_case`` gets the
    document after each case (a long run that is stopped keeps its finished cases)."""
    began = time.monotonic()
    with s3_endpoint(endpoint_url, progress) as (endpoint, env):
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
                    result = run_case(settings, name, endpoint_url=endpoint, env=env,
                                      bucket=bucket, bodies=bodies, pool=pool,
                                      progress=progress)
                    cases.append(summarize(settings, result))
                    doc["wall_s"] = round(time.monotonic() - began, 1)
                    if on_case is not None:
                        on_case(doc)
        finally:
            shutil.rmtree(bodies, ignore_errors=True)
    return doc
