"""Failures while loading a step that are not damage to it: an object storage will not hand
over (a directory where an object should be, a 403), a listing refused, a step gone.

Each becomes a classified CheckpointError (StorageError / CheckpointNotFoundError) that every
rank agrees on: ``load(step=N)`` raises it, ``load()`` falls back to the newest older step that
loads, and nothing is quarantined (the step is not known to be damaged). On S3 the refusals
come from a small HTTP proxy in front of the S3 server that answers 403 AccessDenied to the
requests a test picks, so the engine's real client stack sees a real 403.
"""

from __future__ import annotations

import http.client
import shutil
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import torch
from _dist import run_ranks

from antifragile.engine import (
    CheckpointCorruptError,
    CheckpointEngine,
    CheckpointError,
    CheckpointFormatError,
    PlanOptions,
    StorageError,
)

Storage = tuple[str, dict[str, Any] | None]
PLAN = PlanOptions(max_object_bytes=256)  # 16 x 8 float32: objects of 8 rows, c.0.0 and c.1.0


def state_of(step: int) -> dict[str, Any]:
    return {"w": torch.randn(16, 8, generator=torch.Generator().manual_seed(step)), "step": step}


def blank() -> dict[str, Any]:
    return {"w": torch.zeros(16, 8), "step": -1}


def save_steps(url: str, options: dict[str, Any] | None, steps: tuple[int, ...] = (1, 2)) -> None:
    with CheckpointEngine(url, storage_options=options, keep_last=None,
                          plan_options=PLAN) as engine:
        for step in steps:
            engine.save(step, state_of(step), blocking=True)


def make_directory(root: Path, step: int, key: str) -> None:
    """Replace an object by a directory (tests run as root: chmod would not stop a read)."""
    path = root / f"step_{step:09d}" / key
    path.unlink()
    path.mkdir()


# -- one process -------------------------------------------------------------------------------


def test_object_that_is_a_directory_falls_back_without_quarantine(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    save_steps(url, None)
    make_directory(tmp_path / "ckpt", 2, "w/c.1.0")
    with CheckpointEngine(url) as engine:
        with pytest.raises(StorageError, match=r"step 2\b.*w/c.1.0.*IsADirectoryError"):
            engine.load(blank(), step=2)
        target = blank()
        with pytest.warns(RuntimeWarning, match=r"step 2 skipped.*IsADirectoryError"):
            assert engine.load(target) == 1
        assert torch.equal(target["w"], state_of(1)["w"]) and target["step"] == 1
        assert engine.steps() == [1, 2], "unreadable is not damaged: nothing is quarantined"
        with pytest.raises(StorageError, match=r"w/c.1.0.*IsADirectoryError"):  # nor for verify
            engine.verify(2)


def test_commit_of_another_format_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    save_steps(url, None, (1,))
    marker = tmp_path / "ckpt" / "step_000000001" / "COMMIT"
    marker.write_bytes(b'{"format": 1, "step": 1, "nonce": 5, "objects": {}}')
    with CheckpointEngine(url) as engine:
        with pytest.raises(CheckpointError, match=r"step 1 was written in checkpoint format 1"):
            engine.load(blank(), step=1)
        assert engine.steps() == [1]


def test_a_commit_whose_format_digit_flipped_is_damage_not_another_format(
        tmp_path: Path) -> None:
    # "format": 5 -> 1 is one bit; the marker still parses as JSON but fails its seal. It was
    # refused as "written in checkpoint format 1" on every rank, with no fallback to step 1
    url = str(tmp_path / "ckpt")
    save_steps(url, None)
    marker = tmp_path / "ckpt" / "step_000000002" / "COMMIT"
    data = marker.read_bytes()
    assert data.startswith(b'{"format": 5,')
    marker.write_bytes(data.replace(b'{"format": 5,', b'{"format": 1,', 1))
    with CheckpointEngine(url) as engine:
        with pytest.raises(CheckpointCorruptError, match=r"step 2: COMMIT marker: fails its"):
            engine.load(blank(), step=2)
        target = blank()
        with pytest.warns(RuntimeWarning, match=r"step 2 skipped"):
            assert engine.load(target) == 1
        assert torch.equal(target["w"], state_of(1)["w"]) and target["step"] == 1


def test_an_intact_commit_of_a_newer_format_is_refused_not_quarantined(tmp_path: Path) -> None:
    # a step a newer engine wrote (its COMMIT intact) was taken for damage, confirmed by the
    # re-read and quarantined: this engine hid the newer engine's checkpoint from it
    from antifragile.engine import _format

    url = str(tmp_path / "ckpt")
    save_steps(url, None)
    marker = tmp_path / "ckpt" / "step_000000002" / "COMMIT"
    doc = _format.unseal(marker.read_bytes(), where="COMMIT")
    marker.write_bytes(_format.seal({**doc, "format": 99}))
    with CheckpointEngine(url) as engine:
        with pytest.raises(CheckpointError, match=r"step 2 was written in checkpoint format 99"
                           ) as raised:
            engine.load(blank())
        assert not isinstance(raised.value, CheckpointCorruptError)
        assert engine.steps() == [1, 2] and marker.exists()
        # the class survives the ranks' agreement on the error (it became a CheckpointError)
        with pytest.raises(CheckpointFormatError, match=r"checkpoint format 99"):
            engine.load(blank(), step=2)


FORMAT_2 = Path(__file__).parent / "data" / "format2"  # step 7, written by antifragile 0c7622b


FORMAT_4 = Path(__file__).parent / "data" / "format4"  # step 7, written by antifragile 05621f0


def _loaded_and_saved_again(fixture: Path, tmp_path: Path, template: Callable[[], Any]
                            ) -> tuple[Path, Any, Any]:
    """A copy of ``fixture`` (step 7 in an older format): step 7 verified and loaded into a
    ``template()``, saved again as step 8, in the format written now, and loaded back."""
    import shutil

    from antifragile.engine._paths import FORMAT_VERSION

    url = tmp_path / "ckpt"
    shutil.copytree(fixture, url)
    with CheckpointEngine(str(url)) as engine:
        assert engine.verify(7).ok
        state, again = template(), template()
        assert engine.load(state, step=7) == 7
        engine.save(8, state, blocking=True)
        engine.load(again, step=8)
    marker = (url / "step_000000008" / "COMMIT").read_bytes()
    assert marker.startswith(b'{"format": %d,' % FORMAT_VERSION)
    return url, state, again


def test_a_checkpoint_of_format_4_still_loads_and_verifies(tmp_path: Path) -> None:
    """Format 5 stores the COMMIT's manifest as columns; a step of format 4 (its manifest two
    maps, a non-finite float among its values stored as a str) loads exactly and verifies,
    and the next save beside it is format 5."""
    import math

    def template() -> dict[str, Any]:
        return {"model": {"w": torch.zeros(64, 16), "b": torch.zeros(16, dtype=torch.bfloat16),
                          "scalar": torch.tensor(0.0)},
                "train": {"step": 0, "tag": "", "best": 0.0, "loss": 0.0}}

    url, state, again = _loaded_and_saved_again(FORMAT_4, tmp_path, template)
    assert (url / "step_000000007" / "COMMIT").read_bytes().startswith(b'{"format": 4,')
    assert torch.equal(state["model"]["w"], torch.arange(64 * 16.0).reshape(64, 16))
    assert state["train"]["best"] == math.inf and math.isnan(state["train"]["loss"])
    assert state["train"]["tag"] == again["train"]["tag"] == "format 4"
    assert all(torch.equal(again["model"][k], v) for k, v in state["model"].items())


def test_a_checkpoint_of_format_2_still_loads_and_verifies(tmp_path: Path) -> None:
    """Format 3 changed the chunk keys (``w/c.1.0``; ``w/c/1/0`` in format 2): a step written
    by the version before loads, bit for bit what zarr-python reads from the same files, and
    verifies; the next save beside it is of the format written now."""
    import numpy as np
    import zarr

    def template() -> dict[str, Any]:
        return {"model": {"w": torch.zeros(64, 16), "b": torch.zeros(16, dtype=torch.bfloat16),
                          "scalar": torch.tensor(0.0)}, "train": {"step": 0, "tag": ""}}

    url, state, again = _loaded_and_saved_again(FORMAT_2, tmp_path, template)
    assert (url / "step_000000007" / "model" / "w" / "c" / "3" / "0").is_file()
    assert again["train"] == {"step": 7, "tag": "format 2"}
    assert all(torch.equal(again["model"][k], v) for k, v in state["model"].items())
    group = zarr.open_group(str(url / "step_000000007"), mode="r")
    assert torch.equal(state["model"]["w"], torch.from_numpy(np.asarray(group["model/w"][...])))
    assert torch.equal(state["model"]["b"].view(torch.int16),
                       torch.from_numpy(np.asarray(group["model/b"][...]).view(np.int16)))
    assert state["model"]["scalar"].item() == 2.5 and state["train"]["step"] == 7
    assert (url / "step_000000008" / "model" / "w" / "c.0.0").is_file()


# -- S3: a 403 from the server --------------------------------------------------------------


class DenyingProxy:
    """An HTTP proxy to an S3 endpoint that answers 403 AccessDenied to the requests for which
    ``deny(method, path_and_query)`` is true and forwards every other one."""

    def __init__(self, upstream: str) -> None:
        target = urlparse(upstream)
        self.deny: Callable[[str, str], bool] = lambda method, path: False
        self.denied = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if proxy.deny(self.command, self.path):
                    proxy.denied += 1
                    error = (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>AccessDenied"
                             b"</Code><Message>Access Denied</Message></Error>")
                    self.send_response(403)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(error)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(error)
                    return
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
                # the Host header stays the proxy's: it is part of the request's signature
                headers = dict(self.headers.items())
                conn.request(self.command, self.path, body=body, headers=headers)
                response = conn.getresponse()
                data = response.read()
                self.send_response(response.status)
                for key, value in response.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.endpoint_url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def denying(s3_bucket: tuple[str, dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any],
                                                                    DenyingProxy]]:
    url, options = s3_bucket
    proxy = DenyingProxy(options["endpoint_url"])
    no_retries = {"retries": {"max_attempts": 1, "mode": "standard"}}
    yield url, {**options, "endpoint_url": proxy.endpoint_url,
                "config_kwargs": no_retries}, proxy
    proxy.close()


@pytest.mark.s3
def test_a_403_on_an_object_falls_back_without_quarantine(
    denying: tuple[str, dict[str, Any], DenyingProxy],
) -> None:
    url, options, proxy = denying
    save_steps(url, options)
    proxy.deny = lambda method, path: "step_000000002/w/c.1.0" in path
    with CheckpointEngine(url, storage_options=options) as engine:
        with pytest.raises(StorageError, match=r"step 2\b.*w/c.1.0.*PermissionError"):
            engine.load(blank(), step=2)
        target = blank()
        with pytest.warns(RuntimeWarning, match="step 2 skipped"):
            assert engine.load(target) == 1
        assert torch.equal(target["w"], state_of(1)["w"])
        assert engine.steps() == [1, 2]
    assert proxy.denied >= 2


@pytest.mark.s3
def test_a_403_on_listing_is_a_storage_error(
    denying: tuple[str, dict[str, Any], DenyingProxy],
) -> None:
    url, options, proxy = denying
    save_steps(url, options, (1,))
    proxy.deny = lambda method, path: "list-type" in path or "delimiter" in path
    with CheckpointEngine(url, storage_options=options) as engine:
        with pytest.raises(StorageError, match="PermissionError"):
            engine.steps()
        with pytest.raises(StorageError, match="PermissionError"):
            engine.load(blank())
    assert proxy.denied >= 2


# -- two ranks: only one of them hits the error ------------------------------------------------


def _load_rows(url: str, step: int | None) -> tuple[str, int, bool]:
    """Rank r loads rows [8r, 8r + 8): only rank 1 reads object w/c.1.0. Returns the outcome,
    the step loaded (-1 on error) and whether the loaded rows are that step's."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    target = {"w": distribute_tensor(torch.zeros(16, 8), mesh, [Shard(0)]), "step": -1}
    with CheckpointEngine(url) as engine:
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                loaded = engine.load(target, step=step)
        except CheckpointError as exc:
            return f"{type(exc).__name__}: {exc}", -1, False
    rank = torch.distributed.get_rank()
    rows = state_of(loaded)["w"][8 * rank:8 * rank + 8]
    warned = " | ".join(str(w.message) for w in caught)
    return f"loaded {warned}", loaded, torch.equal(target["w"].to_local(), rows)


@pytest.mark.multiproc
def test_an_error_on_one_rank_is_agreed_by_all(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    save_steps(url, None)
    make_directory(tmp_path / "ckpt", 2, "w/c.1.0")
    explicit = run_ranks(2, _load_rows, url, 2, timeout_s=90)
    assert all(o.startswith("StorageError") and "rank 1" in o and "w/c.1.0" in o
               for o, _, _ in explicit), explicit
    latest = run_ranks(2, _load_rows, url, None, timeout_s=90)
    assert [(step, ok) for _, step, ok in latest] == [(1, True), (1, True)], latest
    assert all("step 2 skipped" in o for o, _, _ in latest), latest


# -- a failed step leaves no read in flight ----------------------------------------------------


class _HeldReads:
    """Holds reads of step 2's ``a`` objects until ``release`` (after load has returned), or
    for ``HOLD_S``: a correct load waits for them that long (it may not fall back while they
    run); a load that does not wait falls back to step 1 and returns well within it (a
    fraction of a second: two 4-element tensors from a local disk), and the held reads then
    land after it, which the test sees."""

    HOLD_S = 5.0

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.release = threading.Event()

    def read(self, key: str, start: int = 0, end: int | None = None) -> Any:
        if "step_000000002/a/c." in key:
            self.release.wait(self.HOLD_S)
        return self.inner.read(key, start, end)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_no_read_of_a_failed_step_lands_after_the_fallback(tmp_path: Path) -> None:
    """Step 2's second tensor is damaged, found while reads of its first tensor are held:
    load() falls back to step 1, and no read of step 2 may still be running to overwrite the
    target with step 2's data afterwards."""
    url = str(tmp_path / "ckpt")
    with CheckpointEngine(url, keep_last=None) as engine:
        for step in (1, 2):
            engine.save(step, {"a": torch.full((4,), float(step)),
                               "b": torch.full((4,), float(step))}, blocking=True)
        shard = tmp_path / "ckpt" / "step_000000002" / "b" / "c.0"
        data = bytearray(shard.read_bytes())
        data[0] ^= 1
        shard.write_bytes(bytes(data))
        held = _HeldReads(engine.storage.inner)
        engine.storage.inner = held
        target = {"a": torch.zeros(4), "b": torch.zeros(4)}
        with pytest.warns(RuntimeWarning, match="step 2 skipped"):
            assert engine.load(target) == 1
        held.release.set()
    assert torch.equal(target["a"], torch.ones(4)), "a read of step 2 landed after the fallback"
    assert torch.equal(target["b"], torch.ones(4))


# -- ranks must load the same save -------------------------------------------------------------


def _load_step_1(urls: list[str]) -> str:
    """Rank r loads step 1 from ``urls[r]`` (node-local storage that looks shared)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    rank = torch.distributed.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    target = {"w": distribute_tensor(torch.zeros(16, 8), mesh, [Shard(0)]), "step": -1}
    with CheckpointEngine(urls[rank]) as engine:
        try:
            engine.load(target, step=1)
        except CheckpointError as exc:
            return f"refused: {exc}"
    return "loaded"


@pytest.mark.multiproc
def test_ranks_that_see_different_saves_of_a_step_refuse_to_mix_them(tmp_path: Path) -> None:
    """Each rank sees its own step 1 (two saves with other contents, e.g. node-local disks
    mounted at the same path): every rank's data checks out, but together they would be a
    checkpoint nobody saved. The ranks compare the save's nonce and refuse."""
    urls = [str(tmp_path / f"node{r}") for r in range(2)]
    for r, url in enumerate(urls):
        with CheckpointEngine(url) as engine:
            engine.save(1, {"w": torch.full((16, 8), float(r)), "step": 1}, blocking=True)
    outcomes = run_ranks(2, _load_step_1, urls, timeout_s=90)
    assert all(o.startswith("refused") and "step 1" in o and "different saves" in o
               for o in outcomes), outcomes


# -- the state's own objects fail ---------------------------------------------------------------


class _Refusing:
    """A Stateful whose ``state_dict()`` (``fails_at="save"``) or ``load_state_dict()``
    (``"load"``) raises, as a scheduler or loader of another version can."""

    def __init__(self, fails_at: str | None) -> None:
        self.fails_at = fails_at

    def state_dict(self) -> dict[str, Any]:
        if self.fails_at == "save":
            raise RuntimeError("state_dict failed on this rank")
        return {"n": 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.fails_at == "load":
            raise KeyError("missing key 'milestones'")


def _save_then_load_with_one_refusing_rank(url: str) -> tuple[str, str]:
    import torch.distributed as dist

    fails = dist.get_rank() == 1
    outcomes = []
    with CheckpointEngine(url) as engine:
        for call in ("save", "load"):
            try:
                if call == "save":
                    state = {"w": torch.ones(4), "obj": _Refusing("save" if fails else None)}
                    engine.save(1, state, blocking=True)
                else:
                    engine.save(2, {"w": torch.ones(4), "obj": _Refusing(None)}, blocking=True)
                    engine.load({"w": torch.zeros(4), "obj": _Refusing("load" if fails else None)})
                outcomes.append("ok")
            except Exception as exc:
                outcomes.append(f"{type(exc).__name__}: {exc}")
    return outcomes[0], outcomes[1]


@pytest.mark.multiproc
def test_a_stateful_that_raises_on_one_rank_is_a_checkpoint_error_on_every_rank(
        tmp_path: Path) -> None:
    # a state_dict() that raised on rank 1 before the save's first collective left rank 0 in
    # it until the process-group timeout; a load_state_dict() that raised escaped load() as
    # itself (a KeyError), on that rank only
    out = run_ranks(2, _save_then_load_with_one_refusing_rank, str(tmp_path / "ckpt"),
                    timeout_s=60)
    (saved_0, loaded_0), (saved_1, loaded_1) = out
    assert saved_0.startswith("CheckpointError: step 1 not saved: another rank's"), saved_0
    assert saved_1 == ("CheckpointError: obj: _Refusing.state_dict() raised RuntimeError: "
                       "state_dict failed on this rank"), saved_1
    assert loaded_0.startswith("CheckpointError: step 2 loaded, but another rank's"), loaded_0
    assert loaded_1.startswith("CheckpointError: step 2 loaded, but not taken: obj: _Refusing."
                               "load_state_dict() refused the loaded state: KeyError"), loaded_1


def test_a_storage_error_of_a_load_names_its_own_step_not_one_it_prefixes() -> None:
    """An unreadable step's error is prefixed with ``step N:`` unless it names the step
    already; "step 12" was taken for naming step 1 (a substring), so step 1's failure was
    reported under another step's name alone."""
    from antifragile.engine._agree import classify

    for message, named in [("step 12: connection reset", False),
                           ("step 1: connection reset", True),
                           ("reading step 1's COMMIT: connection reset", True)]:
        _, exc = classify(1, StorageError(message))
        assert str(exc) == (message if named else f"step 1: {message}"), (message, exc)


def test_a_step_folder_given_as_the_root_is_refused_not_taken_for_an_empty_root(
        tmp_path: Path) -> None:
    """An engine opened on a step's own folder (``ckpt/step_000000002``, to resume from that
    step) listed nothing there: ``agreed_steps()`` was empty and ``load`` said "no committed
    checkpoint", so a trainer that starts over when nothing is committed did so beside the
    step it was pointed at. It names the folder as a step folder and the root to give."""
    save_steps(str(tmp_path), None)
    # a step's folder under a name of its own (a copy kept aside as "best"): known by what
    # it holds; under its own name it is refused as the engine opens (the next test)
    shutil.copytree(tmp_path / "step_000000002", tmp_path / "best")
    step_folder = str(tmp_path / "best")
    with CheckpointEngine(step_folder, keep_last=None) as engine:
        for call in (engine.agreed_steps, engine.steps, lambda: engine.load(blank())):
            with pytest.raises(CheckpointError, match="is a step folder") as caught:
                call()
            assert str(tmp_path) in str(caught.value), caught.value


def test_an_engine_opened_on_a_step_folders_name_is_refused_before_it_saves_into_it(
        tmp_path: Path) -> None:
    """``CheckpointEngine("ckpt/step_000000002")`` (a step's folder, as a DCP user gives each
    checkpoint its own) opened, and its save wrote a checkpoint root inside the committed
    step (``step_000000002/step_000000005/...``). The name alone says what it is, the same on
    every rank: refused as the engine opens, naming the root and step to give, nothing
    written."""
    save_steps(str(tmp_path), None)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for url in (str(tmp_path / "step_000000002"), f"{tmp_path}/step_000000002/",
                str(tmp_path / "step_000000009")):  # also one not there yet
        with pytest.raises(CheckpointError) as caught:
            CheckpointEngine(url)
        step = int(url.rstrip("/")[-9:])
        assert str(caught.value) == (f"{url} is a step folder (by its name), not a "
                                     f"checkpoint root: give {tmp_path} and step={step}")
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_a_root_inside_a_checkpoint_is_refused_before_a_save_nests_a_step_in_it(
        tmp_path: Path) -> None:
    """A root inside a step's folder (an array's folder, a new folder beside them) or a
    step's folder kept under a name of its own (``step_000000002_old``) opened, and its first
    save wrote ``step_000000005`` inside the committed checkpoint (the listing that names such
    a root only warned). Refused: by name as the engine opens (any folder of the URL named
    like a step's), by what the root holds at the save (a COMMIT, or zarr.json: a zarr node,
    which no checkpoint root is), on every rank, naming the path and why; nothing written."""
    save_steps(str(tmp_path), None)
    shutil.copytree(tmp_path / "step_000000002", tmp_path / "step_000000002_old")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    step2 = tmp_path / "step_000000002"
    for url in (step2 / "w", step2 / "new", f"{step2}/w/"):
        with pytest.raises(CheckpointError) as caught:
            CheckpointEngine(str(url))
        assert str(caught.value) == (f"{url} is inside the step folder {step2} (by its name), "
                                     f"not a checkpoint root: give {tmp_path} and step=2")
    old = tmp_path / "step_000000002_old"
    # not "give tmp_path": the folder above a copy need not hold the step it is a copy of
    for url, what in ((old, "is a step folder (it holds COMMIT) under a name that is no "
                            "step's, not a checkpoint root: a root holds each step as a folder "
                            "step_<step, 9 digits> (step_000000120); give that root"),
                      (old / "w", "is inside a checkpoint (it holds zarr.json: a zarr array or "
                                  "group), not a checkpoint root")):
        with CheckpointEngine(str(url)) as engine, pytest.raises(CheckpointError) as caught:
            engine.save(5, blank())
        assert str(caught.value) == f"step 5 not saved: {url} {what}", caught.value
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
