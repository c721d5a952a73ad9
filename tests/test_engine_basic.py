"""Single-process behaviour of CheckpointEngine on every backend (local path and S3 on SeaweedFS).

What a training loop relies on: a nested state round-trips exactly, ``save`` returns before the
commit and what is written is the state at the time of the call, a save never blocks on the
previous one, failures surface (on ``wait()`` or on the next ``save()``), committed steps are
never overwritten, retention keeps the newest step, and load errors name the path and the step.
"""

from __future__ import annotations

import copy
import datetime
import json
import math
import re
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import torch
from torch import nn

from antifragile.engine import (
    CheckpointBusyError,
    CheckpointCommittedError,
    CheckpointEngine,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    PlanOptions,
    StorageError,
)

Storage = tuple[str, dict[str, Any] | None]


@pytest.fixture
def ckpt(storage: Storage) -> Iterator[CheckpointEngine]:
    url, options = storage
    with CheckpointEngine(url, storage_options=options, keep_last=None) as engine:
        yield engine


class GatedStorage:
    """Wraps an engine's storage: every write waits for ``release``; ``entered`` is set by the
    first write. Makes "the save is still persisting" a fact instead of a race."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.entered = threading.Event()
        self.release = threading.Event()

    def write(self, key: str, parts: Sequence[Any], **kwargs: Any) -> None:
        self.entered.set()
        if not self.release.wait(60):
            raise PermissionError("test gate never opened")
        self.inner.write(key, parts, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def gate(engine: CheckpointEngine) -> GatedStorage:
    gated = GatedStorage(engine.storage)
    engine.storage = gated
    return gated


def raw_fs(storage: Storage) -> tuple[Any, str]:
    """A filesystem outside the engine and the checkpoint root on it."""
    url, options = storage
    extra = (
        {"skip_instance_cache": True, "use_listings_cache": False}
        if options
        else {"auto_mkdir": True}
    )
    return fsspec.core.url_to_fs(url, **(options or {}), **extra)


def until(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def assert_same(actual: Any, expected: Any, path: str = "") -> None:
    """Exact equality of nested states: tensors bit for bit, dtype and shape included."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), path
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        assert torch.equal(actual, expected), path
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), path
        for key in expected:
            assert_same(actual[key], expected[key], f"{path}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), path
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{path}/{i}")
    elif isinstance(expected, float) and math.isnan(expected):
        assert isinstance(actual, float) and math.isnan(actual), path
    else:
        assert actual == expected and type(actual) is type(expected), path


def blank(state: Any) -> Any:
    """A target of the same structure: tensors of the same dtype/shape filled with other bits,
    JSON leaves replaced by placeholders."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state) if state.dtype == torch.bool else torch.full_like(state, 7)
    if isinstance(state, dict):
        return {k: blank(v) for k, v in state.items()}
    if isinstance(state, list):
        return [blank(v) for v in state]
    return "placeholder"


def nested_state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=gen)
    return {
        "model": {
            "f32": torch.randn(5, 3, generator=gen),
            "f16": torch.randn(4, 4, generator=gen).half(),
            "bf16": torch.randn(3, 5, generator=gen).bfloat16(),
            "i64": torch.randint(-(2**40), 2**40, (7,), generator=gen),
            "bool": torch.rand(2, 3, generator=gen) > 0.5,
            "c64": torch.randn(4, dtype=torch.complex64, generator=gen),
            "scalar": torch.tensor(3.25),
            "scalar_bf16": torch.tensor(-1.5, dtype=torch.bfloat16),
            "empty": torch.empty(0, 4),
            "empty_mid": torch.empty(3, 0, 2, dtype=torch.int64),
            "transposed": base.t(),
            "strided": base[::2, 1::3],
        },
        "layers": [torch.arange(6, dtype=torch.float32), {"w": torch.ones(2, 2)}, 4, "relu"],
        "extra": {
            "int": 7,
            "big": 2**62,
            "str": "héllo",
            "float": 0.1,
            "none": None,
            "list": [1, "a", None, 2.5, [3]],
            "nan": float("nan"),
            "inf": float("inf"),
        },
        "step": 120,
    }


def test_nested_state_round_trips_exactly(ckpt: CheckpointEngine) -> None:
    state = nested_state()
    assert not state["model"]["transposed"].is_contiguous()
    expected = copy.deepcopy(state)
    ckpt.save(3, state, blocking=True)
    target = blank(state)
    assert ckpt.load(target) == 3
    assert_same(target, expected)


def test_conjugate_and_negative_views_are_saved_with_their_values(
        ckpt: CheckpointEngine) -> None:
    # a lazy conj view, and a contiguous view with the neg bit (x.conj().imag of one element):
    # their bytes are the unconjugated values; a byte copy saved x instead of x.conj()
    x = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    neg = torch.tensor([1 + 2j], dtype=torch.complex64).conj().imag
    assert neg.is_neg() and neg.is_contiguous()
    ckpt.save(1, {"z": x.conj(), "v": neg}, blocking=True)
    out = {"z": torch.zeros(2, dtype=torch.complex64), "v": torch.zeros(1)}
    ckpt.load(out)
    assert torch.equal(out["z"], x.conj().resolve_conj())
    assert out["v"].tolist() == [-2.0]


def test_a_column_of_8_byte_values_whose_rows_are_strided_is_saved(tmp_path: Path) -> None:
    # a transposed strided row: (4, 1) with strides (2, 8). Its inner chunks after the first
    # sit 4 bytes off the 8-byte grid (the crc slots) and are copied as bytes; one row of it
    # is contiguous, so contiguous() kept the stride of 8 of its size-1 last dim, and the
    # view as bytes raised: the save failed while staging
    column = torch.arange(8, dtype=torch.float64).reshape(1, 8)[:, ::2].t()
    assert column.stride() == (2, 8)
    with CheckpointEngine(str(tmp_path), keep_last=None,
                          plan_options=PlanOptions(inner_chunk_bytes=8)) as engine:
        engine.save(1, {"w": column}, blocking=True)
        assert torch.equal(engine.read(1)["w"], column)


def test_conjugate_and_negative_views_are_loaded_into_with_their_values(
        ckpt: CheckpointEngine) -> None:
    # a contiguous target was read into as raw bytes: with the conj or neg bit set that
    # raised (torch.Tensor.view refuses them), a RuntimeError on every step tried
    x = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    ckpt.save(1, {"z": x, "v": torch.tensor([5.0])}, blocking=True)
    z_base, v_base = torch.zeros(2, dtype=torch.complex64), torch.zeros(1, dtype=torch.complex64)
    out = {"z": z_base.conj(), "v": v_base.conj().imag}
    assert out["v"].is_neg() and out["v"].is_contiguous()
    ckpt.load(out, step=1)
    assert torch.equal(out["z"].resolve_conj(), x) and out["v"].tolist() == [5.0]
    assert torch.equal(z_base, x.conj()) and v_base.imag.tolist() == [-5.0]


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_mx_scales_fp4_and_half_complex_round_trip_bitwise_and_sub_byte_ints_are_refused(
        ckpt: CheckpointEngine) -> None:
    # float8_e8m0fnu, float4_e2m1fn_x2 and complex32 were refused as "CheckpointCorruptError:
    # unknown dtype", the error of a damaged checkpoint
    gen = torch.Generator().manual_seed(5)
    state = {name: torch.randint(0, 255, (6, 4), dtype=torch.uint8, generator=gen).view(
        getattr(torch, name)) for name in ("float8_e8m0fnu", "float4_e2m1fn_x2")}
    state["complex32"] = torch.randint(0, 2**15, (3, 4), dtype=torch.int16, generator=gen
                                       ).view(torch.complex32)
    ckpt.save(1, state, blocking=True)
    target = {k: torch.empty_like(v) for k, v in state.items()}
    ckpt.load(target)
    for key, value in state.items():
        assert target[key].dtype == value.dtype
        assert torch.equal(target[key].view(torch.uint8), value.view(torch.uint8)), key
    with pytest.raises(CheckpointError, match="'q': a tensor of dtype int4 cannot be stored"):
        ckpt.save(2, {"q": torch.zeros(4, dtype=torch.int4)})


def test_load_fills_non_contiguous_views_in_place(ckpt: CheckpointEngine) -> None:
    state = nested_state()
    ckpt.save(1, state, blocking=True)
    base_t, base_s = torch.zeros(6, 8), torch.zeros(6, 8)
    target = blank(state)
    target["model"]["transposed"] = base_t.t()
    target["model"]["strided"] = base_s[::2, 1::3]
    ckpt.load(target, step=1)
    assert torch.equal(base_t.t(), state["model"]["transposed"])
    assert torch.equal(base_s[::2, 1::3], state["model"]["strided"])
    base_s[::2, 1::3] = 0
    assert not base_s.any(), "load wrote outside the target view"


def test_load_fills_contiguous_targets_whose_size_one_dims_have_any_stride(
        tmp_path: Path) -> None:
    # a column that is a transposed row (5, 1) with strides (1, 5) is contiguous, and so is a
    # one-element slice of a strided view; a read of one row of either flattened to a stride
    # of 5 (or 2) that a view as bytes refuses: "loading step 1 failed unexpectedly"
    state = {"col": torch.arange(5.0).reshape(5, 1),
             "one": torch.tensor([1.5], dtype=torch.float64)}
    with CheckpointEngine(str(tmp_path), keep_last=None,
                          plan_options=PlanOptions(inner_chunk_bytes=4)) as engine:
        engine.save(1, state, blocking=True)
        target = {"col": torch.zeros(1, 5).t(),
                  "one": torch.zeros(4, dtype=torch.float64)[1::2][:1]}
        assert all(t.is_contiguous() for t in target.values())
        engine.load(target, step=1)
    assert torch.equal(target["col"], state["col"]) and torch.equal(target["one"], state["one"])


def test_load_fills_parameters_held_in_a_plain_dict(ckpt: CheckpointEngine) -> None:
    # the reads run on the engine's pool, where grad mode is on: copying into a view of a
    # parameter (a 0-d one, a non-contiguous one) raised "a view was created in no_grad mode"
    state = {"w": torch.arange(12.0).reshape(3, 4), "s": torch.tensor(2.5)}
    ckpt.save(1, state, blocking=True)
    target = {"w": nn.Parameter(torch.zeros(4, 3).t()), "s": nn.Parameter(torch.tensor(0.0))}
    ckpt.load(target, step=1)
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["s"], state["s"])
    assert target["w"].requires_grad and target["w"].grad_fn is None


def test_a_load_inside_inference_mode_fills_inference_tensors(ckpt: CheckpointEngine) -> None:
    # an eval script built under inference_mode: the pool threads ran outside it, and torch
    # refuses an in-place update of an inference tensor there (every step skipped)
    state = {"w": torch.arange(12.0).reshape(3, 4), "v": torch.arange(4.0), "s": torch.tensor(2.5)}
    ckpt.save(1, state, blocking=True)
    with torch.inference_mode():
        target = {"w": torch.zeros(4, 3).t(), "v": torch.zeros(4), "s": torch.tensor(0.0)}
        ckpt.load(target, step=1)
    assert all(torch.equal(target[k], v) for k, v in state.items())


def test_inference_tensors_loaded_into_outside_inference_mode_are_refused_by_the_call(
        ckpt: CheckpointEngine) -> None:
    """Torch updates an inference tensor in place only inside inference mode. Such a target
    loaded outside it failed every step's read with a RuntimeError (logged with its
    traceback per step; "no older step loads either", as if the checkpoint were at fault),
    or, laid out so that its bytes were read straight into it, loaded: which one was down
    to its strides. Refused at the call, naming the path and the way out."""
    ckpt.save(1, {"w": torch.arange(12.0).reshape(3, 4)}, blocking=True)
    ckpt.save(2, {"w": torch.arange(12.0).reshape(3, 4)}, blocking=True)
    for make in (lambda: torch.zeros(4, 3).t(), lambda: torch.zeros(3, 4)):
        with torch.inference_mode():
            target = {"w": make()}
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no step is tried, so none is skipped
            with pytest.raises(CheckpointError, match=r"'w'.*inference_mode"):
                ckpt.load(target)
        assert torch.equal(target["w"], torch.zeros(3, 4))


def small_model(seed: int) -> tuple[nn.Module, torch.optim.Adam]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2 if seed == 0 else 0.5)


def train_step(model: nn.Module, optim: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 4, generator=gen), torch.randn(16, 2, generator=gen)
    optim.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    optim.step()


class TrainState:
    """A Stateful wrapper, as trainers hand to DCP."""

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.optim.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.model.load_state_dict(state_dict["model"])
        self.optim.load_state_dict(state_dict["optim"])


def assert_same_training(
    a: tuple[nn.Module, torch.optim.Adam], b: tuple[nn.Module, torch.optim.Adam]
) -> None:
    """Same parameters and optimizer state now, and after one more identical step."""
    for step in range(2):
        for pa, pb in zip(a[0].parameters(), b[0].parameters()):
            assert torch.equal(pa, pb)
        sa, sb = a[1].state_dict(), b[1].state_dict()
        assert_same(sb["state"], sa["state"])
        assert [g["lr"] for g in sb["param_groups"]] == [g["lr"] for g in sa["param_groups"]]
        if step == 0:
            train_step(*a, seed=99)
            train_step(*b, seed=99)


def test_adam_through_a_stateful_wrapper(ckpt: CheckpointEngine) -> None:
    source = small_model(0)
    for seed in range(3):
        train_step(*source, seed)
    ckpt.save(3, {"app": TrainState(*source), "step": 3}, blocking=True)

    target = small_model(1)
    train_step(*target, seed=7)  # optimizer state exists, as after DCP's init
    holder = {"app": TrainState(*target), "step": 0}
    assert ckpt.load(holder) == 3
    assert holder["step"] == 3
    assert_same_training(source, target)


def test_adam_state_dict_directly(ckpt: CheckpointEngine) -> None:
    source = small_model(0)
    for seed in range(2):
        train_step(*source, seed)
    ckpt.save(2, {"model": source[0].state_dict(), "optim": source[1].state_dict()}, blocking=True)

    target = small_model(1)
    train_step(*target, seed=7)
    state = {"model": target[0].state_dict(), "optim": target[1].state_dict()}
    ckpt.load(state)
    target[1].load_state_dict(state["optim"])
    assert_same_training(source, target)


# -- asynchronous save -----------------------------------------------------------------------


def test_save_returns_before_commit_and_writes_the_state_at_call_time(
    ckpt: CheckpointEngine,
) -> None:
    state = {"w": torch.randn(32, 8), "extra": {"history": [1, 2]}, "step": 1}
    expected = copy.deepcopy(state)
    gated = gate(ckpt)
    handle = ckpt.save(1, state)
    assert handle.staged.is_set()
    assert gated.entered.wait(30)
    assert not handle.done() and ckpt.steps() == [] and ckpt.latest_step() is None

    state["w"].mul_(-3).add_(1)
    state["extra"]["history"].append(3)
    state["step"] = 2
    gated.release.set()
    handle.wait()
    assert ckpt.steps() == [1] and ckpt.latest_step() == 1
    assert handle.nbytes >= 32 * 8 * 4 and handle.committed_nbytes >= handle.nbytes
    target = blank(expected)
    ckpt.load(target)
    assert_same(target, expected)


def test_deferred_staging_sets_staged_before_persisting(ckpt: CheckpointEngine) -> None:
    state = {"w": torch.randn(16, 4)}
    expected = state["w"].clone()
    gated = gate(ckpt)
    handle = ckpt.save(1, state, defer_staging=True)
    assert handle.staged.wait(30)
    state["w"].zero_()
    gated.release.set()
    ckpt.wait()
    target = {"w": torch.empty(16, 4)}
    ckpt.load(target)
    assert torch.equal(target["w"], expected)


def test_steps_and_latest_step(ckpt: CheckpointEngine) -> None:
    assert ckpt.steps() == [] and ckpt.latest_step() is None
    state = {"w": torch.ones(3)}
    for step in (10, 2, 30):
        ckpt.save(step, state, blocking=True)
    assert ckpt.steps() == [2, 10, 30]
    assert ckpt.latest_step() == 30


def test_folders_named_like_a_step_but_not_as_the_engine_names_one_are_not_steps(
        tmp_path: Path) -> None:
    """Only ``step_dir``'s own names are steps: a folder whose digits are not ASCII, have more
    leading zeros than the engine writes or make a step past 2**62 is someone else's, even with
    a COMMIT in it. Such folders were listed as committed steps (``latest_step()`` named one)
    that load and verify then called not committed, and one past 2**62 made every
    ``load()`` raise instead of loading the intact step."""
    root = tmp_path / "ckpt"
    with CheckpointEngine(str(root)) as engine:
        engine.save(5, {"w": torch.arange(4.0)}, blocking=True)
    for name in ["step_\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0667",
                 "step_0000000009", "step_00000000\u00b2", "step_" + "9" * 20]:
        shutil.copytree(root / "step_000000005", root / name)
    with CheckpointEngine(str(root)) as engine, warnings.catch_warnings():
        warnings.simplefilter("error")
        assert engine.steps() == [5] and engine.latest_step() == 5
        target = {"w": torch.zeros(4)}
        assert engine.load(target) == 5 and torch.equal(target["w"], torch.arange(4.0))
        engine.save(6, {"w": torch.ones(4)}, blocking=True)
    assert len(list(root.iterdir())) == 6  # retention left the foreign folders alone


def test_a_records_folder_entry_whose_name_is_not_a_rank_is_ignored(tmp_path: Path) -> None:
    """The coordinator lists the records folder: an entry whose name only looks like a rank to
    ``str.isdigit()`` ('²', which ``int()`` refuses) failed the save with a ValueError."""
    root = tmp_path / "ckpt"

    def plant(step: int, phase: str) -> None:
        if phase == "written":
            (root / "step_000000001" / ".ranks").mkdir(parents=True, exist_ok=True)
            (root / "step_000000001" / ".ranks" / "\u00b2.json").write_bytes(b"{}")

    with CheckpointEngine(str(root), on_phase=plant) as engine:
        engine.save(1, {"w": torch.ones(3)}, blocking=True)
        assert engine.steps() == [1]


def test_a_state_whose_layout_changes_between_saves_is_saved_as_it_is_now(
        ckpt: CheckpointEngine) -> None:
    """The engine reuses its plan while the state's layout stays the same; a changed shape,
    dtype, key or value must still be saved as it is at the call."""
    states = [
        {"w": torch.arange(6.0), "b": torch.ones(2), "n": 1},
        {"w": torch.arange(6.0) + 1, "b": torch.ones(2), "n": 2},  # same layout, new data
        {"w": torch.arange(8.0), "b": torch.ones(2), "n": 3},  # a shape
        {"w": torch.arange(8, dtype=torch.int64), "b": torch.ones(2), "n": 4},  # a dtype
        {"w": torch.arange(8, dtype=torch.int64), "c": torch.zeros(3), "n": 5},  # a key
        {"w": torch.arange(8, dtype=torch.int64), "c": torch.zeros(3), "n": 6, "m": "x"},
    ]
    for step, state in enumerate(states, 1):
        ckpt.save(step, state, blocking=True)
    for step, state in enumerate(states, 1):
        target = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else None
                  for k, v in state.items()}
        assert ckpt.load(target, step=step) == step
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                assert target[key].dtype == value.dtype and torch.equal(target[key], value)
            else:
                assert target[key] == value, (step, key)


def test_a_save_whose_staging_allocation_failed_leaves_the_next_save_working(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The staging buffers of a new plan could not be allocated (out of memory): that save
    raises, and the next one plans and allocates again; it used to keep the new plan without
    its buffers and fail every later save on an assertion."""
    from antifragile.engine import engine as engine_module

    real, calls = engine_module.StagingArea, []

    def allocate(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError("cannot allocate the staging arena")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_module, "StagingArea", allocate)
    state = {"w": torch.arange(12.0)}
    with CheckpointEngine(str(tmp_path / "ckpt")) as engine:
        with pytest.raises(MemoryError):
            engine.save(1, state)
        engine.save(2, state, blocking=True)
        target = {"w": torch.zeros(12)}
        assert engine.load(target) == 2 and torch.equal(target["w"], state["w"])


def _save_twice_rank_1_out_of_staging_memory_once(url: str, keep_in_memory: bool,
                                                  failing: int) -> list[str]:
    """On each of 2 ranks: two blocking saves of a row-sharded tensor; rank 1 cannot allocate
    its ``failing``-th staging area. Returns each save's outcome."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from antifragile.engine import engine as engine_module

    real, calls = engine_module.StagingArea, []

    def allocate(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == failing and torch.distributed.get_rank() == 1:
            raise MemoryError("cannot allocate the staging arena")
        return real(*args, **kwargs)

    engine_module.StagingArea = allocate  # type: ignore[misc]
    mesh = init_device_mesh("cpu", (2,))
    state = {"w": distribute_tensor(torch.arange(32.0).reshape(8, 4), mesh, [Shard(0)])}
    outcomes = []
    with CheckpointEngine(url, commit_timeout_s=10, keep_in_memory=keep_in_memory) as engine:
        for step in (1, 2):
            try:
                engine.save(step, state, blocking=True)
                outcomes.append("committed")
            except (CheckpointError, MemoryError) as exc:
                outcomes.append(f"{type(exc).__name__}: {exc}")
    return outcomes


@pytest.mark.multiproc
@pytest.mark.parametrize("keep_in_memory, failing", [(False, 1), (True, 2)],
                         ids=["first-area", "keep-in-memory-second-area"])
def test_a_staging_allocation_that_failed_on_one_rank_fails_the_save_on_every_rank_at_once(
        tmp_path: Path, keep_in_memory: bool, failing: int) -> None:
    """Rank 1 raised alone; rank 0's save waited for rank 1's record until the commit
    deadline (600 s by default), and every save until then was skipped as busy. With
    ``keep_in_memory`` the second set of buffers (staged into while the copy holds the
    first) was allocated by the second save alone, outside the agreement."""
    from _dist import run_ranks

    url = str(tmp_path / "ckpt")
    rank0, rank1 = run_ranks(2, _save_twice_rank_1_out_of_staging_memory_once, url,
                             keep_in_memory, failing, timeout_s=90)
    assert rank1 == ["MemoryError: cannot allocate the staging arena", "committed"], rank1
    assert rank0[0].startswith("CheckpointError: step 1 not saved") and "rank" in rank0[0], rank0
    assert rank0[1] == "committed", rank0
    with CheckpointEngine(url) as engine:
        assert engine.steps() == [2] and engine.verify(2).ok


def test_save_while_persisting_is_skipped_with_busy_error(ckpt: CheckpointEngine) -> None:
    state = {"w": torch.randn(8, 8)}
    gated = gate(ckpt)
    first = ckpt.save(1, state)
    assert gated.entered.wait(30)
    with pytest.warns(RuntimeWarning, match=r"step 2 skipped.*step 1 still persisting"):
        second = ckpt.save(2, state)
    assert second.staged.is_set()
    assert second.done() and second.retention_done()  # over: nothing to wait or poll for
    with pytest.raises(CheckpointBusyError, match="step 2"):
        second.wait()
    gated.release.set()
    first.wait()
    assert ckpt.steps() == [1]
    ckpt.save(2, state, blocking=True)
    assert ckpt.steps() == [1, 2]


def test_a_blocking_save_behind_one_in_flight_waits_for_it_and_saves(
        ckpt: CheckpointEngine) -> None:
    # a run's last save (blocking) behind an async save still persisting: it returned a
    # failed handle with only a warning, and the last step was never written
    state = {"w": torch.randn(8, 8)}
    gated = gate(ckpt)
    ckpt.save(1, state)
    assert gated.entered.wait(30)
    threading.Timer(0.5, gated.release.set).start()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "skipped" warning
        ckpt.save(2, state, blocking=True)
    assert ckpt.steps() == [1, 2]


def break_storage(storage: Storage, step: int) -> Callable[[], None]:
    """Make every write of ``step`` fail, even for root; returns the repair.

    Locally the step folder's path becomes a regular file; on S3 the bucket disappears.
    """
    url, options = storage
    if options is None:
        fs, root = raw_fs(storage)
        blocker = f"{root}/step_{step:09d}"
        fs.makedirs(root, exist_ok=True)
        fs.pipe_file(blocker, b"not a folder")
        return lambda: fs.rm(blocker)
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=options["endpoint_url"],
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    bucket = url.removeprefix("s3://").split("/", 1)[0]
    for obj in client.list_objects_v2(Bucket=bucket).get("Contents", []):
        client.delete_object(Bucket=bucket, Key=obj["Key"])
    client.delete_bucket(Bucket=bucket)
    return lambda: client.create_bucket(Bucket=bucket)


def test_failed_persist_surfaces_on_wait(storage: Storage, ckpt: CheckpointEngine) -> None:
    state = {"w": torch.randn(4, 4)}
    ckpt.save(1, state, blocking=True)
    repair = break_storage(storage, 2)
    try:
        handle = ckpt.save(2, state)
        with pytest.raises(CheckpointError, match="step 2"):
            handle.wait()
    finally:
        repair()
    assert 2 not in ckpt.steps()
    ckpt.save(3, state, blocking=True)
    assert ckpt.latest_step() == 3


def test_a_failed_staging_leaves_no_copy_running_into_the_staging_buffers(
        ckpt: CheckpointEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    # a small cell's copy failed on the caller's thread while a large cell's copy went on in
    # the copy pool: it wrote into the buffers (and released its cell) after the save had
    # failed, while the next save could be staging into them
    from antifragile.engine import stage

    real = stage._copy_cell
    running: list[int] = []

    def slow_large_broken_small(cell: Any, *args: Any, **kwargs: Any) -> None:
        if cell.nbytes < stage._POOL_MIN_BYTES:
            raise RuntimeError("copy failed")
        running.append(1)
        time.sleep(0.5)
        real(cell, *args, **kwargs)
        running.pop()

    monkeypatch.setattr(stage, "_copy_cell", slow_large_broken_small)
    state = {"big": torch.randn(1024, 512), "small": torch.randn(4, 4)}
    with pytest.raises(RuntimeError, match="copy failed"):
        ckpt.save(1, state)
    assert not running, "a staging copy still runs after its save failed"


def test_a_staging_error_fails_its_save_and_the_next_save_goes_ahead(
        ckpt: CheckpointEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A small state is staged before its writer starts; when the copy fails, the save still
    ends (failed, nothing committed) so the next one is not refused as busy forever."""
    import warnings

    from antifragile.engine import CheckpointBusyError, stage

    state = {"w": torch.randn(4, 4)}
    ckpt.save(1, state, blocking=True)
    real = stage._copy_cell

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("copy failed")

    monkeypatch.setattr(stage, "_copy_cell", broken)
    with pytest.raises(RuntimeError, match="copy failed"):
        ckpt.save(2, state)
    monkeypatch.setattr(stage, "_copy_cell", real)
    deadline = time.monotonic() + 30
    while True:  # the failed save ends on its writer thread, soon
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            handle = ckpt.save(3, state)
        try:
            handle.wait()
            break
        except CheckpointBusyError:
            assert time.monotonic() < deadline, "the failed save of step 2 never ended"
            time.sleep(0.05)
    assert ckpt.steps() == [1, 3]


def test_unobserved_failure_makes_next_save_raise(storage: Storage, ckpt: CheckpointEngine) -> None:
    state = {"w": torch.randn(4, 4)}
    repair = break_storage(storage, 2)
    try:
        handle = ckpt.save(2, state)
        until(handle.done)
    finally:
        repair()
    with pytest.raises(CheckpointError, match=r"step 3 not saved.*step 2 failed"):
        ckpt.save(3, state)
    assert ckpt.steps() == []
    ckpt.save(3, state, blocking=True)
    assert ckpt.steps() == [3]


class _GatedFailure:
    """Wraps an engine's storage: writes into ``step``'s folder wait for ``release``, then
    fail; ``entered`` is set by the first of them."""

    def __init__(self, inner: Any, step: int) -> None:
        self.inner, self.prefix = inner, f"step_{step:09d}/"
        self.entered, self.release = threading.Event(), threading.Event()

    def write(self, key: str, parts: Sequence[Any], **kwargs: Any) -> None:
        if key.startswith(self.prefix):
            self.entered.set()
            self.release.wait(60)
            raise PermissionError("test: write refused")
        self.inner.write(key, parts, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_save_that_fails_while_the_next_save_begins_is_still_raised(
        ckpt: CheckpointEngine) -> None:
    """Step 1's save fails just as ``save(2)`` looks at it: after it asked for an unobserved
    failure (none yet), before it asked whether the save is still in flight (no longer).
    ``save(2)`` went ahead as if step 1 had committed and the failure was never raised."""
    state = {"w": torch.randn(4, 4)}
    gated = _GatedFailure(ckpt.storage, 1)
    ckpt.storage = gated  # type: ignore[assignment]
    first = ckpt.save(1, state)
    assert gated.entered.wait(30)
    asked = first._unobserved_failure

    def fails_right_after() -> BaseException | None:
        found = asked()
        gated.release.set()
        until(first.done)
        return found

    first._unobserved_failure = fails_right_after  # type: ignore[method-assign]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # skipped: step 1 was in flight
        ckpt.save(2, state)
    with pytest.raises(CheckpointError, match=r"step 3 not saved.*step 1 failed"):
        ckpt.save(3, state)


def test_a_wait_that_timed_out_leaves_a_later_failure_to_be_raised(
        ckpt: CheckpointEngine) -> None:
    """``handle.wait(timeout=...)`` that ran out before the save ended counted the save as
    observed: when it failed afterwards, the next ``save()`` went ahead and nobody was told."""
    state = {"w": torch.randn(4, 4)}
    gated = _GatedFailure(ckpt.storage, 1)
    ckpt.storage = gated  # type: ignore[assignment]
    first = ckpt.save(1, state)
    assert gated.entered.wait(30)
    with pytest.raises(TimeoutError, match="step 1"):
        first.wait(timeout=0.01)
    gated.release.set()
    until(first.done)
    ckpt.storage = gated.inner
    with pytest.raises(CheckpointError, match=r"step 2 not saved.*step 1 failed"):
        ckpt.save(2, state)


class _SlowRetention(GatedStorage):
    """Writes wait for ``release``; retention's deletes wait for ``deletes``."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.deletes = threading.Event()

    def delete_tree(self, key: str) -> bool:
        self.deletes.wait(60)
        return bool(self.inner.delete_tree(key))


def test_a_wait_with_a_timeout_returns_within_it_when_the_commit_lands_meanwhile(
        tmp_path: Path) -> None:
    """``wait(timeout)`` gave the commit ``timeout`` s and then the retention after it another
    ``timeout`` s: a save committed 1 s into a 2 s wait whose retention was slow took 3 s."""
    with CheckpointEngine(str(tmp_path), keep_last=1) as engine:
        engine.save(1, {"w": torch.ones(4)}, blocking=True)
        slow = _SlowRetention(engine.storage)
        engine.storage = slow  # type: ignore[assignment]
        try:
            handle = engine.save(2, {"w": torch.ones(4)})
            threading.Timer(1.0, slow.release.set).start()
            start = time.monotonic()
            with pytest.raises(TimeoutError, match="step 2"):
                handle.wait(timeout=2.0)
            assert time.monotonic() - start < 2.7
            assert handle.done()  # committed; only its retention still ran
        finally:
            slow.release.set()
            slow.deletes.set()


def test_committed_step_is_never_overwritten(ckpt: CheckpointEngine) -> None:
    original = torch.randn(5, 5)
    ckpt.save(4, {"w": original.clone()}, blocking=True)
    handle = ckpt.save(4, {"w": original + 1})
    with pytest.raises(CheckpointCommittedError, match="step 4 is already committed"):
        handle.wait()
    target = {"w": torch.empty(5, 5)}
    assert ckpt.load(target) == 4
    assert torch.equal(target["w"], original)
    assert ckpt.verify(4).ok


@pytest.mark.parametrize(
    ("saved", "again"),
    [(1, True), (0, False), (1, 1.0), (0.0, -0.0), ([1, 1], [1, True]), ({"a": 0.0}, {"a": -0.0}),
     ({"a": 1, "b": 2}, {"b": 2, "a": 1})],
    ids=["int-bool", "zero-false", "int-float", "zero-sign", "in-a-list", "in-a-dict", "order"],
)
def test_a_resave_whose_json_differs_only_in_type_sign_or_order_is_refused(
        tmp_path: Path, saved: Any, again: Any) -> None:
    """Python's == finds True == 1 and -0.0 == 0.0; the step would then keep the old value while
    the caller believes the new one saved. Equal JSON (a NaN included) is still a re-save."""
    with CheckpointEngine(str(tmp_path)) as engine:
        engine.save(5, {"w": torch.ones(2), "cfg": saved, "loss": math.nan}, blocking=True)
        engine.save(5, {"w": torch.ones(2), "cfg": copy.deepcopy(saved), "loss": math.nan},
                    blocking=True)
        with pytest.raises(CheckpointCommittedError, match=r"step 5 is already committed.*'cfg'"):
            engine.save(5, {"w": torch.ones(2), "cfg": again, "loss": math.nan}, blocking=True)
        target = {"w": torch.zeros(2), "cfg": None}
        engine.load(target, step=5)
        assert_same(target["cfg"], saved)


def test_a_resave_of_a_step_whose_documents_were_formatted_otherwise_is_a_resave(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine wrote its zarr.json documents indented until it wrote them compact (json's
    indent path encodes in Python); a save of a step committed by the older engine (the
    retry of a save whose COMMIT landed, across an upgrade) compared the documents byte for
    byte and was refused. The same document is the same, whatever its spacing."""
    from antifragile.engine import _format

    state = {"w": torch.arange(6.0), "cfg": {"lr": 0.1}}
    with monkeypatch.context() as patch:
        patch.setattr(_format, "dumps",
                      lambda doc: json.dumps(doc, indent=1, allow_nan=True).encode())
        with CheckpointEngine(str(tmp_path)) as engine:
            engine.save(5, state, blocking=True)
    assert b'\n "zarr_format"' in (tmp_path / "step_000000005" / "w" / "zarr.json").read_bytes()
    with CheckpointEngine(str(tmp_path)) as engine:
        engine.save(5, state, blocking=True)
        with pytest.raises(CheckpointCommittedError, match="step 5 is already committed"):
            engine.save(5, {"w": torch.arange(6.0) + 1, "cfg": {"lr": 0.1}}, blocking=True)


def _fail_at(phase: str) -> Callable[[int, str], None]:
    def hook(step: int, at: str) -> None:
        if at == phase:
            raise RuntimeError(f"failed at {at}")

    return hook


@pytest.mark.parametrize("phase", ["persisting", "written", "recorded", "committing"])
@pytest.mark.parametrize("restarted", [False, True, None],
                         ids=["same-engine", "restarted", "restarted-saving-first"])
def test_a_step_saved_again_after_a_failed_attempt_holds_only_the_new_save(
        tmp_path: Path, phase: str, restarted: bool | None) -> None:
    """A save of step 2 fails after writing (in this engine, or in a process that then died:
    its successor lists the folder, or saves before it lists or loads anything); step 2 saved
    again in another layout commits a folder in which a zarr reader finds only the new arrays.
    A committed step is never removed."""
    url = str(tmp_path)
    state = {"w": torch.full((4,), 2.0), "old": torch.full((8,), 2.0)}
    engine = CheckpointEngine(url, keep_last=None)
    engine.save(1, {"w": torch.ones(4)}, blocking=True)
    engine._on_phase = _fail_at(phase)
    with pytest.raises(CheckpointError, match="step 2"):
        engine.save(2, state, blocking=True)
    engine._on_phase = None
    if restarted is not False:
        engine.close()
        engine = CheckpointEngine(url, keep_last=None)
        if restarted:
            assert engine.agreed_steps() == [1]
    with engine:
        engine.save(2, {"w": torch.full((4,), 3.0)}, blocking=True)
        assert sorted(p.name for p in (tmp_path / "step_000000002").iterdir()) == [
            ".ranks", "COMMIT", "w", "zarr.json"]
        with pytest.raises(CheckpointCommittedError, match="step 2 is already committed"):
            engine.save(2, {"w": torch.full((4,), 4.0)}, blocking=True)
        engine.save(2, {"w": torch.full((4,), 3.0)}, blocking=True)
        target = {"w": torch.zeros(4)}
        assert engine.load(target) == 2 and target["w"].tolist() == [3.0] * 4
        assert engine.verify(2).ok


def test_no_save_lists_the_root_on_the_training_thread(tmp_path: Path) -> None:
    """A fresh engine learns which step folders an earlier process left (see above) from one
    listing, made beside the caller: at its first save, on the training thread, it stalled
    training for as long as storage took to answer (1.3 s in a nightly run's S3 outage,
    0.02 s before)."""
    engine = CheckpointEngine(str(tmp_path), keep_last=None)
    inner = engine.storage.inner
    listed_by: list[str] = []
    real_list = inner.list_dir

    def list_dir(prefix: str) -> list[str]:
        listed_by.append(threading.current_thread().name)
        return real_list(prefix)

    inner.list_dir = list_dir
    with engine:
        caller = threading.current_thread().name
        engine.save(1, {"w": torch.ones(4)}).wait()
        engine.save(2, {"w": torch.ones(4)}).wait()
    assert caller not in listed_by, listed_by


class _CommitAnswerLost:
    """Storage applies the COMMIT of ``step`` but its answer never arrives (the connection
    drops once the request is through): the first time only."""

    def __init__(self, inner: Any, step: int) -> None:
        self.inner, self.key, self.lost = inner, f"step_{step:09d}/COMMIT", False

    def write(self, key: str, parts: Sequence[Any], **kwargs: Any) -> None:
        self.inner.write(key, parts, **kwargs)
        if key == self.key and not self.lost:
            self.lost = True
            raise PermissionError("connection dropped before the answer")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_retry_of_a_save_whose_commit_landed_but_whose_answer_was_lost_succeeds(
        ckpt: CheckpointEngine) -> None:
    """The save fails (its COMMIT's answer was lost) although storage holds the commit. Saving
    the same state at that step again is a success with nothing written, as the checkpoint is
    exactly what this save would write; other content at that step is still refused."""
    state = {"w": torch.randn(6, 4), "step": 2}
    ckpt.storage.inner = _CommitAnswerLost(ckpt.storage.inner, 2)
    with pytest.raises(CheckpointError, match="step 2"):
        ckpt.save(2, state, blocking=True)
    assert ckpt.steps() == [2]
    handle = ckpt.save(2, state, blocking=True)
    assert handle.exception() is None
    assert handle.committed_nbytes > 0
    for other in ({"w": state["w"] + 1, "step": 2}, {"w": state["w"], "step": 3}):
        with pytest.raises(CheckpointCommittedError, match="step 2 is already committed"):
            ckpt.save(2, other, blocking=True)
    target = {"w": torch.empty(6, 4), "step": 0}
    assert ckpt.load(target) == 2
    assert torch.equal(target["w"], state["w"]) and target["step"] == 2
    assert ckpt.verify(2).ok


def _save_twice_losing_rank0s_commit_answer(url: str) -> list[str]:
    """On each of 2 ranks: save step 3 of a row-sharded tensor, rank 0's COMMIT answer lost;
    then the same save again. Returns each attempt's outcome."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    state = {"w": distribute_tensor(torch.arange(32.0).reshape(8, 4), mesh, [Shard(0)])}
    outcomes = []
    with CheckpointEngine(url) as engine:
        if engine.rank == 0:
            engine.storage.inner = _CommitAnswerLost(engine.storage.inner, 3)
        for _ in range(2):
            try:
                engine.save(3, state, blocking=True)
                outcomes.append("committed")
            except CheckpointError as exc:
                outcomes.append(f"failed: {exc}")
    return outcomes


@pytest.mark.multiproc
def test_ranks_that_disagreed_on_a_lost_commit_answer_agree_on_the_retry(tmp_path: Path) -> None:
    """Rank 0's COMMIT landed but its answer was lost: rank 1 saw the COMMIT and succeeded,
    rank 0 failed. The retry, made by both, succeeds on both (each rank's share is intact)."""
    from _dist import run_ranks

    url = str(tmp_path / "ckpt")
    rank0, rank1 = run_ranks(2, _save_twice_losing_rank0s_commit_answer, url, timeout_s=90)
    assert rank0[0].startswith("failed") and "COMMIT" in rank0[0], rank0
    assert rank0[1:] == ["committed"] and rank1 == ["committed", "committed"], (rank0, rank1)
    with CheckpointEngine(url) as engine:
        target = {"w": torch.empty(8, 4)}
        assert engine.load(target) == 3
        assert torch.equal(target["w"], torch.arange(32.0).reshape(8, 4))


def _resave_after_rank_1_failed(url: str) -> list[str]:
    """On each of 2 ranks: step 2 of a row-sharded tensor and a plain one fails on rank 1 once
    written, then step 2 is saved again without the plain one. Returns the outcomes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    w = distribute_tensor(torch.arange(32.0).reshape(8, 4), mesh, [Shard(0)])
    outcomes = []
    with CheckpointEngine(url) as engine:
        engine._on_phase = _fail_at("written") if engine.rank == 1 else None
        for state in ({"w": w, "old": torch.ones(4)}, {"w": w}):
            try:
                engine.save(2, state, blocking=True)
                outcomes.append("committed")
            except CheckpointError as exc:
                outcomes.append(f"failed: {exc}")
            engine._on_phase = None
    return outcomes


@pytest.mark.multiproc
def test_a_resave_after_a_failed_attempt_on_another_rank_clears_it_first(tmp_path: Path) -> None:
    """Rank 0 removes the failed attempt's folder before the save's first collective: no rank
    has written into it yet, so every rank's new objects are kept and the old array is gone."""
    from _dist import run_ranks

    url = str(tmp_path / "ckpt")
    outcomes = run_ranks(2, _resave_after_rank_1_failed, url, timeout_s=90)
    assert all(o[0].startswith("failed") and o[1] == "committed" for o in outcomes), outcomes
    assert not (tmp_path / "ckpt" / "step_000000002" / "old").exists()
    with CheckpointEngine(url) as engine:
        target = {"w": torch.empty(8, 4)}
        assert engine.load(target) == 2 and engine.verify(2).ok
        assert torch.equal(target["w"], torch.arange(32.0).reshape(8, 4))


class _SignalsClear:
    """Rank 0's storage: touches ``cleared`` once it has removed a step folder."""

    def __init__(self, inner: Any, cleared: Path) -> None:
        self.inner, self.cleared = inner, cleared

    def delete_tree(self, prefix: str) -> bool:
        found = self.inner.delete_tree(prefix)
        self.cleared.touch()
        return found

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _LooksLate:
    """Rank 1's storage: each listing of ``prefix`` waits until ``cleared`` exists (at most
    2 s), as a rank polling the step folder of a large job may look only seconds later."""

    def __init__(self, inner: Any, prefix: str, cleared: Path) -> None:
        self.inner, self.prefix, self.cleared = inner, prefix, cleared

    def list_dir(self, prefix: str) -> list[str]:
        if prefix == self.prefix:
            deadline = time.monotonic() + 2.0
            while not self.cleared.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        return self.inner.list_dir(prefix)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _retry_a_save_rank_0_failed_at_its_commit(url: str, signals: str) -> list[str]:
    """On each of 2 ranks: a blocking save of step 2 fails on rank 0 as it commits (it writes
    an ABORT), then both save step 2 again at once. Returns each attempt's outcome."""
    cleared = Path(signals, "rank0-cleared-step-2")
    outcomes = []
    with CheckpointEngine(url, commit_timeout_s=10) as engine:
        if engine.rank == 0:
            engine.storage.inner = _SignalsClear(engine.storage.inner, cleared)
            engine._on_phase = _fail_at("committing")
        else:
            engine.storage.inner = _LooksLate(engine.storage.inner, "step_000000002", cleared)
        for _ in range(2):
            try:
                engine.save(2, {"w": torch.ones(4)}, blocking=True)
                outcomes.append("committed")
            except CheckpointError as exc:
                outcomes.append(f"failed: {exc}")
            engine._on_phase = None
    return outcomes


@pytest.mark.multiproc
def test_a_retry_clears_a_failed_attempt_only_once_every_rank_saw_its_abort(
        tmp_path: Path) -> None:
    """Rank 0 used to remove the failed attempt's folder (its ABORT with it) as its retry
    began, before the first collective, while rank 1 had not yet looked for the ABORT: rank 1
    waited out the commit deadline (here 15 s, by default 630 s) and rank 0 with it, in the
    retry's first collective."""
    from _dist import run_ranks

    url = str(tmp_path / "ckpt")
    rank0, rank1 = run_ranks(2, _retry_a_save_rank_0_failed_at_its_commit, url, str(tmp_path),
                             timeout_s=90)
    assert rank0[0].startswith("failed") and rank0[1] == "committed", rank0
    assert "aborted by rank 0" in rank1[0] and rank1[1] == "committed", rank1
    with CheckpointEngine(url) as engine:
        assert engine.steps() == [2] and engine.verify(2).ok


def _save_with_rank_0_late_to_commit(url: str) -> tuple[list[str], list[int]]:
    """On each of 2 ranks: step 2's save, whose writes on rank 0 take longer than the commit
    deadline and the waiting ranks' margin (3 s here), then step 3. Returns each save's
    outcome and the committed steps."""
    def late(step: int, phase: str) -> None:
        if step == 2 and phase == "written":
            time.sleep(4.0)

    outcomes = []
    with CheckpointEngine(url, commit_timeout_s=2.0) as engine:
        engine._on_phase = late if engine.rank == 0 else None
        for step in (2, 3):
            try:
                engine.save(step, {"w": torch.full((4,), float(step))}, blocking=True)
                outcomes.append("committed")
            except CheckpointError as exc:
                outcomes.append(f"failed: {exc}")
        return outcomes, engine.steps()


@pytest.mark.multiproc
def test_a_coordinator_past_its_deadline_does_not_commit_what_the_other_ranks_gave_up(
        tmp_path: Path) -> None:
    """Rank 0 found every record in only after rank 1 had stopped waiting for the COMMIT (its
    own writes were slow) and committed all the same: rank 1's save failed, rank 0's
    succeeded, and the step was visible although one rank reported it lost."""
    from _dist import run_ranks

    url = str(tmp_path / "ckpt")
    (rank0, steps0), (rank1, steps1) = run_ranks(2, _save_with_rank_0_late_to_commit, url,
                                                 timeout_s=90)
    assert rank0[0].startswith("failed") and "deadline" in rank0[0], rank0
    assert rank1[0].startswith("failed"), rank1
    assert rank0[1] == rank1[1] == "committed", (rank0, rank1)
    assert steps0 == steps1 == [3]


class _HungWrites:
    """Storage whose writes into ``prefix`` never return until ``release`` is set (a hung NFS
    server, an endpoint that accepts the connection and never answers)."""

    def __init__(self, inner: Any, prefix: str) -> None:
        self.inner, self.prefix = inner, prefix
        self.release = threading.Event()
        self.held: list[Any] = []

    def write(self, key: str, parts: Any, **kw: Any) -> None:
        if key.startswith(self.prefix):
            self.held.extend(parts)  # what the stuck write would send once it returns
            self.release.wait()
        self.inner.write(key, parts, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_write_that_never_returns_fails_its_save_at_the_deadline(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write stuck on storage held its save forever: the handle never resolved (wait()
    hung, every later save was skipped as busy: no checkpoint for the rest of the run) and
    close() never returned. The save fails at its deadline (commit_timeout_s) naming the
    write, nothing more is written into the hung step, the next save commits, and close()
    gives up on the stuck thread after CLOSE_WAIT_S."""
    from antifragile.engine import CommitTimeoutError, _threads

    monkeypatch.setattr(_threads, "CLOSE_WAIT_S", 0.5)
    engine = CheckpointEngine(str(tmp_path / "ckpt"), commit_timeout_s=1.0)
    hung = _HungWrites(engine.storage, "step_000000001/")
    engine.storage = hung
    try:
        handle = engine.save(1, {"w": torch.ones(8)})
        began = time.monotonic()
        with pytest.raises(CommitTimeoutError, match=r"step 1, rank 0: .*step_000000001/.* "
                                                     r"not written: no write returned for 1 s"):
            handle.wait()
        assert time.monotonic() - began < 10
        engine.save(2, {"w": torch.full((8,), 2.0)}, blocking=True)
        assert engine.steps() == [2]
        began = time.monotonic()
        engine.close()
        assert time.monotonic() - began < 10
    finally:
        hung.release.set()
        engine.close()


class _HungRequest:
    """Storage whose ``method`` never returns for a key starting with ``prefix`` until
    ``release`` is set (a hard NFS mount whose server went away)."""

    def __init__(self, inner: Any, method: str, prefix: str) -> None:
        self.inner, self.method, self.prefix = inner, method, prefix
        self.release, self.reached = threading.Event(), threading.Event()

    def __getattr__(self, name: str) -> Any:
        real = getattr(self.inner, name)
        if name != self.method:
            return real

        def hung(*args: Any, **kw: Any) -> Any:
            if args[0].startswith(self.prefix):
                self.reached.set()
                self.release.wait()
            return real(*args, **kw)
        return hung


@pytest.mark.parametrize(("method", "prefix"), [
    ("exists", "step_000000001/COMMIT"),  # the save's first look-up
    ("write", "step_000000001/.ranks/"),  # its record
    ("list_dir", "step_000000001/.ranks"),  # the coordinator's listing of the records
    ("write", "step_000000001/COMMIT")])  # the commit itself
def test_a_request_of_a_save_beside_its_writes_that_never_returns_fails_it_in_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str, prefix: str) -> None:
    """Only the object writes and their sync were bounded by commit_timeout_s: a save whose
    first look-up, record, listing or COMMIT hung on storage never resolved (wait() hung,
    every later save was skipped as busy). Each such request now fails the save as its
    writes do, and the next save commits."""
    from antifragile.engine import CommitTimeoutError, _threads

    monkeypatch.setattr(_threads, "CLOSE_WAIT_S", 0.5)
    engine = CheckpointEngine(str(tmp_path / "ckpt"), commit_timeout_s=1.0)
    hung = _HungRequest(engine.storage, method, prefix)
    engine.storage = hung
    try:
        handle = engine.save(1, {"w": torch.ones(8)})
        began = time.monotonic()
        with pytest.raises(CommitTimeoutError, match=rf"step 1, rank 0: .*{method}"):
            handle.wait(timeout=30)
        assert hung.reached.is_set() and time.monotonic() - began < 10
        hung.prefix = "-"  # the storage answers again (the hung request stays hung)
        engine.save(2, {"w": torch.full((8,), 2.0)}, blocking=True)
        assert engine.steps() == [2]
    finally:
        hung.release.set()
        engine.close()


def _save_with_rank_1_hung(url: str) -> tuple[list[str], list[int], int]:
    """On each of 2 ranks: step 2, whose writes hang on rank 1 (until the end), then step 3.
    Returns each save's outcome, the committed steps and the objects rank 1's hung writes
    held."""
    outcomes = []
    with CheckpointEngine(url, commit_timeout_s=2.0) as engine:
        hung = _HungWrites(engine.storage, "step_000000002/" if engine.rank == 1 else "-")
        engine.storage = hung
        state = {name: torch.full((64,), float(i)) for i, name in enumerate("abcdef")}
        for step in (2, 3):
            try:
                engine.save(step, state, blocking=True)
                outcomes.append("committed")
            except CheckpointError as exc:
                outcomes.append(f"failed: {exc}")
        hung.release.set()  # close() need not wait CLOSE_WAIT_S for it
        return outcomes, engine.steps(), len(hung.held)


@pytest.mark.multiproc
def test_a_rank_whose_write_hangs_fails_the_save_on_every_rank_and_the_next_commits(
        tmp_path: Path) -> None:
    """Rank 1's write hangs: it fails its save once no write returns for commit_timeout_s
    (writing nothing more), rank 0 times out naming it, and the next save (planned again on
    every rank, as rank 1 stages into new buffers) commits on both."""
    from _dist import run_ranks

    url = str(tmp_path / "ckpt")
    (rank0, steps0, _), (rank1, steps1, held) = run_ranks(2, _save_with_rank_1_hung, url,
                                                          timeout_s=90)
    assert held, "rank 1 wrote nothing of step 2: no write hung"
    assert rank1[0].startswith("failed") and "no write returned" in rank1[0], rank1
    assert rank0[0].startswith("failed") and "rank(s) [1]" in rank0[0], rank0
    assert rank0[1] == rank1[1] == "committed", (rank0, rank1)
    assert steps0 == steps1 == [3]


class _CutOff:
    """Rank 1's storage: every write into ``prefix`` fails (its storage is down for it: its
    error record cannot reach the others either)."""

    def __init__(self, inner: Any, prefix: str) -> None:
        self.inner, self.prefix = inner, prefix

    def write(self, key: str, parts: Any, **kw: Any) -> None:
        if key.startswith(self.prefix):
            raise OSError(f"{key}: storage unreachable from this rank")
        self.inner.write(key, parts, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _save_with_rank_1_cut_off(url: str, observe: bool) -> tuple[list[str], float]:
    """On each of 2 ranks (commit_timeout_s 60): step 2, whose every write fails on rank 1;
    once rank 1's save has failed (``observe``: its failure read, as a trainer's poll does),
    step 3, then a blocking step 4. Returns the outcomes (step 2's last) and how long step 2
    was still waited for after step 3's save."""
    import torch.distributed as dist

    outcomes = []
    with CheckpointEngine(url, commit_timeout_s=60.0) as engine:
        if engine.rank == 1:
            engine.storage = _CutOff(engine.storage, "step_000000002/")
        state = {name: torch.full((64,), float(i)) for i, name in enumerate("abcdef")}
        second = engine.save(2, state)
        if engine.rank == 1:
            while not second.done():
                time.sleep(0.01)
            if observe:
                assert second.exception() is not None
        dist.barrier()
        for step, blocking in ((3, False), (4, True)):
            try:
                engine.save(step, state, blocking=blocking).wait()
                outcomes.append("committed")
            except CheckpointError as exc:
                outcomes.append(f"failed: {exc}")
            if step == 3:
                begun = time.monotonic()
                try:
                    second.wait()
                    last = "committed"
                except CheckpointError as exc:
                    last = f"failed: {exc}"
                waited = time.monotonic() - begun
        return [*outcomes, last], waited


@pytest.mark.multiproc
@pytest.mark.parametrize("observe", [False, True])
def test_a_rank_whose_part_failed_unblocks_the_coordinator_at_the_next_save(
        tmp_path: Path, observe: bool) -> None:
    """Rank 1's storage is down for it alone: its save fails at once, and its error record
    cannot reach storage either, so the coordinator waited for that record to the deadline
    (commit_timeout_s, 600 s by default), every save meanwhile skipped as busy: no checkpoint
    for ten minutes. The next save's all-reduce tells it that a rank's part failed: it gives
    the step up (an ABORT for the ranks still waiting) at once, and the save after commits."""
    from _dist import run_ranks

    url = str(tmp_path / "ckpt")
    (rank0, waited), (rank1, _) = run_ranks(2, _save_with_rank_1_cut_off, url, observe,
                                            timeout_s=150)
    assert waited < 15.0, (waited, rank0)
    assert rank0[2].startswith("failed") and "rank(s) [1]" in rank0[2], rank0
    assert "its part failed" in rank0[2], rank0
    assert rank0[1] == rank1[1] == "committed", (rank0, rank1)
    assert rank1[2].startswith("failed") and "unreachable" in rank1[2], rank1
    with CheckpointEngine(url) as engine:
        assert engine.steps() == [4]


def test_a_hung_write_keeps_its_save_s_bytes_while_the_next_save_stages(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write hung on storage still holds the staging buffer it was given (a view into the
    save's buffers) and may send it when the storage answers again. The next save staged its
    own state into those same buffers: the hung write of step 1 then stored step 2's bytes
    (torn, if it was sending) into step 1's folder. The next save stages into new buffers."""
    from antifragile.engine import CommitTimeoutError, _threads

    monkeypatch.setattr(_threads, "CLOSE_WAIT_S", 0.5)
    engine = CheckpointEngine(str(tmp_path / "ckpt"), commit_timeout_s=1.0)
    hung = _HungWrites(engine.storage, "step_000000001/w/c")
    engine.storage = hung
    try:
        with pytest.raises(CommitTimeoutError):
            engine.save(1, {"w": torch.ones(64)}).wait()
        engine.save(2, {"w": torch.full((64,), 2.0)}, blocking=True)
        assert engine.steps() == [2]
        held = [bytes(part) for part in hung.held]
        assert held and all(torch.ones(64).numpy().tobytes() in data for data in held)
    finally:
        hung.release.set()
        engine.close()


@pytest.mark.parametrize(("refused", "nbytes", "defer"), [
    ("ckpt-save-", 32, False),  # staged on the caller's thread, then the save thread
    ("ckpt-save-", 64 * 2**20, False),  # overlapped: the save thread first
    ("ckpt-save-", 32, True),  # deferred: the save thread, then the staging thread
    ("ckpt-stage-", 32, True),  # deferred: the save thread runs, waiting for staging
])
def test_a_save_whose_thread_does_not_start_fails_and_the_next_one_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refused: str, nbytes: int,
        defer: bool) -> None:
    """``threading.Thread.start`` raising ("can't start new thread": a process at its thread
    limit) made ``save()`` raise with its handle never done: every later save was skipped as
    busy and ``close()`` waited for it forever. The save fails naming its step, the handle
    too, and the next save commits."""
    from antifragile.engine import _threads

    real_run = _threads.DaemonWorkers.run

    def run(self: Any, name: str, *args: Any) -> None:
        if name.startswith(refused) and name.endswith("-1"):
            raise RuntimeError("can't start new thread")
        real_run(self, name, *args)

    monkeypatch.setattr(_threads.DaemonWorkers, "run", run)
    engine = CheckpointEngine(str(tmp_path / "ckpt"), commit_timeout_s=5.0)
    try:
        state = {"w": torch.ones(nbytes // 4)}
        handle = None
        try:
            handle = engine.save(1, state, defer_staging=defer)
        except CheckpointError as exc:
            assert "step 1" in str(exc) and "can't start new thread" in str(exc)
        if handle is not None:  # the save thread runs: it fails the save itself
            with pytest.raises(CheckpointError, match=r"step 1.*can't start new thread"):
                handle.wait(timeout=30)
        assert engine._last is not None
        with pytest.raises(CheckpointError, match=r"step 1.*can't start new thread"):
            engine._last.wait(timeout=30)  # done: not a TimeoutError
        engine.save(2, state, blocking=True, defer_staging=defer)
        assert engine.steps() == [2]
    finally:
        closer = threading.Thread(target=engine.close, daemon=True)
        closer.start()
        closer.join(30)
        assert not closer.is_alive(), "close() hung"


class _HungSync:
    """Local storage whose first ``sync`` after ``armed`` is set never returns until
    ``release`` is (a hung NFS server: buffered writes return, their fsync does not)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.armed, self.release = threading.Event(), threading.Event()

    def sync(self) -> None:
        if self.armed.is_set():
            self.armed.clear()
            self.release.wait()
        self.inner.sync()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_sync_that_never_returns_fails_its_save_like_a_hung_write(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a hung NFS server the writes (into the page cache) return and the fsync of the
    save's files does not: the save thread waited in it forever, its handle never resolved
    and every later save was skipped as busy, though a hung write fails its save. The sync is
    held to the same commit_timeout_s."""
    from antifragile.engine import CommitTimeoutError, _threads

    monkeypatch.setattr(_threads, "CLOSE_WAIT_S", 0.5)
    engine = CheckpointEngine(str(tmp_path / "ckpt"), commit_timeout_s=1.0)
    hung = _HungSync(engine.storage)
    engine.storage = hung
    try:
        hung.armed.set()
        with pytest.raises(CommitTimeoutError, match=r"step 1, rank 0: .*sync"):
            engine.save(1, {"w": torch.ones(8)}).wait(timeout=30)
        engine.save(2, {"w": torch.full((8,), 2.0)}, blocking=True)
        assert engine.steps() == [2]
    finally:
        hung.release.set()
        engine.close()


class _SlowWrites:
    """Storage whose every write into ``prefix`` takes ``delay_s`` (slow, but it answers)."""

    def __init__(self, inner: Any, prefix: str, delay_s: float) -> None:
        self.inner, self.prefix, self.delay_s = inner, prefix, delay_s

    def write(self, key: str, parts: Any, **kw: Any) -> None:
        if key.startswith(self.prefix):
            time.sleep(self.delay_s)
        self.inner.write(key, parts, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_slow_storage_that_answers_every_write_is_not_taken_for_a_hung_one(
        tmp_path: Path) -> None:
    """The writes' deadline counted from the save's start: on one rank, whose save commits
    however long its writes take, a storage slower than commit_timeout_s for the whole state
    (50 GiB at 50 MB/s is 1000 s, against 600 s) failed every save, saying the storage
    did not answer, though every write returned. A write is hung only when no write has
    returned for commit_timeout_s."""
    engine = CheckpointEngine(str(tmp_path / "ckpt"), commit_timeout_s=1.0, io_threads=1)
    engine.storage = _SlowWrites(engine.storage, "step_000000001/", 0.3)
    try:
        state = {f"w{i}": torch.full((8,), float(i)) for i in range(6)}
        began = time.monotonic()
        engine.save(1, state, blocking=True)
        assert time.monotonic() - began > 1.0  # the writes took longer than commit_timeout_s
        assert engine.steps() == [1]
    finally:
        engine.close()


class _StepFolderOut:
    """Rank 1's storage: listing ``prefix`` fails (as RetryingStorage raises once its retries
    are spent) for ``outage_s`` from the first listing on."""

    def __init__(self, inner: Any, prefix: str, outage_s: float) -> None:
        self.inner, self.prefix, self.outage_s = inner, prefix, outage_s
        self.began: float | None = None

    def list_dir(self, prefix: str) -> list[str]:
        if prefix == self.prefix:
            self.began = self.began or time.monotonic()
            if time.monotonic() - self.began < self.outage_s:
                raise StorageError(f"list {prefix}: connection reset (retries spent)")
        return self.inner.list_dir(prefix)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _save_while_rank_1_cannot_list_for_a_while(url: str) -> tuple[str, list[int]]:
    """On each of 2 ranks: a blocking save of step 2 while rank 1 cannot list the step folder
    for its first second (well inside the 10 s deadline). Returns the outcome and the steps."""
    with CheckpointEngine(url, commit_timeout_s=10.0) as engine:
        if engine.rank == 1:
            engine.storage = _StepFolderOut(engine.storage, "step_000000002", 1.0)
        try:
            engine.save(2, {"w": torch.ones(4)}, blocking=True)
            outcome = "committed"
        except CheckpointError as exc:
            outcome = f"failed: {exc}"
        return outcome, engine.steps()


@pytest.mark.multiproc
def test_a_rank_that_cannot_reach_storage_for_a_while_waits_for_the_commit_until_its_deadline(
        tmp_path: Path) -> None:
    """Rank 1's first look for the COMMIT failed (storage out on its link for a second) and
    failed its save at once, while rank 0 committed the step: one rank reported lost what
    was committed. A waiting rank now looks again until its deadline."""
    from _dist import run_ranks

    url = str(tmp_path / "ckpt")
    results = run_ranks(2, _save_while_rank_1_cannot_list_for_a_while, url, timeout_s=90)
    assert results == [("committed", [2]), ("committed", [2])], results


# -- retention -------------------------------------------------------------------------------


def step_folders(storage: Storage) -> list[str]:
    """The step folders that hold objects. (An object store has no folders: on S3 a prefix
    whose objects are gone is gone; SeaweedFS keeps listing it for ~2.5 minutes, until its
    filer removes the empty directory.)"""
    fs, root = raw_fs(storage)
    return sorted({p.removeprefix(f"{root}/").split("/", 1)[0] for p in fs.find(root)})


def test_keep_last_retains_newest_and_removes_older_debris(storage: Storage) -> None:
    url, options = storage
    state = {"w": torch.randn(4, 2)}
    fs, root = raw_fs(storage)
    with CheckpointEngine(url, storage_options=options, keep_last=2) as engine:
        for step in (1, 2, 3, 4):
            engine.save(step, state, blocking=True)
        assert engine.steps() == [3, 4]
        fs.pipe_file(f"{root}/step_000000002/w/c.0.0", b"debris of a crashed save")
        fs.pipe_file(f"{root}/step_000000009/w/c.0.0", b"a save that may still be running")
        engine.save(5, state, blocking=True)
        assert engine.steps() == [4, 5]
        assert step_folders(storage) == ["step_000000004", "step_000000005", "step_000000009"]
        target = {"w": torch.empty(4, 2)}
        assert engine.load(target, step=4) == 4 and torch.equal(target["w"], state["w"])


def test_retention_spares_the_step_it_follows_and_saves_newer_than_it(storage: Storage) -> None:
    # a newer committed step (100) is left from before a rollback to an older step; step 10's
    # retention deleted step 20's folder as "debris older than the newest committed step"
    # while step 20 was being saved (which then committed torn), and with keep_last=1 it
    # deleted step 10 itself right after its save returned committed
    url, options = storage
    fs, root = raw_fs(storage)
    with CheckpointEngine(url, storage_options=options) as stale:
        stale.save(100, {"w": torch.full((3,), 100.0)}, blocking=True)
    with CheckpointEngine(url, storage_options=options, keep_last=1) as engine:
        fs.pipe_file(f"{root}/step_000000020/w/c.0", b"a save of this run, in flight")
        engine.save(10, {"w": torch.full((3,), 10.0)}, blocking=True)
        assert engine.steps() == [10, 100]
        assert "step_000000020" in step_folders(storage)
        target = {"w": torch.empty(3)}
        assert engine.load(target, step=10) == 10 and torch.equal(target["w"],
                                                                 torch.full((3,), 10.0))


@pytest.mark.parametrize("first", [25, 30, 20])
def test_a_save_after_a_rollback_supersedes_the_abandoned_runs_newer_steps(
        storage: Storage, first: int) -> None:
    """A run that went back to step 20 (a loss spike) left steps 30 and 40 of the run it
    abandoned committed: a restart's load() resumed from 40, undoing the rollback; retention
    (keep_last=2) deleted the new run's steps to keep them; and with a fixed interval the new
    run's save of 30 was refused ('already committed', other data) until it passed 40. The
    first save after the load hides them as a quarantine does (their evidence kept), before it
    writes: a crash in between leaves step 20, where the run went back to, the newest.
    ``first``: the new run's first save, between the abandoned steps, on one of them (its
    own data), or the step it went back to again (saved the same: nothing written)."""
    from antifragile.engine.quarantine import quarantined_steps, read_quarantine

    url, options = storage
    with CheckpointEngine(url, storage_options=options, keep_last=3) as engine:
        for step in (10, 20, 30, 40):
            engine.save(step, {"w": torch.full((3,), float(step))}, blocking=True)
    new = {"w": torch.full((3,), -1.0)}
    with CheckpointEngine(url, storage_options=options, keep_last=2) as engine:
        target = {"w": torch.empty(3)}
        assert engine.load(target, step=20) == 20
        engine.save(first, target if first == 20 else new, blocking=True)
        assert engine.steps() == ([20] if first == 20 else [20, first])
        assert quarantined_steps(engine.storage) == [s for s in (30, 40) if s != first]
        note = read_quarantine(engine.storage, 40)
        assert note is not None and note[0]["reason"].startswith(
            "superseded: the run went back to step 20 (a load of it, then a save)"), note[0]
        engine.save(41, new, blocking=True)
    with CheckpointEngine(url, storage_options=options) as engine:
        target = {"w": torch.empty(3)}
        assert engine.load(target) == 41 and torch.equal(target["w"], new["w"])
        if first != 20:
            assert engine.load(target, step=first) == first and torch.equal(target["w"],
                                                                            new["w"])


def test_a_save_that_is_no_rollback_supersedes_nothing(storage: Storage) -> None:
    """Only a load says where the run went back to: a save of an older step without one (a
    second run pointed at the same folder) leaves the newer steps as they are, and so does a
    save past every step after a load of an older one (looked at, then trained on)."""
    url, options = storage
    with CheckpointEngine(url, storage_options=options, keep_last=None) as engine:
        for step in (10, 2, 30):
            engine.save(step, {"w": torch.ones(3)}, blocking=True)
        assert engine.steps() == [2, 10, 30]
        assert engine.load({"w": torch.empty(3)}, step=10) == 10
        engine.save(31, {"w": torch.ones(3)}, blocking=True)
        engine.save(11, {"w": torch.ones(3)}, blocking=True)  # not the first after the load
        assert engine.steps() == [2, 10, 11, 30, 31]


def test_a_load_whose_listed_step_is_deleted_by_a_newer_save_loads_the_newer(
        storage: Storage, monkeypatch: pytest.MonkeyPatch) -> None:
    # a reader lists step 10; the training job commits step 20 and its retention
    # (keep_last=1) deletes step 10 before the reader reads it: the load failed although an
    # intact step (20) existed
    url, options = storage
    with CheckpointEngine(url, storage_options=options, keep_last=1) as writer, \
            CheckpointEngine(url, storage_options=options) as reader:
        writer.save(10, {"w": torch.full((3,), 10.0)}, blocking=True)
        load_step = reader._loader._load_step
        calls: list[int] = []

        def newer_save_first(step: int, *args: Any) -> Any:
            if not calls:
                writer.save(20, {"w": torch.full((3,), 20.0)}, blocking=True)
                writer.wait()  # its retention has deleted step 10
            calls.append(step)
            return load_step(step, *args)

        monkeypatch.setattr(reader._loader, "_load_step", newer_save_first)
        target = {"w": torch.empty(3)}
        with pytest.warns(RuntimeWarning, match="step 10 skipped, trying step 20"):
            assert reader.load(target) == 20
        assert calls == [10, 20] and torch.equal(target["w"], torch.full((3,), 20.0))


class _MainThreadWaits(threading.Event):
    """Stands in for a save handle's "retention over" event: records when the training (main)
    thread starts waiting for that retention."""

    def __init__(self, main_waits: threading.Event) -> None:
        super().__init__()
        self.main_waits = main_waits

    def wait(self, timeout: float | None = None) -> bool:
        if threading.current_thread() is threading.main_thread():
            self.main_waits.set()
        return super().wait(timeout)


class _HeldDebrisDeletion:
    """Rank 0's storage: retention's removal of the debris folder of step 5 waits until rank 1
    has written its objects of a save of step 5 (``written``) or rank 0's training thread waits
    for that retention (``main_waits``); ``deleted`` is created once it is removed."""

    def __init__(self, inner: Any, written: Path, deleted: Path,
                 main_waits: threading.Event) -> None:
        self.inner, self.written, self.deleted = inner, written, deleted
        self.main_waits = main_waits

    def delete_tree(self, prefix: str) -> bool:
        if prefix == "step_000000005":
            deadline = time.monotonic() + 60
            while not (self.written.exists() or self.main_waits.is_set()):
                if time.monotonic() > deadline:
                    raise PermissionError("test gate never opened")
                time.sleep(0.01)
        found = bool(self.inner.delete_tree(prefix))
        if prefix == "step_000000005":
            self.deleted.touch()
        return found

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _save_an_older_step_while_rank0s_retention_runs(url: str, signals: str) -> list[Any]:
    """On each of 2 ranks: steps 10 and 20 of a row-sharded tensor; step 20's retention (rank 0)
    removes the debris of a crashed save of step 5 while the ranks save step 5 (after a
    rollback). Returns whether step 5 verifies, and what a load of it gives."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))

    def state(value: float) -> dict[str, Any]:
        return {"w": distribute_tensor(torch.full((8, 4), value), mesh, [Shard(0)])}

    written, deleted = Path(signals, "rank1-wrote-step-5"), Path(signals, "step-5-debris-gone")
    main_waits = threading.Event()

    def rank1_written(step: int, phase: str) -> None:
        if step == 5 and phase == "written":
            written.touch()
            until(deleted.exists)  # rank 0's retention had its chance to remove the folder

    with CheckpointEngine(url, keep_last=None) as engine:
        engine.save(10, state(10.0), blocking=True)
        if engine.rank == 0:
            debris = Path(url, "step_000000005", "w")
            debris.mkdir(parents=True)
            (debris / "c").write_bytes(b"debris of a crashed save")
            engine.storage.inner = _HeldDebrisDeletion(engine.storage.inner, written, deleted,
                                                       main_waits)
        else:
            engine._on_phase = rank1_written
        handle = engine.save(20, state(20.0))
        if engine.rank == 0:
            until(handle.done)  # committed; its retention is held at the debris of step 5
            handle._retained = _MainThreadWaits(main_waits)
        else:
            handle.wait()
        engine.save(5, state(5.0), blocking=True)
        engine.wait()
        target = {"w": distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)])}
        try:
            engine.load(target, step=5)
            loaded: Any = bool((target["w"].to_local() == 5.0).all())
        except CheckpointError as exc:
            loaded = str(exc)
        return [engine.verify(5).ok, loaded]


@pytest.mark.multiproc
def test_an_older_step_saved_beside_the_coordinators_retention_commits_whole(
        tmp_path: Path) -> None:
    """After a rollback, a save of step 5 begins while rank 0's retention after step 20 is still
    removing the debris of an earlier crashed save of step 5. Only rank 0 used to wait for that
    retention: rank 1 wrote its objects, the retention deleted them, and rank 0 committed a
    step 5 whose COMMIT lists objects that are gone."""
    from _dist import run_ranks

    url = str(tmp_path / "ckpt")
    outcomes = run_ranks(2, _save_an_older_step_while_rank0s_retention_runs, url,
                         str(tmp_path), timeout_s=120)
    assert outcomes == [[True, True], [True, True]], outcomes


def test_keep_last_one_never_deletes_the_newest(storage: Storage) -> None:
    url, options = storage
    with CheckpointEngine(url, storage_options=options, keep_last=1) as engine:
        for step in (1, 2, 3):
            engine.save(step, {"w": torch.full((3,), float(step))}, blocking=True)
            assert engine.steps() == [step]
        target = {"w": torch.empty(3)}
        assert engine.load(target) == 3 and torch.equal(target["w"], torch.full((3,), 3.0))


def test_a_retention_failure_does_not_fail_a_committed_save(
    storage: Storage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Committed means committed: the save of step 2 succeeds on every rank even though
    retention cannot delete step 1 (the storage layer refuses); the error is on the handle and
    retention runs again, successfully, at the next save."""
    url, options = storage
    with CheckpointEngine(url, storage_options=options, keep_last=1) as engine:
        engine.save(1, {"w": torch.ones(3)}, blocking=True)
        inner = engine.storage.inner

        def refuse(prefix: str) -> None:
            raise PermissionError(f"delete refused: {prefix}")

        monkeypatch.setattr(inner, "delete_tree", refuse)
        handle = engine.save(2, {"w": torch.full((3,), 2.0)})
        handle.wait()
        assert handle.retention_error is not None
        assert "step_000000001" in handle.retention_error
        assert "PermissionError" in handle.retention_error
        assert engine.steps() == [2]
        assert "step_000000001" in step_folders(storage)
        with pytest.raises(CheckpointCommittedError, match="step 2 is already committed"):
            engine.save(2, {"w": torch.ones(3)}, blocking=True)
        monkeypatch.undo()
        handle = engine.save(3, {"w": torch.full((3,), 3.0)}, blocking=True)
        assert handle.retention_error is None
        assert step_folders(storage) == ["step_000000003"]


# -- load errors -----------------------------------------------------------------------------


def test_load_without_checkpoint_raises_not_found(ckpt: CheckpointEngine) -> None:
    with pytest.raises(CheckpointNotFoundError):
        ckpt.load({"w": torch.empty(2)})
    ckpt.save(1, {"w": torch.ones(2)}, blocking=True)
    with pytest.raises(CheckpointNotFoundError, match="step 7"):
        ckpt.load({"w": torch.empty(2)}, step=7)


def test_load_target_with_a_tensor_the_checkpoint_lacks(ckpt: CheckpointEngine) -> None:
    ckpt.save(5, {"model": {"w": torch.ones(2)}}, blocking=True)
    target = {"model": {"w": torch.empty(2), "new_head": torch.empty(3)}}
    with pytest.raises(CheckpointMismatchError, match=r"step 5.*model/new_head"):
        ckpt.load(target, step=5)


def test_load_target_with_another_shape(ckpt: CheckpointEngine) -> None:
    ckpt.save(5, {"model": {"w": torch.ones(4, 3)}}, blocking=True)
    with pytest.raises(CheckpointMismatchError, match=r"step 5.*model/w.*\[4, 3\].*\[3, 4\]"):
        ckpt.load({"model": {"w": torch.empty(3, 4)}}, step=5)


def test_mismatch_on_every_step_warns_raises_and_quarantines_nothing(
    ckpt: CheckpointEngine,
) -> None:
    ckpt.save(1, {"w": torch.ones(2)}, blocking=True)
    ckpt.save(2, {"w": torch.ones(2), "v": torch.ones(1)}, blocking=True)
    with (
        pytest.warns(RuntimeWarning, match=r"step 2 skipped, trying step 1.*'v'.*\[5\]"),
        pytest.raises(CheckpointMismatchError, match=r"step 2.*'v'"),
    ):
        ckpt.load({"w": torch.empty(2), "v": torch.empty(5)})
    assert ckpt.steps() == [1, 2]
    target = {"w": torch.empty(2), "v": torch.empty(1)}
    assert ckpt.load(target) == 2


def test_a_load_target_that_cannot_be_filled_is_refused_without_trying_any_step(
    ckpt: CheckpointEngine,
) -> None:
    """A broadcast view (stride 0: its elements share memory) or a meta tensor cannot take the
    data of any step: refused by the call naming the path, no step tried (no warning)."""
    ckpt.save(1, {"bias": torch.ones(2, 3)}, blocking=True)
    ckpt.save(2, {"bias": torch.ones(2, 3)}, blocking=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(CheckpointMismatchError, match=r"'bias'.*dim 0 has stride 0"):
            ckpt.load({"bias": torch.zeros(3).expand(2, 3)})
        with pytest.raises(CheckpointError, match=r"'bias'.*meta device"):
            ckpt.load({"bias": torch.empty(2, 3, device="meta")})
    assert ckpt.steps() == [1, 2]
    target = {"bias": torch.zeros(2, 3)[:, :]}  # a view that owns its elements loads
    assert ckpt.load(target) == 2 and torch.equal(target["bias"], torch.ones(2, 3))


def test_a_load_target_whose_elements_overlap_in_memory_is_refused(
    ckpt: CheckpointEngine,
) -> None:
    """Strides that are not 0 can make elements share memory too (``as_strided``): such a
    target loaded "successfully" and then held other values than the step (each shared
    element kept whichever value was copied last). Refused like a broadcast view; a layout
    whose strides interleave without sharing memory still loads."""
    saved = torch.arange(9.0).reshape(3, 3)
    ckpt.save(1, {"w": saved}, blocking=True)
    for strides in [(1, 1), (2, 1), (1, 2)]:
        target = torch.zeros(16).as_strided((3, 3), strides)
        with pytest.raises(CheckpointMismatchError, match=r"'w'.*share memory"):
            ckpt.load({"w": target})
    interleaved = torch.zeros(16).as_strided((3, 3), (3, 4))  # offsets all distinct
    assert ckpt.load({"w": interleaved}) == 1 and torch.equal(interleaved, saved)


def test_tied_target_tensors_load_only_data_they_can_both_hold(ckpt: CheckpointEngine) -> None:
    """Two target entries that are one tensor (tied embedding and head) take a step that holds
    the same data for both; a step that holds different data (saved untied) is a mismatch
    naming both paths. It loaded one of the two silently, or, the reads of both landing in the
    one memory at once, failed its crc32c check as if the step were damaged."""
    tied = torch.randn(64, 32)
    ckpt.save(1, {"emb": tied, "head": tied}, blocking=True)
    ckpt.save(2, {"emb": torch.randn(64, 32), "head": torch.randn(64, 32)}, blocking=True)
    shared = torch.zeros(64, 32)
    assert ckpt.load({"emb": shared, "head": shared}, step=1) == 1
    assert torch.equal(shared, tied)
    with pytest.raises(CheckpointMismatchError, match=r"step 2.*'emb' and 'head'.*memory"):
        ckpt.load({"emb": shared, "head": shared}, step=2)


def test_target_tensors_that_share_part_of_their_memory_load_only_data_they_agree_on(
        ckpt: CheckpointEngine) -> None:
    """Two target entries that are different views of one memory (one a slice of the other, a
    transpose) are tied too: a step that holds the same data for the shared elements loads
    (the elements only one of them holds filled too); one that holds different data is a
    mismatch. Only views that were the very same tensor were caught: the reads of both landed
    in the shared elements, and the load succeeded with whichever landed last, so one target
    silently held other values than the step."""
    whole, tail, weight = torch.arange(12.0), torch.arange(100.0, 106.0), torch.randn(3, 4)
    ckpt.save(1, {"a": whole, "b": whole[6:], "w": weight, "w_t": weight.t()}, blocking=True)
    ckpt.save(2, {"a": whole, "b": tail, "w": weight, "w_t": weight.t()}, blocking=True)
    buffer, matrix = torch.zeros(12), torch.zeros(3, 4)
    target = {"a": buffer[:], "b": buffer[6:], "w": matrix, "w_t": matrix.t()}
    assert ckpt.load(target, step=1) == 1
    assert torch.equal(buffer, whole) and torch.equal(matrix, weight)
    halves = torch.zeros(3, 4)  # strides interleave, no element shared: both load
    ckpt.save(3, {"even": weight[:, 0::2], "odd": weight[:, 1::2]}, blocking=True)
    assert ckpt.load({"even": halves[:, 0::2], "odd": halves[:, 1::2]}, step=3) == 3
    assert torch.equal(halves, weight)
    for _ in range(5):  # which read lands last was down to the threads
        with pytest.raises(CheckpointMismatchError, match=r"step 2.*'a' and 'b'.*memory"):
            ckpt.load({"a": buffer[:], "b": buffer[6:]}, step=2)


def test_load_of_a_subset_of_the_checkpoint(ckpt: CheckpointEngine) -> None:
    state = {"model": {"w": torch.randn(3), "b": torch.randn(2)}, "step": 4}
    ckpt.save(4, state, blocking=True)
    target = {"model": {"w": torch.empty(3)}}
    assert ckpt.load(target) == 4
    assert torch.equal(target["model"]["w"], state["model"]["w"])


# -- user errors -----------------------------------------------------------------------------


def _nested(leaf: Any, depth: int) -> Any:
    for _ in range(depth):
        leaf = {"k": leaf}
    return leaf


@pytest.mark.parametrize(
    ("state", "named"),
    [
        ({"w": torch.ones(2), "extra": {"tags": {1, 2}}}, "'extra/tags'.*set"),
        ({"w": torch.ones(2), "hook": lambda: None}, "hook"),
        ({"model": {"a/b": torch.ones(2)}}, "a/b"),
        ({"model": {"..": torch.ones(2)}}, r"'\.\.'"),
        ({"model": {".hidden": torch.ones(2)}}, r"\.hidden"),
        ({"model": {("tuple", "key"): torch.ones(2)}}, "tuple"),
        ({"model": {"w": torch.empty(4, device="meta")}}, "'model/w'.*meta device"),
        ({"model": {"w": torch.eye(3).to_sparse()}}, "'model/w'.*sparse_coo"),
        ({"model": {"w": torch.nested.as_nested_tensor([torch.ones(2), torch.ones(3)],
                                                       layout=torch.jagged)}},
         "'model/w'.*nested"),
        ({"model": {"w": torch.ones(2)}, "deep": _nested({"w": torch.ones(1)}, 600)},
         r"'deep'.*nested too deeply"),
        ({"model": {"w": torch.ones(2)}, "deep": _nested(1, 600)}, r"'deep'.*nested too deeply"),
        # past the recursion limit: the look for modules ran out of stack first, naming no key
        ({"model": {"w": torch.ones(2)}, "deep": _nested(1, 1500)},
         r"'deep.*nested too deeply"),
        ({"model": {"w": torch.ones(2)}, "seed": 10**5000}, r"'seed'.*int.*4300 digits"),
        ({"model": {"w": torch.ones(2), "seeds": (torch.ones(1), -(10**5000))}},
         r"'model/seeds/1'.*int.*4300 digits"),
        ({"model": {10**5000: torch.ones(2)}},
         r"state path 'model': an int key of 16610 bits.*4300 digits"),
        # inside a value that holds no tensor: named by its own path, not the value's
        ({"w": torch.ones(2), "train": {"step": 3, "metrics": {"loss": np.float32(1.5)}}},
         r"state path 'train/metrics/loss': numpy.float32 is neither"),
        ({"w": torch.ones(2), "rng": np.random.get_state()},
         r"state path 'rng/1': numpy.ndarray is neither"),
        ({"w": torch.ones(2), "cfg": {"by_seed": {10**5000: 1}}},
         r"state path 'cfg/by_seed': an int key of 16610 bits.*4300 digits"),
    ],
    ids=["set", "lambda", "slash-key", "dotdot-key", "hidden-key", "tuple-key", "meta",
         "sparse", "nested", "deep-tensors", "deep-json", "deeper-than-the-recursion-limit",
         "huge-int", "huge-int-in-tuple",
         "huge-int-key", "numpy-scalar-in-a-value", "numpy-array-in-a-value",
         "huge-int-key-in-a-value"],
)
def test_invalid_state_is_refused_naming_the_path(
    tmp_path: Any, state: dict[str, Any], named: str
) -> None:
    """Refused by ``save`` itself, before any storage is touched (so one backend suffices)."""
    with CheckpointEngine(str(tmp_path / "ckpt")) as engine:
        with pytest.raises(CheckpointError, match=named):
            engine.save(1, state)
        assert engine.steps() == []
        engine.save(1, {"w": torch.ones(2)}, blocking=True)
        assert engine.steps() == [1]


def _cyclic(kind: str) -> dict[str, Any]:
    model: dict[str, Any] = {"w": torch.ones(2)}
    if kind == "dict":
        model["parent"] = {"up": model}
    elif kind == "list":
        model["layers"] = [torch.zeros(1), model]
    else:
        model["pair"] = (torch.zeros(1), [model])
    return {"model": model}


@pytest.mark.parametrize("kind", ["dict", "list", "tuple"])
def test_a_state_that_holds_itself_is_refused_naming_where(tmp_path: Any, kind: str) -> None:
    """A container inside itself (a config holding its parent, say) was walked until Python's
    recursion limit: 'step 1 not saved: RecursionError: maximum recursion depth exceeded',
    naming no key."""
    where = {"dict": "model/parent/up", "list": "model/layers/1", "tuple": "model/pair/1/0"}
    with CheckpointEngine(str(tmp_path / "ckpt")) as engine:
        with pytest.raises(CheckpointError, match=rf"state path '{where[kind]}': .*inside "
                                                  "itself"):
            engine.save(1, _cyclic(kind))
        assert engine.steps() == []


@pytest.mark.timeout(60)
def test_a_value_without_tensors_that_holds_itself_is_refused(tmp_path: Any) -> None:
    """A JSON value inside itself (a config list holding itself) was refused as "Circular
    reference detected"; looking for the innermost entry JSON refused, save() then followed
    the cycle for ever (the path growing without end) and never returned."""
    looped: list[Any] = [1]
    looped.append(looped)
    with CheckpointEngine(str(tmp_path / "ckpt")) as engine:
        with pytest.raises(CheckpointError, match=r"state path 'cfg/layers/1': list .*"
                                                  "Circular reference"):
            engine.save(1, {"w": torch.ones(2), "cfg": {"layers": looped}})
        assert engine.steps() == []


class _Holder:
    """A Stateful whose state_dict() is one value, not a dict."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def state_dict(self) -> Any:
        return self.value

    def load_state_dict(self, state_dict: Any) -> None:
        self.value = state_dict


@pytest.mark.parametrize("value", [torch.ones(2), b"abc"], ids=["tensor", "bytes"])
def test_a_whole_state_whose_state_dict_is_one_tensor_is_refused_by_the_save(
        tmp_path: Any, value: Any) -> None:
    """A Stateful given as the whole state whose state_dict() returned a tensor (or bytes) was
    saved under an empty name (the object '/c.0') and committed: a step that every load then
    refused as hostile, after the save had said it succeeded."""
    with CheckpointEngine(str(tmp_path / "ckpt")) as engine:
        with pytest.raises(CheckpointError, match=r"_Holder\.state_dict\(\) returned "
                                                  f"{type(value).__name__}"):
            engine.save(1, _Holder(value), blocking=True)
        assert engine.steps() == []
        engine.save(1, {"h": _Holder(value)}, blocking=True)  # one entry of the state: fine
        target = {"h": _Holder(torch.zeros(2) if isinstance(value, torch.Tensor) else b"")}
        assert engine.load(target) == 1
        loaded = target["h"].value
        assert torch.equal(loaded, value) if isinstance(value, torch.Tensor) else loaded == value


def test_a_tensor_that_becomes_unsupported_between_saves_is_refused(tmp_path: Any) -> None:
    """The inventory is reused while paths, dtypes and shapes stay the same: a tensor that
    became a meta or sparse one of the same shape skipped the check and failed in staging with
    a bare NotImplementedError."""
    with CheckpointEngine(str(tmp_path / "ckpt")) as engine:
        engine.save(1, {"model": {"w": torch.eye(3)}}, blocking=True)
        for changed, named in ((torch.empty(3, 3, device="meta"), "'model/w'.*meta device"),
                               (torch.eye(3).to_sparse(), "'model/w'.*sparse_coo")):
            with pytest.raises(CheckpointError, match=named):
                engine.save(2, {"model": {"w": changed}}, blocking=True)
        assert engine.steps() == [1]


def _freed(tensor: torch.Tensor) -> torch.Tensor:
    tensor.untyped_storage().resize_(0)  # as FSDP frees the storage of a resharded parameter
    return tensor


def test_a_tensor_whose_storage_was_freed_is_refused_naming_its_path(tmp_path: Any) -> None:
    """A tensor whose memory was freed under it (its storage resized to 0) still has its shape:
    the save (at the first save, or at a later one reusing the inventory) and a load into it
    read or wrote memory that was not there, and the process died of a segmentation fault."""
    with CheckpointEngine(str(tmp_path / "ckpt")) as engine:
        with pytest.raises(CheckpointError, match=r"'model/w'.*storage"):
            engine.save(1, {"model": {"w": _freed(torch.ones(64, 64))}}, blocking=True)
        engine.save(1, {"model": {"w": torch.ones(64, 64)}}, blocking=True)
        with pytest.raises(CheckpointError, match=r"'model/w'.*storage"):
            engine.save(2, {"model": {"w": _freed(torch.ones(64, 64))}}, blocking=True)
        with pytest.raises(CheckpointError, match=r"'model/w'.*storage"):
            engine.load({"model": {"w": _freed(torch.ones(64, 64))}})
        assert engine.steps() == [1]


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_a_nested_tensor_of_the_default_layout_is_refused_naming_its_path(tmp_path: Any) -> None:
    """``torch.nested.nested_tensor()`` makes a strided-layout nested tensor by default, whose
    ``shape`` raises: the save failed with 'RuntimeError: Internal error: NestedTensorImpl
    doesn't support sizes', naming no key (the jagged layout was refused by path)."""
    def nested() -> torch.Tensor:
        return torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])

    with CheckpointEngine(str(tmp_path / "ckpt")) as engine:
        with pytest.raises(CheckpointError, match=r"'model/w'.*nested"):
            engine.save(1, {"model": {"w": nested()}}, blocking=True)
        engine.save(1, {"model": {"w": torch.ones(2)}}, blocking=True)
        with pytest.raises(CheckpointError, match=r"'model/w'.*nested"):
            engine.save(2, {"model": {"w": nested()}}, blocking=True)
        assert engine.steps() == [1]


@pytest.mark.parametrize(
    ("metadata", "named"),
    [
        ({"when": datetime.datetime(2024, 1, 1)}, r"metadata\['when'\].*datetime"),
        ({"loss": np.float32(1.5)}, r"metadata\['loss'\].*float32"),
        ({"run": {"loss": torch.tensor(1.5)}}, r"metadata\['run'\]\['loss'\].*Tensor"),
        ({1: "a"}, r"metadata: key 1 \(int\)"),
        ({"ranks": [{2: "b"}]}, r"metadata\['ranks'\]\[0\]: key 2 \(int\)"),
        ({"loss": math.nan}, r"metadata\['loss'\]: nan is not JSON"),
        ({"best": [1.0, -math.inf]}, r"metadata\['best'\]\[1\]: -inf is not JSON"),
    ],
    ids=["datetime", "numpy-scalar", "tensor", "int-key", "nested-int-key", "nan", "infinity"],
)
def test_metadata_that_json_cannot_store_is_refused_by_the_call(
    tmp_path: Path, metadata: dict[Any, Any], named: str
) -> None:
    """Refused by ``save`` itself, like a state value that cannot be stored: no data written,
    no step folder left, an int key not silently turned into a str."""
    with CheckpointEngine(str(tmp_path / "ckpt")) as engine:
        with pytest.raises(CheckpointError, match=named):
            engine.save(1, {"w": torch.ones(2)}, metadata=metadata)
        assert engine.steps() == [] and not (tmp_path / "ckpt" / "step_000000001").exists()
        engine.save(1, {"w": torch.ones(2)}, blocking=True, metadata={"ok": [1, None, 0.5]})
        assert engine.steps() == [1]


def test_metadata_mutated_after_save_returns_is_committed_as_it_was(tmp_path: Path) -> None:
    """``save`` returns once the state may be mutated: the metadata dict too (a training loop
    reuses its dict), although the coordinator writes it only when it commits."""
    metadata = {"step": 1, "loss": 0.5, "tags": ["a"]}
    with CheckpointEngine(str(tmp_path)) as engine:
        storage = gate(engine)
        handle = engine.save(1, {"w": torch.ones(2)}, metadata=metadata)
        handle.staged.wait()
        metadata["step"], metadata["loss"] = 2, 0.25
        metadata["tags"].append("b")  # type: ignore[attr-defined]
        storage.release.set()
        handle.wait()
    group = json.loads((tmp_path / "step_000000001" / "zarr.json").read_text())
    assert group["attributes"]["antifragile"]["metadata"] == {
        "step": 1, "loss": 0.5, "tags": ["a"]}


class _CommitsFirst:
    """Another job commits the same step while this save is finishing: its COMMIT appears
    just before this coordinator writes the group metadata."""

    def __init__(self, inner: Any, foreign: bytes) -> None:
        self.inner, self.foreign = inner, foreign

    def write(self, key: str, parts: Sequence[Any], **kwargs: Any) -> None:
        if key == "step_000000005/zarr.json":
            self.inner.write("step_000000005/COMMIT", [self.foreign], durable=True)
        self.inner.write(key, parts, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_commit_never_overwrites_another_saves_commit(tmp_path: Any) -> None:
    """Two jobs at one URL: the save that comes second fails instead of replacing the first
    one's COMMIT (which would silently drop a committed checkpoint)."""
    other = str(tmp_path / "other")
    with CheckpointEngine(other) as engine:
        engine.save(5, {"w": torch.ones(3)}, blocking=True)
    foreign = (tmp_path / "other" / "step_000000005" / "COMMIT").read_bytes()
    with CheckpointEngine(str(tmp_path / "ckpt")) as engine:
        engine.storage.inner = _CommitsFirst(engine.storage.inner, foreign)
        with pytest.raises(CheckpointCommittedError, match=r"step 5.*committed by another save"):
            engine.save(5, {"w": torch.zeros(3)}, blocking=True)
    assert (tmp_path / "ckpt" / "step_000000005" / "COMMIT").read_bytes() == foreign


@pytest.mark.parametrize("step", [-1, "7", 2.0, True, None, 2**62, 2**63])
def test_a_step_that_is_not_a_non_negative_int_is_refused_by_the_call(
        ckpt: CheckpointEngine, step: Any) -> None:
    """A bad step is the caller's mistake: ``save``/``load`` raise at once, naming it; no
    background save starts (it used to fail in the save thread, whose log line then crashed
    formatting a str step with %d). Steps travel in the ranks' int64 all-reduces, negated
    too: 2**63 was saved alone, and overflowed torch's int64 (not a CheckpointError) with a
    process group."""
    with pytest.raises(CheckpointError, match=r"step must be (a non-negative int|< 2\*\*62)"):
        ckpt.save(step, {"w": torch.zeros(2)})
    if step is not None:
        with pytest.raises(CheckpointError,
                           match=r"step must be (a non-negative int|< 2\*\*62)"):
            ckpt.load({"w": torch.zeros(2)}, step=step)
    assert ckpt.steps() == []


@pytest.mark.parametrize("options", [
    {"keep_last": 2.5}, {"keep_last": "3"}, {"keep_last": True}, {"keep_last": 0},
    {"commit_timeout_s": float("nan")}, {"commit_timeout_s": -1.0}, {"commit_timeout_s": 0},
    {"commit_timeout_s": "600"}, {"commit_timeout_s": 1e10}], ids=str)
def test_a_keep_last_or_commit_timeout_that_cannot_be_one_is_refused(
        tmp_path: Path, options: dict[str, Any]) -> None:
    """keep_last=2.5 was taken, and every retention after it failed (slicing by a float),
    so no step was ever deleted; keep_last='3' raised TypeError; a commit_timeout_s of nan
    made a save that cannot commit wait forever, a negative one fail at its first poll, and
    one past threading.TIMEOUT_MAX (9.2e9 s) fail every save (OverflowError in a lock wait)."""
    name = next(iter(options))
    with pytest.raises(CheckpointError, match=name):
        CheckpointEngine(str(tmp_path / "ckpt"), **options)


@pytest.mark.parametrize("io_threads", [0, -1, 2.5, "4", True], ids=repr)
def test_an_io_threads_that_cannot_be_a_thread_count_is_refused(
        tmp_path: Path, io_threads: Any) -> None:
    """io_threads=0 was taken: the I/O pool never started a thread, so a load waited forever
    and every save failed after commit_timeout_s (600 s) saying "the storage does not
    answer"; io_threads='4' failed every save with a TypeError from the pool."""
    with pytest.raises(CheckpointError, match="io_threads"):
        CheckpointEngine(str(tmp_path / "ckpt"), io_threads=io_threads)


@pytest.mark.parametrize(("option", "value", "says"), [
    ("plan_options", {"max_object_bytes": 2**20}, "plan_options must be a PlanOptions or None, "
     "got dict"),
    ("plan_options", "x", "plan_options must be a PlanOptions or None, got str"),
    ("on_phase", 5, "on_phase must be a callable (step, phase) or None, got int"),
])
def test_a_plan_options_or_on_phase_of_the_wrong_kind_is_refused(
        tmp_path: Path, option: str, value: Any, says: str) -> None:
    """Each was taken; then every save failed: plan_options with an AttributeError traceback
    from the planner ('dict' object has no attribute 'max_cells_per_box'), on_phase with a
    save error naming no option ("TypeError: 'int' object is not callable")."""
    with pytest.raises(CheckpointError) as exc:
        CheckpointEngine(str(tmp_path / "ckpt"), **{option: value})
    assert str(exc.value) == says


def test_one_io_thread_saves_and_loads(tmp_path: Path) -> None:
    with CheckpointEngine(str(tmp_path / "ckpt"), io_threads=1) as ckpt:
        ckpt.save(1, {"w": torch.arange(4.0), "v": torch.ones(3)}).wait()
        target = {"w": torch.zeros(4), "v": torch.zeros(3)}
        assert ckpt.load(target) == 1
    assert torch.equal(target["w"], torch.arange(4.0)) and torch.equal(target["v"], torch.ones(3))


@pytest.mark.parametrize("local", [True, False])
@pytest.mark.parametrize("options", ["endpoint_url", [], 0, [("endpoint_url", "http://h:1")]])
def test_storage_options_that_are_no_mapping_are_refused(tmp_path: Path, local: bool,
                                                         options: Any) -> None:
    """As on S3: a local or fsspec URL took an empty list or 0 as no options without a word,
    and a text was refused as the options "(e, n, d, ...)" (its letters)."""
    url = str(tmp_path / "ckpt") if local else "memory://ckpt"
    with pytest.raises(CheckpointError) as exc:
        CheckpointEngine(url, storage_options=options)
    assert str(exc.value) == (f"cannot open {url}: storage_options must be a mapping, not a "
                              f"{type(options).__name__}")


def test_a_local_url_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match="is a file, not a checkpoint folder"):
        CheckpointEngine(str(tmp_path / "notes.txt"))


@pytest.mark.parametrize(("url", "says"), [
    ("notes.txt/ckpt", "notes.txt is a file, not a folder"),
    ("notes.txt/deeper/ckpt", "notes.txt is a file, not a folder"),
    ("gone", "gone is a link to nowhere, which does not exist"),
    ("gone/ckpt", "gone is a link to nowhere, which does not exist"),
])
def test_a_local_url_under_a_file_or_a_link_to_nothing_is_refused(
        tmp_path: Path, url: str, says: str) -> None:
    """A folder under a file (or a link whose target is missing: a disk not mounted) can never
    be made: it was accepted, ``steps()`` said [] and ``load`` "no committed checkpoint" (a
    trainer then started from scratch), and every save failed."""
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "gone").symlink_to("nowhere")
    with pytest.raises(CheckpointError, match=re.escape(says)):
        CheckpointEngine(str(tmp_path / url))


@pytest.mark.parametrize("prefix", ["", "file://"])
def test_storage_options_for_a_local_url_are_refused(tmp_path: Path, prefix: str) -> None:
    """A local folder takes no storage options: they were ignored without a word (an
    ``endpoint_url`` meant for S3, with the ``s3://`` forgotten, saved to a local folder). The
    CLI refuses ``--storage-option`` for a local path; the engine refuses them too."""
    url = f"{prefix}{tmp_path / 'ckpt'}"
    with pytest.raises(CheckpointError, match="endpoint_url") as refused:
        CheckpointEngine(url, storage_options={"endpoint_url": "http://127.0.0.1:9"})
    assert url in str(refused.value)
    assert not (tmp_path / "ckpt").exists()
    with CheckpointEngine(url, storage_options={}) as ckpt:  # no options: nothing ignored
        assert ckpt.steps() == []


def test_a_closed_engine_refuses_every_call_that_needs_its_threads(tmp_path: Path) -> None:
    """After ``close()`` its I/O pool is shut down: ``verify`` raised the pool's
    ``RuntimeError: cannot schedule new futures after shutdown``, not a CheckpointError."""
    engine = CheckpointEngine(str(tmp_path))
    engine.save(1, {"w": torch.ones(4)}, blocking=True)
    engine.close()
    engine.close()  # twice: nothing more to do
    calls: dict[str, Callable[[], object]] = {
        "save": lambda: engine.save(2, {"w": torch.ones(4)}),
        "load": lambda: engine.load({"w": torch.zeros(4)}),
        "read": lambda: engine.read(1),
        "verify": lambda: engine.verify(1),
    }
    for name, call in calls.items():
        with pytest.raises(CheckpointError, match="the engine is closed"):
            call()
            pytest.fail(f"{name} after close")
    assert engine.steps() == [1]  # a listing needs no thread


def test_a_resave_whose_check_raises_waits_for_its_other_checks_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One of a re-save's checks raising (not a CheckpointError) must not end the save while
    another still runs: that one goes on to finish its cell (CRC slots written into the shared
    staging arena) after the save has failed and the next save began staging into the arena.
    The check that raises comes first, so the results read in order reach it first."""
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from antifragile.engine import _resave

    release, raised = threading.Event(), threading.Event()
    finished: list[int] = []

    class Staging:
        writes = [SimpleNamespace(key="w/c/0"), SimpleNamespace(key="w/c/1")]

        def wait_staged(self, index: int | None = None) -> None:
            if index == 1 and not release.wait(10):
                raise AssertionError("never released")

        def finish(self, index: int) -> tuple[bytes, list[int]]:
            finished.append(index)
            return b"", []

    class Reader:
        commit = {"plan_id": "p", "nonce": 1}
        values: dict[str, Any] = {}
        values_by_rank: dict[str, Any] = {}
        manifest = SimpleNamespace(crcs={"w/c/0": [], "w/c/1": []})

        def __init__(self, storage: Any, step: int) -> None:
            pass

        def read_object(self, key: str) -> bytes:
            if key == "w/c/0":
                raised.set()
                raise OSError("connection reset")
            return b""

    monkeypatch.setattr(_resave, "StepReader", Reader)
    outcome: list[BaseException] = []

    def resave() -> None:
        try:
            _resave.same_as_committed(None, 2, 0, SimpleNamespace(plan_id="p"),  # type: ignore[arg-type]
                                      Staging(), {}, {}, pool)  # type: ignore[arg-type]
        except BaseException as exc:
            outcome.append(exc)

    with ThreadPoolExecutor(2) as pool:
        thread = threading.Thread(target=resave)
        thread.start()
        assert raised.wait(10)
        thread.join(0.5)
        still_running = thread.is_alive()
        release.set()
        thread.join(10)
    assert still_running, "the re-save ended while one of its checks still ran"
    assert sorted(finished) == [0, 1]
    assert len(outcome) == 1 and isinstance(outcome[0], OSError)


def _resave_rank_1_blind_to_the_commit(url: str) -> tuple[list[str], bool]:
    """On each of 2 ranks: step 1 of a row-sharded tensor, committed; then step 1 again with
    rank 1's rows changed and rank 1 not seeing the COMMIT yet (a lagging listing or cache).
    Returns the retry's outcome and whether the committed step still loads its first rows."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    first = torch.arange(32.0).reshape(8, 4)
    outcomes = []
    with CheckpointEngine(url) as engine:
        engine.save(1, {"w": distribute_tensor(first, mesh, [Shard(0)])}, blocking=True)
        if engine.rank == 1:
            inner = engine.storage.exists
            engine.storage.exists = lambda key: False if key.endswith("COMMIT") else inner(key)
        changed = distribute_tensor(first + 100, mesh, [Shard(0)])
        try:
            engine.save(1, {"w": changed}, blocking=True)
            outcomes.append("committed")
        except CheckpointError as exc:
            outcomes.append(f"failed: {type(exc).__name__}")
        target = {"w": distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)])}
        if engine.rank == 1:
            engine.storage.exists = inner
        try:
            engine.load(target, step=1)
            intact = torch.equal(target["w"].full_tensor(), first)
        except CheckpointError:
            intact = False
    return outcomes, intact


@pytest.mark.multiproc
def test_a_resave_that_one_rank_judges_alone_neither_diverges_nor_overwrites(
        tmp_path: Path) -> None:
    """Whether a save's step is already committed was judged by each rank on its own: a rank
    that did not see the COMMIT wrote its changed rows into the committed step while the
    other accepted the save. Every rank must refuse together, the committed step intact."""
    from _dist import run_ranks

    rank0, rank1 = run_ranks(2, _resave_rank_1_blind_to_the_commit, str(tmp_path / "c"),
                             timeout_s=90)
    assert rank0 == rank1 == (["failed: CheckpointCommittedError"], True), (rank0, rank1)
