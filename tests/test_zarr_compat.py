"""A checkpoint is plain zarr v3: zarr-python and TensorStore (an independent implementation,
C++) open it and read every tensor back, bit for bit.

Also the other way: the engine loads data objects that zarr-python itself rewrote, and zarr's
own crc32c check fires on a flipped bit.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr
from _forge import edit_commit, part_crcs, set_entry
from zarr.storage import FsspecStore

from antifragile.engine import CheckpointEngine, PlanOptions

Storage = tuple[str, dict[str, Any] | None]

# model/w: 64 x 16 float32 in 4 shards of 16 rows, each of 8 inner chunks of 2 rows
PLAN = PlanOptions(max_object_bytes=1024, inner_chunk_bytes=128)


def state_of(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(64, 16, generator=gen),
            "bf16": torch.randn(6, 4, generator=gen).bfloat16(),
            "f16": torch.randn(3, 3, generator=gen).half(),
            "i64": torch.randint(-(2**50), 2**50, (9,), generator=gen),
            "mask": torch.rand(4, 2, generator=gen) > 0.5,
            "c64": torch.randn(5, dtype=torch.complex64, generator=gen),
            "scalar": torch.tensor(seed + 0.5),
            "empty": torch.empty(0, 4),
        },
        "step": seed,
    }


def open_step(storage: Storage, step: int, mode: str = "r") -> zarr.Group:
    url, options = storage
    path = f"{url}/step_{step:09d}"
    if options is None:
        return zarr.open_group(path, mode=mode)
    store = FsspecStore.from_url(path, storage_options=options, read_only=mode == "r")
    return zarr.open_group(store, mode=mode)


def as_tensor(array: zarr.Array, dtype: torch.dtype) -> torch.Tensor:
    """What plain zarr reads, as the saved tensor: bf16 comes back from its uint16 bits."""
    data = np.asarray(array[...])
    tensor = torch.from_numpy(data.copy())
    return tensor.view(torch.bfloat16) if dtype == torch.bfloat16 else tensor


def assert_zarr_reads(group: zarr.Group, tensors: dict[str, torch.Tensor]) -> None:
    for path, tensor in tensors.items():
        array = group[path]
        assert isinstance(array, zarr.Array), path
        assert array.shape == tuple(tensor.shape), path
        assert array.attrs["antifragile"]["dtype"] == str(tensor.dtype).removeprefix("torch.")
        read = as_tensor(array, tensor.dtype)
        assert read.dtype == tensor.dtype and torch.equal(read, tensor), path


def test_zarr_python_reads_every_array(storage: Storage) -> None:
    url, options = storage
    state = state_of(1)
    with CheckpointEngine(url, storage_options=options, plan_options=PLAN) as engine:
        engine.save(1, state, blocking=True, metadata={"run": "zarr-compat"})
    group = open_step(storage, 1)
    assert group.attrs["antifragile"]["metadata"] == {"run": "zarr-compat"}
    assert group.attrs["antifragile"]["values"]["step"] == 1
    w = group["model/w"]
    assert isinstance(w, zarr.Array)
    assert w.shards == (16, 16) and w.chunks == (2, 16), "the test wants multi-chunk shards"
    assert w.dtype == np.float32 and group["model/bf16"].dtype == np.uint16
    assert_zarr_reads(group, {f"model/{k}": v for k, v in state["model"].items()})


def test_zarr_crc32c_check_fires_on_a_flipped_bit(storage: Storage) -> None:
    url, options = storage
    with CheckpointEngine(url, storage_options=options, plan_options=PLAN) as engine:
        engine.save(1, state_of(1), blocking=True)
    group = open_step(storage, 1)
    store = group.store
    key = "model/w/c.2.0"
    data = bytearray(_get(store, key))
    data[200] ^= 0x10
    _set(store, key, bytes(data), storage)
    group = open_step(storage, 1)
    with pytest.raises(ValueError, match="checksum"):
        group["model/w"][...]


def _get(store: Any, key: str) -> bytes:
    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.sync import sync

    buffer = sync(store.get(key, prototype=default_buffer_prototype()))
    assert buffer is not None, key
    return bytes(buffer.to_bytes())


def _set(store: Any, key: str, data: bytes, storage: Storage) -> None:
    url, options = storage
    if options is None:
        Path(store.root, key).write_bytes(data)
    else:
        import fsspec

        fs, root = fsspec.core.url_to_fs(
            f"{url}/step_000000001", **options, skip_instance_cache=True
        )
        fs.pipe_file(f"{root}/{key}", data)


def test_engine_loads_data_rewritten_by_zarr_python(storage: Storage) -> None:
    """zarr-python rewrites the shards (its own encoder, index layout and crc32c); only the
    COMMIT manifest, which zarr knows nothing about, is updated to the new sizes and part
    CRCs (read from the objects zarr wrote, as a tool that re-encodes a checkpoint would)."""
    url, options = storage
    original = state_of(1)
    with CheckpointEngine(url, storage_options=options, plan_options=PLAN) as engine:
        engine.save(1, original, blocking=True)
        group = open_step(storage, 1, mode="r+")
        rewritten = {"w": original["model"]["w"] * 2 + 1, "bf16": -original["model"]["bf16"]}
        w, bf16 = group["model/w"], group["model/bf16"]
        assert isinstance(w, zarr.Array) and isinstance(bf16, zarr.Array)
        w[...] = rewritten["w"].numpy()
        bf16[...] = rewritten["bf16"].view(torch.uint16).numpy()
        w[3:5, 2:9] = np.full((2, 7), 42.0, dtype=np.float32)
        rewritten["w"][3:5, 2:9] = 42.0
        _refresh_manifest(
            engine, group.store, 1, [f"model/w/c.{i}.0" for i in range(4)] + ["model/bf16/c.0.0"]
        )

        assert engine.verify(1).ok
        target = state_of(9)
        assert engine.load(target, step=1) == 1
        assert torch.equal(target["model"]["w"], rewritten["w"])
        assert torch.equal(target["model"]["bf16"], rewritten["bf16"])
        assert torch.equal(target["model"]["i64"], original["model"]["i64"])


def _refresh_manifest(engine: CheckpointEngine, store: Any, step: int, keys: list[str]) -> None:
    commit_key = f"step_{step:09d}/COMMIT"

    def refresh(commit: dict[str, Any]) -> None:
        for key in keys:
            data = _get(store, key)
            array = json.loads(_get(store, key.rpartition("/c.")[0] + "/zarr.json"))
            shard_rows = array["chunk_grid"]["configuration"]["chunk_shape"][0]
            inner_rows = array["codecs"][0]["configuration"]["chunk_shape"][0]
            set_entry(commit, key, len(data), part_crcs(data, shard_rows // inner_rows))

    edit_commit(lambda: bytes(engine.storage.read(commit_key)), refresh,
                lambda sealed: engine.storage.write(commit_key, [sealed]))


# -- uneven shard grids: two gloo ranks save DTensors whose torch.chunk shards are short ------

_RANK = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from antifragile.engine import CheckpointEngine, PlanOptions
    rank, root, rdzv = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    full = {"rows": torch.randn(7, 4), "cols": torch.randn(4, 5),
            "bf16": torch.randn(5, 3).bfloat16(), "one_row": torch.randn(1, 6)}
    dims = {"rows": 0, "cols": 1, "bf16": 0, "one_row": 0}
    state = {"model": {k: distribute_tensor(v, mesh, [Shard(dims[k])]) for k, v in full.items()}}
    with CheckpointEngine(root, plan_options=PlanOptions(inner_chunk_bytes=16)) as engine:
        engine.save(1, state, blocking=True)
    dist.barrier()
    dist.destroy_process_group()
""")


def _full_tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "rows": torch.randn(7, 4),
        "cols": torch.randn(4, 5),
        "bf16": torch.randn(5, 3).bfloat16(),
        "one_row": torch.randn(1, 6),
    }


@pytest.mark.multiproc
def test_zarr_python_reads_uneven_shard_grids(tmp_path: Path) -> None:
    root, rdzv = tmp_path / "ckpt", tmp_path / "rdzv"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, str(r), str(root), str(rdzv)],
            cwd=Path(__file__).parent.parent,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], outputs

    group = zarr.open_group(str(root / "step_000000001"), mode="r")
    full = _full_tensors()
    rows, cols = group["model/rows"], group["model/cols"]
    assert isinstance(rows, zarr.Array) and isinstance(cols, zarr.Array)
    assert rows.shards == (4, 4) and rows.chunks == (1, 4), "7 rows: shards of 4, then 3"
    assert cols.shards == (4, 3), "5 columns: shards of 3, then 2"
    assert_zarr_reads(group, {f"model/{k}": v for k, v in full.items()})

    target = {"model": {k: torch.zeros_like(v) for k, v in full.items()}}
    with CheckpointEngine(str(root)) as engine:
        assert engine.verify(1).ok
        assert engine.load(target) == 1
    for key, tensor in full.items():
        assert torch.equal(target["model"][key], tensor), key


def test_rows_larger_than_max_object_bytes_round_trip(tmp_path: Path) -> None:
    """Objects split along columns (one row exceeds the cap): zarr-python and the engine both
    read them back."""
    url = str(tmp_path / "ckpt")
    w = torch.randn(3, 1000)
    with CheckpointEngine(url, plan_options=PlanOptions(max_object_bytes=1000)) as engine:
        engine.save(1, {"w": w}, blocking=True)
        sizes = [p.stat().st_size for p in (tmp_path / "ckpt" / "step_000000001" / "w")
                 .glob("c.*")]
        assert len(sizes) > 3 and max(sizes) <= 1000 + 4 + 16 + 4, sizes
        target = {"w": torch.zeros(3, 1000)}
        engine.load(target)
        assert torch.equal(target["w"], w) and engine.verify(1).ok
    assert_zarr_reads(zarr.open_group(f"{url}/step_000000001", mode="r"), {"w": w})


_ODD_SHAPES = [(), (0,), (7,), (5, 3), (0, 3), (13, 7, 3)]


def test_every_dtype_reads_back_bit_for_bit_in_zarr_and_tensorstore(tmp_path: Path) -> None:
    """Every dtype the engine accepts, in odd shapes (0-d, zero-size, partial edge shards on
    every dim): zarr-python and TensorStore read the same bytes the tensor held, with the
    documented data type (the bit pattern's for dtypes zarr has no name for)."""
    ts = pytest.importorskip("tensorstore")
    from antifragile.engine._dtypes import _TORCH_BY_NAME, zarr_data_type

    gen = torch.Generator().manual_seed(5)
    tensors: dict[str, torch.Tensor] = {}
    for name, dtype in _TORCH_BY_NAME.items():
        width = dtype.itemsize
        for shape in _ODD_SHAPES:
            raw = torch.randint(0, 256, (math.prod(shape) * width,), dtype=torch.uint8,
                                generator=gen)
            if dtype == torch.bool:
                raw = raw % 2
            tensors[f"{name}/s{'x'.join(map(str, shape))}"] = raw.view(dtype).reshape(shape)
    state: dict[str, dict[str, torch.Tensor]] = {}
    for path, tensor in tensors.items():
        name, leaf = path.split("/")
        state.setdefault(name, {})[leaf] = tensor
    url = str(tmp_path / "ckpt")
    with CheckpointEngine(url, plan_options=PlanOptions(max_object_bytes=64,
                                                        inner_chunk_bytes=16)) as engine:
        engine.save(1, state, blocking=True)
    step = tmp_path / "ckpt" / "step_000000001"
    group = zarr.open_group(str(step), mode="r")
    for path, tensor in tensors.items():
        array = group[path]
        assert isinstance(array, zarr.Array), path
        document = json.loads((step / path / "zarr.json").read_bytes())
        assert document["data_type"] == zarr_data_type(tensor.dtype), path
        assert array.attrs["antifragile"]["dtype"] == path.split("/")[0], path
        expected = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        read = np.asarray(array[...])
        store = ts.open({"driver": "zarr3", "kvstore": {"driver": "file",
                                                        "path": str(step / path)}},
                        read=True).result()
        by_ts = np.asarray(store.read().result())
        for reader, data in (("zarr", read), ("tensorstore", by_ts)):
            assert data.shape == tuple(tensor.shape), (reader, path)
            assert data.dtype == np.dtype(zarr_data_type(tensor.dtype)), (reader, path)
            assert data.tobytes() == expected, (reader, path)


_COMPLEX32_SAVE = """
import sys, torch
from antifragile.engine import CheckpointEngine
z = torch.zeros(6, dtype=torch.int16).view(torch.complex32)
with CheckpointEngine(sys.argv[1]) as engine:
    engine.save(1, {"z": z}, blocking=True)
"""


def test_the_first_complex32_save_of_a_process_warns_nothing(tmp_path: Path) -> None:
    """torch warns "ComplexHalf support is experimental" once per process, when a complex32
    tensor is built: the engine built a 0-d one to learn the dtype's width, so the first save
    of a complex32 tensor in a process failed under warnings-as-errors. In pytest's own
    process an earlier test (test_engine_basic's complex32 round trip) has already spent
    that one warning, so only a fresh interpreter under ``-W error`` shows it."""
    done = subprocess.run([sys.executable, "-W", "error", "-c", _COMPLEX32_SAVE,
                           str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ComplexHalf" not in done.stderr, done.stderr[-2000:]


# -- an independent reader: TensorStore opens every array of a multi-rank checkpoint ----------


def _tensorstore_globals() -> dict[str, torch.Tensor]:
    """The global tensors the ranks save (random bytes: NaN payloads and -0.0 included)."""
    gen = torch.Generator().manual_seed(11)

    def random_bits(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
        return raw.view(dtype).reshape(shape)

    return {
        "w": random_bits((8, 6), torch.float32),  # Replicate over dp, Shard(0) over tp
        "bf16": random_bits((6, 5), torch.bfloat16),  # Shard(1) over dp, Replicate over tp
        "nested": random_bits((10, 3), torch.float32),  # Shard(0), Shard(0): piece_* arrays
        "plain": random_bits((5,), torch.int64),
        "scalar": random_bits((), torch.float64),
    }


_TS_PLACEMENTS = {"w": ("R", "S0"), "bf16": ("S1", "R"), "nested": ("S0", "S0")}


def _save_for_tensorstore(root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = _tensorstore_globals()
    model: dict[str, Any] = {k: v.clone() for k, v in full.items()}
    for name, codes in _TS_PLACEMENTS.items():
        placements = [Replicate() if c == "R" else Shard(int(c[1:])) for c in codes]
        model[name] = distribute_tensor(full[name], mesh, placements, src_data_rank=None)
    with CheckpointEngine(root, plan_options=PlanOptions(max_cells_per_box=1,
                                                         inner_chunk_bytes=24)) as engine:
        engine.save(1, {"model": model}, blocking=True)


_SAME_WIDTH_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _ts_read(path: Path) -> np.ndarray:
    import tensorstore as ts

    store = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}},
                    read=True).result()
    return np.asarray(store.read().result())


@pytest.mark.multiproc
def test_tensorstore_reads_every_array_of_a_multi_rank_checkpoint(tmp_path: Path) -> None:
    """TensorStore (its own zarr v3, sharding and crc32c code) reads every array the group's
    index names, bit for bit: bf16 through its uint16 bit pattern, piece_* arrays placed at
    their recorded offsets. A flipped byte makes it raise."""
    pytest.importorskip("tensorstore")
    from _dist import run_ranks

    root = tmp_path / "ckpt"
    run_ranks(4, _save_for_tensorstore, str(root), timeout_s=180)
    step = root / "step_000000001"
    index = json.loads((step / "zarr.json").read_bytes())["attributes"]["antifragile"]["tensors"]
    full = _tensorstore_globals()
    assert set(index) == {f"model/{k}" for k in full}
    arrays = {p.parent.relative_to(step).as_posix() for p in step.rglob("zarr.json")
              if json.loads(p.read_bytes())["node_type"] == "array"}
    assert arrays == {a for entry in index.values() for a in entry["arrays"]}, "every array"
    assert any("/piece_" in a for a in arrays), "the test wants the piece_* fallback"
    for path, entry in index.items():
        expected = full[path.removeprefix("model/")]
        as_int = _SAME_WIDTH_INT[expected.element_size()]  # compare bits, never values
        bits = torch.zeros(expected.shape, dtype=as_int)
        filled = torch.zeros(expected.shape, dtype=torch.int64)
        for name in entry["arrays"]:
            meta = json.loads((step / name / "zarr.json").read_bytes())
            offset = meta["attributes"]["antifragile"]["offset"]
            data = torch.from_numpy(_ts_read(step / name).copy())
            if expected.dtype == torch.bfloat16:
                assert data.dtype == torch.uint16, "bf16 is stored as its bit pattern"
            where = tuple(slice(o, o + n) for o, n in zip(offset, data.shape))
            bits[where] = data.view(as_int)
            filled[where] += 1
        assert bool((filled == 1).all()), f"{path}: arrays overlap or leave gaps"
        assert torch.equal(bits, expected.view(as_int)), f"{path} differs from what was saved"

    shard = step / "model" / "w" / "c.1.0"
    data = bytearray(shard.read_bytes())
    data[3] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="Digest mismatch"):  # its crc32c check
        _ts_read(step / "model" / "w")
