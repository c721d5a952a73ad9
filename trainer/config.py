"""The trainer's configuration and its command line (``python -m antifragile.trainer --help``)."""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field
from typing import NoReturn

from antifragile.engine._paths import MAX_STEP
from antifragile.trainer.ckpt_backends import ENGINES
from antifragile.trainer.footprint import available_bytes, min_process_bytes, too_large
from antifragile.trainer.model import ModelConfig
from antifragile.trainer.parallel.dims import ParallelDims
from antifragile.trainer.progress import (
    MIN_COLLECTIVE_TIMEOUT_S,
    MIN_HANG_TIMEOUT_S,
    MIN_LEASE_S,
    WATCH_POLL_S,
    lease_conflict,
)

FINAL_SAVE_PATIENCE_S = 120.0  # how long the last step's checkpoint is retried while it fails
# the longest collective or checkpoint timeout (about 31 years): a save waits on its writes with
# it (a lock's timeout, at most threading.TIMEOUT_MAX, 9.2e9 s: beyond, every save failed), the
# store and process groups take it (twice it for a re-formation) as a timedelta
MAX_TIMEOUT_S = 1e9


@dataclass(kw_only=True, slots=True, frozen=True)
class TrainConfig:
    parallel: ParallelDims = field(default_factory=ParallelDims)
    model: ModelConfig = field(default_factory=ModelConfig)
    steps: int = 20
    batch_size: int = 8
    micro_batches: int = 2
    schedule: str = "1f1b"
    seed: int = 0
    lr: float = 3e-3
    data_path: str | None = None
    run_dir: str | None = None
    ckpt_url: str | None = None
    ckpt_engine: str = "antifragile"
    ckpt_every: int = 10
    async_ckpt: bool = True
    keep_last: int = 3
    ckpt_timeout_s: float = 600.0
    final_save_patience_s: float = FINAL_SAVE_PATIENCE_S
    collective_timeout_s: float = 60.0
    hang_timeout_s: float | None = None  # None: adaptive (trainer.supervisor.Watchdog)
    recovery: str = "restart"  # restart | in_process
    lease_s: float | None = None  # in_process: a slot silent this long is lost (trainer.lease)
    activation_checkpointing: bool = False
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "micro_batches", "ckpt_every", "keep_last"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.steps >= MAX_STEP:
            raise ValueError(f"steps must be below 2**62 (the engine's bound on a step: the "
                             f"run's final checkpoint is of its last step), got {self.steps}")
        if not (self.lr >= 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a finite number >= 0, got {self.lr}")
        if not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must be in [-2**63, 2**64) (what torch.manual_seed takes), "
                             f"got {self.seed}")
        for name in ("collective_timeout_s", "ckpt_timeout_s"):
            if not 0 < getattr(self, name) <= MAX_TIMEOUT_S:
                raise ValueError(f"{name} must be a finite number > 0 and at most "
                                 f"{MAX_TIMEOUT_S:g} s, got {getattr(self, name)}")
        if self.collective_timeout_s < MIN_COLLECTIVE_TIMEOUT_S:
            raise ValueError(f"collective_timeout_s must be at least {MIN_COLLECTIVE_TIMEOUT_S:g} "
                             "s (it bounds each worker's connection to the launcher's store and "
                             "the wait for every worker to start), got "
                             f"{self.collective_timeout_s:g}")
        per_dp, rem = divmod(self.batch_size, self.parallel.dp)
        if rem:
            raise ValueError(f"batch size {self.batch_size} is not divisible by dp "
                             f"{self.parallel.dp}")
        if self.parallel.pp > 1 and per_dp % self.micro_batches:
            raise ValueError(f"the per-replica batch {per_dp} is not divisible by "
                             f"{self.micro_batches} micro-batches")
        # 1F1B keeps one micro-batch in flight per stage (torch's Schedule1F1B refuses fewer);
        # GPipe runs them all forward, then all backward, and takes any number
        if self.parallel.pp > 1 and self.schedule == "1f1b" \
                and self.micro_batches < self.parallel.pp:
            raise ValueError(f"{self.micro_batches} micro-batches cannot fill "
                             f"{self.parallel.pp} pipeline stages under the 1f1b schedule: "
                             f"give --micro-batches >= {self.parallel.pp} or --schedule gpipe")
        for name in ("ckpt_url", "run_dir"):  # None is the option left out; "" is not that
            if getattr(self, name) == "":  # (an unset variable: --ckpt-url "$CKPT")
                raise ValueError(f"{name} must not be empty: leave the option out for none "
                                 "(no checkpoints, no events)")
        if self.ckpt_engine not in ENGINES:
            raise ValueError(f"ckpt_engine must be one of {', '.join(ENGINES)}, "
                             f"not {self.ckpt_engine!r}")
        if self.ckpt_engine != "antifragile" and self.ckpt_url and "://" in self.ckpt_url \
                and not self.ckpt_url.startswith("file://"):
            raise ValueError(f"ckpt_engine {self.ckpt_engine} runs on local storage only, "
                             f"not {self.ckpt_url}")
        if self.schedule not in ("gpipe", "1f1b"):
            raise ValueError(f"schedule must be gpipe or 1f1b, not {self.schedule!r}")
        if self.model.heads % self.parallel.tp:
            raise ValueError(f"heads {self.model.heads} not divisible by tp {self.parallel.tp}")
        # the embedding and the head are split over tp by vocabulary rows, in chunks of
        # ceil(vocab / tp) (torch.chunk): the last ranks may get none, and an embedding shard
        # without rows fails its forward on every rank (index_select on an empty weight)
        rows = -(-self.model.vocab // self.parallel.tp)
        if rows * (self.parallel.tp - 1) >= self.model.vocab:
            empty = -(-self.model.vocab // rows)  # the first rank past the last chunk
            raise ValueError(f"vocab {self.model.vocab} leaves tp rank {empty} of "
                             f"{self.parallel.tp} no rows of the embedding (split in chunks of "
                             f"{rows}): use a vocab that leaves every tp rank some (a multiple "
                             "of tp does) or a smaller tp")
        if self.model.layers < self.parallel.pp:
            raise ValueError(f"{self.model.layers} layers cannot fill {self.parallel.pp} stages")
        if self.recovery not in ("restart", "in_process"):
            raise ValueError(f"recovery must be restart or in_process, not {self.recovery!r}")
        if self.recovery == "in_process" and self.device != "cpu":
            raise ValueError("recovery in_process is built for --device cpu (gloo): it gets "
                             "survivors out of their collectives by shutting down gloo's "
                             "connections, which does not interrupt an NCCL collective (an "
                             "NCCL communicator abort is not built); use --recovery restart")
        if not 0 <= self.final_save_patience_s <= MAX_TIMEOUT_S:  # NaN, inf: retried forever
            raise ValueError(f"final_save_patience_s must be a finite number >= 0 and at most "
                             f"{MAX_TIMEOUT_S:g} s, got {self.final_save_patience_s}")
        if self.hang_timeout_s is not None and not self.hang_timeout_s > 0:  # NaN: never a hang
            raise ValueError(f"hang_timeout_s must be > 0, got {self.hang_timeout_s}")
        if self.hang_timeout_s is not None and self.hang_timeout_s < MIN_HANG_TIMEOUT_S:
            raise ValueError(f"hang_timeout_s must be at least {MIN_HANG_TIMEOUT_S:g} s (the "
                             f"supervisor looks at training progress every {WATCH_POLL_S:g} "
                             f"s), got {self.hang_timeout_s}")
        if self.lease_s is not None and not MIN_LEASE_S <= self.lease_s < math.inf:  # NaN too
            raise ValueError(f"lease_s must be a finite number >= {MIN_LEASE_S:g} s (four "
                             f"renewals at the heartbeat's 0.25 s), got {self.lease_s}")
        if why := lease_conflict(self.recovery, self.lease_s, self.hang_timeout_s,
                                 option=lambda key: "--" + key.replace("_", "-")):
            raise ValueError(why)


class ConfigError(ValueError):
    """A mistake in the trainer's options: the same in every process and every attempt, so no
    restart mends it (``check_args``)."""


class _Parser(argparse.ArgumentParser):
    """Raises ConfigError where argparse would print its usage and exit 2."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """The command line's configuration; a mistake is argparse's usage error (exit 2). Makes
    ``--run-dir``'s events folder."""
    p = _parser(argparse.ArgumentParser)
    try:
        cfg = check_args(argv)
    except ConfigError as exc:
        p.error(str(exc))
        raise
    if cfg.run_dir is not None:  # every rank and supervisor writes its events there
        try:
            os.makedirs(os.path.join(cfg.run_dir, "events"), exist_ok=True)
        except OSError as exc:
            p.error(f"--run-dir {cfg.run_dir}: {exc.strerror or exc}")
    return cfg


def check_args(argv: list[str] | None = None) -> TrainConfig:
    """The configuration the command line ``argv`` gives, changing nothing (a launcher checks
    a trainer's options with it before it starts any process: ``chaos run``); ConfigError
    says what is wrong with them."""
    a = _parser(_Parser).parse_args(argv)
    try:
        cfg = TrainConfig(
            parallel=ParallelDims(dp=a.dp, tp=a.tp, pp=a.pp),
            model=ModelConfig(layers=a.layers, d_model=a.d_model, heads=a.heads, vocab=a.vocab,
                              seq_len=a.seq_len),
            steps=a.steps, batch_size=a.batch_size, micro_batches=a.micro_batches,
            schedule=a.schedule, seed=a.seed, lr=a.lr, data_path=a.data_path,
            run_dir=a.run_dir, ckpt_url=a.ckpt_url, ckpt_engine=a.ckpt_engine,
            ckpt_every=a.ckpt_every, async_ckpt=not a.no_async_ckpt, keep_last=a.keep_last,
            ckpt_timeout_s=a.ckpt_timeout_s, final_save_patience_s=a.final_save_patience_s,
            collective_timeout_s=a.collective_timeout_s,
            hang_timeout_s=a.hang_timeout_s, recovery=a.recovery, lease_s=a.lease_s,
            activation_checkpointing=a.activation_checkpointing, device=a.device)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.device == "cpu" and (why := _too_large(cfg, available_bytes())):
        raise ConfigError(why)
    # a scheme no storage serves (a typo, ``S3://``), one that only reads (http) or a
    # malformed URL: every rank died opening the engine (exit 1, restarted into the same) or
    # failed its first save; the check chaos makes of a scenario's checkpoint.url
    from antifragile.engine.storage import no_storage_for

    if cfg.ckpt_url and (why := _no_shared_place(cfg.ckpt_url)
                         or no_storage_for(cfg.ckpt_url)
                         or _not_a_local_folder(cfg.ckpt_url)):
        raise ConfigError(f"--ckpt-url {cfg.ckpt_url}: {why}")
    if cfg.data_path is not None:  # a usage error here, not a traceback in every training
        # process (which are forked from this one and reuse the checked map: ``open_tokens``)
        from antifragile.trainer.data import open_tokens

        try:
            open_tokens(cfg.data_path, cfg.model.seq_len, cfg.model.vocab)
        except OSError as exc:
            raise ConfigError(f"--data-path {cfg.data_path}: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise ConfigError(f"--data-path {exc}") from None
    return cfg


def _parser(kind: type[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = kind(prog="python -m antifragile.trainer", description=__doc__)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--micro-batches", type=int, default=2,
                   help="micro-batches per step through the pipeline (--pp > 1; at --pp 1 "
                   "each replica runs its batch in one pass)")
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b",
                   help="the pipeline schedule (--pp > 1)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--data-path", help="a 1-D .npy of token ids (default: synthetic data)")
    p.add_argument("--run-dir", help="events go to RUN_DIR/events/rank<r>.jsonl")
    p.add_argument("--ckpt-url", help="checkpoint root (local path or s3://...)")
    p.add_argument("--ckpt-engine", choices=ENGINES, default="antifragile",
                   help="the checkpoint engine under test (dcp, torchsnapshot: local storage)")
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--ckpt-timeout-s", type=float, default=600.0)
    p.add_argument("--final-save-patience-s", type=float, default=FINAL_SAVE_PATIENCE_S,
                   help="the last step's checkpoint is retried while it fails for this long; "
                   "then the run exits with code 46, its last steps not saved")
    p.add_argument("--no-async-ckpt", action="store_true")
    p.add_argument("--collective-timeout-s", type=float, default=60.0,
                   help="how long a collective, a worker's connection to the launcher's store "
                   "and the wait for every worker to start may take (at least 1 s)")
    p.add_argument("--hang-timeout-s", type=float, default=None,
                   help="no training progress for this long is a hang (default: adaptive, "
                   "max(10 s, 20 x p99 of the intervals between progress bumps))")
    p.add_argument("--recovery", choices=("restart", "in_process"), default="restart",
                   help="restart: torchrun restarts the group after a failure; in_process: "
                   "survivors re-form it with a warm spare (extra torchrun workers)")
    p.add_argument("--lease-s", type=float, default=None,
                   help="in_process: a worker slot whose supervisor renews no lease for this "
                   "long is lost, with its host (default: 5 s, or 1.5 x --hang-timeout-s "
                   "where that is shorter; at least 1 s, and below 3 x --hang-timeout-s, or "
                   "30 s under the adaptive hang timeout)")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    return p


def _too_large(cfg: TrainConfig, available: int | None) -> str | None:
    """Why the sizes cannot fit in this machine's memory (``footprint``); host memory only,
    so a CUDA device's is not judged here."""
    m, p = cfg.model, cfg.parallel
    micro_batch = cfg.batch_size // p.dp // (cfg.micro_batches if p.pp > 1 else 1)
    parts = min_process_bytes(layers=m.layers, d_model=m.d_model, heads=m.heads, vocab=m.vocab,
                              seq_len=m.seq_len, mlp_ratio=m.mlp_ratio,
                              micro_batch=max(micro_batch, 1), tp=p.tp, pp=p.pp)
    options = {"vocab": ("--vocab", m.vocab), "seq_len": ("--seq-len", m.seq_len),
               "d_model": ("--d-model", m.d_model), "batch_size": ("--batch-size", cfg.batch_size)}
    return too_large(parts, options, available)


def _no_shared_place(url: str) -> str | None:
    """Why a URL is no checkpoint root the ranks share, else None: a scheme and nothing else
    (``file://``, ``s3://``: an unset variable after it; ``file://`` is the working directory
    to the engines, ``s3://`` fails every rank's engine as it opens, a traceback restarted
    into the same), or ``memory://`` (each process's own)."""
    scheme, sep, where = url.partition("://")
    if not sep:
        return None
    if scheme.lower() == "memory":  # as chaos refuses it in a scenario's checkpoint.url
        return ("each process's own memory: the ranks would not see one store (every save "
                "fails at its commit deadline) and it is gone when the run ends (give a local "
                "folder or s3://bucket/prefix)")
    if scheme == "file":
        return None if where else "names no folder"
    if scheme in ("s3", "s3a"):  # s3:///prefix: a prefix, but no bucket before it
        return None if where.split("/", 1)[0] else "names no bucket"
    return None


def _not_a_local_folder(url: str) -> str | None:
    """Why a local checkpoint URL can never be a folder (it, or the nearest of its parents
    that exists, is a file or a link to nothing), else None. Caught here, not by the training
    processes: at a file every rank died opening the engine (exit 1, restarted into the
    same), under one every save failed, so the run trained to its end unsaved and exited 46
    for a restart that trained it all again. Nothing is made: the engines make the folder at
    their first save."""
    from antifragile.engine.storage import local_root, no_folder_at

    root = local_root(url)
    return None if root is None else no_folder_at(root)
