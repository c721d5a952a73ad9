"""Real training states resharded: a model and its AdamW that stepped, saved as the objects
(as the README shows) on one layout and loaded on another, compared bit for bit with the
state gathered to full tensors, and one more optimizer step on each layout.

The step after the load takes a gradient computed element by element from each parameter
(``grads_of``), so the math is the same in every layout and the parameters after it must be
bitwise equal; a backward pass would reduce gradients in a layout-dependent order.

A load refused for its target (a shape, a parameter the step lacks, another optimizer, one
rank's own refusal) is a CheckpointError on every rank, and leaves the target as it was: a
freshly built optimizer keeps having no state.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import RankGroup, run_ranks
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from antifragile.engine import CheckpointEngine

pytestmark = pytest.mark.multiproc

V, D, H = 11, 6, 7  # 11, 7: uneven over 2 and 4 ranks


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.hidden = nn.Linear(D, H)
        self.low = nn.Linear(H, D).to(torch.bfloat16)
        self.out = nn.Linear(D, V, bias=False)
        self.out.weight = self.emb.weight  # tied
        self.scale = nn.Parameter(torch.tensor([0.5]))  # fully_shard refuses 0-dim
        self.empty = nn.Parameter(torch.zeros(0, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.hidden(self.emb(x)).relu()
        h = self.low(h.to(torch.bfloat16)).float()
        return self.out(h * self.scale)  # self.empty: FSDP2 cannot reduce a 0-element grad


def build(seed: int, layout: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model: nn.Module = Net()
    if layout == "fsdp":
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh("cpu", list(range(dist.get_world_size())))
        fully_shard(model.hidden, mesh=mesh)
        fully_shard(model.low, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    x = torch.randint(0, V, (5, 3), generator=gen)
    y = torch.randn(5, 3, V, generator=gen)
    optim.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    optim.step()


def full(t: Any) -> Any:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(flatten_optimizer_state_dict=True)
    out = {f"model/{k}": full(v) for k, v in get_model_state_dict(model, options=opts).items()}
    for k, v in get_optimizer_state_dict(model, optim, options=opts).items():
        out[f"optim/{k}"] = full(v) if isinstance(v, torch.Tensor) else v
    return out


def grads_of(model: nn.Module) -> None:
    """The same gradient on every layout, element by element from the parameter (no reduction
    whose order could differ between layouts)."""
    for p in model.parameters():
        p.grad = torch.sin(p.detach() * 3)


def _named(model: nn.Module) -> dict[str, nn.Parameter]:
    model = getattr(model, "module", model)
    return dict(model.named_parameters())


def step_after(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    grads_of(model)
    optim.step()
    out: dict[str, Any] = {name: full(p) for name, p in _named(model).items()}
    inner = getattr(model, "module", model)
    if isinstance(inner, Net):
        out["tied"] = inner.out.weight is inner.emb.weight
    return out


def save_on(url: str, layout: str) -> tuple[dict[str, Any], dict[str, Any]]:
    model, optim = build(0, layout)
    for step in range(2):
        train(model, optim, step)
    with CheckpointEngine(url) as engine:
        engine.save(2, {"model": model, "optim": optim}, blocking=True)
    return full_state(model, optim), step_after(model, optim)


def load_on(url: str, layout: str) -> tuple[dict[str, Any], dict[str, Any]]:
    model, optim = build(1, layout)
    with CheckpointEngine(url) as engine:
        engine.load({"model": model, "optim": optim})
    return full_state(model, optim), step_after(model, optim)


# --- 2D: TP x FSDP2 ---------------------------------------------------------------------------


def build_2d(seed: int, dp: int, tp: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """TP (col, row, col) over ``tp``, FSDP2 over ``dp``: odd sizes, so shards are uneven."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(10, 14), nn.ReLU(), nn.Linear(14, 6), nn.ReLU(),
                          nn.Linear(6, 9))
    if dp * tp == 1:  # one process, no process group
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    mesh = DeviceMesh("cpu", torch.arange(dp * tp).reshape(dp, tp), mesh_dim_names=("dp", "tp"))
    if tp > 1:
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel(),
                                               "4": ColwiseParallel(output_layouts=Replicate())})
    if dp > 1:
        for index in ("0", "2", "4"):
            fully_shard(model.get_submodule(index), mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train_2d(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(4, 10, generator=gen), torch.randn(4, 9, generator=gen)
    optim.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    optim.step()


def save_2d(url: str, dp: int, tp: int) -> tuple[dict[str, Any], dict[str, Any]]:
    model, optim = build_2d(0, dp, tp)
    for step in range(2):
        train_2d(model, optim, step)
    with CheckpointEngine(url) as engine:
        engine.save(2, {"model": model, "optim": optim}, blocking=True)
    return full_state(model, optim), step_after(model, optim)


def load_2d(url: str, dp: int, tp: int) -> tuple[dict[str, Any], dict[str, Any]]:
    model, optim = build_2d(1, dp, tp)
    with CheckpointEngine(url) as engine:
        engine.load({"model": model, "optim": optim})
    return full_state(model, optim), step_after(model, optim)


# --- bad targets ------------------------------------------------------------------------------


class Variant(Net):
    def __init__(self, case: str) -> None:
        super().__init__()
        if case == "shape":
            self.hidden = nn.Linear(D, H + 1)
            self.low = nn.Linear(H + 1, D).to(torch.bfloat16)
        elif case == "extra":
            self.more = nn.Parameter(torch.ones(3))


def build_bad(case: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(1)
    model = Variant(case)
    mesh = DeviceMesh("cpu", list(range(dist.get_world_size())))
    fully_shard(model.hidden, mesh=mesh)
    fully_shard(model.low, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim: torch.optim.Optimizer
    if case == "sgd":
        optim = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    else:
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, optim


def local_bits(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, bytes]:
    """This rank's parameters, optimizer state and hyperparameters, as bytes."""
    def raw(t: torch.Tensor) -> bytes:
        local = t.to_local() if isinstance(t, DTensor) else t
        return bytes(local.detach().contiguous().reshape(-1).view(torch.uint8).numpy())

    out = {name: raw(p) for name, p in model.named_parameters()}
    for index, state in optim.state_dict()["state"].items():
        out.update({f"{index}.{key}": raw(value) for key, value in state.items()})
    out["groups"] = repr([{k: v for k, v in g.items() if k != "params"}
                          for g in optim.param_groups]).encode()
    return out


def load_bad(url: str, case: str) -> tuple[str, list[str]]:
    """Load into a bad target: the error this rank raised, and whether the target is as it
    was."""
    model, optim = build_bad(case)
    before = local_bits(model, optim)
    error = "no error"
    state: dict[str, Any] = {"model": model, "optim": optim}
    if case == "mistake" and dist.get_rank() == 1:
        state["junk"] = object()  # refused by this rank's flatten, after the optimizer's
    with CheckpointEngine(url) as engine:
        try:
            engine.load(state, step=2)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
    after = local_bits(model, optim)
    return error, sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))


# --- the tests --------------------------------------------------------------------------------


def differences(saved: dict[str, Any], loaded: dict[str, Any]) -> list[str]:
    """The entries that differ in dtype, shape or any bit (a DDP model's names lack the
    ``module.`` prefix, as in its saved FQNs)."""
    loaded = {k.replace("module.", ""): v for k, v in loaded.items()}
    out = []
    for key in sorted(set(saved) | set(loaded)):
        a, b = saved.get(key), loaded.get(key)
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(
                    a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
                out.append(key)
        elif type(a) is not type(b) or a != b:
            out.append(key)
    return out


def test_fsdp2_objects_of_four_ranks_resume_on_two_fsdp2_ddp_and_one_process(
        tmp_path: Path) -> None:
    """Uneven shards, a 1-element parameter (one rank of four holds it), a 0-element one with no
    optimizer state, bf16 parameters and tied weights: the state loads bit for bit on every
    layout, and the next step gives the same parameters."""
    url = str(tmp_path / "ckpt")
    saved = run_ranks(4, save_on, url, "fsdp")
    state, after = saved[0]
    assert after["tied"] and "optim/state.empty.step" not in state
    assert "optim/state.scale.step" in state and state["model/low.weight"].dtype == torch.bfloat16
    for layout in ("fsdp", "ddp"):
        for rank, (loaded, stepped) in enumerate(run_ranks(2, load_on, url, layout)):
            assert differences(state, loaded) == [], (layout, rank)
            assert differences(after, stepped) == [], (layout, rank)
    loaded, stepped = load_on(url, "plain")
    assert differences(state, loaded) == [] and differences(after, stepped) == []


def test_tp_by_fsdp2_objects_resume_on_fsdp2_alone_and_on_tp_alone(tmp_path: Path) -> None:
    """A 2x2 (dp, tp) model and AdamW (strided shards, uneven) loads on a dp-2 FSDP2 mesh and on
    a tp-4 mesh bit for bit, and the next step gives the same parameters."""
    url = str(tmp_path / "ckpt")
    state, after = run_ranks(4, save_2d, url, 2, 2)[0]
    for world, dp, tp in ((2, 2, 1), (4, 1, 4)):
        for rank, (loaded, stepped) in enumerate(run_ranks(world, load_2d, url, dp, tp)):
            assert differences(state, loaded) == [], (dp, tp, rank)
            assert differences(after, stepped) == [], (dp, tp, rank)


@pytest.fixture(scope="module")
def saved_two(tmp_path_factory: pytest.TempPathFactory) -> tuple[RankGroup, str]:
    url = str(tmp_path_factory.mktemp("bad") / "ckpt")
    with RankGroup(2, timeout_s=120) as group:
        group.run(save_on, url, "fsdp")
        yield group, url


@pytest.mark.parametrize(("case", "named"), [
    ("shape", r"tensor 'model/hidden.weight': stored shape \[7, 6\], target shape \[8, 6\]"),
    ("extra", r"step 2 has no tensor 'model/more'"),
    ("sgd", r"step 2 has no value 'optim/param_groups\.\w+(\.\w+)?\.momentum'"),
    # one rank's own refusal (rank 1 names it; rank 0 says another rank's call was refused)
    ("mistake", r"'junk'|another rank's call of load\(\) was refused"),
])
def test_a_refused_target_is_named_on_every_rank_and_left_as_it_was(
        saved_two: tuple[RankGroup, str], case: str, named: str) -> None:
    """Before: a fresh AdamW came back from a refused load with the state DCP's helper had
    made for it (zero moments, step 1), so a run that starts over when its checkpoint does not
    fit took a first step with the bias correction of a second."""
    group, url = saved_two
    for rank, (error, changed) in enumerate(group.run(load_bad, url, case)):
        assert error.startswith("Checkpoint") and re.search(named, error), (rank, error)
        assert changed == [], (rank, changed)
