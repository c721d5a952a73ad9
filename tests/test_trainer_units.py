"""Trainer pieces that need no processes: data, model split, configuration."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from antifragile.trainer.abort import (
    PARKED_S,
    STUCK_AFTER_S,
    STUCK_GAPS,
    STUCK_MIN_S,
    FailureWatch,
    GlooSockets,
    stuck_bound,
    thread_wait,
)
from antifragile.trainer.config import TrainConfig, parse_args
from antifragile.trainer.data import TokenData
from antifragile.trainer.model import GPT, ModelConfig, init_weights, keep_stage, split_layers
from antifragile.trainer.parallel.dims import ParallelDims
from antifragile.trainer.pause import HoldInterrupted, PausePoints
from antifragile.trainer.progress import Phase, SharedProgress
from antifragile.trainer.recovery import JobStore, signal_failure


def test_synthetic_batches_are_a_function_of_the_cursor() -> None:
    data = TokenData(seq_len=16, vocab=64, seed=3)
    a_in, a_tg = data.batch(40, 8)
    b_in, b_tg = TokenData(seq_len=16, vocab=64, seed=3).batch(40, 8)
    assert torch.equal(a_in, b_in) and torch.equal(a_tg, b_tg)
    assert torch.equal(a_in[:, 1:], a_tg[:, :-1])  # targets are the inputs shifted by one
    assert not torch.equal(data.batch(48, 8)[0], a_in)
    assert torch.equal(data.batch(44, 4)[0], a_in[4:])  # resuming mid-stream sees the same rows
    assert int(a_in.max()) < 64


def test_file_backed_tokens(tmp_path: Path) -> None:
    path = tmp_path / "tokens.npy"
    np.save(path, np.arange(1000, dtype=np.int32) % 50)
    data = TokenData(seq_len=16, vocab=50, seed=0, path=str(path))
    inputs, targets = data.batch(0, 4)
    assert inputs.shape == (4, 16) and torch.equal(inputs[:, 1:], targets[:, :-1])
    assert torch.equal(TokenData(seq_len=16, vocab=50, seed=0, path=str(path)).batch(0, 4)[0],
                       inputs)
    np.save(tmp_path / "bad.npy", np.arange(100, dtype=np.int32))
    with pytest.raises(ValueError, match="outside"):
        TokenData(seq_len=16, vocab=50, seed=0, path=str(tmp_path / "bad.npy"))


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint16, np.uint8])
def test_a_token_file_of_any_integer_dtype_gives_the_same_batches(tmp_path: Path,
                                                                  dtype: type) -> None:
    """A file of int64 ids (numpy's default integer, what ``np.save(np.array(ids))`` writes)
    gave samples that were views of the read-only memory map: torch warned in every training
    process that the array is not writable (and the tensor aliased the file, which a rewrite
    of it changes under the run). Every dtype now gives the same, own, batches, silently
    (warnings are errors here)."""
    ids = np.arange(1000) % 50
    reference = tmp_path / "int32.npy"
    np.save(reference, ids.astype(np.int32))
    path = tmp_path / "tokens.npy"
    np.save(path, ids.astype(dtype))
    data = TokenData(seq_len=16, vocab=50, seed=0, path=str(path))
    sample = data.sample(3)
    assert sample.dtype == torch.int64
    assert torch.equal(sample, TokenData(seq_len=16, vocab=50, seed=0,
                                         path=str(reference)).sample(3))
    sample += 1  # its own memory: the file and the next sample are unchanged
    assert torch.equal(data.sample(3), sample - 1)


def test_every_window_of_a_token_file_is_sampled(tmp_path: Path) -> None:
    """A sample is ``seq_len + 1`` tokens from a start drawn below ``len - seq_len - 1``
    (exclusive): the file's last window (its last token) was never drawn, and a file of
    exactly one window was refused as too short."""
    path = tmp_path / "tokens.npy"
    np.save(path, np.arange(18, dtype=np.int32))  # seq_len 16: two windows, starts 0 and 1
    data = TokenData(seq_len=16, vocab=50, seed=0, path=str(path))
    starts = {int(data.sample(i)[0]) for i in range(64)}
    assert starts == {0, 1}
    np.save(path, np.arange(17, dtype=np.int32))  # exactly one window
    assert torch.equal(TokenData(seq_len=16, vocab=50, seed=0, path=str(path)).sample(5),
                       torch.arange(17))
    np.save(path, np.arange(16, dtype=np.int32))
    with pytest.raises(ValueError, match="16 tokens, need at least 17"):
        TokenData(seq_len=16, vocab=50, seed=0, path=str(path))


def _npy(header: str) -> bytes:
    """A version 1.0 .npy file of ``header`` (padded as numpy pads it) and 400 zero bytes."""
    text = header.encode()
    text += b" " * (-(10 + len(text) + 1) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + bytes(400)


@pytest.mark.parametrize(("make", "message"), [
    (None, "No such file"),
    (lambda p: np.save(p, np.arange(100, dtype=np.int32)), "token ids outside [0, 50)"),
    (lambda p: np.save(p, np.zeros((4, 40), dtype=np.int32)), "1-D integer token array"),
    # numpy counts timedelta64 among its integer types: it passed the dtype check, then the
    # id range check died converting a timedelta to int (TypeError, a traceback)
    (lambda p: np.save(p, np.zeros(100, dtype="m8[s]")), "1-D integer token array"),
    (lambda p: np.save(p, np.array([{"a": 1}], dtype=object)), "Python objects"),
    (lambda p: p.write_text("not tokens\n"), "allow_pickle"),
    (lambda p: np.savez(open(p, "wb"), np.arange(100)), "not a .npy"),  # noqa: SIM115
    (lambda p: p.write_bytes(b""), "empty"),
    # a header cut short inside its dict (numpy's tokenizer raised TokenError) or with a shape
    # beyond any array (OverflowError): tracebacks, not usage errors
    (lambda p: p.write_bytes(_npy("{'descr': '<i4', 'fortran_order': False, 'shape': (10,), ")),
     "malformed .npy header"),
    (lambda p: p.write_bytes(_npy("{'descr': '<i4', 'fortran_order': False, "
                                  f"'shape': ({10**22},), }}")), "malformed .npy header"),
])
def test_an_unusable_token_file_is_refused_before_training(
        tmp_path: Path, make: Any, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A --data-path the trainer cannot read (missing, ids beyond --vocab, not a 1-D .npy) is
    a usage error: one line naming the option, exit 2, before any rank starts (it was a
    traceback in every training process, exit 1, which torchrun restarts)."""
    path = tmp_path / "tokens.npy"
    if make is not None:
        make(path)
    with pytest.raises(SystemExit) as exc:
        parse_args(["--data-path", str(path), "--vocab", "50", "--seq-len", "16"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("python -m antifragile.trainer: error: --data-path ")
    assert message in err


def test_stages_keep_the_full_models_names() -> None:
    cfg = ModelConfig(layers=5, d_model=32, heads=4, vocab=64, seq_len=8)
    assert [list(r) for r in split_layers(5, 2)] == [[0, 1, 2], [3, 4]]
    full = GPT(cfg)
    init_weights(full, seed=1)
    names = set(full.state_dict())
    parts = []
    for stage in range(2):
        part = GPT(cfg)
        init_weights(part, seed=1)
        parts.append(keep_stage(part, stage, 2).state_dict())
    assert set(parts[0]) | set(parts[1]) == names and not set(parts[0]) & set(parts[1])
    assert "layers.4.attn.wq.weight" in parts[1]
    assert all(torch.equal(parts[1][k], full.state_dict()[k]) for k in parts[1])


def test_pipeline_stages_compose_to_the_full_model() -> None:
    cfg = ModelConfig(layers=4, d_model=32, heads=4, vocab=64, seq_len=8)
    full = GPT(cfg)
    init_weights(full, seed=2)
    stages = []
    for s in range(2):
        part = GPT(cfg)
        init_weights(part, seed=2)
        stages.append(keep_stage(part, s, 2))
    tokens = torch.randint(64, (2, 8))
    assert torch.equal(stages[1](stages[0](tokens)), full(tokens))


@pytest.mark.parametrize(("argv", "message"), [
    (["--dp", "3", "--batch-size", "8"], "not divisible by dp"),
    (["--tp", "3"], "heads 4 not divisible by tp 3"),
    (["--pp", "8", "--layers", "4", "--micro-batches", "8"], "cannot fill"),
    (["--pp", "2", "--micro-batches", "3"], "micro-batches"),
    (["--heads", "0"], "heads must be >= 1"),
    (["--pp", "2", "--micro-batches", "0"], "micro_batches must be >= 1, got 0"),
    (["--micro-batches", "-1"], "micro_batches must be >= 1, got -1"),
    (["--ckpt-every", "0"], "ckpt_every must be >= 1, got 0"),
    # accepted, then trained (for ever) toward a last step whose final checkpoint the engine
    # refuses (a step is below 2**62); a scenario's trainer.steps is refused so
    (["--steps", str(2**62)], "steps must be below 2**62 (the engine's bound on a step: the "
     "run's final checkpoint is of its last step), got 4611686018427387904"),
    # accepted before, then refused by the training process with a traceback on every rank
    # (exit 1; a restart under torchrun's --max-restarts), or silently harmful
    (["--keep-last", "0"], "keep_last must be >= 1, got 0"),
    (["--lr", "-1"], "lr must be a finite number >= 0, got -1.0"),
    (["--lr", "nan"], "lr must be a finite number >= 0, got nan"),
    (["--seed", str(2**64)], "seed must be"),
    (["--collective-timeout-s", "0"], "collective_timeout_s must be a finite number > 0"),
    (["--collective-timeout-s", "-5"], "collective_timeout_s must be a finite number > 0"),
    (["--ckpt-timeout-s", "0"], "ckpt_timeout_s must be a finite number > 0"),
    # accepted, then every training process died with a traceback: the launcher's store
    # cannot be reached in 1 ms, nor the job's workers gathered for the first formation in
    # 10 ms (exit 1 on every rank, which torchrun restarts into the same)
    (["--collective-timeout-s", "0.001"],
     "collective_timeout_s must be at least 1 s (it bounds each worker's connection to the "
     "launcher's store and the wait for every worker to start), got 0.001"),
    (["--collective-timeout-s", "0.5"], "collective_timeout_s must be at least 1 s"),
    # accepted, then every save failed waiting on its writes (OverflowError: a lock's timeout
    # past threading.TIMEOUT_MAX, 9.2e9 s): the run trained to its end unsaved and exited 46;
    # a collective timeout past timedelta's range was a traceback in every training process
    (["--ckpt-timeout-s", "1e10"], "ckpt_timeout_s must be a finite number > 0 and at most"),
    (["--collective-timeout-s", "1e14"],
     "collective_timeout_s must be a finite number > 0 and at most"),
    (["--final-save-patience-s", "nan"], "final_save_patience_s must be a finite number >= 0"),
    # accepted, and the last save was retried forever (NaN was refused for exactly that)
    (["--final-save-patience-s", "inf"], "final_save_patience_s must be a finite number >= 0 "
                                         "and at most 1e+09 s, got inf"),
    (["--hang-timeout-s", "nan"], "hang_timeout_s must be > 0, got nan"),
    # accepted, and any pause between two blocks' forwards longer than it was a "hang" that
    # killed the process; the supervisor looks at the counter only every 0.05 s
    (["--hang-timeout-s", "0.01"], "hang_timeout_s must be at least 0.1 s"),
    (["--lease-s", "nan"], "lease_s must be a finite number >= 1 s"),
    (["--lease-s", "5"], "--lease-s: leases are held only under recovery in_process"),
    # accepted under the adaptive hang timeout: an infinite lease never judged a host lost, a
    # tiny one was renewed every lease_s / 4 (a busy loop on the store) and took a renewal late
    # by a store round trip for a lost host, and one of 30 s or more outlasted the survivors'
    # stall escalation (3 x the adaptive timeout, whose floor is 10 s): their own watchdogs
    # killed them before the lost host was declared
    (["--recovery", "in_process", "--lease-s", "inf"],
     "lease_s must be a finite number >= 1 s (four renewals at the heartbeat's 0.25 s), got inf"),
    (["--recovery", "in_process", "--lease-s", "0"], "lease_s must be a finite number >= 1 s"),
    (["--recovery", "in_process", "--lease-s", "-3"], "lease_s must be a finite number >= 1 s"),
    (["--recovery", "in_process", "--lease-s", "0.01"], "lease_s must be a finite number >= 1 s"),
    (["--recovery", "in_process", "--lease-s", "30"],
     "--lease-s: 30 s is not below the watchdog's stall escalation under the adaptive hang "
     "timeout, 3 x its floor of 10 s = 30 s: set --hang-timeout-s, or a shorter --lease-s"),
    (["--recovery", "in_process", "--hang-timeout-s", "2", "--lease-s", "6"],
     "--lease-s: 6 s is not below the watchdog's stall escalation, 3 x --hang-timeout-s = 6 s"),
    # the default lease (1.5 x a short hang timeout) fell below the 1 s refused when given:
    # a 0.05 s timeout leased for 75 ms, renewed every 19 ms (a busy loop on the store)
    (["--recovery", "in_process", "--hang-timeout-s", "0.3"],
     "--hang-timeout-s: 0.3 is too short under recovery in_process: the lease that finds a "
     "lost host (at least 1 s) must be below 3 x it; set --hang-timeout-s above 0.33"),
    # a tp rank left no row of the vocabulary: every rank died in the embedding's forward
    # (index_select(): self indexing axis dim should be positive), exit 1
    (["--tp", "4", "--vocab", "9"], "vocab 9 leaves tp rank 3 of 4 no rows"),
    (["--tp", "2", "--vocab", "1"], "vocab 1 leaves tp rank 1 of 2 no rows"),
    # chunks of 2, 2, 1: rank 2 holds a row, rank 3 none (the message named rank 2)
    (["--tp", "4", "--vocab", "5"], "vocab 5 leaves tp rank 3 of 4 no rows"),
    # in-process recovery gets survivors out of their collectives by shutting down gloo's
    # connections, which does not interrupt an NCCL collective: on CUDA it was accepted and
    # never run (survivors would wait in NCCL until judged stuck and killed)
    (["--device", "cuda", "--recovery", "in_process"],
     "recovery in_process is built for --device cpu (gloo)"),
])
def test_bad_configuration_is_rejected_with_a_reason(argv: list[str], message: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "option", "need"), [
    # one layer's scores (micro-batch 8 x 4 heads x seq_len**2) and the position embedding
    (["--seq-len", str(10**12)], "--seq-len 1000000000000", (8 * 4 * 10**24 + 10**12 * 64) * 4),
    (["--vocab", str(10**12)], "--vocab 1000000000000", 2 * 10**12 * 64 * 4),  # embeddings
])
def test_a_size_no_memory_here_holds_is_a_usage_error_naming_it(
        argv: list[str], option: str, need: int, capsys: pytest.CaptureFixture[str]) -> None:
    """--seq-len 10**12 ran until torch's allocator refused the position embedding: a
    traceback (exit 1, which torchrun restarts) that named no option; a size the machine
    could nearly hold ended in an out-of-memory kill. A size whose weights and one layer's
    attention scores alone exceed the memory available is refused up front: exit 2, naming
    the option and the bytes it needs."""
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"python -m antifragile.trainer: error: {option}: needs at least "), err
    assert f"{option}: {need:,}" in err and "bytes of memory available here" in err, err
    done = subprocess.run([sys.executable, "-m", "antifragile.trainer", "--steps", "1",
                           "--layers", "1", "--d-model", "8", "--heads", "2", "--vocab", "16",
                           "--batch-size", "2", *argv], capture_output=True, text=True,
                          timeout=60, preexec_fn=_limit_memory)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"error: {option}: needs at least" in done.stderr and "Traceback" not in done.stderr
    parse_args(["--seq-len", "256", "--vocab", "50000"])  # a real size still passes


def _limit_memory() -> None:
    """The child's address space held to 8 GiB: on the unfixed code its allocation fails
    there instead of taking a shared machine's memory."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))


def test_a_run_dir_that_cannot_be_made_is_a_usage_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--run-dir under a plain file: every rank died with a traceback opening its event log
    (exit 1, which torchrun restarts); now one line naming the option, exit 2."""
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as exc:
        parse_args(["--run-dir", str(tmp_path / "file" / "run")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("python -m antifragile.trainer: error: --run-dir ")
    assert parse_args(["--run-dir", str(tmp_path / "run")]).run_dir == str(tmp_path / "run")


@pytest.mark.parametrize("option", ["--ckpt-url", "--run-dir"])
def test_an_empty_path_option_is_a_usage_error(
        tmp_path: Path, option: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--ckpt-url ""`` (an unset variable, ``--ckpt-url "$CKPT"``) was taken for no
    --ckpt-url: the run trained without a checkpoint and exited 0; ``--run-dir ""`` made an
    ``events`` folder in the working directory and then wrote no event at all."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        parse_args([option, ""])
    assert exc.value.code == 2
    assert f"{option[2:].replace('-', '_')} must not be empty" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("url", ["file://", "s3://", "s3:///", "s3:///prefix", "s3a:///p/q"])
def test_a_ckpt_url_that_names_no_place_is_a_usage_error(
        tmp_path: Path, url: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A URL scheme and nothing else (an unset variable, ``--ckpt-url "s3://$BUCKET"``) was
    accepted: ``file://`` wrote the checkpoints into the working directory (and retention
    removed its ``step_*`` folders), ``s3://`` made every rank die opening the engine
    (CheckpointError traceback, exit 1, which torchrun restarts into the same). Now one line
    naming the option, exit 2, as ``--ckpt-url ""`` is. A prefix without a bucket
    (``s3:///prefix``: an empty ``$BUCKET`` before a prefix) passed too, and rank 0 died listing
    the step folders with a StorageError traceback."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        parse_args(["--ckpt-url", url])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"python -m antifragile.trainer: error: --ckpt-url {url}: "), err
    assert "names no folder" in err or "names no bucket" in err, err
    assert parse_args(["--ckpt-url", "s3://bucket"]).ckpt_url == "s3://bucket"


@pytest.mark.parametrize(("url", "why"), [
    *((url, "not a file URL (give file:///abs/path or a plain path)")
      for url in ("file:/tmp/ckpt", "file:", "file:ckpt")),
    *((url, "not an S3 URL (give s3://bucket/prefix)") for url in ("s3:/b/ckpt", "s3:b"))])
def test_a_ckpt_url_that_is_no_file_or_s3_url_is_a_usage_error(
        url: str, why: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--ckpt-url file:/tmp/ckpt`` (RFC 8089's short form) was taken as the relative folder
    ``file:/tmp/ckpt`` under the working directory: the checkpoints went where nobody looks;
    ``s3:/b/ckpt`` (a typo of s3://) still is."""
    with pytest.raises(SystemExit) as exc:
        parse_args(["--ckpt-url", url])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == f"python -m antifragile.trainer: error: --ckpt-url {url}: {why}", err


def test_a_ckpt_url_in_each_processs_own_memory_is_a_usage_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--ckpt-url memory://...`` was accepted (chaos refuses it in a scenario): under
    torchrun each rank saved into its own process's memory, so rank 0 never saw the others'
    records and every save failed at its commit deadline (--ckpt-timeout-s, 600 s by
    default), the last one too: exit 46, a restart that trains it all again into the same.
    Alone, what it saved was gone when the run ended. Now one line naming the option, exit
    2."""
    url = "memory://ckpt"
    with pytest.raises(SystemExit) as exc:
        parse_args(["--ckpt-url", url])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"python -m antifragile.trainer: error: --ckpt-url {url}: "), err
    assert "each process's own memory" in err, err


@pytest.mark.parametrize("url", ["nonsense://bucket/ckpt", "S3://bucket/ckpt", "File:///tmp/ckpt"])
def test_a_ckpt_url_of_a_scheme_no_storage_serves_is_a_usage_error(
        url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A URL whose scheme no storage knows (a typo, another case: the engine reads ``S3://``
    and ``File://`` as fsspec protocols, which have none of that name) was accepted, then
    every rank died opening the engine (CheckpointError "Protocol not known" traceback, exit
    1, which torchrun restarts into the same). Now one line naming the option, exit 2."""
    with pytest.raises(SystemExit) as exc:
        parse_args(["--ckpt-url", url])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"python -m antifragile.trainer: error: --ckpt-url {url}: "), err
    assert f"no storage for {url.partition(':')[0]}://" in err, err


@pytest.mark.parametrize(("url", "reason"), [
    ("https://example.com/ckpt", "https:// storage only reads, and checkpoints are written"),
    ("http://[::1", "not a valid URL (Invalid IPv6 URL)"),
])
def test_a_ckpt_url_no_checkpoint_can_be_written_to_is_a_usage_error(
        url: str, reason: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A read-only scheme (http, https) or a malformed URL was accepted; every rank then
    failed its first save (or its first listing). Now one line naming the option, exit 2:
    the same check as a scenario's checkpoint.url (``engine.storage.no_storage_for``)."""
    with pytest.raises(SystemExit) as exc:
        parse_args(["--ckpt-url", url])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"python -m antifragile.trainer: error: --ckpt-url {url}: {reason}"), err


@pytest.mark.parametrize("where", ["file", "file/ckpt"])
def test_a_local_ckpt_url_that_cannot_be_a_folder_is_a_usage_error(
        tmp_path: Path, where: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--ckpt-url a plain file: every rank died opening the engine (CheckpointError traceback,
    exit 1, which torchrun restarts into the same); under a plain file: every save failed, the
    run trained to the end without a checkpoint, retried the last save for its patience and
    exited 46 for a restart that trains it all again. Now one line naming the option, exit 2;
    a folder not made yet is accepted, and not made by the check."""
    (tmp_path / "file").write_text("")
    for url in (str(tmp_path / where), f"file://{tmp_path / where}"):
        with pytest.raises(SystemExit) as exc:
            parse_args(["--ckpt-url", url])
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith(f"python -m antifragile.trainer: error: --ckpt-url {url}: "), err
        assert f"{tmp_path / 'file'} is a file" in err, err
    fresh = tmp_path / "new" / "ckpt"
    assert parse_args(["--ckpt-url", str(fresh)]).ckpt_url == str(fresh)
    assert not (tmp_path / "new").exists()


def test_a_local_ckpt_url_under_a_link_to_nothing_is_a_usage_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--ckpt-url under a link whose target is missing (a disk not mounted): the check walked
    past the link to its folder and accepted it; every rank then died opening the engine,
    which refuses it (exit 1, restarted into the same)."""
    (tmp_path / "disk").symlink_to(tmp_path / "unmounted")
    url = str(tmp_path / "disk" / "ckpt")
    with pytest.raises(SystemExit) as exc:
        parse_args(["--ckpt-url", url])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(f"--ckpt-url {url}: {tmp_path / 'disk'} is a link to "
                        f"{tmp_path / 'unmounted'}, which does not exist"), err


@pytest.mark.parametrize(("tp", "vocab"), [(4, 7), (4, 10), (2, 63), (4, 4)])
def test_a_vocabulary_every_tp_rank_holds_rows_of_is_accepted(tp: int, vocab: int) -> None:
    """Uneven vocabulary shards train (tp 4, vocab 7: rows 2, 2, 2, 1); only a shard left
    empty is refused."""
    cfg = parse_args(["--tp", str(tp), "--heads", "4", "--vocab", str(vocab)])
    assert cfg.model.vocab == vocab


def test_gpipe_takes_fewer_micro_batches_than_stages() -> None:
    """GPipe runs every micro-batch forward, then every one backward: it needs no more of them
    than stages (torch's ScheduleGPipe takes one micro-batch through two stages, and trains
    as the whole model does). Only 1F1B, whose steady state keeps one in flight per stage,
    needs as many as stages (torch's Schedule1F1B refuses fewer); the config refused both."""
    cfg = parse_args(["--pp", "2", "--schedule", "gpipe", "--micro-batches", "1"])
    assert (cfg.schedule, cfg.micro_batches, cfg.parallel.pp) == ("gpipe", 1, 2)
    with pytest.raises(ValueError, match="1 micro-batches cannot fill 2 pipeline stages "
                                         "under the 1f1b schedule"):
        TrainConfig(parallel=ParallelDims(pp=2), schedule="1f1b", micro_batches=1)


def test_config_defaults_are_consistent() -> None:
    cfg = TrainConfig(parallel=ParallelDims(dp=2, tp=2, pp=2), micro_batches=2)
    assert cfg.parallel.world_size == 8


def _checkpointer(tmp_path: Path, *, keep_last: int = 2) -> tuple[Any, Any]:
    """The trainer's checkpointer of a small model over our engine (async saves) in
    ``tmp_path / "ckpt"``, and its event log (``tmp_path / "events"``)."""
    from antifragile.trainer.checkpoint import TrainCheckpointer
    from antifragile.trainer.ckpt_backends.antifragile import AntifragileBackend
    from antifragile.trainer.events import EventLog

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    backend = AntifragileBackend(str(tmp_path / "ckpt"), keep_last=keep_last, timeout_s=30.0,
                                 async_=True)
    events = EventLog(str(tmp_path), rank=0, attempt=0)
    return TrainCheckpointer(backend, model, optimizer, events), events


def test_a_retention_failure_after_the_commit_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save is done at its COMMIT while the coordinator's retention still runs; a retention
    that fails after the trainer saw the commit is still reported (``ckpt_retention_failed``)."""
    import json
    import threading
    import time

    ckpt, events = _checkpointer(tmp_path, keep_last=1)
    backend = ckpt.backend
    ckpt.save(1, 0, blocking=True)
    release = threading.Event()

    def refuse(prefix: str) -> None:
        release.wait(30)
        raise PermissionError(f"delete refused: {prefix}")

    monkeypatch.setattr(backend.engine.storage.inner, "delete_tree", refuse)
    ckpt.save(2, 8, blocking=False)
    handle = ckpt._pending
    assert handle is not None
    deadline = time.monotonic() + 30
    while not handle.done() and time.monotonic() < deadline:  # committed; retention waits
        time.sleep(0.01)
    assert handle.done() and handle.exception() is None
    ckpt.poll()
    release.set()
    ckpt.close()
    events.close()
    lines = [json.loads(line) for line in (tmp_path / "events" / "rank0.jsonl").open()]
    kinds = [(e["event"], e.get("step")) for e in lines]
    assert ("ckpt_committed", 2) in kinds
    failed = [e for e in lines if e["event"] == "ckpt_retention_failed"]
    assert len(failed) == 1 and failed[0]["step"] == 2
    assert "PermissionError" in failed[0]["error"]


def test_the_reported_stall_is_the_whole_wait_of_the_training_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ckpt_staged``'s ``stall_s`` is what the loop waited for the save, as it is for DCP
    and torchsnapshot (their handles time the whole call): our engine's save() also waits in
    its collectives for the slowest rank (0.2 s here), which its staging copy alone leaves out."""
    import json
    import time

    ckpt, events = _checkpointer(tmp_path)
    ckpt.save(1, 0, blocking=True)  # plans and allocates the staging area
    ranks = ckpt.backend.engine._ranks
    all_max = ranks.all_max

    def slow_rank(values: list[int]) -> list[int]:
        time.sleep(0.2)  # the other ranks are not there yet
        return all_max(values)

    monkeypatch.setattr(ranks, "all_max", slow_rank)
    start = time.perf_counter()
    ckpt.save(2, 8, blocking=False)
    waited = time.perf_counter() - start
    ckpt.close()
    events.close()
    lines = [json.loads(line) for line in (tmp_path / "events" / "rank0.jsonl").open()]
    (staged,) = [e for e in lines if e["event"] == "ckpt_staged" and e["step"] == 2]
    assert 0.2 <= staged["stall_s"] <= waited, (staged["stall_s"], waited)


def _final_save_setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refuse_for_s: float
                      ) -> tuple[Any, Any, Path]:
    """A checkpointer whose storage refuses every write for ``refuse_for_s`` from now."""
    import time

    ckpt, events = _checkpointer(tmp_path)
    storage = ckpt.backend.engine.storage.inner
    write, until = storage.write, time.monotonic() + refuse_for_s

    def refusing(key: str, *args: Any, **kwargs: Any) -> None:
        if time.monotonic() < until:
            raise PermissionError(f"storage refuses {key}")
        write(key, *args, **kwargs)

    monkeypatch.setattr(storage, "write", refusing)
    return ckpt, events, tmp_path / "events"


def _kinds(events_dir: Path) -> list[tuple[str, Any]]:
    import json

    lines = (events_dir / "rank0.jsonl").read_text().splitlines()
    return [(e["event"], e.get("step")) for e in map(json.loads, lines)]


def test_the_last_checkpoint_is_retried_until_storage_takes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A periodic save that fails is superseded by the next; the last one is not, so it is
    retried with backoff (storage refusing for 2.5 s: attempts at 0, 1 and 3 s)."""
    ckpt, events, events_dir = _final_save_setup(tmp_path, monkeypatch, refuse_for_s=2.5)
    assert ckpt.save_final(7, 56, patience_s=30) is True
    ckpt.close()
    events.close()
    kinds = _kinds(events_dir)
    assert kinds.count(("ckpt_failed", 7)) == 2 and kinds.count(("ckpt_retry", 7)) == 2
    last_failure = max(i for i, k in enumerate(kinds) if k == ("ckpt_failed", 7))
    assert kinds.index(("ckpt_committed", 7)) > last_failure
    assert ckpt.backend.engine.steps() == [7]


def test_the_last_checkpoint_whose_commit_answer_was_lost_is_committed_on_its_retry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Storage applied the last save's COMMIT but its answer was lost: the save failed, and
    its retry finds that checkpoint, intact and equal to the state, so the run ends
    committed (it used to be refused as already committed until the patience ran out)."""
    ckpt, events, events_dir = _final_save_setup(tmp_path, monkeypatch, refuse_for_s=0)
    storage = ckpt.backend.engine.storage.inner
    create, lost = storage.create, []  # a COMMIT is written by an atomic create

    def losing(key: str, *args: Any, **kwargs: Any) -> None:
        create(key, *args, **kwargs)
        if key.endswith("/COMMIT") and not lost:
            lost.append(key)
            raise PermissionError(f"the answer to {key} was lost")

    monkeypatch.setattr(storage, "create", losing)
    assert ckpt.save_final(7, 56, patience_s=30) is True
    ckpt.close()
    events.close()
    kinds = _kinds(events_dir)
    assert kinds.count(("ckpt_failed", 7)) == 1 and kinds.count(("ckpt_retry", 7)) == 1
    assert kinds.index(("ckpt_committed", 7)) > kinds.index(("ckpt_failed", 7))
    assert lost and ckpt.backend.engine.steps() == [7]


def test_the_last_checkpoint_gives_up_after_its_patience(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt, events, events_dir = _final_save_setup(tmp_path, monkeypatch, refuse_for_s=60)
    assert ckpt.save_final(7, 56, patience_s=2.5) is False  # attempts at 0 and 1 s
    ckpt.close()
    events.close()
    kinds = _kinds(events_dir)
    assert kinds.count(("ckpt_failed", 7)) == 2 and ("ckpt_committed", 7) not in kinds
    assert ckpt.backend.engine.steps() == []


def test_the_trainer_runs_as_one_process_without_torchrun(tmp_path: Path) -> None:
    """``python -m antifragile.trainer`` without torchrun is one rank with nobody to supervise
    it (``launch_info`` gives it an in-process store); it died at its first step with
    ``KeyError: 'MASTER_ADDR'``, looking for torchrun's store."""
    import subprocess

    from _trainer import SMALL_MODEL, env

    proc = subprocess.run(
        [sys.executable, "-m", "antifragile.trainer", *SMALL_MODEL, "--steps", "2",
         "--ckpt-every", "2", "--ckpt-url", str(tmp_path / "ckpt"), "--run-dir", str(tmp_path)],
        env={k: v for k, v in env().items() if k not in ("MASTER_ADDR", "RANK")},
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "ckpt" / "step_000000002" / "COMMIT").exists()


@pytest.mark.s3
def test_a_missing_bucket_or_refused_credentials_at_resume_is_one_line_and_exit_2(
        tmp_path: Path, s3_server: dict[str, Any],
        s3_bucket: tuple[str, dict[str, Any]]) -> None:
    """``--ckpt-url`` in a bucket that does not exist, or with credentials the endpoint
    refuses, printed a StorageError traceback on rank 0 at resume, exit 1: a launcher would
    restart it into the same refusal. Now one line naming the URL and why, exit 2 (as
    ``chaos ckpt ls`` answers them); a storage that fails otherwise stays restartable."""
    import subprocess

    from _trainer import SMALL_MODEL, env

    url, _ = s3_bucket
    base = {k: v for k, v in env().items() if k not in ("MASTER_ADDR", "RANK")}
    base.update(AWS_ENDPOINT_URL=s3_server["endpoint_url"],
                AWS_ACCESS_KEY_ID=s3_server["key"] or "", AWS_SECRET_ACCESS_KEY="")
    for ckpt_url, secret, why in (("s3://no-such-bucket-trainer/run", s3_server["secret"],
                                   "bucket 'no-such-bucket-trainer' does not exist"),
                                  (url, "wrong", "PermissionError")):
        proc = subprocess.run(
            [sys.executable, "-m", "antifragile.trainer", *SMALL_MODEL, "--steps", "2",
             "--ckpt-url", ckpt_url, "--run-dir", str(tmp_path / secret)],
            env={**base, "AWS_SECRET_ACCESS_KEY": secret or ""},
            capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith(f"antifragile.trainer: error: --ckpt-url {ckpt_url}: "), last
        assert why in last, last


def test_storage_that_cannot_be_reached_at_resume_is_one_line_and_stays_restartable(
        tmp_path: Path) -> None:
    """An S3 endpoint that refuses every connection at resume (an outage, or a wrong port)
    ended rank 0 in a StorageError traceback. A restart may find the storage back, so the
    exit stays 1 (torchrun restarts it), not the usage error's 2; but what the run says is
    one line naming the URL, why and that a restart retries, as the other resume errors."""
    import socket
    import subprocess

    from _trainer import SMALL_MODEL, env

    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {k: v for k, v in env().items() if k not in ("MASTER_ADDR", "RANK")}
    base.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="k",
                AWS_SECRET_ACCESS_KEY="s")
    proc = subprocess.run(
        [sys.executable, "-m", "antifragile.trainer", *SMALL_MODEL, "--steps", "2",
         "--ckpt-url", "s3://unreachable/run", "--run-dir", str(tmp_path)],
        env=base, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("antifragile.trainer: error: --ckpt-url s3://unreachable/run: "), last
    assert "connection refused" in last.lower() and "a restart retries" in last, last


def test_several_ranks_without_torchrun_are_refused_naming_torchrun(tmp_path: Path) -> None:
    """It said "torchrun started 1 workers", of a run that torchrun did not start."""
    import subprocess

    from _trainer import SMALL_MODEL, env

    proc = subprocess.run(
        [sys.executable, "-m", "antifragile.trainer", *SMALL_MODEL, "--dp", "2", "--steps", "2",
         "--batch-size", "2", "--run-dir", str(tmp_path)],
        env={k: v for k, v in env().items() if k not in ("MASTER_ADDR", "RANK")},
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "torchrun started" not in proc.stderr
    assert "without torchrun" in proc.stderr and "--nproc-per-node 2" in proc.stderr


@pytest.mark.parametrize(("recovery", "attempt_store", "agent_store", "message"), [
    ("restart", "127.0.0.1", "", "ANTIFRAGILE_ATTEMPT_STORE='127.0.0.1': expected <host>:<port>"),
    ("in_process", "127.0.0.1:port", "", "ANTIFRAGILE_ATTEMPT_STORE='127.0.0.1:port': expected "
                                         "<host>:<port>"),
    ("restart", "127.0.0.1:0", "", "ANTIFRAGILE_ATTEMPT_STORE='127.0.0.1:0': expected "
                                   "<host>:<port>, a port in 1..65535"),
    ("in_process", "127.0.0.1:29999", "true",
     "ANTIFRAGILE_ATTEMPT_STORE='127.0.0.1:29999' needs a fresh store per attempt, but "
     "TORCHELASTIC_USE_AGENT_STORE='true'"),
])
def test_a_bad_attempt_store_variable_is_a_usage_error(
        tmp_path: Path, recovery: str, attempt_store: str, agent_store: str,
        message: str) -> None:
    """``ANTIFRAGILE_ATTEMPT_STORE`` without a port, with one that is not a number, or set
    while torchrun's agent hosts the store: the training process died with a traceback
    (``ValueError: invalid literal for int()`` when it first connected, or a bare
    RuntimeError), exit 1, which torchrun restarts into the same death, and in in_process mode
    the supervisor died the same way. Now one line naming the variable, its value and what is
    expected, exit 2, before anything is forked."""
    import subprocess

    from _trainer import SMALL_MODEL, env

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_env = {k: v for k, v in env().items() if k != "TORCHELASTIC_USE_AGENT_STORE"}
    run_env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   ANTIFRAGILE_ATTEMPT_STORE=attempt_store)
    if agent_store:
        run_env["TORCHELASTIC_USE_AGENT_STORE"] = agent_store
    proc = subprocess.run(
        [sys.executable, "-m", "antifragile.trainer", *SMALL_MODEL, "--steps", "2",
         "--recovery", recovery, "--collective-timeout-s", "5",
         "--ckpt-url", str(tmp_path / "ckpt"), "--run-dir", str(tmp_path)],
        env=run_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("antifragile.trainer: error: ")
    assert message in proc.stderr, proc.stderr[-2000:]


def test_a_run_whose_every_checkpoint_is_damaged_does_not_start_over(tmp_path: Path) -> None:
    """Every committed step of the run is damaged: the first restart's load quarantined them
    all and died with a traceback, and torchrun's next attempt found nothing committed and
    trained from step 0, the run's checkpoints set aside without a word. Every attempt now
    refuses to resume: one line naming the steps, its own exit code, nothing trained. Its 3
    launches are forked from one interpreter that imported torch and the trainer once."""

    from _trainer import SMALL_MODEL, PreloadedTrainer, env

    from antifragile.trainer.supervisor import NO_RESUME_EXIT_CODE

    ckpt = tmp_path / "ckpt"
    run_env = {k: v for k, v in env().items() if k not in ("MASTER_ADDR", "RANK")}
    logs = tmp_path / "launches"
    logs.mkdir()
    launcher = PreloadedTrainer(run_env, logs)

    def train(steps: int) -> subprocess.CompletedProcess[str]:
        return launcher.run([*SMALL_MODEL, "--steps", str(steps), "--ckpt-every", "2",
                             "--ckpt-url", str(ckpt), "--run-dir", str(tmp_path)],
                            timeout_s=120)

    with launcher:
        assert train(4).returncode == 0
        for step in (2, 4):  # one bit of one chunk object of each step
            chunk = next(p for p in sorted((ckpt / f"step_{step:09d}" / "model").rglob("c*"))
                         if p.is_file() and p.stat().st_size > 16)
            data = bytearray(chunk.read_bytes())
            data[8] ^= 1
            chunk.write_bytes(bytes(data))
        for attempt in range(2):  # the load that quarantines them, then a restart of the job
            proc = train(8)
            assert proc.returncode == NO_RESUME_EXIT_CODE, (attempt, proc.stderr[-2000:])
            assert "Traceback" not in proc.stderr, (attempt, proc.stderr[-2000:])
            named = "tried [4, 2]" if attempt == 0 else "steps [2, 4] were quarantined"
            assert "cannot resume" in proc.stderr and named in proc.stderr, proc.stderr[-2000:]
        assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_000000002", "step_000000004"]


def test_a_resume_of_another_run_is_refused_naming_what_differs(tmp_path: Path) -> None:
    """A resume with settings that change what the checkpoint means went on without a word:
    another --seed, a lost/gained --data-path or a token file of other content trained on
    other batches than the checkpoint's run; fewer --layers loaded a subset of its tensors,
    other --heads the same tensors into another function; another --ckpt-engine at the same
    URL found none of its own checkpoints, trained from step 0 and overwrote or pruned the
    run's (same step folder names). Each is now refused, naming both values, with the exit
    code that stops restarts, and leaves the checkpoints alone. One saved run serves every
    mismatch; every launch is forked from one interpreter that imported torch and the trainer
    once (PreloadedTrainer: an import costs 4 s of a 4.5 s launch, and there are 11)."""

    from _trainer import SMALL_MODEL, PreloadedTrainer, env

    from antifragile.trainer.supervisor import NO_RESUME_EXIT_CODE

    run_env = {k: v for k, v in env().items() if k not in ("MASTER_ADDR", "RANK")}
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.arange(1000, dtype=np.int32) % 64)

    logs = tmp_path / "launches"
    logs.mkdir()
    launcher = PreloadedTrainer(run_env, logs)

    def train(ckpt: Path, steps: int, *extra: str) -> subprocess.CompletedProcess[str]:
        return launcher.run([*SMALL_MODEL, "--steps", str(steps), "--ckpt-every", "2",
                             "--ckpt-url", str(ckpt), "--run-dir", str(tmp_path), *extra],
                            timeout_s=120)

    def refused(ckpt: Path, extra: tuple[str, ...], message: str) -> None:
        saved = sorted(p.relative_to(ckpt) for p in ckpt.rglob("*"))
        proc = train(ckpt, 4, *extra)
        assert proc.returncode == NO_RESUME_EXIT_CODE, (extra, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert message in proc.stderr, (extra, proc.stderr[-2000:])
        assert sorted(p.relative_to(ckpt) for p in ckpt.rglob("*")) == saved

    with launcher:
        ours = tmp_path / "ours"
        assert train(ours, 2, "--seed", "7").returncode == 0  # SMALL_MODEL: 2 layers, 4 heads
        for extra, message in [
                (("--seed", "8"), "step 2 was trained with --seed 7, this run has --seed 8"),
                (("--seed", "7", "--layers", "1"), "with --layers 2, this run has --layers 1"),
                (("--seed", "7", "--heads", "2"), "with --heads 4, this run has --heads 2"),
                (("--seed", "7", "--data-path", str(tokens)),
                 "step 2 was trained on synthetic data, this run on a --data-path token file")]:
            refused(ours, extra, message)
        assert train(ours, 4, "--seed", "7").returncode == 0
        dcp = tmp_path / "dcp"
        assert train(dcp, 2, "--ckpt-engine", "dcp", "--data-path", str(tokens)).returncode == 0
        refused(dcp, ("--ckpt-engine", "antifragile", "--data-path", str(tokens)),
                "checkpoints of --ckpt-engine dcp (steps [2])")
        refused(dcp, ("--ckpt-engine", "dcp"),
                "step 2 was trained on a --data-path token file, this run on synthetic data")
        # a token file of other ids at the same path trains on other batches: refused too
        original = tokens.read_bytes()
        np.save(tokens, (np.arange(1000, dtype=np.int32) * 3) % 64)
        refused(dcp, ("--ckpt-engine", "dcp", "--data-path", str(tokens)),
                "step 2 was trained on a --data-path token file of other content (crc32 0x")
        moved = tmp_path / "moved.npy"  # the same ids elsewhere: the same batches, resumed
        moved.write_bytes(original)
        assert train(dcp, 4, "--ckpt-engine", "dcp", "--data-path", str(moved)).returncode == 0


_REFUSING_LAST_STEP = """
import sys
from antifragile.engine.storage._local import LocalStorage
from antifragile.trainer.__main__ import main

write = LocalStorage.write

def refusing(self, key, *args, **kwargs):
    if key.startswith("step_000000004/"):
        raise PermissionError(f"storage refuses {key}")
    return write(self, key, *args, **kwargs)

LocalStorage.write = refusing
sys.exit(main())
"""


def test_a_run_whose_last_checkpoint_could_not_be_saved_does_not_exit_0(tmp_path: Path) -> None:
    """Storage refuses every write of the last step's checkpoint: the trainer retried it for
    its patience and then exited 0, as if the run were complete and saved; its last steps
    exist nowhere, and a launcher or scheduler took the job for done."""
    import json
    import subprocess

    from _trainer import SMALL_MODEL, env

    proc = subprocess.run(
        [sys.executable, "-c", _REFUSING_LAST_STEP, *SMALL_MODEL, "--steps", "4",
         "--ckpt-every", "2", "--ckpt-url", str(tmp_path / "ckpt"), "--run-dir", str(tmp_path),
         "--final-save-patience-s", "1"],
        env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode not in (0, 2), proc.stderr[-2000:]  # 2: usage, not this
    assert "step 4" in proc.stderr and "not saved" in proc.stderr, proc.stderr[-2000:]
    events = [json.loads(line) for line in (tmp_path / "events" / "rank0.jsonl").open()]
    assert [e["step"] for e in events if e["event"] == "ckpt_committed"] == [2]
    assert any(e["event"] == "ckpt_failed" and e["step"] == 4 for e in events)


# --- the connections an in-process recovery shuts down ----------------------------------------


def _connected(server: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    return client, accepted


def _at_fd(sock: socket.socket, fd: int) -> socket.socket:
    """``sock`` moved to file descriptor ``fd`` (as the kernel does when it reuses a number)."""
    if sock.fileno() == fd:  # the kernel did
        return sock
    os.dup2(sock.fileno(), fd)
    sock.close()
    return socket.socket(fileno=fd)


def test_a_connection_opened_at_a_reused_descriptor_is_shut_down() -> None:
    """A socket closed during the formation frees its descriptor; a gloo connection that gets
    the same number is the formation's and must be aborted (first suspected of the rare 2x2x2
    survivor left in a tensor-parallel all-reduce after the abort; that hang recurred after
    this fix, so it was not its cause)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        transient, transient_peer = _connected(server)
        sockets = GlooSockets(keep_ports=set())
        sockets.begin()
        number = transient.fileno()
        transient.close()
        transient_peer.close()
        client, peer = _connected(server)
        gloo = _at_fd(client, number)
        sockets.end()
        assert sockets.shutdown() == 2  # both ends: this process holds both
        peer.settimeout(5)
        assert peer.recv(1) == b""  # the connection was shut down
        gloo.close()
        peer.close()


def test_a_generation_that_failed_while_it_formed_shuts_its_connections_once_formed() -> None:
    """The failure watch fired while the training thread still built the generation's groups
    (before ``end``): only the store link was cut, and the gloo connections formed before
    that were never shut down, so the survivors went on into the restore's collectives of a
    failed generation (waiting out the collective timeout for a lost host). ``end`` now shuts
    them down at once."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        sockets = GlooSockets(keep_ports=set())
        sockets.begin()
        gloo, gloo_peer = _connected(server)  # formed before the failure
        assert sockets.shutdown() == 0  # the watch fires: forming, no store link to cut
        sockets.end()  # the training thread finishes the formation after that
        gloo_peer.settimeout(5)
        assert gloo_peer.recv(1) == b""  # the connection was shut down
        gloo.close()
        gloo_peer.close()


def _captured_then_closed(server: socket.socket) -> tuple[GlooSockets, int]:
    """A connection captured by a formation, then closed: its number is free for reuse."""
    sockets = GlooSockets(keep_ports=set())
    sockets.begin()
    gloo, gloo_peer = _connected(server)
    sockets.end()
    number = gloo.fileno()
    gloo.close()
    gloo_peer.close()
    return sockets, number


def test_a_captured_descriptor_reused_after_the_formation_is_left_alone() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        sockets, number = _captured_then_closed(server)
        other, other_peer = _connected(server)  # e.g. a new store client, at the same number
        other = _at_fd(other, number)
        assert sockets.shutdown() == 0
        other.sendall(b"x")
        other_peer.settimeout(5)
        assert other_peer.recv(1) == b"x"
        other.close()
        other_peer.close()


def test_a_captured_descriptor_reused_by_a_pipe_is_not_held_open_by_the_abort() -> None:
    """A captured connection's number reused by something that is no socket (a pipe, a file)
    after the formation: the abort's look at it (a socket made on a duplicate of the number)
    failed, and the duplicate was never closed: a descriptor leaked per such number, and a
    pipe's write end held open that way leaves its reader waiting for an end that never
    comes."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        read_end, write_end = os.pipe()  # made first: it must not take the freed number
        sockets, number = _captured_then_closed(server)
        os.dup2(write_end, number)  # the pipe's write end, at the captured number
        os.close(write_end)
        assert sockets.shutdown() == 0
        os.close(number)  # its last write end: the reader sees the end
        os.set_blocking(read_end, False)
        try:
            assert os.read(read_end, 1) == b""
        finally:
            os.close(read_end)


def _watch(stuck_after_s: float | None, progress: SharedProgress | None = None,
           thread_id: int | None = None
           ) -> tuple[JobStore, FailureWatch, threading.Event, threading.Event]:
    import torch.distributed as dist

    store = dist.HashStore()
    aborted, stuck = threading.Event(), threading.Event()
    watch = FailureWatch(lambda: JobStore(store, "a0"), 3, aborted.set, progress=progress,
                         stuck_after_s=stuck_after_s, on_stuck=lambda seconds: stuck.set(),
                         thread_id=thread_id)
    watch.start()
    return JobStore(store, "a0"), watch, aborted, stuck


def _training() -> SharedProgress:
    progress = SharedProgress()
    progress.set(Phase.TRAINING, step=7)
    return progress


def test_a_training_thread_still_in_its_collective_after_the_abort_is_ended() -> None:
    js, _, aborted, stuck = _watch(0.2, _training())
    signal_failure(js, 3, "worker 1.0 died")
    assert aborted.wait(5), "the failure did not abort the generation"
    assert stuck.wait(5), "a training thread that never left was not escalated"


def test_a_training_thread_that_leaves_in_time_is_not_ended() -> None:
    js, watch, aborted, stuck = _watch(0.2, _training())
    watch.left()  # out of its collective (the error reached it) before the watch checks
    signal_failure(js, 3, "worker 1.0 died")
    assert aborted.wait(5)
    assert not stuck.wait(1.0)


def test_a_thread_that_progresses_saves_or_is_held_is_waited_for() -> None:
    progress = _training()
    js, watch, aborted, stuck = _watch(1.0, progress)
    signal_failure(js, 3, "worker 1.0 died")
    assert aborted.wait(5)
    for _ in range(40):  # micro-steps after the abort: slow, not stuck
        progress.bump()
        assert not stuck.wait(0.05)
    for phase in (Phase.CHECKPOINT, Phase.PAUSED):
        progress.set(phase)
        assert not stuck.wait(1.5), phase
    progress.set(Phase.TRAINING)
    assert stuck.wait(5), "no progress in training after the abort"
    watch.stop()


def test_the_stuck_bound_follows_the_gaps_the_loop_showed_while_training() -> None:
    assert stuck_bound([0.0] * (STUCK_GAPS - 1)) == STUCK_AFTER_S  # too few to judge
    assert stuck_bound([0.01] * STUCK_GAPS) == STUCK_MIN_S
    assert stuck_bound([0.01] * 75 + [0.5] * 25) == 2.0  # a backward every 4th gap
    assert stuck_bound([0.01] * 98 + [0.8] * 2) == 1.5 * 0.8  # a deep model's rare backward
    assert stuck_bound([3.0] * 100) == STUCK_AFTER_S
    # never below 1.5x the loop's own longest gap: a survivor in the middle of one of its
    # usual 8 s gaps at the abort (a compute with no collective to leave) is not stuck
    assert stuck_bound([8.0] * 100) == 12.0
    assert stuck_bound([8.0] * (STUCK_GAPS - 1)) == 12.0
    progress = _training()
    for _ in range(STUCK_GAPS):
        progress.bump()
    progress.set(Phase.CHECKPOINT)
    time.sleep(0.3)  # a save, a restore or a pause is not a gap in training
    progress.set(Phase.TRAINING)
    assert len(progress.gaps_s) >= STUCK_GAPS and max(progress.gaps_s) < 0.2
    gaps = len(progress.gaps_s)
    time.sleep(0.3)  # blocked in the failed generation's collective, then the failure
    progress.set(Phase.RECOVERING)
    assert len(progress.gaps_s) == gaps, "the wait that ended in a failure is not a gap"


def test_a_stuck_thread_of_a_fast_loop_is_ended_within_seconds_of_the_abort() -> None:
    # a 2x2x2 survivor that stayed in its collective was ended only after 5-10 s (the fixed
    # bound), all of it recovery time; this loop's marks come microseconds apart: 1 s
    progress = _training()
    for _ in range(STUCK_GAPS):
        progress.bump()
    ended_s = _ended_after_abort(_watch(None, progress), within_s=4.0)
    assert ended_s is not None, "a stuck thread of a fast loop was waited for as long as 5 s"
    assert ended_s >= STUCK_MIN_S * 0.9


def _ended_after_abort(watched: tuple[JobStore, FailureWatch, threading.Event, threading.Event],
                       *, within_s: float) -> float | None:
    """Fail the watched generation: seconds until the watch ended the thread as stuck, or
    None if it did not within ``within_s``."""
    js, watch, aborted, stuck = watched
    began = time.monotonic()
    signal_failure(js, 3, "worker 1.0 died")
    assert aborted.wait(5)
    ended = stuck.wait(within_s)
    watch.stop()
    return time.monotonic() - began if ended else None


def _thread_id(target: Any) -> int:
    """The native id of a daemon thread started to run ``target``."""
    ids: list[int] = []
    ready = threading.Event()

    def run() -> None:
        ids.append(threading.get_native_id())
        ready.set()
        target()

    threading.Thread(target=run, daemon=True).start()
    ready.wait(5)
    return ids[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_training_thread_parked_in_one_wait_after_the_abort_is_ended_at_once() -> None:
    """A gloo send queued when its connection failed is never woken (gloo signals only the
    buffers waiting for the peer's handshake): the 2x2x2 survivor stuck that way was ended
    only at the bound of its loop's gaps, 1.5-5 s, all of it recovery time. Asleep in one
    kernel wait (no context switch) for PARKED_S after the abort, it is stuck."""
    release = threading.Event()
    tid = _thread_id(release.wait)  # one futex wait with no timeout, like c10d's Work::wait
    time.sleep(0.1)
    assert thread_wait(tid) is not None and thread_wait(tid)[0] == "S"  # type: ignore[index]
    ended_s = _ended_after_abort(_watch(None, _training(), thread_id=tid),  # bound: 5 s
                                 within_s=3.0)
    release.set()
    assert ended_s is not None, "a thread parked in one wait was waited for as long as its bound"
    assert ended_s >= PARKED_S * 0.9


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_training_thread_that_computes_or_waits_in_turns_is_not_taken_for_parked() -> None:
    """Computing (running, or preempted on two busy cores) and short waits (the GIL, a
    sleep) move the thread's context-switch counters: only the bound of its gaps applies."""
    done = threading.Event()

    def compute() -> None:
        x = torch.randn(64, 64)
        while not done.is_set():
            x = (x @ x).tanh()

    def naps() -> None:
        while not done.is_set():
            time.sleep(0.02)

    for target in (compute, naps):
        tid = _thread_id(target)
        js, watch, aborted, stuck = _watch(2.0, _training(), thread_id=tid)
        signal_failure(js, 3, "worker 1.0 died")
        assert aborted.wait(5)
        assert not stuck.wait(1.5), target.__name__
        assert stuck.wait(3.0), f"{target.__name__}: the bound of its gaps still applies"
        watch.stop()
    done.set()


def test_a_stopped_watch_neither_aborts_nor_ends() -> None:
    js, watch, aborted, stuck = _watch(0.1, _training())
    watch.stop()
    signal_failure(js, 3, "worker 1.0 died")
    assert not aborted.wait(0.5) and not stuck.wait(0.5)


def _restore_decisions(url: str) -> list[int]:
    import torch.distributed as dist

    from antifragile.trainer.ckpt_backends.antifragile import AntifragileBackend

    backend = AntifragileBackend(url, keep_last=2, timeout_s=30, async_=True)
    try:
        if dist.get_rank() == 1:  # a COMMIT (the failed generation's last) landed in between
            backend.engine.steps = lambda: [7]  # type: ignore[method-assign]
        return backend.candidates()
    finally:
        backend.close()


@pytest.mark.multiproc
def test_ranks_agree_on_whether_there_is_a_checkpoint_to_restore(tmp_path: Path) -> None:
    # each rank listed for itself: one could call the collective load while another started
    # fresh and went on training
    from _dist import run_ranks

    assert run_ranks(2, _restore_decisions, str(tmp_path / "ckpt"), timeout_s=60) == [[], []]


def test_cuda_without_enough_devices_is_refused_with_a_reason(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """--device cuda on a host with fewer CUDA devices than workers is a launch that does not
    fit (exit 2, one line); it was a traceback from torch.cuda.set_device in every rank
    (AttributeError '_cuda_setDevice' on a CPU build, 'invalid device ordinal' on a GPU host)."""
    from antifragile.trainer.train import LaunchError, run

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(LaunchError, match=r"--device cuda: .*no CUDA device"):
        run(parse_args(["--device", "cuda", "--steps", "1"]))


def test_in_process_recovery_is_refused_where_a_training_process_hosts_the_store(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """With a fresh store per rendezvous round (multi-host launch) slot 0's training process
    hosts the launcher's store; a kill of that process would take the store, and with it the
    re-formation, away: in_process is refused at start, naming the reason."""
    from antifragile.trainer.train import LaunchError, run

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    cfg = parse_args(["--recovery", "in_process", "--steps", "2", "--ckpt-url",
                      str(tmp_path / "ckpt"), "--collective-timeout-s", "5"])
    with pytest.raises(LaunchError, match=r"in_process.*store"):
        run(cfg)


_FORMATION_SCRIPT = """
import os, sys, threading, time
import torch.distributed as dist
from antifragile.trainer.distributed import GlooSockets, join, launch_info
from antifragile.trainer.recovery import Formation

launch = launch_info(collective_timeout_s=60)
sockets = GlooSockets(launch.store_ports(), links=launch.link)
ctx = join(launch, f"{launch.slot}.0", Formation(0, ("0.0", "1.0")), sockets,
           device_type="cpu")
if launch.slot == 1:
    os._exit(0)  # dies while the others build their subgroups
threading.Timer(0.5, sockets.shutdown).start()  # the generation's failure watch fires
t0 = time.monotonic()
try:
    dist.new_group([0, 1])
    print("built", flush=True)
except Exception as exc:
    print(f"left after {time.monotonic() - t0:.1f} s: {type(exc).__name__}", flush=True)
os._exit(0)
"""


def test_a_failure_while_the_subgroups_form_ends_the_wait_at_once() -> None:
    """A member died after the generation's rendezvous, while the others built their
    subgroups (the device mesh: a store wait for the dead member's address): the abort shut
    down only gloo's connections, captured once every group existed, so the survivors waited
    for the collective timeout (60 s) and then fell back to a restart. The abort of a forming
    generation now cuts the store connection the rendezvous waits on."""
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_USE_AGENT_STORE"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
    procs = [subprocess.Popen([sys.executable, "-c", _FORMATION_SCRIPT], text=True,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for r in (0, 1)]
    try:
        out, err = procs[0].communicate(timeout=40)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert out.startswith("left after"), out + err[-2000:]
    assert float(out.split()[2]) < 5.0, out


def _pause_plan(run_dir: Path, points: list[dict[str, Any]]) -> Path:
    release = run_dir / "control" / "release"
    release.mkdir(parents=True)
    (run_dir / "control" / "plan.json").write_text(json.dumps({"points": points}))
    return release


def _passing_rank(run_dir: Path, release: Path, rank: int) -> tuple[PausePoints, list[str]]:
    """A rank's pause points whose holds are released as soon as they are announced (chaos
    made its fault): the points it held, in order."""
    held: list[str] = []

    def emit(event: str, **fields: Any) -> None:
        if event == "paused":
            held.append(fields["point"])
            (release / fields["point"]).touch()

    return PausePoints(str(run_dir), rank, emit), held


def test_a_save_phase_point_of_a_later_pass_waits_for_the_earlier_pass_of_another_rank(
        tmp_path: Path) -> None:
    """Crash rank 1 at the save of step 10 the first time, rank 0 the second time (on_pass
    2): each rank has one point there. Rank 0 held its pass-2 point the first time the job
    got there, beside rank 1's pass-1 point: the lowest pass was taken among its own points
    only, so the second crash landed on the first pass."""
    release = _pause_plan(tmp_path, [
        {"id": "p0", "checkpoint_step": 10, "phase": "persisting", "ranks": [1]},
        {"id": "p1", "checkpoint_step": 10, "phase": "persisting", "ranks": [0], "pass": 2}])
    rank0, held0 = _passing_rank(tmp_path, release, 0)
    rank1, held1 = _passing_rank(tmp_path, release, 1)
    rank0.save_phase(10, "persisting")  # the first pass: p0 is rank 1's
    rank1.save_phase(10, "persisting")
    assert (held0, held1) == ([], ["p0"])
    rank0, held0 = _passing_rank(tmp_path, release, 0)  # the next generation, back at step 10
    rank0.save_phase(10, "persisting")
    assert held0 == ["p1"]


def test_a_hold_ends_when_its_generation_fails_and_holds_again_in_the_next(
        tmp_path: Path) -> None:
    """In-process recovery: a rank died before it reached the pause point where the others
    were held. The survivors stayed held (a hold waits only for chaos's release) and could not
    re-form with a spare until chaos gave the point up as never reached, its faults missed.
    The hold ends with the generation; the point is not released, so the next generation,
    back at that step, is held there and the fault lands then."""
    release = _pause_plan(tmp_path, [{"id": "f0", "step": 12}])
    events: list[tuple[str, dict[str, Any]]] = []
    failed = threading.Event()
    survivor = PausePoints(str(tmp_path), 0, lambda e, **f: events.append((e, f)),
                           interrupted=failed.is_set)
    threading.Timer(0.2, failed.set).start()
    began = time.monotonic()
    with pytest.raises(HoldInterrupted, match="f0"):
        survivor.step_end(12)
    assert time.monotonic() - began < 5
    assert [e for e, _ in events] == ["paused", "resumed"] and events[1][1]["interrupted"]
    assert not (release / "f0").exists()
    rank0, held = _passing_rank(tmp_path, release, 0)  # the next generation
    rank0.step_end(12)
    assert held == ["f0"]


def _hold_writes(ckpt: Any, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The engine's writes wait (up to 30 s) until the event returned is set."""
    storage = ckpt.backend.engine.storage.inner
    write, go = storage.write, threading.Event()

    def held(key: str, *args: Any, **kwargs: Any) -> None:
        go.wait(30)
        write(key, *args, **kwargs)

    monkeypatch.setattr(storage, "write", held)
    return go


def test_a_save_that_commits_while_the_next_one_captures_its_state_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The save of step 1 commits while the loop takes the state for step 2 (the state dicts
    of a large model take a while). The next save is then accepted and replaced the pending
    handle of step 1 unreported: no ``ckpt_committed`` for step 1, and ``committed_step``
    still None."""
    ckpt, events, events_dir = _final_save_setup(tmp_path, monkeypatch, refuse_for_s=0)
    go = _hold_writes(ckpt, monkeypatch)
    ckpt.save(1, 8, blocking=False)
    first = ckpt._pending
    assert first is not None and not first.done()
    state = ckpt._state

    def committing_meanwhile(step: int, cursor: int) -> dict[str, Any]:
        go.set()
        first.wait(30)
        return state(step, cursor)

    monkeypatch.setattr(ckpt, "_state", committing_meanwhile)
    ckpt.save(2, 16, blocking=False)
    assert ckpt.committed_step == 1
    ckpt.close()
    events.close()
    kinds = _kinds(events_dir)
    assert ("ckpt_committed", 1) in kinds and ("ckpt_committed", 2) in kinds


def _reported(events_dir: Path, kind: tuple[str, int], within_s: float = 10.0) -> bool:
    """Whether ``kind`` (event, step) is in the event file within ``within_s``, the loop
    meanwhile not polling (whole lines only: the file is being written)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        text = (events_dir / "rank0.jsonl").read_text()
        lines = text[:text.rfind("\n") + 1].splitlines()
        if kind in [(e["event"], e.get("step")) for e in map(json.loads, lines)]:
            return True
        time.sleep(0.01)
    return False


def test_a_background_save_is_reported_when_it_ends_not_at_the_next_poll(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``chaos run`` waits for the saves a generation staged to settle before it damages the
    latest checkpoint, and a save that failed before its ABORT was written says so only by
    ``ckpt_failed``; the persist and lost-work measures read when a step committed. Both
    outcomes came only at the loop's next poll (its next save, or the end): the fault waited
    out its bound, the measures saw the commit late. Each comes once, after its staging."""
    from antifragile.engine import CheckpointError

    ckpt, events, events_dir = _final_save_setup(tmp_path, monkeypatch, refuse_for_s=0)
    storage = ckpt.backend.engine.storage.inner
    write, create, refusing = storage.write, storage.create, threading.Event()

    def refused(real: Any) -> Any:
        def call(key: str, *args: Any, **kwargs: Any) -> Any:
            if refusing.is_set():  # the ABORT too: nothing on storage says it failed
                raise PermissionError(f"storage refuses {key}")
            return real(key, *args, **kwargs)
        return call

    monkeypatch.setattr(storage, "write", refused(write))
    monkeypatch.setattr(storage, "create", refused(create))
    refusing.set()
    ckpt.save(1, 8, blocking=False)
    failed = ckpt._pending
    assert failed is not None
    with pytest.raises(CheckpointError):
        failed.wait(30)
    assert _reported(events_dir, ("ckpt_failed", 1))
    refusing.clear()
    ckpt.save(2, 16, blocking=False)
    assert _reported(events_dir, ("ckpt_committed", 2))
    assert ckpt.committed_step == 2
    ckpt.close()
    events.close()
    kinds = _kinds(events_dir)
    for outcome, step in (("ckpt_failed", 1), ("ckpt_committed", 2)):
        assert kinds.count((outcome, step)) == 1
        assert kinds.index(("ckpt_staged", step)) < kinds.index((outcome, step))


def test_a_save_abandoned_with_its_generation_is_not_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In-process recovery abandons the save in flight: the abort fails it on this rank, which
    says nothing of the save (the report takes a staged step that a later generation restored
    for committed, unless it failed), so its thread reports nothing as it ends."""
    ckpt, events, events_dir = _final_save_setup(tmp_path, monkeypatch, refuse_for_s=0)
    go = _hold_writes(ckpt, monkeypatch)
    ckpt.save(1, 8, blocking=False)
    handle = ckpt._pending
    assert handle is not None and not handle.done()
    threading.Timer(0.2, go.set).start()  # the abandon waits for the writes under way
    ckpt.abandon()
    deadline = time.monotonic() + 30
    while not handle.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert handle.done() and handle.exception() is not None
    assert not _reported(events_dir, ("ckpt_failed", 1), within_s=0.5)
    events.close()
    assert [k for k in _kinds(events_dir) if k[1] == 1] == [("ckpt_staged", 1)]


def test_a_peer_save_failed_by_its_generations_abort_is_not_reported(tmp_path: Path) -> None:
    """In-process recovery: the failure watch marks the generation failed, then shuts its
    connections; a peer's save in flight (DCP's collectives run on them, in its own thread)
    fails there before the training thread gets to ``abandon()`` it. That is the abort's
    failure, no outcome of the save: unreported, as an abandoned save's."""
    from concurrent.futures import Future

    from antifragile.trainer.checkpoint import TrainCheckpointer
    from antifragile.trainer.ckpt_backends.base import PeerHandle
    from antifragile.trainer.events import EventLog

    future: Future[Any] = Future()

    class Peer:
        name, overlaps_saves = "dcp", False

        def save(self, step: int, state: dict[str, Any]) -> PeerHandle:
            return PeerHandle(step, future, stall_s=0.0, sizes=lambda _: (1, 1))

        def abandon(self) -> None:
            pass

    model = torch.nn.Linear(4, 4)
    events = EventLog(str(tmp_path), rank=0, attempt=0)
    failed = threading.Event()
    ckpt = TrainCheckpointer(Peer(), model, torch.optim.AdamW(model.parameters()),  # type: ignore[arg-type]
                             events, interrupted=failed.is_set)
    assert ckpt.save(5, 40, blocking=False)
    failed.set()  # the watch fired, then shut the generation's connections down
    abort = threading.Thread(target=future.set_exception,
                             args=(RuntimeError("Connection closed by peer"),))
    abort.start()
    abort.join()
    ckpt.abandon()
    events.close()
    assert [k for k in _kinds(tmp_path / "events") if k[1] == 5] == [("ckpt_staged", 5)]


def test_a_skipped_save_does_not_hold_at_staged(tmp_path: Path) -> None:
    """The save of step 1 is held at ``persisting``, so the save of step 2 is skipped (the
    engine refuses a save while the previous one persists). A ``staged`` point of step 2 held
    all the same: a crash_during_save there was made, and reported, as a crash during a save
    that never ran."""
    import subprocess

    release = _pause_plan(tmp_path, [
        {"id": "p0", "checkpoint_step": 1, "phase": "persisting", "ranks": [0]},
        {"id": "p1", "checkpoint_step": 2, "phase": "staged", "ranks": [0]}])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "antifragile.trainer", "--layers", "1", "--d-model", "8",
         "--heads", "2", "--vocab", "16", "--seq-len", "4", "--batch-size", "2", "--steps",
         "3", "--ckpt-every", "1", "--run-dir", str(tmp_path), "--ckpt-url",
         str(tmp_path / "ckpt")], env={**env, "PYTHONWARNINGS": "ignore"})
    log = tmp_path / "events" / "rank0.jsonl"
    paused: list[str] = []
    deadline = time.monotonic() + 300
    while proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the trainer did not end; held at {paused}")
        lines = log.read_text().splitlines() if log.exists() else []
        seen = [json.loads(line) for line in lines if line.endswith("}")]
        paused = [e["point"] for e in seen if e["event"] == "paused"]
        skipped = any(e["event"] == "ckpt_failed" and e["step"] == 2 for e in seen)
        for point in paused + (["p0"] if skipped or "p1" in paused else []):
            (release / point).touch()
        time.sleep(0.05)
    assert proc.returncode == 0
    assert paused == ["p0"]


def test_a_wall_clock_step_during_a_gap_after_the_abort_is_not_taken_for_stuck(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The stuck judgment measures time since the loop's last mark: a wall clock stepped
    forward (NTP) while the training thread is in one of its usual gaps is no
    time without progress, and a survivor ended for it costs a needless re-formation."""
    progress = _training()
    js, watch, aborted, stuck = _watch(1.0, progress)
    signal_failure(js, 3, "worker 1.0 died")
    assert aborted.wait(5)
    progress.bump()
    wall = time.time
    monkeypatch.setattr(time, "time", lambda: wall() + 60.0)  # the clock steps a minute on
    assert not stuck.wait(0.3), "a clock step was taken for a minute without progress"
    for _ in range(10):  # the thread makes progress again: slow, not stuck
        progress.bump()
        assert not stuck.wait(0.05)
    watch.stop()


def test_a_checkpoint_saved_before_seeds_were_stored_resumes(tmp_path: Path) -> None:
    """Our engine loads ``train`` as one JSON value, the saved dict in place of the target's:
    a checkpoint written before the seed was stored came back without it, and the seed check
    died with a KeyError (a traceback on every rank, restarted by torchrun into the same)."""
    ckpt, events = _checkpointer(tmp_path)
    with_seed = ckpt._state
    ckpt._state = lambda step, cursor: {  # type: ignore[method-assign]
        **with_seed(step, cursor), "train": {"step": step, "data_cursor": cursor}}
    ckpt.save(2, 16, blocking=True)
    ckpt._state = with_seed  # type: ignore[method-assign]
    assert ckpt.restore() == (2, 16)
    ckpt.close()
    events.close()


def test_the_trainer_fixes_cublas_workspace_for_deterministic_gemms() -> None:
    """On CUDA, deterministic algorithms need ``CUBLAS_WORKSPACE_CONFIG`` set before cuBLAS
    starts; under ``warn_only`` its absence was a warning, and a GPU run's bits could differ
    from its reference. The trainer sets it (a value the user gave wins)."""
    import subprocess

    probe = ("import os, antifragile.trainer.__main__; "
             "print(os.environ['CUBLAS_WORKSPACE_CONFIG'])")
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.stdout.strip() == ":4096:8", done.stderr
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60, env={**env, "CUBLAS_WORKSPACE_CONFIG": ":16:8"})
    assert done.stdout.strip() == ":16:8", done.stderr


class _ResetStore:
    """A store client whose connection was reset: every request raises."""

    def __getattr__(self, name: str) -> Any:
        def refused(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("Connection reset by peer")
        return refused


def _reset_client() -> JobStore:
    import torch.distributed as dist

    js = JobStore(dist.HashStore(), "a0")
    js.attempt = _ResetStore()  # type: ignore[assignment]
    return js


@contextlib.contextmanager
def _watch_over(clients: list[Any], **kwargs: Any) -> Iterator[
        tuple[FailureWatch, threading.Event, list[threading.ExceptHookArgs]]]:
    """A watch whose store clients are ``clients`` in turn (the first made at once), the
    event its failure sets, and the errors its thread died of; stopped, and
    ``threading.excepthook`` restored, on the way out."""
    aborted, died = threading.Event(), []
    hook, threading.excepthook = threading.excepthook, died.append
    made = iter(clients)

    def make_store() -> JobStore:
        client = next(made)
        if isinstance(client, Exception):
            raise client
        return client if isinstance(client, JobStore) else JobStore(client, "a0")

    watch = FailureWatch(make_store, 3, aborted.set, **kwargs)
    watch.start()
    try:
        yield watch, aborted, died
    finally:
        threading.excepthook = hook
        watch.stop()


def test_a_failure_watch_survives_a_reset_of_its_store_connection() -> None:
    """Its client's connection reset: the wait raised, its fallback ``has`` raised too, and
    the thread died (a traceback, nothing retried): a failure of the generation was then found
    only by a collective error or timeout, and a rank held at a pause point waited for chaos's
    release. Now it connects again and goes on watching."""
    import torch.distributed as dist

    store = dist.HashStore()
    with _watch_over([_reset_client(), store]) as (watch, aborted, died):
        time.sleep(0.3)  # the reset, then the retry
        assert not aborted.is_set(), "a store error alone is not a failure of the generation"
        signal_failure(JobStore(store, "a0"), 3, "worker 1.0 died")
        assert aborted.wait(5), "the failure was not seen after the store connection reset"
        assert watch.fired.is_set() and not died


def test_a_failure_watch_whose_store_is_gone_acts_as_on_a_failure() -> None:
    """The store is gone for good (no client connects again): the job can no longer
    coordinate, a failure of the generation; the watch aborts it rather than die silently."""
    gone = RuntimeError("Connection refused")
    with _watch_over([_reset_client()] + [gone] * 100, store_gone_s=0.5) as (
            watch, aborted, died):
        assert aborted.wait(5), "the watch did not act on a store that is gone"
        assert watch.fired.is_set() and not died


def test_a_failure_watch_counts_the_store_gone_from_its_latest_error_not_its_first() -> None:
    """Two resets a while apart are two short outages, not one long one."""
    import torch.distributed as dist

    store, cut = dist.HashStore(), threading.Event()

    class ResetLater:  # a client that works until ``cut``
        def __init__(self, attempt: Any) -> None:
            self._attempt = attempt

        def wait(self, keys: list[str], timeout: Any) -> None:
            if not cut.wait(timeout.total_seconds()):
                raise RuntimeError("Socket Timeout")
            raise RuntimeError("Connection reset by peer")

        def check(self, keys: list[str]) -> bool:
            if cut.is_set():
                raise RuntimeError("Connection reset by peer")
            return bool(self._attempt.check(keys))

    later = JobStore(store, "a0")
    later.attempt = ResetLater(later.attempt)  # type: ignore[assignment]
    with _watch_over([_reset_client(), later, JobStore(store, "a0")], store_gone_s=0.5) as (
            _, aborted, died):
        time.sleep(1.0)  # reconnected after the first reset; the second comes later
        cut.set()
        assert not aborted.wait(1.0), "a second short outage was taken for the store gone"
        signal_failure(JobStore(store, "a0"), 3, "worker 1.0 died")
        assert aborted.wait(5) and not died


def test_a_resume_with_other_tensor_shapes_is_refused_naming_the_option(tmp_path: Path) -> None:
    """Model settings that change a tensor's shape (--d-model, --vocab, --seq-len) or add one
    (more --layers) failed the engine's load before the trainer compared its settings: the
    refusal (exit 47, as documented) named a tensor and two shapes ("stored shape [64, 32],
    target shape [64, 64]"), not the option that differs. It now names the option and both
    values, as for --heads, with each engine; the checkpoints are left alone."""

    from _trainer import PreloadedTrainer, env

    from antifragile.trainer.supervisor import NO_RESUME_EXIT_CODE

    run_env = {k: v for k, v in env().items() if k not in ("MASTER_ADDR", "RANK")}
    logs = tmp_path / "launches"
    logs.mkdir()
    model = {"--layers": "2", "--d-model": "32", "--heads": "4", "--vocab": "64",
             "--seq-len": "16"}

    def train(ckpt: Path, engine: str, **changed: str) -> subprocess.CompletedProcess[str]:
        options = {**model, **{"--" + k.replace("_", "-"): v for k, v in changed.items()}}
        return launcher.run([*(x for kv in options.items() for x in kv), "--batch-size", "4",
                             "--steps", "2", "--ckpt-every", "2", "--ckpt-url", str(ckpt),
                             "--ckpt-engine", engine, "--run-dir", str(tmp_path)],
                            timeout_s=120)

    with PreloadedTrainer(run_env, logs) as launcher:
        for engine, changes in [("antifragile", [{"d_model": "64"}, {"vocab": "128"},
                                                 {"seq_len": "8"}, {"layers": "3"}]),
                                ("dcp", [{"d_model": "16"}])]:
            ckpt = tmp_path / engine
            assert train(ckpt, engine).returncode == 0
            saved = sorted(p.relative_to(ckpt) for p in ckpt.rglob("*"))
            for change in changes:
                proc = train(ckpt, engine, **change)
                (key, value), = change.items()
                option = "--" + key.replace("_", "-")
                assert proc.returncode == NO_RESUME_EXIT_CODE, (change, proc.stderr[-2000:])
                assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
                assert (f"step 2 was trained with {option} {model[option]}, this run has "
                        f"{option} {value}") in proc.stderr, (change, proc.stderr[-2000:])
            assert sorted(p.relative_to(ckpt) for p in ckpt.rglob("*")) == saved


def test_a_save_phase_point_of_a_later_pass_does_not_hold_a_rank_that_arrives_after_the_release(
        tmp_path: Path) -> None:
    """Crash rank 1 at the save of step 10 the first time, rank 0 the second time. Rank 1 was
    held, crashed and released before rank 0's save got to the same phase (rank 0 slower):
    rank 0 then found no earlier pass unreleased there and held its pass-2 point on the first
    pass, so the second crash landed on the first pass. A point released in this rank's own
    generation was this generation's pass; chaos's release names the generation it released."""
    from antifragile.chaos.run.pauses import Point, release

    _pause_plan(tmp_path, [
        {"id": "p0", "checkpoint_step": 10, "phase": "persisting", "ranks": [1]},
        {"id": "p1", "checkpoint_step": 10, "phase": "persisting", "ranks": [0], "pass": 2}])
    points = {"p0": Point("p0", 10, [1], "persisting"),
              "p1": Point("p1", 10, [0], "persisting", 2)}

    def rank_of(generation: int, rank: int) -> tuple[PausePoints, list[str]]:
        held: list[str] = []

        def emit(event: str, **fields: Any) -> None:
            if event == "paused":  # chaos sees it, makes its fault, releases
                held.append(fields["point"])
                points[fields["point"]].paused.add((generation, rank))
                release(tmp_path, points[fields["point"]])

        return PausePoints(str(tmp_path), rank, emit, generation=generation), held

    rank0, held0 = rank_of(0, 0)
    rank1, held1 = rank_of(0, 1)
    rank1.save_phase(10, "persisting")  # held, crashed, released: rank 0 is not there yet
    rank0.save_phase(10, "persisting")
    assert (held0, held1) == ([], ["p0"])
    rank0, held0 = rank_of(1, 0)  # the next generation, back at step 10
    rank0.save_phase(10, "persisting")
    assert held0 == ["p1"]


_RESTORE_STORAGE_ERROR_SCRIPT = """
import os, sys
from antifragile.engine import StorageError
from antifragile.trainer.checkpoint import TrainCheckpointer
from antifragile.trainer.config import parse_args
from antifragile.trainer.train import run

def restore(self, memory=None):
    try:
        raise ConnectionResetError(104, "Connection reset by peer")
    except ConnectionResetError as exc:
        raise StorageError(f"read {sys.argv[1]}/step_000000004/COMMIT failed 6 times: "
                           f"ConnectionResetError: {exc}") from exc

TrainCheckpointer.restore = restore  # storage goes down as the generation restores
cfg = parse_args([*sys.argv[3:], "--recovery", "in_process", "--steps", "2",
                  "--ckpt-url", sys.argv[1], "--run-dir", sys.argv[2]])
try:
    print("RETURNED", run(cfg), flush=True)
except BaseException as exc:
    print("RAISED", type(exc).__name__, flush=True)
os._exit(0)
"""


def test_a_storage_error_that_speaks_of_a_connection_is_not_taken_for_the_groups(
        tmp_path: Path) -> None:
    """A restore whose storage failed with a connection error (ConnectionResetError: an S3 or
    network file system read) was taken for a failure of the process group, because its text
    says "Connection": the rank re-formed the generation in process and restored again, four
    times, until the crash-loop rule handed it to a restart, and the storage error was never
    reported as such. It is raised as the storage error it is."""
    import subprocess

    from _trainer import SMALL_MODEL, env

    proc = subprocess.run(
        [sys.executable, "-c", _RESTORE_STORAGE_ERROR_SCRIPT, str(tmp_path / "ckpt"),
         str(tmp_path), *SMALL_MODEL],
        env={k: v for k, v in env().items() if k not in ("MASTER_ADDR", "RANK")},
        capture_output=True, text=True, timeout=120)
    lines = [x for x in proc.stdout.splitlines() if x.startswith(("RETURNED", "RAISED"))]
    assert lines == ["RAISED StorageError"], proc.stdout + proc.stderr[-2000:]
    events = [json.loads(line) for f in sorted((tmp_path / "events").glob("*.jsonl"))
              for line in f.read_text().splitlines()]
    assert not [e for e in events if e["event"] == "recovery_begin"], events
    exits = [e for e in events if e["event"] == "exit"]
    assert len(exits) == 1 and "StorageError" in exits[0]["error"], exits


def test_ctrl_c_of_the_trainer_outside_torchrun_exits_130_without_a_traceback(
        tmp_path: Path) -> None:
    """``python -m antifragile.trainer`` without torchrun (one process, no supervisor, whose
    SIGINT handler exits 128 + 2) printed a KeyboardInterrupt traceback on Ctrl-C and died
    by SIGINT: in its first second (importing torch) and while it trained. The interrupt is
    made to arrive at the import of torch, as ``python -m`` runs the trainer."""
    import subprocess

    script = tmp_path / "trainer_script.py"
    script.write_text(
        "import runpy, sys\n"
        "class Interrupt:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch':\n"
        "            raise KeyboardInterrupt\n"
        "        return None\n"
        "sys.meta_path.insert(0, Interrupt())\n"
        "sys.argv = ['antifragile.trainer', '--steps', '1']\n"
        "runpy.run_module('antifragile.trainer', run_name='__main__', alter_sys=True)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, check=False, env=env)
    assert done.returncode == 130, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip() == "antifragile.trainer: interrupted", done.stderr


_GENERATIONS_SCRIPT = """
from antifragile.trainer.abort import GlooSockets
from antifragile.trainer.distributed import join, launch_info, leave
from antifragile.trainer.recovery import Formation

launch = launch_info(collective_timeout_s=60)
for generation in range(5):
    sockets = GlooSockets(launch.store_ports(), links=launch.link)
    join(launch, "0.0", Formation(generation, ("0.0",)), sockets, device_type="cpu")
    sockets.end()
    leave()
raise RuntimeError("after five generations")
"""


def test_the_excepthook_of_a_process_that_re_formed_its_group_is_one_rank_prefix_deep() -> None:
    """torch's ``init_process_group`` wraps ``sys.excepthook`` in one that prefixes every line
    with the rank, around whatever hook was there: the previous generation's. A survivor of
    hundreds of in-process recoveries held a chain of hundreds of hooks (each a closure over
    the previous one and an old rank), and an uncaught exception came out with every line
    prefixed once per generation (``[rank0]: [rank1]: [rank0]: ...``), a chain that deep
    past Python's recursion limit. Every generation now wraps the hook the process had
    before its first."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK",
                        "LOCAL_WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE")}
    proc = subprocess.run([sys.executable, "-c", _GENERATIONS_SCRIPT], env=env, text=True,
                          capture_output=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line]
    assert "RuntimeError: after five generations" in lines[-1], proc.stderr[-2000:]
    tail = [line for line in lines if "Traceback" in line or "RuntimeError" in line]
    assert tail and all(line.startswith("[rank0]: ") and "[rank0]: [rank0]" not in line
                        for line in tail), proc.stderr[-2000:]
