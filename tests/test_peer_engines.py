"""The peer checkpoint engines under test (``checkpoint.engine: dcp | torchsnapshot``): the
trainer resumes bit-identically over each, falls back past a damaged newest step, refuses what
a peer cannot do, and ``chaos run`` measures and judges a run over DCP like one over ours."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from antifragile.chaos.cli import main
from antifragile.chaos.faults import Target
from antifragile.chaos.faults.corrupt_shard import CorruptShard
from antifragile.chaos.infra.launch import trainer_args
from antifragile.chaos.scenario import ScenarioError, parse_scenario
from antifragile.trainer.ckpt_backends import committed_steps, read_checkpoint
from antifragile.trainer.ckpt_backends.base import committed, discard_after, prune, step_name
from antifragile.trainer.config import parse_args
from tests._dist import run_ranks
from tests._trainer import assert_bitwise_equal, events, losses, run_trainer, torchrun_cmd

MARKERS = {"dcp": ".metadata", "torchsnapshot": ".snapshot_metadata"}


def _async_take_fails_on_rank_1(root: str) -> str:
    import time

    import torch
    import torch.distributed as dist
    import torchsnapshot.snapshot

    from antifragile.trainer.ckpt_backends.snapshot import SnapshotBackend

    if dist.get_rank() == 1:  # its writes fail while async_take still stages (a full disk)
        def full(**_: Any) -> None:
            raise OSError(28, "No space left on device")

        torchsnapshot.snapshot.sync_execute_write_reqs = full  # type: ignore[assignment]
    backend = SnapshotBackend(root, keep_last=2, timeout_s=30, async_=True)
    t0 = time.monotonic()
    handle = backend.save(1, {"model": {"w": torch.arange(4.0) + dist.get_rank()}})
    try:
        handle.wait(timeout=20)
    except Exception as exc:
        return f"{time.monotonic() - t0:.0f} s: {exc}"
    return "committed"


def test_torchsnapshot_async_save_failing_on_one_rank_fails_every_ranks_handle(
        tmp_path: Path) -> None:
    """torchsnapshot's async_take writes what fits its staging budget before it returns: a
    write failing there raised out of the backend's save (a traceback ending the rank) while
    the other ranks' background threads waited 30 min in torchsnapshot's commit barrier for
    it. Both ranks' saves now fail (ckpt_failed), at once, and nothing commits."""
    got = run_ranks(2, _async_take_fails_on_rank_1, str(tmp_path), timeout_s=120)
    assert all("No space left on device" in g and int(g.split()[0]) < 10 for g in got), got
    assert committed(tmp_path, ".snapshot_metadata") == []


def _save_again_after_a_failed_commit(root: str) -> tuple[str, float]:
    import time

    import torch
    import torch.distributed as dist
    from torchsnapshot.dist_store import get_or_create_store
    from torchsnapshot.pg_wrapper import PGWrapper
    from torchsnapshot.storage_plugins.fs import FSStoragePlugin

    from antifragile.trainer.ckpt_backends.base import step_name
    from antifragile.trainer.ckpt_backends.snapshot import SnapshotBackend

    backend = SnapshotBackend(root, keep_last=2, timeout_s=30, async_=True)
    path = str(backend.root / step_name(1))
    written = [0.0]
    if dist.get_rank() == 0:  # what a first try of this step left in torchsnapshot's barrier
        store = get_or_create_store(PGWrapper(backend.group.pg))
        store.set(f"torchsnapshot_{path}_0", "Rank 0 encountered error: disk full")
        store.set(f"torchsnapshot_{path}_1", "")
    else:  # rank 1 writes slowly
        write = FSStoragePlugin.write

        async def slow(self: Any, write_io: Any) -> None:
            time.sleep(2)
            await write(self, write_io)
            written[0] = time.time()

        FSStoragePlugin.write = slow  # type: ignore[method-assign]
    backend.group.barrier()
    handle = backend.save(1, {"model": {"w": torch.arange(4.0) + dist.get_rank()}})
    try:
        handle.wait(timeout=20)
    except Exception as exc:
        return str(exc)[:300], time.time()
    return "committed", written[0] or time.time()


def test_torchsnapshot_saves_a_step_again_after_its_commit_failed(tmp_path: Path) -> None:
    """torchsnapshot's commit barrier keys are named after the step's folder: the last
    step's retry (or a restart's save of the same step) met the keys of the try before it.
    A rank's old arrival let the leader commit before that rank had written (a torn
    checkpoint, were that rank to die), and a leader's old error could fail the others."""
    (first, committed_t), (second, written_t) = run_ranks(
        2, _save_again_after_a_failed_commit, str(tmp_path), timeout_s=120)
    assert (first, second) == ("committed", "committed")
    assert committed_t >= written_t, "rank 0 committed before rank 1 had written"
    assert committed(tmp_path, ".snapshot_metadata") == [1]


# -- no processes -------------------------------------------------------------------------------

def test_torchsnapshot_async_save_holds_the_step_it_was_given_not_the_next_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchsnapshot 0.1.0 copies a CPU tensor at staging only when it packs it into a batch
    (below 128 MiB); a larger one is written later from the tensor itself (its own copy is
    skipped: ``_should_copy_cpu_tensor`` compares the entry's str with the enum). The trainer
    steps on once ``save`` returns, so step N's checkpoint held parameters or moments of step
    N+1. Here every tensor is over the threshold (lowered) and the writes run after the step."""
    import asyncio

    import torch

    from antifragile.trainer.ckpt_backends.snapshot import SnapshotBackend  # torchsnapshot first

    from torchsnapshot.storage_plugins.fs import FSStoragePlugin  # isort: skip

    monkeypatch.setenv("TORCHSNAPSHOT_SLAB_SIZE_THRESHOLD_BYTES_OVERRIDE", "64")
    stepped = asyncio.Event()  # created here, awaited in torchsnapshot's own loop: polled
    write = FSStoragePlugin.write

    async def after_the_step(self: FSStoragePlugin, write_io: Any) -> None:
        while not stepped.is_set():
            await asyncio.sleep(0.005)
        await write(self, write_io)

    monkeypatch.setattr(FSStoragePlugin, "write", after_the_step)
    weights = {f"w{i}": torch.zeros(64) for i in range(4)}
    backend = SnapshotBackend(str(tmp_path), keep_last=2, timeout_s=30, async_=True)
    handle = backend.save(1, {"model": weights, "train": {"step": 1}})
    for w in weights.values():  # the next optimizer step
        w.add_(1.0)
    stepped.set()
    handle.wait(timeout=30)
    saved = read_checkpoint("torchsnapshot", str(tmp_path), 1)
    assert {k: float(saved[f"0/state/model/{k}"].abs().sum()) for k in weights} == \
        dict.fromkeys(weights, 0.0)


def test_a_peer_save_calls_back_from_the_thread_that_ends_it() -> None:
    """The trainer reports a save's outcome as it ends (``add_done_callback``), not at its next
    poll: a peer's handle calls back from the thread that resolved it, sizes known; one done
    already calls back at once. A failure is the handle's, named by step."""
    import threading
    from concurrent.futures import Future

    from antifragile.engine import CheckpointError
    from antifragile.trainer.ckpt_backends.base import PeerHandle, failed_future

    future: Future[Any] = Future()
    handle = PeerHandle(3, future, stall_s=0.0, sizes=lambda n: (n, 2 * n))
    seen: list[tuple[str, bool, int, int]] = []

    def note(h: PeerHandle) -> None:
        seen.append((threading.current_thread().name, h.done(), h.nbytes, h.committed_nbytes))

    handle.add_done_callback(lambda: note(handle))
    assert seen == []
    resolver = threading.Thread(target=future.set_result, args=(5,), name="peer-save")
    resolver.start()
    resolver.join()
    assert seen == [("peer-save", True, 5, 10)]
    failed = PeerHandle(4, failed_future(OSError("disk full")), stall_s=0.0,
                        sizes=lambda n: (n, n))
    failed.add_done_callback(lambda: note(failed))
    assert seen[1] == (threading.current_thread().name, True, 0, 0)
    error = failed.exception()
    assert isinstance(error, CheckpointError) and "step 4: OSError: disk full" in str(error)
    with pytest.raises(CheckpointError, match="step 4"):
        failed.wait(1)


def test_scenario_takes_a_peer_engine_on_local_storage_only() -> None:
    s = parse_scenario({"name": "x", "checkpoint": {"engine": "dcp"}})
    assert "--ckpt-engine" in (args := trainer_args(s, Path("/r"), "/r/ckpt"))
    assert args[args.index("--ckpt-engine") + 1] == "dcp"
    with pytest.raises(ScenarioError, match=r"x.yaml: checkpoint.engine: torchsnapshot is run "
                                            r"on local storage only, but url is s3://b/p"):
        parse_scenario({"name": "x", "checkpoint": {"engine": "torchsnapshot",
                                                    "url": "s3://b/p"}}, path="x.yaml")
    with pytest.raises(ScenarioError, match=r"checkpoint\.engine: Input should be"):
        parse_scenario({"name": "x", "checkpoint": {"engine": "orbax"}})


def test_trainer_flag_rejects_remote_storage_for_a_peer(capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    assert parse_args(["--ckpt-engine", "dcp", "--ckpt-url", "/tmp/c"]).ckpt_engine == "dcp"
    with pytest.raises(SystemExit):
        parse_args(["--ckpt-engine", "dcp", "--ckpt-url", "s3://bucket/run"])
    assert "runs on local storage only" in capsys.readouterr().err


def _folders(root: Path, steps: dict[int, bool]) -> None:
    for step, is_committed in steps.items():
        folder = root / step_name(step)
        folder.mkdir(parents=True)
        (folder / "__0_0.distcp").write_bytes(b"x")
        if is_committed:
            (folder / ".metadata").write_bytes(b"m")


def test_retention_keeps_the_newest_and_never_touches_a_save_in_flight(tmp_path: Path) -> None:
    _folders(tmp_path, {1: True, 2: False, 3: True, 4: True, 5: True, 6: False})
    assert committed(tmp_path, ".metadata") == [1, 3, 4, 5]
    prune(tmp_path, ".metadata", keep_last=2)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [step_name(4), step_name(5), step_name(6)]  # 6: newer than the last commit
    discard_after(tmp_path, 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_name(4)]


@pytest.mark.parametrize(("engine", "marker"), [("dcp", ".metadata"),
                                                ("torchsnapshot", ".snapshot_metadata")])
def test_a_crash_at_staged_after_a_peers_commit_is_said_to_have_lost_the_race(
        tmp_path: Path, engine: str, marker: str) -> None:
    """crash_during_save at ``staged`` with dcp or torchsnapshot: the save's own thread may
    commit before the kill. The injection looked only for our engine's COMMIT, so it said
    ``committed_before_kill: false`` whatever the peer had written, and the verdict blamed a
    commit "after the kill" for what was a race the save had won before it."""
    import subprocess

    from antifragile.chaos.faults.crash_during_save import CrashDuringSave

    folder = tmp_path / step_name(10)
    folder.mkdir()
    (folder / marker).write_bytes(b"m")
    victim = subprocess.Popen(["sleep", "30"])
    try:
        fault = CrashDuringSave(kind="crash_during_save", at_checkpoint=2, phase="staged")
        injected = fault.inject(Target(pids={0: victim.pid}, coordinates={0: (0, 0, 0)},
                                       ckpt_url=str(tmp_path), rng=random.Random(0),
                                       ckpt_engine=engine), 10)
    finally:
        victim.kill()
        victim.wait()
    assert injected.missed is None and injected.detail["committed_before_kill"] is True


# -- torchrun, dp=2 -----------------------------------------------------------------------------

def _train(run_dir: Path, engine: str, steps: int, *extra: str) -> None:
    run_trainer(run_dir, dp=2, steps=steps, ckpt_every=3, extra=["--ckpt-engine", engine,
                                                                 *extra])


@pytest.mark.multiproc
# torchsnapshot's is the nightly's (45 s: it reads a snapshot object by object); both go
# through the same fallback (``load_newest``)
@pytest.mark.parametrize("engine", ["dcp", pytest.param("torchsnapshot", marks=pytest.mark.slow)])
def test_resume_past_a_damaged_step_is_bitwise_identical(tmp_path: Path, engine: str) -> None:
    """Train to 6 (checkpoints 3 and 6), damage step 6, start again: the restart says it
    skips 6, resumes from 3, and retrains steps 4-6 to the same losses and the same bits."""
    _train(tmp_path, engine, 6)
    straight = losses(tmp_path)
    want = read_checkpoint(engine, str(tmp_path / "ckpt"), 6)
    assert len(straight) == 6 and {v for k, v in want.items() if k.endswith("train/step")} == {6}
    log = events(tmp_path)
    assert {e["step"] for e in log if e["event"] == "ckpt_committed"} == {3, 6}
    assert all(e["bytes"] > 0 and e["persist_s"] > 0 for e in log
               if e["event"] == "ckpt_committed")
    assert all(e["stall_s"] > 0 for e in log if e["event"] == "ckpt_staged")

    fault = CorruptShard(kind="corrupt_shard", at_step=1, mode="truncate")
    injected = fault.inject(Target(pids={}, coordinates={}, ckpt_url=str(tmp_path / "ckpt"),
                                   rng=random.Random(0)), 6)
    assert injected.skipped is None and injected.detail["engine"] == engine
    assert injected.detail["checkpoint_step"] == 6
    _train(tmp_path, engine, 6)

    log = events(tmp_path)
    skipped = [e for e in log if e["event"] == "restore_skipped"]
    assert {e["rank"] for e in skipped} == {0, 1}
    assert all("step 6 skipped, trying step 3" in e["reason"] for e in skipped)
    assert [e["step"] for e in log if e["event"] == "restore_end"] == [3, 3]
    assert sum(e["event"] == "step_end" and e["step"] == 5 for e in log if e["rank"] == 0) == 2
    assert losses(tmp_path) == straight  # steps 4-6 are the second run's
    assert committed_steps(engine, str(tmp_path / "ckpt")) == [3, 6]
    assert_bitwise_equal(want, read_checkpoint(engine, str(tmp_path / "ckpt"), 6))


@pytest.mark.multiproc
@pytest.mark.slow
def test_torchsnapshot_refuses_to_reshard(tmp_path: Path) -> None:
    """torchsnapshot 0.1.0 cannot save DTensors, so ranks save local shards: a checkpoint
    from dp=2 cannot load into dp=1, and the trainer says why instead of training on."""
    import subprocess

    from tests._trainer import SMALL_MODEL, env

    _train(tmp_path, "torchsnapshot", 3)
    args = [*SMALL_MODEL, "--steps", "6", "--ckpt-every", "3", "--ckpt-engine",
            "torchsnapshot", "--ckpt-url", str(tmp_path / "ckpt"), "--run-dir", str(tmp_path)]
    proc = subprocess.run(torchrun_cmd(1, args), env=env(), capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode != 0
    assert "saved by 2 ranks, this job has 1; torchsnapshot cannot reshard" in proc.stderr


def test_a_torchsnapshot_resume_does_not_say_the_state_was_not_loaded(tmp_path: Path) -> None:
    """torchsnapshot logs a warning for each object read without a target (the optimizer's
    step counts, the train state): "`obj_out` is of type <class 'NoneType'>, which does not
    support in-place load. Its state won't be changed after load." A user read on every
    resume that the state was not restored, though the value read is used. The resume now
    says nothing of the kind, and trains on from the saved step."""
    import subprocess
    import sys

    from tests._trainer import SMALL_MODEL, env

    def train(steps: int) -> subprocess.CompletedProcess[str]:
        args = [*SMALL_MODEL, "--steps", str(steps), "--ckpt-every", "2", "--ckpt-engine",
                "torchsnapshot", "--ckpt-url", str(tmp_path / "ckpt"), "--run-dir",
                str(tmp_path)]
        proc = subprocess.run([sys.executable, "-m", "antifragile.trainer", *args], env=env(),
                              capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    train(2)
    resumed = train(4)
    assert [e["step"] for e in events(tmp_path) if e["event"] == "restore_end"] == [2]
    assert "obj_out" not in resumed.stderr and "won't be changed" not in resumed.stderr, \
        resumed.stderr[-3000:]


# -- chaos run ----------------------------------------------------------------------------------

TRAINER = {"parallel": {"dp": 2, "tp": 1, "pp": 1}, "steps": 12, "batch_size": 8,
           "model": {"layers": 2, "d_model": 32, "heads": 4, "vocab": 64, "seq_len": 16},
           "collective_timeout_s": 30}


def _scenario(name: str, engine: str, faults: list[dict[str, Any]]) -> dict[str, Any]:
    return {"name": name, "seed": 3, "trainer": TRAINER,
            "checkpoint": {"every_steps": 4, "keep_last": 3, "engine": engine},
            "faults": faults, "expect": {"bitwise_equal_to_reference": True,
                                         "max_recovery_s": 120, "max_lost_steps": 8}}


def _chaos_run(tmp_path: Path, doc: dict[str, Any], monkeypatch: pytest.MonkeyPatch
               ) -> tuple[int, str, dict[str, Any]]:
    monkeypatch.setenv("ANTIFRAGILE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / f"{doc['name']}.yaml"
    path.write_text(yaml.safe_dump(doc))
    result = CliRunner().invoke(main, ["run", str(path), "--out", str(tmp_path / "out")])
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    return result.exit_code, result.output, report


@pytest.mark.multiproc
def test_chaos_run_kill_rank_over_dcp_passes(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed at step 10: the checkpoint of step 8 may still be persisting (DCP commits in
    about a second here), so the restart resumes from 8 or, losing it, from 4."""
    code, output, report = _chaos_run(tmp_path, _scenario(
        "kill-dcp", "dcp", [{"kind": "kill_rank", "rank": 1, "at_step": 10}]), monkeypatch)
    assert code == 0, output
    assert report["verdict"] == {"verdict": "pass", "reasons": [], "bitwise_equal": True}
    (fault,) = report["faults"]
    assert fault["restored_step"] in (4, 8)
    assert fault["lost_steps"] >= fault["injected_step"] - fault["restored_step"]
    assert fault["recovery_s"] is not None and fault["recovery_s"] > 0
    committed_ckpts = [c for c in report["checkpoints"] if c["committed"]]
    assert {c["step"] for c in committed_ckpts} >= {4, 12}
    # a save that committed as its processes were killed is known only by the restore that
    # read it (``restored_by``): no figures
    assert all(c["bytes"] > 0 and c["stall_s"] > 0 for c in committed_ckpts
               if "restored_by" not in c)
    assert committed_steps("dcp", report["run"]["checkpoint_url"])[-1] == 12
    assert (tmp_path / "out" / "ckpt" / step_name(12) / MARKERS["dcp"]).is_file()


@pytest.mark.multiproc
@pytest.mark.slow
def test_chaos_run_kill_rank_over_torchsnapshot_passes(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    code, output, report = _chaos_run(tmp_path, _scenario(
        "kill-ts", "torchsnapshot", [{"kind": "kill_rank", "rank": 0, "at_step": 10}]),
        monkeypatch)
    assert code == 0, output
    assert report["verdict"]["bitwise_equal"] is True
    assert report["faults"][0]["restored_step"] in (4, 8)


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_flipped_bit_in_dcp_data_is_not_detected_by_dcp(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """DCP keeps no checksums: a bit flipped in the newest step is restored silently. The
    chaos verdict must then be honest: a damaged step loaded without the engine noticing (or
    never read) is a fault without observable effect, and the verdict fails; it passes only if
    the damage made the load fall back and the final state equals the reference."""
    code, _, report = _chaos_run(tmp_path, _scenario("flip-dcp", "dcp", [
        {"kind": "corrupt_shard", "at_step": 9, "checkpoint": "latest", "mode": "bitflip"},
        {"kind": "kill_rank", "rank": 0, "at_step": 10},
    ]), monkeypatch)
    corrupt = report["faults"][0]
    assert corrupt["kind"] == "corrupt_shard" and corrupt["skipped"] is None
    verdict = report["verdict"]
    assert (code == 0) == (verdict["verdict"] == "pass"), (code, verdict)
    if corrupt["effect_observed"]:  # the flip broke DCP's load: it fell back past the step
        assert "skipped the damaged step" in corrupt["effect"]
    else:  # loaded silently (or never read): the fault proved nothing, the verdict says so
        assert verdict["verdict"] == "fail"
        assert any(r.startswith("corrupt_shard") and "no observable effect" in r
                   for r in verdict["reasons"]), verdict
    assert verdict["verdict"] != "pass" or verdict["bitwise_equal"] is True


def test_entries_that_flatten_to_one_key_are_refused_not_collapsed() -> None:
    """``{"a/b": x}`` beside ``{"a": {"b": y}}``: both flattened to ``a/b`` and one silently
    replaced the other, so the verdict compared one entry and never saw the other."""
    from antifragile.engine import CheckpointError
    from antifragile.trainer.ckpt_backends.base import flat

    assert flat({"a": {"b": 1}, "c": 2}) == {"a/b": 1, "c": 2}
    with pytest.raises(CheckpointError, match="'a/b'"):
        flat({"a/b": 1, "a": {"b": 2}})


@pytest.mark.parametrize(("x", "y"), [
    ({1: 5}, {"1": 5}),
    ({}, []),
    ({"a": 1}, {"b": 1}),
], ids=["int-str-key", "empty-dict-list", "key-renamed"])
def test_torchsnapshot_containers_are_compared_too(tmp_path: Path, x: Any, y: Any) -> None:
    """torchsnapshot keeps a dict's keys (their types) and each container's kind in manifest
    entries of their own; the reader left those out, so the verdict saw two final checkpoints
    as equal where one held ``{1: 5}`` and the other ``{"1": 5}``, or ``{}`` and ``[]``."""
    import torch

    from antifragile.chaos.observe import checker
    from antifragile.trainer.ckpt_backends.snapshot import SnapshotBackend

    def save(run: str, extra: Any) -> str:
        url = str(tmp_path / run)
        backend = SnapshotBackend(url, keep_last=2, timeout_s=30, async_=False)
        backend.save(3, {"model": {"w": torch.arange(4.0)}, "extra": extra}).wait()
        return url

    ref = save("ref", x)
    assert checker.compare_final(save("same", x), ref, 3, engine="torchsnapshot").equal
    assert checker.compare_final(save("got", y), ref, 3, engine="torchsnapshot").differs


@pytest.mark.parametrize("engine", ["dcp", "torchsnapshot"])
def test_latest_waits_for_a_peer_save_in_flight(tmp_path: Path, engine: str) -> None:
    """The peer's async save of the step before the pause point commits a moment after the
    fault is due: ``latest`` is that checkpoint, not the one before it (which no restore
    then reads: a fault without effect). Before, only the engine's own saves were awaited."""
    import threading

    def write_step(step: int, *, marker: bool) -> Path:
        folder = tmp_path / step_name(step)
        folder.mkdir(exist_ok=True)
        (folder / "__0_0.distcp").write_bytes(b"x" * 64)
        if marker:
            (folder / MARKERS[engine]).write_text("{}")
        return folder

    write_step(5, marker=True)
    write_step(10, marker=False)
    committing = threading.Timer(0.5, lambda: write_step(10, marker=True))
    committing.start()
    try:
        target = Target(pids={}, coordinates={}, ckpt_url=str(tmp_path), rng=random.Random(0))
        fault = CorruptShard(kind="corrupt_shard", at_step=12, mode="truncate")
        injection = fault.inject(target, 12)
    finally:
        committing.join()
    assert injection.missed is None and injection.detail["engine"] == engine
    assert injection.detail["checkpoint_step"] == 10


def test_torchsnapshot_falls_back_past_a_truncated_data_file(tmp_path: Path) -> None:
    """corrupt_shard's truncate of a torchsnapshot step: every tensor of a rank sits in one
    batched file, and torchsnapshot 0.1.0 reads a batch's tensors in tasks whose errors it
    never collects (``BatchedBufferConsumer``: asyncio.wait, results unread). The load of
    the damaged step "succeeded" with its tensors left as they were (the fresh model's, in
    the trainer) under the step's own ``train`` entry, and nothing was skipped; the checker's
    ``read`` returned uninitialised memory for them. Now the step is skipped for the one
    before it, and ``read`` refuses it."""
    import torch

    from antifragile.trainer.ckpt_backends.snapshot import SnapshotBackend, data_files, read

    def state(v: float) -> dict[str, Any]:
        return {"model": {"w": torch.full((64,), v), "b": torch.full((8,), v)},
                "train": {"step": int(v), "data_cursor": 10 * int(v)}}

    backend = SnapshotBackend(str(tmp_path), keep_last=3, timeout_s=30, async_=False)
    for step in (1, 2):
        backend.save(step, state(step)).wait(30)
    (data,) = data_files(str(tmp_path), 2)
    data.write_bytes(data.read_bytes()[:data.stat().st_size // 2])
    target = state(0)
    step, skipped = backend.load(target)
    assert (step, target["train"]["step"]) == (1, 1), skipped
    assert torch.equal(target["model"]["w"], torch.full((64,), 1.0))
    assert torch.equal(target["model"]["b"], torch.full((8,), 1.0))
    assert len(skipped) == 1 and "checkpoint step 2 skipped, trying step 1" in skipped[0]
    backend.save(2, state(2)).wait(30)
    (data,) = data_files(str(tmp_path), 2)
    data.write_bytes(b"")
    with pytest.raises(Exception):  # noqa: B017 - torchsnapshot's own error, whatever it is
        read(str(tmp_path), 2)


def test_only_a_skipped_step_is_reported_skipped_by_our_backend(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer reports what its backend's load calls skipped as ``restore_skipped``, and
    chaos reads the step from its reason. Every RuntimeWarning of a load was taken for a skip:
    "step 3: rank 1 saved no copy ... it loads another rank's copy", of a step that loaded,
    read as step 3 skipped (a corrupt_shard there would count as noticed). Other warnings go
    on as warnings."""
    import warnings

    import torch

    from antifragile.engine import CheckpointEngine
    from antifragile.trainer.ckpt_backends.antifragile import AntifragileBackend

    backend = AntifragileBackend(str(tmp_path), keep_last=3, timeout_s=60, async_=False)
    try:
        for step in (3, 6):
            backend.save(step, {"w": torch.full((4,), float(step))}).wait()
        (tmp_path / "step_000000006" / "w" / "c.0").unlink()  # damage the newest
        original = CheckpointEngine.load

        def load_that_warns(self: CheckpointEngine, *a: Any, **k: Any) -> int:
            warnings.warn("step 3: rank 1 saved no copy of values that were saved per rank; "
                          "it loads another rank's copy", RuntimeWarning, stacklevel=2)
            return original(self, *a, **k)

        monkeypatch.setattr(CheckpointEngine, "load", load_that_warns)
        state = {"w": torch.zeros(4)}
        with pytest.warns(RuntimeWarning, match="loads another rank's copy"):
            step, skipped = backend.load(state)
    finally:
        backend.close()
    assert step == 3 and torch.equal(state["w"], torch.full((4,), 3.0))
    assert len(skipped) == 1 and skipped[0].startswith("checkpoint step 6 skipped"), skipped


@pytest.mark.parametrize("engine", ["dcp", "torchsnapshot"])
def test_latest_waits_for_a_peers_first_save_in_flight(tmp_path: Path, engine: str) -> None:
    """The run's first checkpoint still persisting when the fault is due: no commit marker of
    the peer is there yet, so the checkpoints were taken for ours, none of which ever commits,
    and the fault was missed after ``SETTLE_S``. The scenario's engine says whose they are."""
    import threading
    import time

    folder = tmp_path / step_name(5)
    folder.mkdir()
    (folder / "__0_0.distcp").write_bytes(b"x" * 64)
    committing = threading.Timer(0.5, lambda: (folder / MARKERS[engine]).write_text("{}"))
    committing.start()
    began = time.monotonic()
    try:
        target = Target(pids={}, coordinates={}, ckpt_url=str(tmp_path), rng=random.Random(0),
                        ckpt_engine=engine)
        fault = CorruptShard(kind="corrupt_shard", at_step=6, mode="truncate")
        injection = fault.inject(target, 6)
    finally:
        committing.join()
    assert injection.missed is None, injection
    assert injection.detail["engine"] == engine and injection.detail["checkpoint_step"] == 5
    assert time.monotonic() - began < 10  # not SETTLE_S (30 s)
