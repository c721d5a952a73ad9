"""The training loop: build the 3D-parallel model, resume, train, checkpoint, report events."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from antifragile.trainer.checkpoint import TrainCheckpointer
from antifragile.trainer.ckpt_backends import open_backend
from antifragile.trainer.config import TrainConfig
from antifragile.trainer.data import TokenData
from antifragile.trainer.distributed import HANG_EXIT_CODE, DistContext, Heartbeat, init_distributed
from antifragile.trainer.events import EventLog
from antifragile.trainer.model import GPT, init_weights, keep_stage
from antifragile.trainer.parallel import apply_fsdp, apply_tp, build_schedule


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class Trainer:
    def __init__(self, cfg: TrainConfig, ctx: DistContext, events: EventLog) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.events = events
        dims = cfg.parallel
        if dims.world_size != ctx.world_size:
            raise ValueError(f"dp*tp*pp = {dims.world_size} but the world has "
                             f"{ctx.world_size} ranks")
        torch.manual_seed(cfg.seed)
        mesh = dims.build_mesh(ctx.device)
        self.dp_mesh = mesh["dp"]
        self.dp_rank = self.dp_mesh.get_local_rank()
        self.pp_rank = mesh["pp"].get_local_rank()
        model = GPT(cfg.model)
        init_weights(model, cfg.seed)
        model = keep_stage(model, self.pp_rank, dims.pp)
        if cfg.activation_checkpointing:
            _checkpoint_blocks(model)
        model.to(ctx.device)
        apply_tp(model, mesh["tp"])
        apply_fsdp(model, mesh["dp"], pipelined=dims.pp > 1)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0,
                                           foreach=False)
        self.schedule = None
        if dims.pp > 1:
            self.schedule = build_schedule(model, mesh["pp"], ctx.device, schedule=cfg.schedule,
                                           num_micro_batches=cfg.micro_batches, loss_fn=loss_fn)
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
                self.schedule.step(inputs)  # type: ignore[attr-defined]
            elif self.is_last:
                self.schedule.step(target=targets, losses=losses)  # type: ignore[attr-defined]
            else:
                self.schedule.step()  # type: ignore[attr-defined]
            if self.is_last:
                loss = float(torch.stack([x.detach() for x in losses]).mean())
        self.optimizer.step()
        if loss is not None and self.dp_mesh.size() > 1:
            mean = torch.tensor([loss], dtype=torch.float64)
            dist.all_reduce(mean, group=self.dp_mesh.get_group())
            loss = float(mean) / self.dp_mesh.size()
        return loss


def _checkpoint_blocks(model: GPT) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for name, block in list(model.layers.items()):
        model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)


def run(cfg: TrainConfig) -> int:
    ctx = init_distributed(device_type=cfg.device,
                           collective_timeout_s=cfg.collective_timeout_s)
    events = EventLog(cfg.run_dir, ctx.rank, ctx.attempt)
    events.emit("start", pid=os.getpid(), world_size=ctx.world_size,
                dp=cfg.parallel.dp, tp=cfg.parallel.tp, pp=cfg.parallel.pp)

    def on_hang(silent: list[int]) -> None:
        msg = (f"[rank {ctx.rank}] rank(s) {silent} silent for more than "
               f"{cfg.hang_timeout_s:.1f} s: exiting so the launcher restarts the group")
        print(msg, file=sys.stderr, flush=True)
        events.emit("hang_detected", silent_ranks=silent)
        events.emit("exit", code=HANG_EXIT_CODE)
        os._exit(HANG_EXIT_CODE)

    heartbeat = None
    if ctx.world_size > 1:
        heartbeat = Heartbeat(ctx.store, ctx.rank, ctx.world_size,
                              interval_s=cfg.heartbeat_interval_s,
                              hang_timeout_s=cfg.hang_timeout_s, on_hang=on_hang)
        heartbeat.start()
    code = 1
    try:
        code = _train(cfg, ctx, events)
        return code
    except Exception as exc:
        events.emit("exit", code=1, error=f"{type(exc).__name__}: {exc}")
        raise
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        if code == 0:
            events.emit("exit", code=0)
        events.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _train(cfg: TrainConfig, ctx: DistContext, events: EventLog) -> int:
    trainer = Trainer(cfg, ctx, events)
    ckpt: TrainCheckpointer | None = None
    step, cursor = 0, 0
    if cfg.ckpt_url:
        backend = open_backend(cfg.ckpt_engine, cfg.ckpt_url, keep_last=cfg.keep_last,
                               timeout_s=cfg.ckpt_timeout_s, async_=cfg.async_ckpt)
        ckpt = TrainCheckpointer(backend, trainer.model, trainer.optimizer, events)
        restored = ckpt.restore()
        if restored is not None:
            step, cursor = restored
    while step < cfg.steps:
        t0 = time.perf_counter()
        loss = trainer.train_step(cursor)
        step += 1
        cursor += cfg.batch_size
        events.emit("step_end", step=step, loss=loss, seconds=time.perf_counter() - t0)
        if ckpt is not None:
            ckpt.poll()
            if step % cfg.ckpt_every == 0 or step == cfg.steps:
                ckpt.save(step, cursor, blocking=step == cfg.steps or not cfg.async_ckpt)
    if ckpt is not None:
        ckpt.close()
    return 0
