"""State fidelity across real gloo ranks: per-rank plain tensors, world-size changes, and
model/optimizer objects under DDP and FSDP2.

A plain (non-DTensor) tensor that differs between ranks (``torch.get_rng_state()``, a sampler
offset, a data loader's bytes) is kept per rank and comes back to the rank that saved it, even
when the ranks agreed at an earlier save of the same engine. Loading on more ranks than saved
gives the new ranks rank 0's copy of every per-rank value, with a RuntimeWarning that names the
paths: never silently.
"""

from __future__ import annotations

import json
import math
import struct
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import RankGroup
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from antifragile.engine import CheckpointEngine, CheckpointError

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def ranks() -> Iterator[RankGroup]:
    with RankGroup(2, timeout_s=180) as group:
        yield group


def bits(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


# --- per-rank plain tensors and values --------------------------------------------------------


def rank_state(rank: int, version: int) -> dict[str, Any]:
    """Replicated weights plus what differs by rank from ``version`` 2 on (all equal at 1)."""
    torch.manual_seed(100 + (rank if version > 1 else 0) + version)
    own = rank if version > 1 else 0
    return {
        "model": {"w": torch.arange(12.0).reshape(3, 4) * version},
        "rng": torch.get_rng_state(),
        "sampler": {"offset": torch.tensor(10 * own + version), "epoch": version},
        "loader": {"blob": bytes([own + 1]) * (3 + own), "cursor": own},
    }


def blank_state() -> dict[str, Any]:
    return {
        "model": {"w": torch.full((3, 4), -1.0)},
        "rng": torch.zeros_like(torch.get_rng_state()),
        "sampler": {"offset": torch.tensor(-1), "epoch": -1},
        "loader": {"blob": b"", "cursor": -1},
    }


def summary(state: dict[str, Any]) -> dict[str, Any]:
    return {"w": bits(state["model"]["w"]), "rng": bits(state["rng"]),
            "offset": int(state["sampler"]["offset"]), "epoch": state["sampler"]["epoch"],
            "blob": state["loader"]["blob"], "cursor": state["loader"]["cursor"]}


def save_versions(url: str, members: list[int]) -> None:
    """Steps 1 (ranks agree) and 2 (they differ) through one engine (cached plan)."""
    group = dist.new_group(members)
    if dist.get_rank() not in members:
        return
    with CheckpointEngine(url, process_group=group) as engine:
        for version in (1, 2):
            engine.save(version, rank_state(dist.get_rank(group), version), blocking=True)


def load_version(url: str, step: int) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """(what this rank loaded, what it saved as this rank, warnings)."""
    target = blank_state()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with CheckpointEngine(url) as engine:
            engine.load(target, step=step)
    expected = summary(rank_state(dist.get_rank(), step))
    return summary(target), expected, [str(w.message) for w in caught]


def test_plain_tensors_that_differ_between_ranks_are_kept_per_rank(
    ranks: RankGroup, tmp_path: Path
) -> None:
    url = str(tmp_path / "ckpt")
    ranks.run(save_versions, url, [0, 1])
    for step in (1, 2):
        results = ranks.run(load_version, url, step)
        for rank, (got, expected, caught) in enumerate(results):
            assert got == expected, f"step {step}, rank {rank}"
            assert caught == [], f"step {step}, rank {rank}"
    got = [r[0] for r in ranks.run(load_version, url, 2)]
    assert got[0]["rng"] != got[1]["rng"] and got[0]["blob"] != got[1]["blob"]


def test_read_gives_every_ranks_copy_of_what_was_saved_per_rank(
    ranks: RankGroup, tmp_path: Path
) -> None:
    # read() gave the lowest rank's copy of a JSON value that differed between ranks, under
    # its path, and no other: comparing two runs' final checkpoints (chaos's checker) could
    # not see rank 1's cursor differ. Per-rank values are keyed as per-rank tensors are
    url = str(tmp_path / "ckpt")
    ranks.run(save_versions, url, [0, 1])
    with CheckpointEngine(url) as engine:
        stored = engine.read(2)
        assert engine.verify(2).ok  # the per-rank index, values and type records check out
    saved = [rank_state(rank, 2) for rank in (0, 1)]
    for rank in (0, 1):
        assert bits(stored[f"rng/rank_{rank}"]) == bits(saved[rank]["rng"])
        assert stored[f"loader/cursor/rank_{rank}"] == saved[rank]["loader"]["cursor"]
    assert "loader/cursor" not in stored and "rng" not in stored
    assert stored["sampler/epoch"] == 2  # the same on both ranks: one value


def save_strided_scalars(url: str) -> list[bytes]:
    """Two saves of a one-element strided view (a loss scale kept in a buffer), equal on the
    ranks at the first save and different at the second; what each rank reads back."""
    rank = dist.get_rank()
    buffer = torch.zeros(4, dtype=torch.float64)
    scale = buffer[1::2][:1]  # contiguous, stride 2
    with CheckpointEngine(url) as engine:
        for step in (1, 2):
            scale.fill_(step + (rank if step == 2 else 0))
            engine.save(step, {"scale": scale}, blocking=True)
    target = {"scale": torch.zeros(1, dtype=torch.float64)}
    with CheckpointEngine(url) as engine:
        engine.load(target, step=2)
        return [bits(engine.read(1)["scale"]), bits(target["scale"])]


def test_a_one_element_strided_view_held_by_every_rank_is_saved(
    ranks: RankGroup, tmp_path: Path
) -> None:
    # digesting the ranks' copies flattened it with reshape(-1), which kept the stride of 2
    # that a view as bytes refuses: every save of it raised a RuntimeError
    for rank, got in enumerate(ranks.run(save_strided_scalars, str(tmp_path / "ckpt"))):
        assert got == [bits(torch.tensor([value], dtype=torch.float64))
                       for value in (1.0, 2.0 + rank)], rank


def test_more_ranks_than_saved_get_rank_0s_values_with_a_warning(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    with RankGroup(3, timeout_s=180) as three:
        three.run(save_versions, url, [0, 1])
        results = three.run(load_version, url, 2)
    for rank in (0, 1):
        got, expected, caught = results[rank]
        assert got == expected and caught == [], rank
    got, _, caught = results[2]
    rank0 = results[0][1]
    assert got == rank0, "rank 2 gets rank 0's copy of every per-rank value"
    assert len(caught) == 1, caught
    for path in ("rng", "sampler/offset", "loader/blob", "loader/cursor"):
        assert repr(path) in caught[0], caught[0]
    assert "rank 2" in caught[0] and "rank 0" in caught[0]


# --- model and optimizer objects under DDP and FSDP2 ------------------------------------------


def tiny_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 3))


def step_on(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen)
    optim.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    optim.step()


def wrapped(kind: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = tiny_model(seed)
    if kind == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh("cpu", list(range(dist.get_world_size())))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def fingerprint(model: nn.Module, optim: torch.optim.Optimizer) -> list[tuple[str, bytes]]:
    """This rank's parameters and optimizer state, as bytes (local shards of DTensors)."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    out = [(name, bits(local(p))) for name, p in model.named_parameters()]
    for index, state in optim.state_dict()["state"].items():
        for key, value in sorted(state.items()):
            out.append((f"{index}.{key}", bits(local(value))))
    return out


def resume_objects(url: str, kind: str) -> tuple[list[Any], list[Any]]:
    """Train 3 steps straight; and 2, save the objects, build fresh, load, 1 more."""
    straight = wrapped(kind, seed=0)
    for step in range(3):
        step_on(*straight, step)
    source = wrapped(kind, seed=0)
    for step in range(2):
        step_on(*source, step)
    with CheckpointEngine(url) as engine:
        engine.save(2, {"model": source[0], "optim": source[1]}, blocking=True)
        fresh = wrapped(kind, seed=5)  # other weights, an optimizer that never stepped
        state = {"model": fresh[0], "optim": fresh[1]}
        assert engine.load(state) == 2
    assert fingerprint(*fresh) == fingerprint(*source)
    step_on(*fresh, 2)
    return fingerprint(*fresh), fingerprint(*straight)


@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_model_and_optimizer_objects_resume_on_two_ranks(
    ranks: RankGroup, tmp_path: Path, kind: str
) -> None:
    url = str(tmp_path / kind)
    for rank, (resumed, straight) in enumerate(ranks.run(resume_objects, url, kind)):
        assert resumed == straight, f"rank {rank}"


def test_fsdp2_objects_load_into_one_plain_process(ranks: RankGroup, tmp_path: Path) -> None:
    """Saved sharded by FQN: a plain model and a fresh optimizer in one process load it."""
    url = str(tmp_path / "fsdp2")
    ranks.run(resume_objects, url, "fsdp2")
    model = tiny_model(seed=9)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    with CheckpointEngine(url) as engine:
        engine.load({"model": model, "optim": optim})
        stored = engine.read(2)
    for name, param in model.named_parameters():
        assert bits(param) == bits(stored[f"model/{name}"]), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert bits(optim.state[param][key]) == bits(stored[f"optim/state.{name}.{key}"])


def test_digests_see_one_flipped_bit_on_host_and_device_paths() -> None:
    """The per-save agreement compares digests: equal copies agree, one flipped bit differs
    (crc32c on the host; the word sums accelerators use, run here on CPU)."""
    from antifragile.engine._ranks import _device_sums, digests

    for dtype in (torch.float32, torch.bfloat16, torch.uint8, torch.bool, torch.int64):
        base = (torch.arange(37) % 2 == 1) if dtype == torch.bool else torch.arange(37).to(dtype)
        flipped = base.clone()
        raw = flipped.view(torch.uint8)
        raw[len(raw) // 2] ^= 1
        assert digests([base, base.clone()]) == digests([base.clone(), base]), dtype
        assert digests([base])[0] != digests([flipped])[0], dtype
        host = _device_sums(base.view(torch.uint8).reshape(-1))
        assert not torch.equal(host, _device_sums(raw.reshape(-1))), dtype


def test_device_digests_of_a_view_off_the_4_byte_grid() -> None:
    """A half-precision slice of a buffer (``buf[1:9]``) starts 2 bytes into its storage: its
    bytes viewed as int32 words raised on an accelerator, failing every save of such a
    replicated plain tensor. Its digest is that of an aligned copy of the same bytes (the
    device path, run here on CPU), so the ranks' copies still compare equal."""
    from antifragile.engine._ranks import _bytes_of, _device_sums

    buffer = torch.arange(10).to(torch.float16)
    view = buffer[1:9]
    assert _bytes_of(view).storage_offset() % 4 == 2
    assert torch.equal(_device_sums(_bytes_of(view)), _device_sums(_bytes_of(view.clone())))


def test_device_digests_see_values_that_moved() -> None:
    """Per-rank shuffled sample indices hold the same values in another order: the word sums
    accelerators used (all words, odd words) were equal for any permutation that keeps the
    parity of positions, so the ranks' tensors were taken for one replica and written once."""
    from antifragile.engine._ranks import _device_sums

    def sums(t: torch.Tensor) -> torch.Tensor:
        return _device_sums(t.contiguous().view(torch.uint8).reshape(-1))

    indices = torch.arange(1000)
    assert not torch.equal(sums(indices), sums(indices[torch.randperm(1000)]))
    swapped = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert not torch.equal(sums(swapped), sums(swapped[[2, 1, 0, 3]]))  # same parity
    odd = torch.arange(13, dtype=torch.uint8)  # bytes, not words
    assert not torch.equal(sums(odd), sums(odd.flip(0)))


def save_and_load_own_step(url: str) -> tuple[str, str, list[int]]:
    """Each rank asks for a step of its own: both calls are refused on every rank, at once."""
    rank = dist.get_rank()
    out = []
    with CheckpointEngine(url) as engine:
        engine.save(1, {"w": torch.ones(4)}, blocking=True)
        for call in (lambda: engine.save(10 + rank, {"w": torch.zeros(4)}, blocking=True),
                     lambda: engine.load({"w": torch.empty(4)}, step=1 if rank else None)):
            try:
                call()
                out.append("no error")
            except CheckpointError as exc:
                out.append(str(exc))
        return out[0], out[1], engine.steps()


def test_ranks_that_pass_different_steps_are_refused_not_hung(
    ranks: RankGroup, tmp_path: Path
) -> None:
    """save(10) on one rank and save(11) on the other used to hang (each waited for the
    other's record of its own step); load(step=1) beside load(step=None) compared nonces."""
    for rank, (saved, loaded, steps) in enumerate(ranks.run(save_and_load_own_step,
                                                             str(tmp_path / "ckpt"))):
        assert "the ranks called save() with different steps (10 to 11)" in saved, rank
        assert "the ranks called load() with different steps" in loaded, rank
        assert steps == [1], rank


def test_different_steps_are_named_in_the_words_of_the_call() -> None:
    """save() takes no None step, so its refusal said "None is -1" of nothing: only load's
    (``step=None``, the newest, reduced as -1) says it."""
    from antifragile.engine._agree import refuse_together

    with pytest.raises(CheckpointError) as saved:
        refuse_together("step 10 not saved", "save", None, 0, 11, -10)
    assert str(saved.value) == ("step 10 not saved: the ranks called save() with different "
                                "steps (10 to 11)")
    with pytest.raises(CheckpointError) as loaded:
        refuse_together("nothing loaded", "load", None, 0, 1, 1)
    assert str(loaded.value) == ("nothing loaded: the ranks called load() with different "
                                 "steps (-1 to 1; None is -1)")
    refuse_together("step 10 not saved", "save", None, 0, 10, -10)  # the same step: no error


def one_rank_passes_what_cannot_be_stored(url: str) -> list[str]:
    rank = dist.get_rank()
    out = []
    with CheckpointEngine(url) as engine:
        bad = {1, 2} if rank == 1 else 1  # a set: refused by rank 1's own checks only
        for call in (lambda: engine.save(1, {"w": torch.ones(4), "x": bad}, blocking=True),
                     lambda: engine.load({"w": torch.empty(4), "x": bad})):
            try:
                call()
                out.append("no error")
            except CheckpointError as exc:
                out.append(str(exc))
        # the group is still usable: nothing was left waiting in a collective
        engine.save(2, {"w": torch.full((4,), float(rank))}, blocking=True)
        out.append(str(engine.steps()))
    return out


def test_a_mistake_found_on_one_rank_is_raised_on_every_rank(
    ranks: RankGroup, tmp_path: Path
) -> None:
    """A state path only one rank cannot store used to raise on that rank alone, leaving the
    other in the save's first collective (until the process group timed out, or paired with
    the next collective the failed rank made)."""
    results = ranks.run(one_rank_passes_what_cannot_be_stored, str(tmp_path / "ckpt"))
    for rank, (saved, loaded, steps) in enumerate(results):
        expected = ("set is neither a tensor nor JSON-able" if rank == 1
                    else "another rank's call of save() was refused")
        assert expected in saved, (rank, saved)
        assert ("set" in loaded if rank == 1
                else "another rank's call of load() was refused" in loaded), (rank, loaded)
        assert steps == "[2]", rank


def collectives_per_save(url: str) -> tuple[list[int], int]:
    """How many collectives each of four saves of one layout made on this rank, and the
    ``own`` value this rank loads back from step 4."""
    counts: list[int] = []
    calls = [0]
    real = {name: getattr(dist, name) for name in ("all_reduce", "all_gather_object")}

    def counted(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            return real[name](*args, **kwargs)
        return call

    with CheckpointEngine(url, keep_last=2) as engine:
        try:
            for name in real:
                setattr(dist, name, counted(name))
            for step in range(1, 5):
                calls[0] = 0
                # replicated plain tensors (digested and agreed at every save) and one that
                # comes to differ at step 3
                engine.save(step, {"w": torch.ones(8) * step, "seen": torch.tensor(step),
                                   "own": torch.tensor(dist.get_rank() if step >= 3 else 0)},
                            blocking=True)
                counts.append(calls[0])
        finally:
            for name, fn in real.items():
                setattr(dist, name, fn)
        target = {"w": torch.zeros(8), "seen": torch.tensor(0), "own": torch.tensor(-1)}
        engine.load(target, step=4)
    return counts, int(target["own"])


def test_a_save_of_an_unchanged_layout_makes_one_collective(
    ranks: RankGroup, tmp_path: Path
) -> None:
    """The flags, the nonce, the step and the digests of the replicated plain tensors travel
    in one all-reduce: a second (the digests alone) cost every save ~1.5 ms on two gloo ranks.
    The first save also gathers the inventories and agrees the digests of the plan it built;
    step 3, where a plain tensor starts to differ, rebuilds the plan. Each save that builds a
    plan agrees that every rank allocated its staging buffers (one all-reduce more)."""
    results = ranks.run(collectives_per_save, str(tmp_path / "ckpt"))
    for rank, (counts, own) in enumerate(results):
        assert counts == [4, 1, 2, 1], (rank, counts)
        assert own == rank, (rank, own)  # the folded digests saw the copies differ


def digests_per_save(url: str) -> list[int]:
    """How many tensors each save digested on this rank: the first (it builds the plan), two
    of an unchanged layout, and one skipped as busy while the one before it persists."""
    from antifragile.engine import _ranks

    counts: list[int] = []
    digested = [0]
    real = _ranks.digests

    def counted(tensors: list[torch.Tensor]) -> list[int]:
        digested[0] += len(tensors)
        return real(tensors)

    gate = threading.Event()
    state = {"w": torch.ones(8), "seen": torch.tensor(1), "rng": torch.arange(4)}
    with CheckpointEngine(url, keep_last=None,
                          on_phase=lambda step, phase: step == 3 and gate.wait(30)) as engine:
        _ranks.digests = counted
        try:
            for step, blocking in ((1, True), (2, True), (3, False), (4, False)):
                digested[0] = 0
                handle = engine.save(step, state, blocking=blocking)
                counts.append(digested[0])
            assert handle.done() and handle.exception() is not None  # step 4: busy
        finally:
            _ranks.digests = real
            gate.set()
    return counts


def test_a_save_digests_only_what_it_agrees_on(ranks: RankGroup, tmp_path: Path) -> None:
    """The digests of the replicated plain tensors (a DDP model's every parameter) went into
    every save's first all-reduce: a save skipped as busy digested them for nothing, and the
    first save twice (the plan it builds agrees them again). Now: once, where they count."""
    for rank, counts in enumerate(ranks.run(digests_per_save, str(tmp_path / "ckpt"))):
        assert counts == [3, 3, 3, 0], (rank, counts)


def side_group_timeout(url: str) -> float:
    """The engine's own gloo group beside a group of another backend (NCCL; here a gloo group
    that says it is one): its timeout, in seconds."""
    from datetime import timedelta

    group = dist.new_group([0, 1], timeout=timedelta(seconds=77))
    real = dist.get_backend
    dist.get_backend = lambda pg=None: "nccl"  # type: ignore[assignment]
    try:
        engine = CheckpointEngine(url, process_group=group)
    finally:
        dist.get_backend = real  # type: ignore[assignment]
    side = engine._ranks._gloo
    assert side is not group
    engine.close()
    return float(side._get_backend(torch.device("cpu")).options._timeout.total_seconds())


def test_the_engines_own_gloo_group_takes_the_callers_timeout(
    ranks: RankGroup, tmp_path: Path
) -> None:
    """Beside an NCCL group the engine makes a gloo group of its own for its agreements; it
    was made with torch's default timeout (30 minutes), so a rank hung in save() or load()
    held the others there for half an hour whatever timeout the job gave its group."""
    assert ranks.run(side_group_timeout, str(tmp_path / "ckpt")) == [77.0, 77.0]


def engines_on_an_nccl_group_of_two_of_four(url: str) -> float:
    """Ranks 0 and 1 open engines on their group of another backend (here a gloo group that
    says it is NCCL); ranks 2 and 3, not in it, make none. Then every rank makes a group of
    all four and reduces over it."""
    rank = dist.get_rank()
    pair = dist.new_group([0, 1])
    if rank < 2:
        real = dist.get_backend
        dist.get_backend = lambda pg=None: "nccl"  # type: ignore[assignment]
        try:
            for step in (1, 2):  # a second engine on the same group makes its own side group
                with CheckpointEngine(url, process_group=pair) as engine:
                    engine.save(step, {"w": torch.full((4,), float(rank))}, blocking=True)
        finally:
            dist.get_backend = real  # type: ignore[assignment]
    everyone = dist.new_group([0, 1, 2, 3])
    total = torch.tensor([float(rank)])
    dist.all_reduce(total, group=everyone)
    return float(total)


def an_engine_on_the_nccl_world_beside_a_group_of_some_ranks(url: str) -> float:
    """Ranks 0 and 2 are in a group that 1 and 3 are not (a pipeline's first and last stages,
    for tied embeddings): the processes hold different numbers of groups. Then every rank
    opens an engine on the whole job's group of another backend."""
    rank = dist.get_rank()
    dist.new_group([0, 2])
    real = dist.get_backend
    dist.get_backend = lambda pg=None: "nccl"  # type: ignore[assignment]
    try:
        with CheckpointEngine(url) as engine:
            engine.save(1, {"w": torch.full((4,), float(rank))}, blocking=True)
    finally:
        dist.get_backend = real  # type: ignore[assignment]
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return float(total)


def test_an_engine_on_a_subgroup_needs_nothing_of_the_ranks_outside_it(tmp_path: Path) -> None:
    """The engine's own gloo group beside a caller's NCCL group was made with ``new_group``,
    which every process of the job must enter, members or not: ranks outside the group
    (which open no engine on it) did not, so their next group of their own paired with the
    wrong one and every rank hung. Now only its members make it; beside the whole job's
    group every rank still makes it (its members' names for a group made by members alone
    differ where they hold different numbers of groups)."""
    with RankGroup(4, timeout_s=60) as four:
        assert four.run(engines_on_an_nccl_group_of_two_of_four, str(tmp_path / "pair")) == [
            6.0] * 4
        assert four.run(an_engine_on_the_nccl_world_beside_a_group_of_some_ranks,
                        str(tmp_path / "world")) == [6.0] * 4


def engine_on_a_group_without_this_rank(url: str) -> str:
    """Rank 1 opens an engine on a group of rank 0 alone (every rank makes the group)."""
    group = dist.new_group([0])
    if dist.get_rank() == 0:
        return "member"
    try:
        with CheckpointEngine(url, process_group=group) as engine:
            engine.save(1, {"w": torch.ones(4)}, blocking=True)
    except CheckpointError as exc:
        return str(exc)
    return "no error"


def test_an_engine_on_a_group_this_process_is_not_in_is_refused(
    ranks: RankGroup, tmp_path: Path
) -> None:
    """A process outside ``process_group`` got rank -1 of world size -1: its save crashed
    with a KeyError from the plan (the engine was never refused)."""
    outcome = ranks.run(engine_on_a_group_without_this_rank, str(tmp_path / "ckpt"))[1]
    assert "not a member of process_group" in outcome, outcome


def save_and_load_non_finite(url: str) -> tuple[bytes, bytes, bytes]:
    """Values that differ between the ranks and are not finite (kept per rank); the bits of
    what this rank loads back: its ``loss``, ``hist[1]``, ``hist[0]``."""
    rank = dist.get_rank()
    loss = math.nan if rank == 0 else -math.inf
    state = {"w": torch.ones(2), "loss": loss, "hist": [float(rank), (math.inf, -0.0)[rank]]}
    with CheckpointEngine(url) as engine:
        engine.save(1, state, blocking=True)
    target: dict[str, Any] = {"w": torch.empty(2), "loss": None, "hist": None}
    with CheckpointEngine(url) as engine:
        engine.load(target, step=1)
    return tuple(struct.pack("<d", v) for v in (target["loss"], target["hist"][1],  # type: ignore[return-value]
                                               target["hist"][0]))


def test_non_finite_values_saved_per_rank_are_strict_json_and_come_back(
    ranks: RankGroup, tmp_path: Path
) -> None:
    url = str(tmp_path / "ckpt")
    got = ranks.run(save_and_load_non_finite, url)
    assert got[0] == (struct.pack("<d", math.nan), struct.pack("<d", math.inf),
                      struct.pack("<d", 0.0))
    assert got[1] == (struct.pack("<d", -math.inf), struct.pack("<d", -0.0),
                      struct.pack("<d", 1.0))
    group = (tmp_path / "ckpt" / "step_000000001" / "zarr.json").read_text()

    def refuse(token: str) -> None:
        raise ValueError(f"{token} is not JSON")

    attrs = json.loads(group, parse_constant=refuse)["attributes"]["antifragile"]
    assert set(attrs["values_by_rank"]) >= {"loss", "hist"}


def load_a_value_only_rank_0_saved(url: str) -> tuple[Any, Any, Any, Any]:
    """Rank 0 alone holds ``best`` (inf) and ``loss`` (a NaN); every rank loads them. ``tag``
    is a NaN on rank 0 and the str ``"NaN"`` on rank 1 (stored alike). What this rank gets,
    and read()'s ``best``."""
    rank = dist.get_rank()
    state: dict[str, Any] = {"w": torch.ones(2), "tag": math.nan if rank == 0 else "NaN"}
    if rank == 0:
        state.update(best=math.inf, loss=math.nan)
    with CheckpointEngine(url) as engine:
        engine.save(1, state, blocking=True)
    target: dict[str, Any] = {"w": torch.empty(2), "best": None, "loss": None, "tag": None}
    with CheckpointEngine(url) as engine:
        engine.load(target, step=1)
        stored = engine.read(1)
    return target["best"], target["loss"], stored["best"], target["tag"]


def test_a_non_finite_value_saved_by_one_rank_loads_as_a_float_on_every_rank(
    ranks: RankGroup, tmp_path: Path
) -> None:
    """Format 4 stores the float as the str ``"Infinity"`` and describes it in the type record
    of the rank that saved it; a rank that saved no such value has no description of it and
    got the str back (format 3 gave it the float)."""
    got = ranks.run(load_a_value_only_rank_0_saved, str(tmp_path / "ckpt"))
    for best, loss, stored, _ in got:
        assert best == math.inf and stored == math.inf, got
        assert isinstance(loss, float) and math.isnan(loss), got
    assert math.isnan(got[0][3]) and got[1][3] == "NaN", got  # each rank its own


def save_a_value_per_rank(url: str) -> None:
    rank = dist.get_rank()
    with CheckpointEngine(url) as engine:
        engine.save(1, {"w": torch.ones(2), "offset": 10 * rank, "epoch": 3}, blocking=True,
                    metadata={"git": "abc123"})


def test_inspect_shows_the_values_saved_per_rank_and_the_metadata(
    ranks: RankGroup, tmp_path: Path
) -> None:
    """``chaos ckpt inspect`` listed only the values every rank shared: a sampler offset that
    differed between the ranks (saved per rank) was missing from its table and its --json, as
    was the ``metadata`` the save recorded, so the one tool for looking into a step hid them.
    Each rank's copy is listed under ``<path>/rank_<r>`` (as ``read()`` keys it)."""
    from click.testing import CliRunner

    from antifragile.chaos.cli import main

    url = str(tmp_path / "ckpt")
    ranks.run(save_a_value_per_rank, url)
    shown = CliRunner().invoke(main, ["ckpt", "inspect", url, "--step", "1", "--json"])
    assert shown.exit_code == 0, shown.output
    doc = json.loads(shown.output)
    assert doc["values"] == {"epoch": 3, "offset/rank_0": 0, "offset/rank_1": 10}
    assert doc["metadata"] == {"git": "abc123"}
    table = CliRunner().invoke(main, ["ckpt", "inspect", url, "--step", "1"])
    assert "values: epoch, offset/rank_0, offset/rank_1" in table.output, table.output
    assert "metadata: " in table.output and "abc123" in table.output
