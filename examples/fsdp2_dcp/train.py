"""Train a small model with FSDP2 and checkpoint it with torch.distributed.checkpoint.

A plain PyTorch script, as FSDP2 users write one: `fully_shard` on every block and the root,
AdamW, state dicts from `get_state_dict` / `set_state_dict`, one DCP checkpoint folder per step
(`<ckpt-url>/step_000000010/`, complete once DCP has written its `.metadata`), and on start a
resume from the newest complete folder (an older one if that fails to load). The batches are a
pure function of the step, so a resumed run sees the data an uninterrupted one would.

For chaos: `probe.step_end`, and `probe.dcp_save` / `probe.dcp_load` in place of `dcp.save` /
`dcp.load` (same arguments plus the step; they report the save or restore to chaos and are
plain DCP calls otherwise). The checkpoint URL comes from `ANTIFRAGILE_CKPT_URL` under chaos.

    torchrun --nproc-per-node 2 examples/fsdp2_dcp/train.py --ckpt-url /tmp/fsdp2-ckpt
    chaos run scenarios/examples/fsdp2-dcp-kill.yaml
"""

from __future__ import annotations

import argparse
import os
import re
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from antifragile import probe


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, dim: int = 32, depth: int = 3, classes: int = 10) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build() -> tuple[Net, torch.optim.Optimizer]:
    """The model, sharded, and its optimizer: initialised alike on every call."""
    torch.manual_seed(0)
    model = Net()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def batch(step: int, rank: int, world: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the global batch of ``step`` (seeded by the step: resumable)."""
    g = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(size * world, 32, generator=g)
    y = (x[:, :10].argmax(dim=1) + step) % 10
    rows = slice(rank * size, (rank + 1) * size)
    return x[rows], y[rows]


def complete_steps(root: Path) -> list[int]:
    """Steps whose DCP folder is complete (``.metadata`` is written last), newest first."""
    found = [int(m.group(1)) for p in root.glob("step_*")
             if (m := re.fullmatch(r"step_(\d+)", p.name)) and (p / ".metadata").is_file()]
    return sorted(found, reverse=True)


def positive(text: str) -> int:
    """An argparse type: a whole number of at least 1 (a step count, an interval, a batch)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not positive")
    return value


def local_folder(text: str) -> Path:
    """An argparse type: a local folder, as a path or a ``file://`` URL (chaos passes
    ``checkpoint.url`` as written); DCP's ``FileSystemWriter`` writes to local folders only,
    and ``Path("file:///x")`` or ``Path("s3://b/x")`` would be a relative folder here."""
    if text.startswith("file://"):
        return Path(text.removeprefix("file://"))
    if "://" in text:
        raise argparse.ArgumentTypeError(f"{text!r}: DCP's file system writer needs a local "
                                         "folder (a path or a file:// URL)")
    return Path(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive, default=40)
    parser.add_argument("--ckpt-every", type=positive, default=5)
    parser.add_argument("--ckpt-url", type=local_folder,
                        default=os.environ.get("ANTIFRAGILE_CKPT_URL", "/tmp/fsdp2-dcp-ckpt"))
    parser.add_argument("--batch-size", type=positive, default=8)
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.use_deterministic_algorithms(True)
    model, optimizer = build()
    root: Path = args.ckpt_url

    step = 0
    for candidate in complete_steps(root):
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd, "train": {"step": 0}}
        try:
            probe.dcp_load(state, checkpoint_id=root / f"step_{candidate:09d}", step=candidate)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            if rank == 0:
                print(f"step {candidate} does not load ({type(exc).__name__}); trying older")
            # DCP loads into the model's own tensors: a load that failed part way may have
            # overwritten some of them (where none loads, training starts from a fresh model)
            model, optimizer = build()
            continue
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        step = state["train"]["step"]
        break

    while step < args.steps:
        step += 1
        x, y = batch(step, rank, world, args.batch_size)
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        probe.step_end(step, loss.item())
        if step % args.ckpt_every == 0 or step == args.steps:
            folder = root / f"step_{step:09d}"
            # a step saved again (the job fell back past it): its old .metadata goes before
            # any rank writes, or a save cut short would leave a folder that looks complete
            if rank == 0:
                (folder / ".metadata").unlink(missing_ok=True)
            dist.barrier()
            model_sd, optim_sd = get_state_dict(model, optimizer)
            probe.dcp_save({"model": model_sd, "optim": optim_sd, "train": {"step": step}},
                           checkpoint_id=folder, step=step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
