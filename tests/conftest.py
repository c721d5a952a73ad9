"""Shared fixtures: a real S3 endpoint on loopback (a SeaweedFS cluster), storage URLs for both
backends."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from antifragile.chaos.infra.s3 import configured_endpoint, environ

os.environ.setdefault("OMP_NUM_THREADS", "1")
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="session")
def seaweedfs() -> Iterator[Any]:
    """A SeaweedFS cluster on 127.0.0.1 (master, 2 volume servers, filer, S3 gateway; free
    ports) for the whole session; it accepts only the ``testing``/``testing`` credentials."""
    pytest.importorskip("s3fs")
    from antifragile.chaos.infra.seaweedfs import SeaweedCluster, SeaweedError, find_weed

    try:
        find_weed()
    except SeaweedError as exc:
        pytest.skip(str(exc))
    with SeaweedCluster(access_key="testing", secret_key="testing") as cluster:
        yield cluster


@pytest.fixture(scope="session")
def s3_server(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """The session's S3 endpoint: ``AWS_ENDPOINT_URL`` when set (with the standard credential
    variables), else the session's SeaweedFS cluster. Yields s3fs storage options."""
    pytest.importorskip("s3fs")
    endpoint = configured_endpoint()
    if endpoint:
        yield {"endpoint_url": endpoint, "key": os.environ.get("AWS_ACCESS_KEY_ID"),
               "secret": os.environ.get("AWS_SECRET_ACCESS_KEY")}
        return
    cluster = request.getfixturevalue("seaweedfs")
    with environ(CREDENTIALS):
        yield cluster.storage_options


@pytest.fixture
def s3_bucket(s3_server: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """A fresh bucket per test: (``s3://bucket/ckpt``, storage_options)."""
    import boto3

    client = boto3.client("s3", endpoint_url=s3_server["endpoint_url"],
                          aws_access_key_id=s3_server["key"],
                          aws_secret_access_key=s3_server["secret"], region_name="us-east-1")
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    yield f"s3://{bucket}/ckpt", dict(s3_server)
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for obj in page.get("Contents", []):
            client.delete_object(Bucket=bucket, Key=obj["Key"])
    client.delete_bucket(Bucket=bucket)


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def storage(request: pytest.FixtureRequest, tmp_path: Any) -> tuple[str, dict[str, Any] | None]:
    """(url, storage_options) for every backend: each storage test runs on both."""
    if request.param == "local":
        return str(tmp_path / "ckpt"), None
    return request.getfixturevalue("s3_bucket")
