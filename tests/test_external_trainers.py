"""Real objects of other trainers through the engine: HuggingFace ``transformers`` GPT-2 (built
from a config, nothing downloaded), ``torch.optim.AdamW``, a warmup LR schedule and a
``torchdata`` ``StatefulDataLoader`` that shuffles with a seeded generator.

The promise under test: train 3 steps, save the objects themselves, build everything anew
(other seeds, so nothing can match by accident), load, train 3 more, and get bit for bit what 6
straight steps give: parameters, optimizer state, scheduler state, the batches seen and the
losses. Dropout is on, so the global RNG state is part of the trainer's own Stateful. The
two-rank version runs DDP on gloo and resumes in processes that did not save.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # built from a config: never reach for the hub

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _dist import RankGroup
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

from antifragile.engine import CheckpointEngine

# torchdata 0.11 calls torch.set_vital, which torch 2.13 deprecates
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")

STEPS, SAVE_AT = 6, 3


class TrainState:
    """torchtitan's TrainState plus the RNG dropout draws from: no tensor but the RNG state."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen,
                "rng": torch.get_rng_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"]
        torch.set_rng_state(state_dict["rng"])


class Trainer:
    """Everything a small HuggingFace-style training loop holds."""

    def __init__(self, seed: int, *, ddp: bool = False) -> None:
        rank = dist.get_rank() if ddp else 0
        torch.manual_seed(seed)
        config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32,
                            bos_token_id=0, eos_token_id=0)
        self.model: nn.Module = GPT2LMHeadModel(config)
        if ddp:
            self.model = nn.parallel.DistributedDataParallel(self.model)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=3e-3, weight_decay=0.01)
        self.sched = get_linear_schedule_with_warmup(self.optim, num_warmup_steps=2,
                                                     num_training_steps=10)
        data_gen = torch.Generator().manual_seed(0)  # the same dataset for every build
        # one epoch spans all the steps: torchdata's own state does not reproduce the next
        # epoch's shuffle (a StatefulDataLoader restored from its state_dict() draws another
        # permutation at the epoch boundary, with or without a checkpoint engine)
        dataset = [torch.randint(0, 128, (16,), generator=data_gen) for _ in range(40)]
        if ddp:  # the sampler's seed is configuration, not state: the same for every build
            sampler = StatefulDistributedSampler(dataset, num_replicas=dist.get_world_size(),
                                                 rank=rank, shuffle=True, seed=42)
            # iter() draws a base seed from the loader's generator, from the global RNG
            # (dropout's) if it has none: at step 1 straight, at step 4 resumed
            self.loader = StatefulDataLoader(dataset, batch_size=2, sampler=sampler,
                                             generator=torch.Generator().manual_seed(seed))
        else:
            shuffle = torch.Generator().manual_seed(seed)
            self.loader = StatefulDataLoader(dataset, batch_size=4, shuffle=True,
                                             generator=shuffle)
        self.train = TrainState()
        torch.manual_seed(1000 * seed + rank)  # dropout's RNG, different on every rank
        self._batches: Iterator[torch.Tensor] | None = None
        self.seen: list[bytes] = []
        self.losses: list[bytes] = []

    def state(self) -> dict[str, Any]:
        return {"model": self.model, "optim": self.optim, "sched": self.sched,
                "loader": self.loader, "train": self.train}

    def next_batch(self) -> torch.Tensor:
        if self._batches is None:
            self._batches = iter(self.loader)  # a restored loader resumes mid-epoch
        return next(self._batches)

    def step(self) -> None:
        batch = self.next_batch()
        self.model.train()
        loss = self.model(input_ids=batch, labels=batch).loss
        loss.backward()
        self.optim.step()
        self.sched.step()
        self.optim.zero_grad()
        self.train.step += 1
        self.train.ntokens_seen += batch.numel()
        self.seen.append(bits(batch))
        self.losses.append(bits(loss))

    def fingerprint(self) -> dict[str, Any]:
        """Everything that must be equal, as bytes and typed JSON."""
        optim = self.optim.state_dict()
        return {
            "params": {k: bits(v) for k, v in self.model.state_dict().items()},
            "optim_state": {i: {k: bits(v) for k, v in s.items()}
                            for i, s in optim["state"].items()},
            "param_groups": floats_as_bits(optim["param_groups"]),
            "sched": floats_as_bits({k: v for k, v in self.sched.state_dict().items()
                                     if k != "lr_lambdas"}),
            "train": (self.train.step, self.train.ntokens_seen, bits(torch.get_rng_state())),
        }


def bits(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def floats_as_bits(value: Any) -> Any:
    """A JSON-ish value with every float replaced by its bytes (and its type kept)."""
    if isinstance(value, float):
        return ("float", np.float64(value).tobytes())
    if isinstance(value, dict):
        return {k: floats_as_bits(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [floats_as_bits(v) for v in value])
    if isinstance(value, torch.Tensor):
        return ("tensor", bits(value))
    return (type(value).__name__, value)


def test_gpt2_adamw_scheduler_and_loader_resume_bit_for_bit(tmp_path: Path) -> None:
    straight = Trainer(seed=0)
    for _ in range(STEPS):
        straight.step()
    expected = straight.fingerprint()  # the global RNG state is in it: take it now

    first = Trainer(seed=0)
    for _ in range(SAVE_AT):
        first.step()
    with CheckpointEngine(str(tmp_path / "ckpt")) as engine:
        engine.save(SAVE_AT, first.state(), blocking=True)

        resumed = Trainer(seed=1)  # other weights, data order and RNG; a fresh optimizer
        assert resumed.fingerprint() != first.fingerprint()
        state = resumed.state()
        assert engine.load(state) == SAVE_AT
    assert state["loader"] is resumed.loader and state["train"] is resumed.train
    assert resumed.fingerprint() == first.fingerprint()
    for _ in range(STEPS - SAVE_AT):
        resumed.step()
    assert first.seen + resumed.seen == straight.seen, "the data order differs"
    assert first.losses + resumed.losses == straight.losses
    assert resumed.fingerprint() == expected


# --- two ranks: DDP on gloo, resumed in processes that did not save ---------------------------


def ddp_first_part(url: str) -> dict[str, Any]:
    """Train straight (what the resumed run must equal) and save at SAVE_AT."""
    straight = Trainer(seed=0, ddp=True)
    for _ in range(STEPS):
        straight.step()
    expected = straight.fingerprint()  # the global RNG state is in it: take it now
    first = Trainer(seed=0, ddp=True)
    for _ in range(SAVE_AT):
        first.step()
    with CheckpointEngine(url) as engine:
        engine.save(SAVE_AT, first.state(), blocking=True)
    return {"straight": expected, "seen": straight.seen,
            "losses": straight.losses, "first_seen": first.seen}


def ddp_resume(url: str) -> dict[str, Any]:
    resumed = Trainer(seed=1, ddp=True)
    with CheckpointEngine(url) as engine:
        assert engine.load(resumed.state()) == SAVE_AT
    for _ in range(STEPS - SAVE_AT):
        resumed.step()
    return {"fingerprint": resumed.fingerprint(), "seen": resumed.seen,
            "losses": resumed.losses}


@pytest.mark.multiproc
def test_gpt2_under_ddp_resumes_bit_for_bit_in_new_processes(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    with RankGroup(2, timeout_s=300) as ranks:
        before = ranks.run(ddp_first_part, url)
    with RankGroup(2, timeout_s=300) as ranks:
        after = ranks.run(ddp_resume, url)
    assert before[0]["seen"] != before[1]["seen"], "each rank reads its own shard"
    for rank in range(2):
        assert before[rank]["first_seen"] + after[rank]["seen"] == before[rank]["seen"], rank
        assert after[rank]["losses"] == before[rank]["losses"][SAVE_AT:], rank
        assert after[rank]["fingerprint"] == before[rank]["straight"], rank
