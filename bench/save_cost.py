"""The fixed cost of a save: what the training loop waits for when the state is small.

    python -m bench.save_cost [--ranks 2] [--saves 20] [--json PATH]

A small model's checkpoint is mostly per-tensor bookkeeping, not bytes: the trainer's 2-layer
GPT under FSDP2 on ``--ranks`` gloo processes is 100 tensors (~0.2 MB) per rank plus the
optimizer's values (model, AdamW moments and steps, flattened the way ``get_state_dict`` gives
them). Each process times,
per save and in the same run:

- the engine's ``save()`` return (non-blocking: the loop's wait) and its ``stall_s`` (the
  staging copy alone);
- DCP ``async_save`` return on the same state dict (its loop wait);
- a plain ``copy_`` of every local tensor into preallocated buffers (the bytes' floor);
- the persist of each (``save()`` to committed, ``async_save`` to its future's result and
  the fsync of what DCP does not fsync itself: its ``.metadata`` and folders; the engine
  fsyncs its own files and folders inside ``save()``): for
  a small state on a local disk, file-system metadata (a file per shard, a folder per array),
  not bytes. Neither deletes an older checkpoint inside the timing (DCP never does; the
  engine's previous step is deleted after, untimed, as in ``bench.engine``).

Saves are spaced so each persists before the next (nothing is skipped as busy); the first
two saves of each method (plans, allocations) are not timed. Medians over the timed saves of
the slowest rank are printed with the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import Future
from typing import Any, cast

from bench._args import at_least


def _state(model: Any, optimizer: Any, step: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    m, o = get_state_dict(model, optimizer,
                          options=StateDictOptions(flatten_optimizer_state_dict=True))
    return {"model": m, "optim": o, "train": {"step": step}}


def _worker(rank: int, world: int, port: int, root: str, saves: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from antifragile.engine import CheckpointEngine
    from antifragile.engine._paths import step_dir
    from antifragile.trainer.model import GPT, ModelConfig
    from antifragile.trainer.parallel import apply_fsdp
    from bench._machine import remove
    from bench._peers import fsync_tree

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    torch.manual_seed(0)
    model = GPT(ModelConfig(layers=2, d_model=64, heads=4, vocab=256, seq_len=32))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    apply_fsdp(model, mesh, pipelined=False)  # as the trainer shards it
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    tokens = torch.randint(0, 256, (4, 32))
    model(tokens).float().sum().backward()
    optimizer.step()
    times: dict[str, list[float]] = {"engine_return": [], "engine_stall": [],
                                     "dcp_async_return": [], "memcpy": [],
                                     "engine_persist": [], "dcp_persist": []}
    entries = 0
    # no retention: wait() would wait for its deletes, which DCP's persist has no part of
    with CheckpointEngine(os.path.join(root, "engine"), keep_last=None) as engine:
        for i in range(saves + 2):
            state = _state(model, optimizer, i)
            flat = [t for part in (state["model"], state["optim"]) for t in part.values()
                    if isinstance(t, torch.Tensor)]
            entries = len(flat)
            locals_ = [t.to_local() if hasattr(t, "to_local") else t for t in flat]
            buffers = [torch.empty_like(t) for t in locals_]
            dist.barrier()
            t0 = time.perf_counter()
            for dst, src in zip(buffers, locals_):
                dst.copy_(src)
            t1 = time.perf_counter()
            dist.barrier()
            t_save = time.perf_counter()  # the figures below start with every rank here
            handle = engine.save(i, state)
            t2 = time.perf_counter()
            handle.wait()
            dist.barrier()
            t3 = time.perf_counter()
            dcp_dir = os.path.join(root, f"dcp-{i}")
            future = cast("Future[Any]", dcp.async_save(state, checkpoint_id=dcp_dir))
            t4 = time.perf_counter()
            future.result()
            fsync_tree(dcp_dir)  # its .metadata and folders: DCP fsyncs only its data files
            dist.barrier()
            t5 = time.perf_counter()
            if rank == 0 and i:  # untimed; the next save waits at the barrier above
                remove(os.path.join(engine.url, step_dir(i - 1)))
            if i >= 2:
                times["memcpy"].append(t1 - t0)
                times["engine_return"].append(t2 - t_save)
                times["engine_stall"].append(handle.stall_s)
                times["dcp_async_return"].append(t4 - t3)
                times["engine_persist"].append(t3 - t_save)
                times["dcp_persist"].append(t5 - t3)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"times": times, "entries": entries}, f)
    dist.destroy_process_group()


def run(ranks: int, saves: int) -> dict[str, Any]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="save-cost-") as root:
        out = os.path.join(root, "out")
        os.makedirs(out)
        mp.start_processes(_worker, args=(ranks, port, root, saves, out), nprocs=ranks,
                           start_method="spawn")
        docs = []
        for r in range(ranks):
            with open(os.path.join(out, f"rank{r}.json")) as f:
                docs.append(json.load(f))
    medians = {k: max(statistics.median(d["times"][k]) for d in docs) for k in docs[0]["times"]}
    return {"ranks": ranks, "saves": saves, "entries_per_rank": docs[0]["entries"],
            "median_s": medians,
            "engine_return_vs_dcp_async_return": medians["engine_return"]
            / medians["dcp_async_return"],
            "engine_stall_vs_memcpy": medians["engine_stall"] / medians["memcpy"],
            "engine_persist_vs_dcp_persist": medians["engine_persist"] / medians["dcp_persist"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.save_cost",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=at_least(1), default=2)
    parser.add_argument("--saves", type=at_least(1), default=20)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result = run(args.ranks, args.saves)
    m = result["median_s"]
    print(f"save cost, {result['ranks']} ranks, {result['entries_per_rank']} state entries "
          f"per rank, median of {result['saves']} saves (slowest rank):")
    for key in ("engine_return", "engine_stall", "dcp_async_return", "memcpy", "engine_persist",
                "dcp_persist"):
        print(f"  {key:<18} {m[key] * 1e3:8.2f} ms")
    print(f"  engine save() return / DCP async_save return: "
          f"{result['engine_return_vs_dcp_async_return']:.2f}x")
    print(f"  engine stall / memcpy: {result['engine_stall_vs_memcpy']:.2f}x")
    print(f"  engine persist / DCP persist: {result['engine_persist_vs_dcp_persist']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
