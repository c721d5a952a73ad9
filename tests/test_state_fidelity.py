"""What other trainers hand the engine round-trips exactly, in one process.

``Stateful`` objects without tensors (a TrainState, an LR scheduler, a data loader) are restored
into the caller's own object; a model and an optimizer may be passed as objects, and a
never-stepped optimizer resumes; a target emptier than the checkpoint (a fresh optimizer's
``state_dict()``) is rebuilt from what was saved, with the saved key types; ``bytes`` are stored
as raw bytes; JSON values come back with their types (tuples, int keys). Bits are compared as
bytes (``tensor.view(torch.uint8)``), never with ``==`` on floats.
"""

from __future__ import annotations

import copy
import enum
import json
import math
from collections import OrderedDict, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
import zarr
from torch import nn

from antifragile.engine import CheckpointEngine, CheckpointError, CheckpointMismatchError


@pytest.fixture
def ckpt(tmp_path: Path) -> Iterator[CheckpointEngine]:
    with CheckpointEngine(str(tmp_path / "ckpt"), keep_last=None) as engine:
        yield engine


def bits(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def assert_bitwise(actual: Any, expected: Any, path: str = "") -> None:
    """Same structure, same container and key types, tensors bit for bit, JSON by type."""
    assert type(actual) is type(expected), f"{path}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        assert bits(actual) == bits(expected), path
    elif isinstance(expected, dict):  # key order of a rebuilt dict is sorted, not as saved
        assert set(actual) == set(expected), f"{path}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_bitwise(actual[key], expected[key], f"{path}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), path
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_bitwise(a, e, f"{path}/{i}")
    elif isinstance(expected, float):
        assert np.float64(actual).tobytes() == np.float64(expected).tobytes(), path
    else:
        assert actual == expected, path


class TrainState:
    """torchtitan's TrainState: counters only, no tensor."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0
        self.losses: list[float] = []

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen, "losses": self.losses}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"]
        self.losses = list(state_dict["losses"])


def model_and_optim(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95))


def train_step(model: nn.Module, optim: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 4, generator=gen), torch.randn(16, 2, generator=gen)
    optim.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    optim.step()


def assert_same_training(a: tuple[nn.Module, torch.optim.Optimizer],
                         b: tuple[nn.Module, torch.optim.Optimizer]) -> None:
    """Same parameters and optimizer state (bits, types) now and after one more equal step."""
    for more in range(2):
        assert_bitwise(dict(b[0].state_dict()), dict(a[0].state_dict()))
        assert_bitwise(b[1].state_dict(), a[1].state_dict())
        if more == 0:
            train_step(*a, seed=99)
            train_step(*b, seed=99)


# -- item 7: Stateful objects without tensors -------------------------------------------------


def test_stateful_without_tensors_is_restored_into_the_callers_object(
    ckpt: CheckpointEngine,
) -> None:
    model, optim = model_and_optim(0)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    train = TrainState()
    for seed in range(3):
        train_step(model, optim, seed)
        sched.step()
        train.step += 1
        train.ntokens_seen += 64
        train.losses.append(0.25 * seed)
    ckpt.save(3, {"model": model.state_dict(), "train": train, "sched": sched}, blocking=True)

    model2, optim2 = model_and_optim(1)
    sched2 = torch.optim.lr_scheduler.StepLR(optim2, step_size=2, gamma=0.5)
    train2 = TrainState()
    state = {"model": model2.state_dict(), "train": train2, "sched": sched2}
    assert ckpt.load(state) == 3
    assert state["train"] is train2 and state["sched"] is sched2, "the caller's object replaced"
    assert (train2.step, train2.ntokens_seen, train2.losses) == (3, 192, [0.0, 0.25, 0.5])
    assert_bitwise(sched2.state_dict(), sched.state_dict())


def test_a_state_of_statefuls_without_any_tensor(ckpt: CheckpointEngine) -> None:
    train = TrainState()
    train.step = 41
    ckpt.save(41, {"train": train}, blocking=True)
    train2 = TrainState()
    assert ckpt.load({"train": train2}) == 41
    assert train2.step == 41


# -- item 8: model and optimizer objects, a never-stepped optimizer, emptier targets ----------


def test_fresh_optimizer_resumes_from_its_plain_state_dict(ckpt: CheckpointEngine) -> None:
    source = model_and_optim(0)
    for seed in range(2):
        train_step(*source, seed)
    ckpt.save(2, {"model": source[0].state_dict(), "optim": source[1].state_dict()},
              blocking=True)

    target = model_and_optim(1)  # built fresh: the optimizer has no state yet
    state = {"model": target[0].state_dict(), "optim": target[1].state_dict()}
    assert state["optim"]["state"] == {}
    assert ckpt.load(state) == 2
    target[1].load_state_dict(state["optim"])
    assert_same_training(source, target)


def test_model_and_optimizer_objects_resume_a_fresh_build(ckpt: CheckpointEngine) -> None:
    source = model_and_optim(0)
    sched = torch.optim.lr_scheduler.LambdaLR(source[1], lambda s: 1.0 / (1 + s))
    for seed in range(3):
        train_step(*source, seed)
        sched.step()
    ckpt.save(3, {"model": source[0], "optim": source[1], "sched": sched, "step": 3},
              blocking=True)

    target = model_and_optim(1)
    sched2 = torch.optim.lr_scheduler.LambdaLR(target[1], lambda s: 1.0 / (1 + s))
    state = {"model": target[0], "optim": target[1], "sched": sched2, "step": 0}
    assert ckpt.load(state) == 3
    assert state["model"] is target[0] and state["optim"] is target[1]
    assert state["step"] == 3
    assert_bitwise(sched2.state_dict(), sched.state_dict())
    assert_same_training(source, target)


class TwoHeads(nn.Module):
    """``unused`` never gets a gradient, so a stepped optimizer holds no state for it."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def test_optimizer_state_is_exactly_what_was_saved(ckpt: CheckpointEngine) -> None:
    torch.manual_seed(0)
    model = TwoHeads()
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    ckpt.save(0, {"model": model, "optim": optim}, blocking=True)
    assert not optim.state, "saving initialized the caller's optimizer"
    optim.zero_grad()
    model(torch.ones(3, 4)).sum().backward()
    optim.step()
    ckpt.save(1, {"model": model, "optim": optim}, blocking=True)

    torch.manual_seed(1)
    model2 = TwoHeads()
    optim2 = torch.optim.Adam(model2.parameters(), lr=0.1)
    ckpt.load({"model": model2, "optim": optim2}, step=1)
    assert set(optim2.state) == {model2.used.weight, model2.used.bias}
    assert_bitwise(optim2.state_dict(), optim.state_dict())
    ckpt.load({"model": model2, "optim": optim2}, step=0)  # a never-stepped optimizer
    assert not optim2.state
    assert_bitwise(optim2.state_dict()["param_groups"], optim.state_dict()["param_groups"])


def test_objects_are_stored_by_parameter_name(ckpt: CheckpointEngine) -> None:
    """Keyed by fully qualified names (torch's distributed state-dict helpers), so a
    checkpoint of the objects loads into the ``state_dict()`` of a plain model too."""
    source = model_and_optim(0)
    train_step(*source, seed=0)
    ckpt.save(1, {"model": source[0], "optim": source[1]}, blocking=True)
    stored = ckpt.read(1)
    assert "optim/state.0.weight.exp_avg" in stored
    assert "optim/param_groups.2.bias.lr" in stored
    model2, _ = model_and_optim(1)
    state = {"model": model2.state_dict()}
    ckpt.load(state)
    assert_bitwise(dict(model2.state_dict()), dict(source[0].state_dict()))


def test_an_optimizer_without_its_model_is_refused_naming_the_path(
    ckpt: CheckpointEngine,
) -> None:
    _, optim = model_and_optim(0)
    with pytest.raises(CheckpointError, match=r"'optim'.*model"):
        ckpt.save(1, {"w": torch.ones(2), "optim": optim})


def test_emptier_target_is_rebuilt_with_saved_key_and_container_types(
    ckpt: CheckpointEngine,
) -> None:
    saved = {
        "w": torch.arange(4.0),
        "by_id": {0: {"m": torch.ones(2), "n": 3}, 7: {"m": torch.zeros(1), "n": 4}},
        "pair": (torch.tensor([1, 2]), "x"),
        "items": [torch.tensor(5), {"k": (1, 2.5)}],
    }
    expected = copy.deepcopy(saved)
    ckpt.save(1, saved, blocking=True)
    target: dict[str, Any] = {"w": torch.empty(4), "by_id": {}, "pair": None, "items": []}
    ckpt.load(target)
    assert_bitwise(target, expected)


def test_a_target_names_what_is_filled(ckpt: CheckpointEngine) -> None:
    """A target entry holding tensors is filled entry by entry (a subset loads, a saved entry
    it does not name is not added); an entry holding no tensor takes what was saved there."""
    ckpt.save(1, {"m": {"a": torch.ones(2), "b": torch.ones(3)}, "v": {"x": 1, "y": 2},
                  "o": {"state": {0: {"t": torch.ones(1)}}, "groups": [{"lr": 0.5}]}},
              blocking=True)
    target: dict[str, Any] = {"m": {"a": torch.empty(2)}, "v": {"x": 0}, "o": {"state": {}}}
    ckpt.load(target)
    assert set(target["m"]) == {"a"} and torch.equal(target["m"]["a"], torch.ones(2))
    assert target["v"] == {"x": 1, "y": 2}
    assert_bitwise(target["o"], {"state": {0: {"t": torch.ones(1)}}, "groups": [{"lr": 0.5}]})


def test_a_target_entry_the_checkpoint_lacks_still_raises(ckpt: CheckpointEngine) -> None:
    ckpt.save(1, {"w": torch.ones(2), "step": 1}, blocking=True)
    with pytest.raises(CheckpointMismatchError, match=r"step 1.*'sched'"):
        ckpt.load({"w": torch.empty(2), "sched": {}}, step=1)


# -- JSON values come back with their types ---------------------------------------------------


def test_json_values_keep_tuples_and_int_keys(ckpt: CheckpointEngine) -> None:
    saved = {"w": torch.ones(1), "cfg": {"betas": (0.9, 0.95), "by_layer": {0: "a", 12: [1]},
                                         "nested": [(1, (2, 3)), {"k": {3: None}}]}}
    expected = copy.deepcopy(saved)
    ckpt.save(1, saved, blocking=True)
    target = {"w": torch.empty(1), "cfg": None}
    ckpt.load(target)
    assert_bitwise(target, expected)


def test_json_floats_keep_their_bits(ckpt: CheckpointEngine) -> None:
    """JSON writes every NaN as ``NaN``: a loss of ``inf - inf`` (a NaN with its sign bit set,
    as x86 makes it) or a NaN with a payload came back as the positive quiet NaN."""
    def float_of(bits: int) -> float:
        return float(np.array(bits, dtype=np.uint64).view(np.float64))

    negative_nan, payload_nan = float_of(0xFFF8000000000000), float_of(0x7FF8000000000123)
    saved = {"w": torch.ones(1), "loss": negative_nan, "metrics": {
        "nans": [payload_nan, float("nan"), -0.0, float("inf")], "pair": (1, negative_nan)}}
    expected = copy.deepcopy(saved)
    ckpt.save(1, saved, blocking=True)
    target: dict[str, Any] = {"w": torch.empty(1), "loss": 0.0, "metrics": None}
    ckpt.load(target)
    assert_bitwise(target, expected)


class Split(str, enum.Enum):  # noqa: UP042 (what older code has: str() differs from JSON)
    """A str mixin Enum: ``str()`` gives ``Split.TRAIN``, JSON writes ``train``."""

    TRAIN = "train"


class Rank(enum.IntEnum):
    LEAD = 7

    def __str__(self) -> str:
        return self.name


def test_json_values_keep_tuples_and_int_keys_under_keys_of_str_and_int_subclasses(
        ckpt: CheckpointEngine) -> None:
    """The type record named a child by ``str(key)``, JSON by its text: a tuple under a
    ``(str, Enum)`` key came back a list, an int key whose ``str()`` is its name a str."""
    ckpt.save(1, {"w": torch.ones(1), "cfg": {Split.TRAIN: (1, 2), Rank.LEAD: {Rank.LEAD: 0}}},
              blocking=True)
    target: dict[str, Any] = {"w": torch.empty(1), "cfg": None}
    ckpt.load(target)
    assert_bitwise(target["cfg"], {"train": (1, 2), 7: {7: 0}})


def test_json_values_keep_their_dict_order(ckpt: CheckpointEngine) -> None:
    # a loader resuming by iterating a dict of shard -> rows left; it came back sorted
    remaining = {"shard_c": 3, "shard_a": 5, "shard_b": 1, 10: 0, 2: 1}
    ckpt.save(1, {"w": torch.ones(2), "loader": {"w": torch.ones(1), "remaining": remaining}},
              blocking=True)
    target: dict[str, Any] = {"w": torch.zeros(2), "loader": {"w": torch.zeros(1),
                                                              "remaining": {}}}
    ckpt.load(target)
    assert list(target["loader"]["remaining"].items()) == list(remaining.items())


class Phase(enum.IntEnum):
    WARMUP = 1
    DECAY = 2


class Betas(NamedTuple):
    b1: float
    b2: float


def test_json_values_come_back_in_the_targets_own_types(ckpt: CheckpointEngine) -> None:
    """JSON has float, int, dict and list: a numpy float (a metric), an IntEnum (a phase), an
    OrderedDict (a state_dict) and a named tuple came back as plain float, int, dict and
    tuple. Where the target holds a value of a subclass of what JSON gives back, the loaded
    value takes the target's type (as a tensor is filled in place); other values as saved."""
    saved = {"w": torch.ones(1), "loss": np.float64(2.5), "phase": Phase.DECAY,
             "sched": OrderedDict(last_epoch=3, lrs=[0.1, 0.2],
                                  inner=OrderedDict(k=0.5)),
             "betas": Betas(0.9, 0.95), "n": 7, "count": 5}
    ckpt.save(1, saved, blocking=True)
    target: dict[str, Any] = {
        "w": torch.zeros(1), "loss": np.float64(0), "phase": Phase.WARMUP,
        "sched": OrderedDict(last_epoch=0, lrs=[], inner=OrderedDict(k=np.float64(0))),
        "betas": Betas(0.0, 0.0), "n": "was a string", "count": False}
    ckpt.load(target)
    assert type(target["loss"]) is np.float64 and target["loss"] == 2.5
    assert target["phase"] is Phase.DECAY
    assert type(target["sched"]) is OrderedDict and list(target["sched"]) == [
        "last_epoch", "lrs", "inner"]
    assert type(target["sched"]["inner"]) is OrderedDict
    assert type(target["sched"]["inner"]["k"]) is np.float64
    assert target["sched"]["inner"]["k"] == 0.5
    assert type(target["betas"]) is Betas and target["betas"] == (0.9, 0.95)
    assert type(target["n"]) is int and target["n"] == 7  # the target's str is no int
    assert type(target["count"]) is int and target["count"] == 5  # not bool(5)


def test_a_defaultdict_target_stays_a_defaultdict_with_its_factory(
        ckpt: CheckpointEngine) -> None:
    """A defaultdict's constructor takes its factory first: building one from the loaded
    entries failed, and the target's counters came back a plain dict (``counts[new] += 1``
    then raised KeyError)."""
    ckpt.save(1, {"w": torch.ones(1), "counts": defaultdict(int, {"web": 3, "code": 1})},
              blocking=True)
    target: dict[str, Any] = {"w": torch.empty(1), "counts": defaultdict(int)}
    ckpt.load(target)
    assert type(target["counts"]) is defaultdict and target["counts"] == {"web": 3, "code": 1}
    assert target["counts"].default_factory is int


@pytest.mark.parametrize(("value", "named"), [({1.5: "x"}, "1.5"), ({0: "a", "0": "b"}, "'0'"),
                                              ({None: 1}, "None")],
                         ids=["float-key", "int-and-str-key", "none-key"])
def test_json_keys_that_cannot_round_trip_are_refused(
    ckpt: CheckpointEngine, value: dict[Any, Any], named: str
) -> None:
    with pytest.raises(CheckpointError, match=rf"'extra'.*{named}"):
        ckpt.save(1, {"w": torch.ones(1), "extra": value})


# -- item 9: bytes -----------------------------------------------------------------------------


def test_bytes_round_trip_as_raw_bytes(ckpt: CheckpointEngine, tmp_path: Path) -> None:
    payload = bytes(range(256)) * 3 + b"\x00"
    saved = {"w": torch.ones(2), "loader": {"dp_rank_0": payload, "buf": bytearray(b"abc"),
                                            "empty": b"", "n": 4}}
    expected = copy.deepcopy(saved)
    ckpt.save(1, saved, blocking=True)
    target = {"w": torch.empty(2), "loader": {"dp_rank_0": b"", "buf": bytearray(),
                                              "empty": b"zz", "n": 0}}
    ckpt.load(target)
    assert_bitwise(target, expected)
    # stored as a raw uint8 zarr array, checksummed like any tensor
    group = zarr.open_group(str(tmp_path / "ckpt" / "step_000000001"), mode="r")
    array = group["loader/dp_rank_0"]
    assert array.dtype == np.uint8 and bytes(np.asarray(array[...])) == payload
    assert ckpt.verify(1).ok


class _Blob(bytes):
    """A subclass of bytes, as ``numpy.bytes_`` is."""


def test_a_subclass_of_bytes_loads_as_bytes_or_as_the_targets_own_type(
        ckpt: CheckpointEngine) -> None:
    """Its type's name was recorded as the kind of bytes: the save committed and every load
    of the step refused it ("'loader/blob' was not saved as bytes")."""
    ckpt.save(1, {"w": torch.ones(2), "loader": {"blob": _Blob(b"\x00ab"),
                                                 "np": np.bytes_(b"cd")}}, blocking=True)
    target: dict[str, Any] = {"w": torch.empty(2), "loader": {"blob": None, "np": None}}
    ckpt.load(target)
    assert_bitwise(target["loader"], {"blob": b"\x00ab", "np": b"cd"})
    target = {"w": torch.empty(2), "loader": {"blob": _Blob(), "np": np.bytes_(b"")}}
    ckpt.load(target)
    assert type(target["loader"]["blob"]) is _Blob and target["loader"]["blob"] == b"\x00ab"
    assert type(target["loader"]["np"]) is np.bytes_ and target["loader"]["np"] == b"cd"


class _Sampler:
    """A fresh one holds None where a used one holds its generator state and a cursor."""

    def __init__(self, used: bool) -> None:
        self.gen = torch.arange(3, dtype=torch.uint8) if used else None
        self.cursor = b"cursor" if used else None
        self.weights = torch.ones(2)  # a tensor either way: the target is walked entry by entry

    def state_dict(self) -> dict[str, Any]:
        return {"weights": self.weights, "gen": self.gen, "cursor": self.cursor, "epoch": 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.gen, self.cursor = state["gen"], state["cursor"]


def test_a_fresh_object_with_none_where_a_tensor_or_bytes_was_saved_takes_them(
        ckpt: CheckpointEngine) -> None:
    # it raised "step 1 has no value 'sampler/gen'"
    ckpt.save(1, {"w": torch.ones(2), "sampler": _Sampler(used=True)}, blocking=True)
    fresh = _Sampler(used=False)
    ckpt.load({"w": torch.zeros(2), "sampler": fresh})
    assert fresh.cursor == b"cursor"
    assert fresh.gen is not None and torch.equal(fresh.gen, torch.arange(3, dtype=torch.uint8))


class _Cursor:
    """A loader whose cursor is None until its first batch, bytes after."""

    def __init__(self, cursor: bytes | None) -> None:
        self.cursor = cursor
        self.rng = torch.arange(3, dtype=torch.uint8)  # walked entry by entry either way

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng, "cursor": self.cursor, "epoch": 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursor = state["cursor"]


def test_a_bytes_entry_of_the_target_takes_a_value_or_sub_tree_saved_at_its_path(
        ckpt: CheckpointEngine) -> None:
    """A target's ``bytes`` hold no tensor: like a JSON value they take what was saved at their
    path, whole. A used loader (cursor bytes) rolled back to a step saved before its first
    batch (cursor None) raised "step 1 has no bytes 'loader/cursor'", on every step."""
    ckpt.save(1, {"w": torch.ones(2), "loader": _Cursor(None),
                  "extra": {"note": "text", "sub": {"a": torch.arange(2.0), "k": (3,)}}},
              blocking=True)
    loader = _Cursor(b"abc")
    target: dict[str, Any] = {"w": torch.zeros(2), "loader": loader,
                              "extra": {"note": b"xx", "sub": bytearray(b"yy")}}
    assert ckpt.load(target) == 1
    assert loader.cursor is None
    assert target["extra"]["note"] == "text"
    assert_bitwise(target["extra"]["sub"], {"a": torch.arange(2.0), "k": (3,)})


class _Offset:
    """A loader without tensors: its state is one JSON value until its cursor holds bytes."""

    def __init__(self, cursor: bytes | None) -> None:
        self.cursor, self.seen = cursor, {3: (1, 2)}

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor, "seen": self.seen, "epoch": 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursor, self.seen = state["cursor"], state["seen"]


def test_a_target_holding_bytes_takes_its_entries_from_a_json_value_saved_whole(
        ckpt: CheckpointEngine) -> None:
    """Saved holding no tensor nor bytes, the loader's state is one JSON value at its path; the
    target's, holding bytes now, is walked entry by entry, and each entry takes its part of
    that value (types restored). It raised "step 1 has no bytes 'loader/cursor'"."""
    ckpt.save(1, {"w": torch.ones(2), "loader": _Offset(None)}, blocking=True)
    loader = _Offset(b"abc")
    loader.seen = {}
    assert ckpt.load({"w": torch.zeros(2), "loader": loader}) == 1
    assert loader.cursor is None and loader.seen == {3: (1, 2)}


def test_bytes_inside_a_stateful_are_restored_into_it(ckpt: CheckpointEngine) -> None:
    class Loader:
        def __init__(self, blob: bytes) -> None:
            self.blob = blob

        def state_dict(self) -> dict[str, Any]:
            return {"dp_rank_0": self.blob, "world_size": 1}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.blob = state_dict["dp_rank_0"]

    ckpt.save(5, {"loader": Loader(b"\x80\x04state")}, blocking=True)
    loader = Loader(b"")
    ckpt.load({"loader": loader})
    assert loader.blob == b"\x80\x04state" and type(loader.blob) is bytes


# -- what the type record and per-rank index say is validated ---------------------------------


@pytest.mark.parametrize(("where", "value"), [
    ("types", "junk"),
    ("types", {"containers": {"opt": ["l"]}, "values": {}, "bytes": {}}),
    ("types", {"containers": {}, "values": {"cfg": ["t", 5]}, "bytes": {}}),
    ("types", {"containers": {}, "values": {"cfg": ["z", {}]}, "bytes": {}}),
    ("types", {"containers": {}, "values": {"cfg": ["f", "00"]}, "bytes": {}}),
    ("types", {"containers": {}, "values": {"cfg": ["f", "000000000000f8ff"]}, "bytes": {}}),
    ("per_rank", {"w": "rank 0"}),
    ("per_rank", {"w": [7]}),
], ids=["not-a-dict", "list-without-indices", "children-not-a-dict", "unknown-tag",
        "nan-bits-not-8-bytes", "nan-bits-for-a-value-not-nan",
        "ranks-not-a-list", "no-such-rank-array"])
def test_hostile_type_records_raise_corrupt(tmp_path: Path, where: str, value: Any) -> None:
    from test_hostile import Hostile

    from antifragile.engine import CheckpointCorruptError

    root = tmp_path / "ckpt"
    with CheckpointEngine(str(root)) as engine:
        engine.save(1, {"w": torch.ones(2), "opt": {7: {"t": torch.ones(1)}}, "cfg": (1, 2)},
                    blocking=True)

    def edit(attrs: dict[str, Any]) -> None:
        if where == "types":
            attrs["values"][".types"] = value
        else:
            attrs["per_rank"] = value

    Hostile(root).edit_json("zarr.json", lambda g: edit(g["attributes"]["antifragile"]))
    with CheckpointEngine(str(root)) as engine, pytest.raises(CheckpointCorruptError):
        engine.load({"w": torch.empty(2), "opt": {}, "cfg": None}, step=1)


def test_a_tuple_holding_tensors_is_filled_and_its_values_replaced(
    ckpt: CheckpointEngine,
) -> None:
    ckpt.save(1, {"pair": (torch.tensor([1, 2]), "relu", 3)}, blocking=True)
    tensor = torch.zeros(2, dtype=torch.int64)
    target = {"pair": (tensor, "gelu", 0)}
    ckpt.load(target)
    assert target["pair"][1:] == ("relu", 3) and type(target["pair"]) is tuple
    assert target["pair"][0] is tensor and tensor.tolist() == [1, 2]


class Pair(NamedTuple):
    weight: torch.Tensor
    activation: str


def test_a_named_tuple_holding_tensors_keeps_its_type_when_its_values_are_replaced(
    ckpt: CheckpointEngine,
) -> None:
    """The target's own tuple type is known: a value replaced in it must not turn the
    caller's named tuple into a plain tuple (its fields would be gone)."""
    ckpt.save(1, {"pair": Pair(torch.tensor([1, 2]), "relu")}, blocking=True)
    tensor = torch.zeros(2, dtype=torch.int64)
    target = {"pair": Pair(tensor, "gelu")}
    ckpt.load(target)
    assert type(target["pair"]) is Pair and target["pair"].activation == "relu"
    assert target["pair"].weight is tensor and tensor.tolist() == [1, 2]


def test_a_tuple_state_holding_nested_tuples_of_tensors_loads_in_place(
    ckpt: CheckpointEngine,
) -> None:
    """A whole state given as a tuple cannot have an entry replaced; tensors filled in place
    need none, however deep the tuples. An entry that would be replaced is refused by path."""
    ckpt.save(1, (torch.ones(1), (torch.ones(2), (torch.full((3,), 3.0),))), blocking=True)
    inner = torch.zeros(3)
    target = (torch.zeros(1), (torch.zeros(2), (inner,)))
    ckpt.load(target)
    assert target[1][1][0] is inner and inner.tolist() == [3.0, 3.0, 3.0]
    assert target[0].tolist() == [1.0] and target[1][0].tolist() == [1.0, 1.0]
    ckpt.save(2, (torch.ones(1), (torch.ones(2), "relu")), blocking=True)
    with pytest.raises(CheckpointError, match=r"state path '1': cannot assign into a tuple"):
        ckpt.load((torch.zeros(1), (torch.zeros(2), "gelu")))


def test_a_deeply_nested_json_value_that_flatten_takes_is_saved_and_loaded(
        ckpt: CheckpointEngine) -> None:
    """Its type record nests twice as deep as the value (``["t", {"0": ...}]`` per tuple),
    and the coordinator compared it between ranks recursively, two frames a level: a tuple
    nested 190 deep passed the save's checks, then failed the save in the background with a
    bare ``RecursionError``, naming no path."""
    value: Any = -float("nan")
    for _ in range(190):
        value = (value,)
    saved = {"w": torch.ones(1), "deep": value}
    expected = copy.deepcopy(saved)
    ckpt.save(1, saved, blocking=True).wait()
    target = {"w": torch.empty(1), "deep": None}
    ckpt.load(target)
    assert_bitwise(target, expected)


def test_an_int_enum_key_of_a_dict_holding_tensors_is_stored_by_its_int(
        ckpt: CheckpointEngine) -> None:
    """An ``(int, Enum)`` key (not an IntEnum: its ``str()`` is ``Layer.ENCODER``) was stored
    under that name and recorded as an int key: a load into a target without the dict found
    a type record naming no int and refused the step as corrupt."""

    class Layer(int, enum.Enum):
        ENCODER = 3

    saved = {"w": torch.ones(1), "by_layer": {Layer.ENCODER: torch.arange(2.0)}}
    ckpt.save(1, saved, blocking=True).wait()
    target: dict[str, Any] = {"w": torch.empty(1), "by_layer": None}
    ckpt.load(target)
    assert_bitwise(target, {"w": torch.ones(1), "by_layer": {3: torch.arange(2.0)}})
    in_place = {"w": torch.empty(1), "by_layer": {Layer.ENCODER: torch.zeros(2)}}
    ckpt.load(in_place)
    assert torch.equal(in_place["by_layer"][Layer.ENCODER], torch.arange(2.0))


def test_a_numpy_scalar_refused_is_named_with_its_module(ckpt: CheckpointEngine) -> None:
    """np.bool_'s refusal said "bool is neither a tensor nor JSON-able": its class is named
    ``bool``, read as Python's, which is JSON-able."""
    with pytest.raises(CheckpointError) as raised:
        ckpt.save(1, {"w": torch.ones(1), "done": np.bool_(True)}, blocking=True)
    assert "'done': numpy.bool is neither a tensor nor JSON-able" in str(raised.value)


def test_a_str_enum_key_of_a_dict_holding_tensors_is_stored_by_its_value(
        ckpt: CheckpointEngine) -> None:
    """A ``(str, Enum)`` key was stored under its ``str()``, ``Split.TRAIN``, not its value
    (as an int enum key is, and as JSON writes it in a value): a load into a target keyed by
    the plain str found no ``by_split/train``, and a rebuilt dict came back keyed
    ``'Split.TRAIN'``, which ``Split.TRAIN`` does not find."""
    saved = {"w": torch.ones(1), "by_split": {Split.TRAIN: torch.arange(2.0)}}
    ckpt.save(1, saved, blocking=True).wait()
    target: dict[str, Any] = {"w": torch.empty(1), "by_split": None}
    ckpt.load(target)
    assert_bitwise(target, {"w": torch.ones(1), "by_split": {"train": torch.arange(2.0)}})
    assert torch.equal(target["by_split"][Split.TRAIN], torch.arange(2.0))
    plain = {"w": torch.empty(1), "by_split": {"train": torch.zeros(2)}}
    ckpt.load(plain)
    assert torch.equal(plain["by_split"]["train"], torch.arange(2.0))
    in_place = {"w": torch.empty(1), "by_split": {Split.TRAIN: torch.zeros(2)}}
    ckpt.load(in_place)
    assert torch.equal(in_place["by_split"][Split.TRAIN], torch.arange(2.0))


# -- non-finite floats: strict JSON on storage, the exact value on load -----------------------


def strict_json(text: str) -> Any:
    """``text`` parsed as RFC 8259 JSON: no ``NaN`` / ``Infinity`` tokens (Python's json
    writes and reads them by default; zarr readers such as tensorstore refuse them)."""
    def refuse(token: str) -> None:
        raise ValueError(f"{token} is not JSON")

    return json.loads(text, parse_constant=refuse)


def non_finite_state() -> dict[str, Any]:
    def float_of(bits: int) -> float:
        return float(np.array(bits, dtype=np.uint64).view(np.float64))

    return {"w": torch.ones(2), "loss": math.nan, "best": math.inf, "worst": -math.inf,
            "zero": -0.0, "negative_nan": float_of(0xFFF8000000000000),
            "np_nan": np.float64("nan"), "np_inf": np.float64("-inf"),
            "metrics": {"hist": [math.nan, 1.5, math.inf, -0.0], "pair": (-math.inf, math.nan),
                        "by_epoch": {3: math.inf}},
            # strings that read like what JSON lacks stay strings
            "names": ["NaN", "Infinity", "-Infinity", "nan", "inf"], "tag": "NaN"}


def test_non_finite_floats_are_written_as_strict_json(tmp_path: Path) -> None:
    """A loss gone NaN or an ``inf`` best-metric sentinel was written into the group's
    zarr.json as a bare ``NaN`` / ``Infinity``, which is not JSON: zarr readers refused the
    step's documents (tensorstore: ``DATA_LOSS: ... zarr.json: Invalid JSON``)."""
    root = tmp_path / "ckpt"
    with CheckpointEngine(str(root)) as engine:
        engine.save(1, non_finite_state(), blocking=True)
    documents = sorted((root / "step_000000001").rglob("zarr.json"))
    assert len(documents) == 2  # the step's group and the array w
    for document in documents:
        strict_json(document.read_text())
    ts = pytest.importorskip("tensorstore")
    step = str(root / "step_000000001")
    array = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{step}/w/"}},
                    open=True).result()
    assert array.read().result().tolist() == [1.0, 1.0]
    with pytest.raises(ValueError) as opened:  # a group is no array; its JSON is read first
        ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{step}/"}},
                open=True).result()
    assert "Invalid JSON" not in str(opened.value)


def test_a_step_is_written_in_format_5_which_an_engine_of_format_4_refuses_as_another_engines(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Format 5 stores the COMMIT's manifest as columns; an engine that reads up to format 4
    would find no manifest in it and call the step damaged (quarantine it): told format 5 in
    the COMMIT and the group document alike, it refuses the step as another engine's."""
    from antifragile.engine import CheckpointFormatError, commit

    root = tmp_path / "ckpt"
    with CheckpointEngine(str(root), keep_last=None) as engine:
        engine.save(1, non_finite_state(), blocking=True)
    folder = root / "step_000000001"
    group = strict_json((folder / "zarr.json").read_text())
    assert group["attributes"]["antifragile"]["format"] == 5
    marker = (folder / "COMMIT").read_bytes()
    assert marker.startswith(b'{"format": 5,') and b'"objects"' not in marker
    monkeypatch.setattr(commit, "READABLE_FORMATS", (2, 3, 4))
    with CheckpointEngine(str(root)) as engine, pytest.raises(CheckpointFormatError,
                                                              match="format 5"):
        engine.load({"w": torch.empty(2)}, step=1)
    assert (folder / "COMMIT").is_file()  # not quarantined


def test_non_finite_floats_round_trip_exactly(ckpt: CheckpointEngine) -> None:
    saved = non_finite_state()
    expected = copy.deepcopy(saved)
    ckpt.save(1, saved, blocking=True)
    # a target holding None takes the value as saved (a numpy float as a float) ...
    target: dict[str, Any] = {"w": torch.empty(2), **{k: None for k in saved if k != "w"}}
    ckpt.load(target)
    assert_bitwise(target, {**expected, "np_nan": math.nan, "np_inf": -math.inf})
    # ... a target holding numpy floats keeps their type
    typed: dict[str, Any] = {"w": torch.empty(2), "np_nan": np.float64(0), "np_inf": np.float64(0)}
    ckpt.load(typed)
    assert_bitwise(typed, {"w": expected["w"], "np_nan": expected["np_nan"],
                           "np_inf": expected["np_inf"]})
    stored = ckpt.read(1)  # read() gives the floats back too, as JSON gave them before
    assert math.isnan(stored["loss"]) and stored["best"] == math.inf
    assert stored["metrics"]["hist"][2] == math.inf and stored["tag"] == "NaN"
    assert ckpt.verify(1).ok


def test_a_step_written_with_bare_non_finite_floats_still_loads(tmp_path: Path) -> None:
    """Format 3 wrote ``NaN`` / ``Infinity`` bare, a NaN with other bits than JSON's
    described by ``["f", hex]``: such steps keep loading."""
    from test_hostile import Hostile

    root = tmp_path / "ckpt"
    with CheckpointEngine(str(root)) as engine:
        engine.save(1, {"w": torch.ones(2), "loss": 0.0, "best": 0.0, "hist": [1.0, 2.0]},
                    blocking=True)
    negative_nan = "000000000000f8ff"

    def old_encoding(attrs: dict[str, Any]) -> None:
        attrs["values"].update({"loss": math.nan, "best": math.inf, "hist": [-math.inf, math.nan]})
        attrs["values"][".types"]["values"]["hist"] = ["l", {"1": ["f", negative_nan]}]

    Hostile(root).edit_json("zarr.json",
                            lambda g: old_encoding(g["attributes"]["antifragile"]))
    assert b"Infinity" in (root / "step_000000001" / "zarr.json").read_bytes()
    target: dict[str, Any] = {"w": torch.empty(2), "loss": None, "best": None, "hist": None}
    with CheckpointEngine(str(root)) as engine:
        engine.load(target, step=1)
        assert engine.verify(1).ok
    assert math.isnan(target["loss"]) and target["best"] == math.inf
    assert target["hist"][0] == -math.inf
    assert np.float64(target["hist"][1]).tobytes() == bytes.fromhex(negative_nan)


def test_a_resave_of_non_finite_floats_is_a_resave(tmp_path: Path) -> None:
    """The retry of a save whose answer was lost compares the stored values with its own;
    NaN != NaN in Python must not make it refuse the same state."""
    from antifragile.engine import CheckpointCommittedError

    with CheckpointEngine(str(tmp_path)) as engine:
        engine.save(5, non_finite_state(), blocking=True)
        engine.save(5, non_finite_state(), blocking=True)
        with pytest.raises(CheckpointCommittedError, match=r"step 5 is already committed.*'best'"):
            engine.save(5, {**non_finite_state(), "best": -math.inf}, blocking=True)


@pytest.mark.parametrize("forge", [
    pytest.param(lambda types: types.__setitem__("values", []), id="values-not-an-object"),
    pytest.param(lambda types: types["values"].__setitem__("loss", "f"), id="desc-not-a-list"),
    pytest.param(lambda types: types["values"].__setitem__(
        "nest", ["l", {"0": ["f", "000000000000f07f"]}]), id="desc-a-list-for-a-dict"),
])
def test_read_refuses_a_type_record_that_load_refuses(
        tmp_path: Path, forge: Any) -> None:
    """A forged format-4 type record that does not fit its values: load and verify call the
    step damaged, and read() must not give the stored str (``"NaN"``) back as the value."""
    from test_hostile import Hostile

    from antifragile.engine import CheckpointCorruptError

    root = tmp_path / "ckpt"
    with CheckpointEngine(str(root)) as engine:
        engine.save(1, {"w": torch.ones(2), "loss": math.nan, "nest": {"a": [math.inf]}},
                    blocking=True)
    Hostile(root).edit_json(
        "zarr.json", lambda g: forge(g["attributes"]["antifragile"]["values"][".types"]))
    with CheckpointEngine(str(root)) as engine:
        assert not engine.verify(1).ok
        with pytest.raises(CheckpointCorruptError, match="type record"):
            engine.load({"w": torch.empty(2), "loss": None, "nest": None}, step=1)
        with pytest.raises(CheckpointCorruptError, match="type record"):
            engine.read(1)
