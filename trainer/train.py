"""The training loop: build the 3D-parallel model, resume, train, checkpoint, report events.

``run`` is one torchrun worker's training process (under ``trainer.supervisor``). It plays a
trainer rank of a *generation* (``trainer.recovery``); with ``--recovery in_process`` a failure
of the generation does not end the process: it tears the process group down, re-forms it with a
warm spare in place of the dead rank, restores the last checkpoint and trains on. Extra slots
(``--nproc-per-node`` beyond dp*tp*pp) are those spares: they import torch and build the model
at start, then wait for an assignment.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from antifragile.engine import CheckpointError, StorageAccessError
from antifragile.trainer.abort import FailureWatch, GlooSockets
from antifragile.trainer.checkpoint import ResumeError, TrainCheckpointer
from antifragile.trainer.ckpt_backends import foreign_steps, open_backend
from antifragile.trainer.config import TrainConfig
from antifragile.trainer.data import TokenData, tokens_digest
from antifragile.trainer.distributed import (
    DistContext,
    Launch,
    LaunchError,
    join,
    launch_info,
    leave,
)
from antifragile.trainer.events import EventLog
from antifragile.trainer.lease import register_when_leased
from antifragile.trainer.model import GPT, init_weights, keep_stage
from antifragile.trainer.parallel import apply_fsdp, apply_tp, build_schedule
from antifragile.trainer.pause import PausePoints
from antifragile.trainer.placement import first_slots
from antifragile.trainer.progress import Phase, SharedProgress, default_lease_s
from antifragile.trainer.recovery import (
    Formation,
    end_of_run,
    first_formation,
    gather,
    recover,
    signal_failure,
    wait_for_assignment,
    worker_id,
)
from antifragile.trainer.supervisor import (
    FINAL_SAVE_EXIT_CODE,
    NO_RESUME_EXIT_CODE,
    RESTART_EXIT_CODE,
    STUCK_EXIT_CODE,
    USAGE_EXIT_CODE,
)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_model(cfg: TrainConfig) -> GPT:
    """The whole model, initialised identically on every rank whatever the layout."""
    model = GPT(cfg.model)
    init_weights(model, cfg.seed)
    return model


class Trainer:
    def __init__(self, cfg: TrainConfig, ctx: DistContext, progress: SharedProgress,
                 model: GPT | None = None) -> None:
        self.cfg = cfg
        self.ctx = ctx
        dims = cfg.parallel
        if dims.world_size != ctx.world_size:
            raise ValueError(f"dp*tp*pp = {dims.world_size} but the world has "
                             f"{ctx.world_size} ranks")
        torch.manual_seed(cfg.seed)
        mesh = dims.build_mesh(ctx.device)
        self.dp_mesh = mesh["dp"]
        self.dp_rank = self.dp_mesh.get_local_rank()
        self.pp_rank = mesh["pp"].get_local_rank()
        model = keep_stage(model if model is not None else build_model(cfg), self.pp_rank,
                           dims.pp)
        for block in model.layers.values():  # micro-step progress for the watchdog
            block.register_forward_pre_hook(lambda *_: progress.bump())
        model.to(ctx.device)
        apply_tp(model, mesh["tp"])
        if cfg.activation_checkpointing:  # after TP: its plan names a block's own children
            _checkpoint_blocks(model)
        apply_fsdp(model, mesh["dp"], pipelined=dims.pp > 1)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0,
                                           foreach=False)
        self.schedule = None
        if dims.pp > 1:
            self.schedule = build_schedule(
                model, mesh["pp"], ctx.device, schedule=cfg.schedule,
                num_micro_batches=cfg.micro_batches,
                micro_batch_size=cfg.batch_size // dims.dp // cfg.micro_batches, loss_fn=loss_fn)
        self.data = TokenData(cfg.model.seq_len, cfg.model.vocab, cfg.seed, cfg.data_path)
        self.is_first = self.pp_rank == 0
        self.is_last = self.pp_rank == dims.pp - 1

    def train_step(self, cursor: int) -> float | None:
        """One optimizer step on the global batch at ``cursor``; the loss on last-stage ranks."""
        per_dp = self.cfg.batch_size // self.cfg.parallel.dp
        inputs, targets = self.data.batch(cursor, self.cfg.batch_size)
        rows = slice(self.dp_rank * per_dp, (self.dp_rank + 1) * per_dp)
        inputs, targets = inputs[rows].to(self.ctx.device), targets[rows].to(self.ctx.device)
        self.optimizer.zero_grad(set_to_none=True)
        loss: float | None = None
        if self.schedule is None:
            out = loss_fn(self.model(inputs), targets)
            out.backward()
            loss = float(out.detach())
        else:
            losses: list[torch.Tensor] = []
            if self.is_first:
                self.schedule.step(inputs)
            elif self.is_last:
                self.schedule.step(target=targets, losses=losses)
            else:
                self.schedule.step()
            if self.is_last:
                loss = float(torch.stack([x.detach() for x in losses]).mean())
        self.optimizer.step()
        if loss is not None and self.dp_mesh.size() > 1:
            mean = torch.tensor([loss], dtype=torch.float64)
            dist.all_reduce(mean, group=self.dp_mesh.get_group())
            loss = float(mean) / self.dp_mesh.size()
        return loss


def _checkpoint_blocks(model: GPT) -> None:
    """Wrap each block to recompute its activations in the backward. Only once tensor
    parallelism is applied: the TP plan names a block's children (``attn.wq``), which a
    wrapper hides behind ``_checkpoint_wrapped_module``, and ``parallelize_module`` only warns
    about a key it cannot resolve (the blocks then stay whole on every tp rank)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for name, block in list(model.layers.items()):
        model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)


def _is_collective_error(exc: BaseException | None) -> bool:
    """An error raised because a peer or a connection of the process group went away, also
    when wrapped (the pipeline schedule re-raises a stage's failure as a bare RuntimeError).
    Storage's errors (an OSError, or the engine's CheckpointError naming one) are not, whatever
    their text says: a ConnectionResetError from S3 is no failure of the group."""
    while exc is not None:
        if isinstance(exc, dist.DistError):
            return True
        text = str(exc)
        if not isinstance(exc, OSError | CheckpointError) and ("gloo" in text
                                                              or "Connection" in text):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def run(cfg: TrainConfig, progress: SharedProgress | None = None, incarnation: int = 0) -> int:
    """One training process: play a rank (or wait as a spare) until the job ends. A slot
    beyond dp*tp*pp, or a fresh process of a slot whose previous one died (``incarnation`` >
    0), starts as a spare."""
    progress = progress or SharedProgress()
    launch = launch_info(collective_timeout_s=cfg.collective_timeout_s)
    world = cfg.parallel.world_size
    if launch.slots < world and "RANK" not in os.environ:
        raise LaunchError(f"dp*tp*pp = {world} ranks: without torchrun the trainer is one "
                          f"process; start it with torchrun --nproc-per-node {world}")
    if launch.slots < world:
        raise LaunchError(f"torchrun started {launch.slots} workers for dp*tp*pp = {world}: "
                          f"start at least {world} (--nproc-per-node x nodes)")
    if launch.slots > world and cfg.recovery != "in_process":
        raise LaunchError(f"torchrun started {launch.slots} workers for dp*tp*pp = {world}; "
                          "extra workers are spares, which only --recovery in_process uses")
    if cfg.device == "cuda" and torch.cuda.device_count() < launch.local_slots:
        found = torch.cuda.device_count()
        raise LaunchError(f"--device cuda: this host has {found or 'no'} CUDA device(s) for "
                          f"its {launch.local_slots} worker(s) (one each, spares included): "
                          "start at most that many per host (--nproc-per-node)")
    if launch.hosts_store and cfg.recovery == "in_process":
        raise LaunchError("--recovery in_process needs a launcher store that outlives every "
                          "training process (torchrun's agent store, or one served by slot 0's "
                          "supervisor: run under `python -m antifragile.trainer`); here slot "
                          "0's training process hosts it (TORCH_DISABLE_SHARE_RDZV_TCP_STORE), "
                          "so its death would end the re-formation: use --recovery restart")
    gc.freeze()  # what the imports made: a collection after a re-formation skips it (ms)
    js = launch.job_store()
    me = worker_id(launch.slot, incarnation)
    model: GPT | None = None
    cause = "start"
    active = first_slots(launch.slots, world, launch.local_slots)
    if launch.slot in active and incarnation == 0:
        formation: Formation | None = first_formation(js, launch.slot, active)
    else:
        progress.set(Phase.SPARE)
        if incarnation == 0:  # a dead slot's fresh process: its supervisor registered it
            register_when_leased(js, launch.slot, me, timeout_s=cfg.collective_timeout_s)
        t0 = time.perf_counter()
        model = build_model(cfg)  # warm: torch imported, model built, before it is needed
        spare_log = EventLog(cfg.run_dir, -1, -1, name=f"spare{launch.slot}")
        spare_log.emit("spare_ready", worker=me, pid=os.getpid(),
                       warmup_s=time.perf_counter() - t0)
        spare_log.close()
        assigned = wait_for_assignment(js, me)
        if isinstance(assigned, str):  # declared dead: its slot's lease lapsed
            print(f"in-process recovery: spare {me} was declared dead ({assigned}); exiting "
                  f"(code {STUCK_EXIT_CODE}) to be replaced", file=sys.stderr, flush=True)
            return STUCK_EXIT_CODE
        if assigned is None:
            return 0
        formation = assigned
        cause = "in_process"
    # the last committed save in host memory, until the generation restored from it commits
    memory: list[Any] = [None]
    while True:
        assert formation is not None
        if me not in formation.members:  # counted lost: it came too late to the re-formation
            print(f"in-process recovery: worker {me} reached the re-formation after the others "
                  f"had counted it lost; exiting (code {STUCK_EXIT_CODE}) to be replaced",
                  file=sys.stderr, flush=True)
            return STUCK_EXIT_CODE
        outcome = _generation(cfg, launch, me, formation, progress, model, cause, memory)
        if isinstance(outcome, int):
            # in process only: nobody reads it on a restart, where slot 0's training
            # process may serve the store (gone once it exits: another rank's write would fail)
            if outcome == 0 and cfg.recovery == "in_process":
                end_of_run(js, me, formation)
            return outcome
        (formation, memory[0]), model, cause = outcome, None, "in_process"
        del outcome  # memory[0] alone holds the copy (see ``_release_older_copy``)
        # the failed generation's model: FSDP's modules and states refer to each other, so
        # only a collection frees it, and with it its process groups (their threads, sockets
        # and, on GPUs, communicators) before the next generation builds its own
        gc.collect()


def _generation(cfg: TrainConfig, launch: Launch, me: str, formation: Formation,
                progress: SharedProgress, model: GPT | None, cause: str,
                memory: list[Any]) -> int | tuple[Formation, Any]:
    """Play one generation: its exit code, or (after an in-process recovery) the next
    formation and this rank's last committed save still in memory (None: restore from
    storage)."""
    progress.set(Phase.STARTING, generation=formation.generation,
                 rank=formation.members.index(me))
    js = launch.job_store() if cfg.recovery == "in_process" else None
    if js is not None:
        why = gather(js, formation, timeout_s=cfg.collective_timeout_s)
        if why is not None:  # a member died before it arrived: no rendezvous, re-form again
            print(f"in-process recovery: {why}", file=sys.stderr, flush=True)
            progress.set(Phase.RECOVERING)
            nxt = recover(js, me, formation, timeout_s=cfg.collective_timeout_s,
                          reached=progress.read()[4])
            if isinstance(nxt, str):
                return _not_re_formed(formation.generation, nxt)
            return nxt, memory[0]
    rank, generation = formation.members.index(me), formation.generation
    events = EventLog(cfg.run_dir, rank, generation)
    if launch.link_cut:  # the last generation's abort cut its rendezvous connection
        launch.relink()
    sockets = GlooSockets(launch.store_ports(), links=launch.link)
    watch = None
    if cfg.recovery == "in_process":  # armed before the rendezvous: a member may die during it
        watch = FailureWatch(launch.job_store, generation, sockets.shutdown,
                             progress=progress, on_stuck=_stuck,
                             thread_id=threading.get_native_id(),
                             store_gone_s=cfg.lease_s if cfg.lease_s is not None
                             else default_lease_s(cfg.hang_timeout_s))
        watch.start()
    checkpointer: list[TrainCheckpointer] = []  # set by _train: its memory outlives a failure
    try:
        ctx = join(launch, me, formation, sockets, device_type=cfg.device)
        events.emit("start", pid=os.getpid(), world_size=ctx.world_size, worker=me,
                    dp=cfg.parallel.dp, tp=cfg.parallel.tp, pp=cfg.parallel.pp, cause=cause,
                    recovery=cfg.recovery)
        code = _train(cfg, ctx, events, progress, model, memory, checkpointer,
                      interrupted=watch.fired.is_set if watch is not None else None)
        progress.set(Phase.DONE)
        events.emit("exit", code=code)
        leave()
        return code
    except Exception as exc:
        if watch is not None:
            watch.left()
        # a failure of the generation: a collective error, or the failure key set (by the
        # dead worker's supervisor) around the time this error was raised
        if watch is None or not (_is_collective_error(exc) or watch.fired.wait(1.0)):
            events.emit("exit", code=1, error=f"{type(exc).__name__}: {exc}")
            raise
        assert js is not None  # in process
        progress.set(Phase.RECOVERING)
        reason = f"{type(exc).__name__}: {str(exc)[:300]}"
        events.emit("recovery_begin", reason=reason)
        signal_failure(js, generation, f"rank {rank}: {reason}")
        watch.stop()
        sockets.shutdown()
        launch.link_cut = sockets.cut
        kept = memory[0]  # failed before it restored: the previous copy still holds
        if checkpointer:  # the save in flight cannot commit (a rank is gone): give it up
            kept = checkpointer[0].backend.memory_copy() or kept
            checkpointer[0].abandon()
            # a thread of its save may still wait on the default store, whose client the
            # groups rendezvous through, and a client serves one request at a time: the next
            # generation connects again rather than wait behind it
            if checkpointer[0].backend.saves_wait_on_default_store:
                launch.link_cut = True
        leave()
        events.emit("generation_end", memory_step=kept.step if kept is not None else None)
        nxt = recover(js, me, formation, timeout_s=cfg.collective_timeout_s,
                      reached=progress.read()[4])
        if isinstance(nxt, str):
            events.emit("exit", code=RESTART_EXIT_CODE, error=nxt)
            return _not_re_formed(generation, nxt)
        return nxt, kept
    finally:
        if watch is not None:
            watch.stop()
        events.close()


def _release_older_copy(ckpt: TrainCheckpointer, memory: list[Any]) -> None:
    """Drop the previous generation's copy of the last committed save (``memory[0]``) once
    this generation's engine holds a newer one: a failure from then on restores from that.
    The cost: while this generation's first save persists, the rank holds the old copy
    beside the engine's two sets of staging buffers, one copy of its state more than a run
    without failures holds."""
    if memory[0] is not None and ckpt.backend.memory_copy() is not None:
        memory[0] = None


def _not_re_formed(generation: int, why: str) -> int:
    """A survivor of ``generation`` that the re-formation sends to the torchrun restart: say
    why on stderr (its supervisor only passes the exit code on), and return that code."""
    print(f"in-process recovery: generation {generation} is not re-formed in process: {why}; "
          f"exiting (code {RESTART_EXIT_CODE}) for torchrun to restart the group",
          file=sys.stderr, flush=True)
    return RESTART_EXIT_CODE


def _stuck(seconds: float) -> None:
    """The training thread stayed in a collective of a failed generation after its
    connections were shut down: end the process (see ``FailureWatch``), leaving every thread's
    stack in the log (a gloo send queued when its connection failed is never woken: see
    ``FailureWatch``)."""
    print(f"in-process recovery: the training thread made no progress and did not leave the "
          f"failed generation's collective for {seconds:.1f} s after the abort; exiting "
          f"(code {STUCK_EXIT_CODE}) so that the others re-form without this process; "
          "its threads' stacks:", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    os._exit(STUCK_EXIT_CODE)


def _train(cfg: TrainConfig, ctx: DistContext, events: EventLog, progress: SharedProgress,
           model: GPT | None, memory: list[Any], checkpointer: list[TrainCheckpointer], *,
           interrupted: Callable[[], bool] | None = None) -> int:
    """Train this generation to the end. ``interrupted``: whether the generation failed
    (in-process recovery), which ends a hold at a pause point."""
    trainer = Trainer(cfg, ctx, progress, model)
    pauses = PausePoints(cfg.run_dir, ctx.rank, events.emit, on_hold=progress.hold,
                         interrupted=interrupted, generation=events.attempt)
    ckpt: TrainCheckpointer | None = None
    step, cursor = 0, 0
    if cfg.ckpt_url:
        url = cfg.ckpt_url
        backend = open_backend(cfg.ckpt_engine, cfg.ckpt_url, keep_last=cfg.keep_last,
                               timeout_s=cfg.ckpt_timeout_s, async_=cfg.async_ckpt,
                               keep_in_memory=cfg.recovery == "in_process",
                               on_phase=pauses.save_phase)
        m = cfg.model
        ckpt = TrainCheckpointer(backend, trainer.model, trainer.optimizer, events,
                                seed=cfg.seed,
                                shape={"layers": m.layers, "d_model": m.d_model,
                                       "heads": m.heads, "vocab": m.vocab,
                                       "seq_len": m.seq_len},
                                data="synthetic" if cfg.data_path is None else
                                f"file:{tokens_digest(cfg.data_path, m.seq_len, m.vocab)}",
                                foreign=lambda: foreign_steps(cfg.ckpt_engine, url),
                                interrupted=interrupted)
        checkpointer.append(ckpt)
    ctx.sockets.end()  # every process group of this generation exists now
    if ckpt is not None:
        progress.set(Phase.RESTORING, step=step)
        try:
            restored = ckpt.restore(memory[0])
        except ResumeError as exc:
            ckpt.close()
            if ctx.rank == 0:
                print(f"antifragile.trainer: error: cannot resume: {exc}; exiting with code "
                      f"{NO_RESUME_EXIT_CODE} rather than training from step 0",
                      file=sys.stderr, flush=True)
            return NO_RESUME_EXIT_CODE
        except StorageAccessError as exc:  # a missing bucket, refused credentials: a restart
            ckpt.close()  # meets the same (a storage that fails otherwise is restarted)
            if ctx.rank == 0:
                print(f"antifragile.trainer: error: --ckpt-url {cfg.ckpt_url}: {exc}",
                      file=sys.stderr, flush=True)
            return USAGE_EXIT_CODE
        # restored: a collection now frees what is left of the previous generation in
        # reference cycles (its process groups' threads and sockets) rather than whenever
        # the interpreter next runs a full one. Its copy of the last committed save stays
        # (``memory[0]``, buffers of its abandoned engine, which nothing stages over): until
        # this generation commits a save of its own it is still the newest committed state,
        # and a second failure meanwhile restores from it, not from storage
        if memory[0] is not None:
            if restored is None or getattr(memory[0], "step", None) != restored[0]:
                memory[0] = None  # a newer step was restored from storage: the copy is stale
            gc.collect()
        if restored is not None:
            step, cursor = restored
            # the checkpoint restores the optimizer's state (moments, step counts), and with
            # torch's optimizer state dict also the lr it was saved with: the run trains at
            # the --lr it is given, as a run that changes it on a resume means to
            for group in trainer.optimizer.param_groups:
                group["lr"] = cfg.lr
            if step >= cfg.steps and ctx.rank == 0:  # a finished run, or --steps lowered
                where = (f"the last (--steps {cfg.steps})" if step == cfg.steps
                         else f"past --steps {cfg.steps}")
                print(f"antifragile.trainer: resumed at step {step}, {where}: nothing to "
                      "train", file=sys.stderr, flush=True)
    progress.set(Phase.TRAINING, step=step)
    unsaved = None  # the last step, if its checkpoint could not be saved
    while step < cfg.steps:
        t0 = time.perf_counter()
        loss = trainer.train_step(cursor)
        step += 1
        cursor += cfg.batch_size
        progress.set(Phase.TRAINING, step=step)
        events.emit("step_end", step=step, loss=loss, seconds=time.perf_counter() - t0)
        if ckpt is not None:
            ckpt.poll()
            _release_older_copy(ckpt, memory)
            if step % cfg.ckpt_every == 0 or step == cfg.steps:
                progress.set(Phase.CHECKPOINT)
                if step == cfg.steps:
                    staged = ckpt.save_final(step, cursor, patience_s=cfg.final_save_patience_s)
                    unsaved = None if staged else step
                else:
                    staged = ckpt.save(step, cursor, blocking=not cfg.async_ckpt)
                if staged:  # a save skipped (the previous one still persists) has no phase
                    pauses.save_phase(step, "staged")
                progress.set(Phase.TRAINING)
        pauses.step_end(step)
    if ckpt is not None:
        progress.set(Phase.CHECKPOINT)
        ckpt.close()
    if unsaved is not None:
        if ctx.rank == 0:
            print(f"antifragile.trainer: error: step {unsaved} not saved: its checkpoint "
                  f"failed for {cfg.final_save_patience_s:g} s (the ckpt_failed events say "
                  f"why); exiting with code {FINAL_SAVE_EXIT_CODE}: a restart trains the steps "
                  "since the last checkpoint again", file=sys.stderr, flush=True)
        return FINAL_SAVE_EXIT_CODE
    return 0

