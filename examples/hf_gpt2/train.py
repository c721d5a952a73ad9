"""Fine-tune a small GPT-2 with DDP, checkpointing through antifragile's engine.

An ordinary `transformers` + PyTorch training script, written the way its users write it: a
GPT-2 built from its config (no download), AdamW, a linear warm-up schedule, a torchdata
`StatefulDataLoader` over an in-memory dataset, DDP on gloo. It checkpoints the objects
themselves (model, optimizer, scheduler, data loader, RNG) with `CheckpointEngine` and resumes
from the newest checkpoint on start. Two lines are for chaos: `probe.step_end`, and the
checkpoint URL read from `ANTIFRAGILE_CKPT_URL` (set by `chaos run`; `--ckpt-url` otherwise).

    torchrun --nproc-per-node 2 examples/hf_gpt2/train.py --ckpt-url /tmp/gpt2-ckpt
    chaos run scenarios/examples/hf-gpt2-kill.yaml
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

from antifragile import probe
from antifragile.engine import CheckpointEngine


class RandomTokens(Dataset[torch.Tensor]):
    """A fixed, seeded corpus of token sequences (stands in for a tokenized dataset)."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab, (n, seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


def positive(text: str) -> int:
    """An argparse type: a whole number of at least 1 (a step count, an interval, a batch)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not positive")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=positive, default=40)
    parser.add_argument("--ckpt-every", type=positive, default=5)
    parser.add_argument("--ckpt-url", default=os.environ.get("ANTIFRAGILE_CKPT_URL",
                                                             "/tmp/hf-gpt2-ckpt"))
    parser.add_argument("--batch-size", type=positive, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    # a collective a peer never joins (a hung rank) fails after 60 s, not gloo's default 30 min
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)

    config = GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                        bos_token_id=0, eos_token_id=0)
    model = DDP(GPT2LMHeadModel(config))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=5,
                                                num_training_steps=args.steps)
    dataset = RandomTokens(64, 32, config.vocab_size, seed=args.seed)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)
    # Its own generator: every new iterator draws a seed from it. From the global RNG (the
    # default) that draw would shift dropout's random stream on a resumed run (which starts a
    # new iterator mid-epoch) and the run would no longer match an uninterrupted one.
    loader = StatefulDataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                                generator=torch.Generator().manual_seed(args.seed))

    ckpt = CheckpointEngine(args.ckpt_url, keep_last=3)
    state = {"model": model, "optim": optimizer, "sched": scheduler, "loader": loader,
             "rng": torch.get_rng_state(), "epoch": 0}
    step = 0
    if ckpt.agreed_steps():
        step = ckpt.load(state)  # newest intact checkpoint; objects restored in place
        torch.set_rng_state(state["rng"])

    model.train()
    epoch = state["epoch"]
    while step < args.steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            loss = model(input_ids=batch, labels=batch).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            probe.step_end(step, loss.item())
            if step % args.ckpt_every == 0 or step == args.steps:
                state.update(rng=torch.get_rng_state(), epoch=epoch)
                # the last save blocks: it waits for one still in flight instead of being
                # skipped as busy, and returns once committed
                ckpt.save(step, state, blocking=step == args.steps)
            if step == args.steps:
                break
        else:
            epoch += 1
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
