"""A checkpoint is plain zarr v3: zarr-python opens it and reads every tensor back.

Also the other way: the engine loads data objects that zarr-python itself rewrote, and zarr's
own crc32c check fires on a flipped bit.
"""

from __future__ import annotations

import json
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
    key = "model/w/c/2/0"
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
            engine, group.store, 1, [f"model/w/c/{i}/0" for i in range(4)] + ["model/bf16/c/0/0"]
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
            array = json.loads(_get(store, key.rpartition("/c/")[0] + "/zarr.json"))
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
        sizes = [p.stat().st_size for p in (tmp_path / "ckpt" / "step_000000001" / "w" / "c")
                 .rglob("*") if p.is_file()]
        assert len(sizes) > 3 and max(sizes) <= 1000 + 4 + 16 + 4, sizes
        target = {"w": torch.zeros(3, 1000)}
        engine.load(target)
        assert torch.equal(target["w"], w) and engine.verify(1).ok
    assert_zarr_reads(zarr.open_group(f"{url}/step_000000001", mode="r"), {"w": w})
