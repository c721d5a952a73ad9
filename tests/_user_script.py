"""A small user training script for the ``trainer.command`` tests, run by chaos under torchrun.

Written as a user would: gloo, a linear model, SGD with momentum, data a pure function of the
step, checkpoints through ``CheckpointEngine`` at ``$ANTIFRAGILE_CKPT_URL``, resume on start.
Flags make it misbehave on purpose: ``--no-probe`` (never imports the probe), ``--noise``
(not deterministic), ``--forget-optimizer`` (resumes without the optimizer state),
``--epoch-steps N`` (reports the step within an epoch of ``N`` steps, from 1 again each
epoch, instead of the global step), ``--stop-short`` (checkpoints every ``--every`` steps
only, not its last step, and a resumed run exits 0 one step before ``--steps``),
``--crash-on-resume`` (a resumed run raises), ``--never-resume`` (starts from step 0 after a
restart, its checkpoints ignored).
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch
import torch.distributed as dist

from antifragile.engine import CheckpointEngine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--step-s", type=float, default=0.05)
    parser.add_argument("--no-probe", action="store_true")
    parser.add_argument("--noise", action="store_true")
    parser.add_argument("--forget-optimizer", action="store_true")
    parser.add_argument("--stop-short", action="store_true")
    parser.add_argument("--crash-on-resume", action="store_true")
    parser.add_argument("--epoch-steps", type=int, default=0)
    parser.add_argument("--never-resume", action="store_true")
    args = parser.parse_args()
    probe = None
    if not args.no_probe:
        from antifragile import probe

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ckpt = CheckpointEngine(os.environ["ANTIFRAGILE_CKPT_URL"], keep_last=3)
    step, last = 0, args.steps
    if ckpt.latest_step() is not None and not args.never_resume:
        state = {"model": model} if args.forget_optimizer else {"model": model, "optim": optimizer}
        step = ckpt.load(state)
        if args.crash_on_resume:
            raise RuntimeError(f"my resume code is broken (step {step})")
        if args.stop_short:
            last -= 1
    while step < last:
        step += 1
        g = torch.Generator().manual_seed(step * world + rank)
        x = torch.randn(16, 8, generator=g)
        loss = (model(x) - x.flip(1)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        optimizer.step()
        if args.noise:
            with torch.no_grad():
                model.bias.add_(random.SystemRandom().random() * 1e-6)
        time.sleep(args.step_s)
        if probe is not None:
            probe.step_end((step - 1) % args.epoch_steps + 1 if args.epoch_steps else step,
                           loss)
        if step % args.every == 0 or (step == args.steps and not args.stop_short):
            if step == args.steps:  # the last save must not be skipped for a busy one
                ckpt.wait()
            ckpt.save(step, {"model": model, "optim": optimizer},
                      blocking=step == args.steps)
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
