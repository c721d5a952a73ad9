"""Multipart uploads on S3 leave nothing behind: an upload whose part failed is aborted, and a
tree delete aborts the uploads under it.

An incomplete multipart upload is invisible to listings and reads, but S3 keeps (and bills)
its parts until it is completed or aborted. obstore aborts one whose part failed, but in an
outage that abort fails too, and a process killed mid-upload aborts nothing. The faults come
from an HTTP proxy in front of the session's S3 server that answers 503 to chosen requests and
forwards the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from antifragile.chaos.crashcheck.record import RecordingProxy, _parse_head, _Reader
from antifragile.engine import CheckpointEngine, StorageError
from antifragile.engine.storage import RetryingStorage, open_storage
from antifragile.engine.storage._s3 import MULTIPART_MIN_BYTES

pytestmark = [pytest.mark.s3, pytest.mark.filterwarnings("ignore::RuntimeWarning")]


class FailingProxy(RecordingProxy):
    """Answers ``answer`` (a 503) to the requests ``fails`` picks by their request line;
    forwards the rest."""

    def __init__(self, upstream_url: str) -> None:
        super().__init__(upstream_url, bucket="", root="")
        self.fails: Callable[[str], bool] = lambda request_line: False
        self.failed: list[str] = []
        self.answer = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n"
                       b"Connection: close\r\n\r\n")

    def _forward(self, client: Any, reader: _Reader, head: bytes, issued: float,
                 upstream: list[Any]) -> bool:
        request_line, headers = _parse_head(head)
        if not self.fails(request_line):
            return super()._forward(client, reader, head, issued, upstream)
        self.failed.append(request_line)
        reader.body(headers)
        client.sendall(self.answer)
        return False


@pytest.fixture
def admin(s3_bucket: tuple[str, dict[str, Any]]) -> Iterator[Any]:
    import boto3

    _, options = s3_bucket
    yield boto3.client("s3", endpoint_url=options["endpoint_url"], region_name="us-east-1",
                       aws_access_key_id=options["key"],
                       aws_secret_access_key=options["secret"])


def uploads(admin: Any, bucket: str) -> list[str]:
    """The keys of the bucket's multipart uploads in progress."""
    return sorted(u["Key"] for u in admin.list_multipart_uploads(Bucket=bucket).get("Uploads",
                                                                                     []))


def test_uploads_a_save_could_not_abort_go_with_its_step(
        s3_bucket: tuple[str, dict[str, Any]], admin: Any) -> None:
    """An outage that fails a part upload fails its abort too: the failed save's uploads stay
    until its step's folder is deleted (retention, once later steps commit), not forever."""
    url, options = s3_bucket
    bucket = url.removeprefix("s3://").split("/", 1)[0]
    big = {"w": torch.arange(MULTIPART_MIN_BYTES // 4 + 256, dtype=torch.float32)}
    with FailingProxy(options["endpoint_url"]) as proxy:
        options = {**options, "endpoint_url": proxy.endpoint_url}
        with CheckpointEngine(url, storage_options=options, keep_last=1) as engine:
            assert isinstance(engine.storage, RetryingStorage)
            engine.storage.attempts = 2
            proxy.fails = lambda line: ("partNumber=2&" in line
                                        or (line.startswith("DELETE ") and "uploadId=" in line))
            with pytest.raises(StorageError, match="503"):
                engine.save(1, big, blocking=True)
            assert any(line.startswith("DELETE ") for line in proxy.failed)
            assert uploads(admin, bucket), "the outage left no upload: nothing is tested"
            proxy.fails = lambda line: False
            engine.save(2, big, blocking=True)
            engine.save(3, big, blocking=True)  # retention deletes steps 1 (debris) and 2
            assert engine.steps() == [3]
    assert uploads(admin, bucket) == []


def test_a_tree_delete_aborts_the_uploads_under_it(s3_bucket: tuple[str, dict[str, Any]],
                                                   admin: Any) -> None:
    """What a save killed mid-upload, or failed in an outage, left: aborted when the step's
    folder is deleted; a sibling whose name merely starts the same keeps its upload."""
    url, options = s3_bucket
    bucket, root = url.removeprefix("s3://").split("/", 1)
    made = {}
    for key in ("step_5/a/c.0", "step_5x/a/c.0"):
        made[key] = admin.create_multipart_upload(Bucket=bucket, Key=f"{root}/{key}")["UploadId"]
        admin.upload_part(Bucket=bucket, Key=f"{root}/{key}", UploadId=made[key],
                          PartNumber=1, Body=b"part")
    storage = open_storage(url, options)
    storage.write("step_5/COMMIT", [b"x"])
    assert storage.delete_tree("step_5")
    assert uploads(admin, bucket) == [f"{root}/step_5x/a/c.0"]
    admin.abort_multipart_upload(Bucket=bucket, Key=f"{root}/step_5x/a/c.0",
                                 UploadId=made["step_5x/a/c.0"])


def test_an_upload_gone_under_a_write_is_retried(s3_bucket: tuple[str, dict[str, Any]]) -> None:
    """A part answered 404 NoSuchUpload (the upload was aborted under it: a lifecycle rule,
    another process's tree delete) reached the retry layer as FileNotFoundError, which it lets
    through untouched for lookups: the write failed at once, saying "no such object". A new
    upload succeeds."""
    url, options = s3_bucket
    data = bytes(range(256)) * (MULTIPART_MIN_BYTES // 256 + 3)
    body = b"<Error><Code>NoSuchUpload</Code><Message>gone</Message></Error>"
    with FailingProxy(options["endpoint_url"]) as proxy:
        proxy.answer = (b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n"
                        b"Connection: close\r\n\r\n" % len(body) + body)
        proxy.fails = lambda line: "partNumber=2&" in line and not proxy.failed
        storage = open_storage(url, {**options, "endpoint_url": proxy.endpoint_url})
        assert isinstance(storage, RetryingStorage)
        storage.base_delay_s = 0.01
        storage.write("step_000000001/w/c", [data])
        assert proxy.failed, "no part was refused: nothing is tested"
        assert storage.read("step_000000001/w/c") == data


class _Unanswered:
    """A client connection that gets a ``100 Continue`` but never the answer."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def sendall(self, data: bytes) -> None:
        if data.startswith(b"HTTP/1.1 100 "):
            self.client.sendall(data)


class LosingProxy(FailingProxy):
    """Forwards the requests ``fails`` picks, so that the storage carries them out, but drops
    their answers and closes the connection (an answer lost on the way back)."""

    def _forward(self, client: Any, reader: _Reader, head: bytes, issued: float,
                 upstream: list[Any]) -> bool:
        request_line, _ = _parse_head(head)
        if not self.fails(request_line):
            return RecordingProxy._forward(self, client, reader, head, issued, upstream)
        self.failed.append(request_line)
        RecordingProxy._forward(self, _Unanswered(client), reader, head, issued, upstream)
        return False


def test_an_upload_begun_whose_answer_was_lost_is_aborted(
        s3_bucket: tuple[str, dict[str, Any]], admin: Any) -> None:
    """The answer to the request that begins a multipart upload is lost: the storage began
    the upload, but the client never learned its id, so the upload it retries with is a new
    one. The first stayed in progress (and billed) after a successful write, for as long as
    its step was kept: with ``keep_last=None``, for ever."""
    url, options = s3_bucket
    bucket = url.removeprefix("s3://").split("/", 1)[0]
    data = bytes(range(256)) * (MULTIPART_MIN_BYTES // 256 + 3)
    with LosingProxy(options["endpoint_url"]) as proxy:
        proxy.fails = lambda line: "?uploads" in line and not proxy.failed
        storage = open_storage(url, {**options, "endpoint_url": proxy.endpoint_url})
        assert isinstance(storage, RetryingStorage)
        storage.base_delay_s = 0.01
        storage.write("step_000000001/w/c", [data])
        assert proxy.failed, "no upload was begun unanswered: nothing is tested"
        assert storage.read("step_000000001/w/c") == data
    assert uploads(admin, bucket) == []
