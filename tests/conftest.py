"""Shared fixtures: a real S3 endpoint on loopback (moto server), storage URLs for both backends."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from antifragile.chaos.infra.s3 import environ

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def s3_server() -> Iterator[dict[str, Any]]:
    """A moto S3 server on 127.0.0.1, a free port, for the whole session (as s3fs tests do)."""
    moto_server = pytest.importorskip("moto.moto_server.threaded_moto_server")
    pytest.importorskip("s3fs")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}
    with environ(env):
        yield {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    server.stop()


@pytest.fixture
def s3_bucket(s3_server: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """A fresh bucket per test: (``s3://bucket/ckpt``, storage_options)."""
    import boto3

    client = boto3.client("s3", endpoint_url=s3_server["endpoint_url"],
                          aws_access_key_id="testing", aws_secret_access_key="testing",
                          region_name="us-east-1")
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    yield f"s3://{bucket}/ckpt", {"endpoint_url": s3_server["endpoint_url"], "key": "testing",
                                  "secret": "testing"}
    objects = client.list_objects_v2(Bucket=bucket).get("Contents", [])
    for obj in objects:
        client.delete_object(Bucket=bucket, Key=obj["Key"])
    client.delete_bucket(Bucket=bucket)


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def storage(request: pytest.FixtureRequest, tmp_path: Any) -> tuple[str, dict[str, Any] | None]:
    """(url, storage_options) for every backend: each storage test runs on both."""
    if request.param == "local":
        return str(tmp_path / "ckpt"), None
    return request.getfixturevalue("s3_bucket")
