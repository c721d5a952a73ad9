"""The engine and the trainer on one CUDA device, in one run.

    python -m bench.gpu [--gib 3] [--reps 3] [--trainer-pairs 3] [--json PATH]

Measured side by side, medians of ``--reps``:

- the link: one device-to-host copy of ``--gib`` into pinned memory (CUDA events), the best
  a staging copy can do; and the same bytes as the state's tensors, each copied on its own;
- the engine's staging stall (``save()`` with blocking staging: the copy into its pinned,
  page-aligned staging area) of a state of ``--gib`` on the device, as GiB/s and as a share of
  the link (target >= 0.8x, a verdict from at least 3 ``--reps``); its persist; a load back
  onto the device, checked bit for bit;
- the GPT trainer on the device (NCCL; one process, since NCCL wants a device per rank) in
  paired runs with and without async checkpoints (``bench.trainer``; which run of a pair
  goes first alternates): step-time overhead (target <= 2%).

Exit 0 with PASS/MISS lines; exit 3 without a CUDA device (nothing measured).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._args import at_least, finite

GIB = 2**30
STAGING_TARGET = 0.8  # the engine's staging stall at least this share of the link's speed
MIN_SAMPLES = 3  # as bench.engine's: a median of fewer has no spread to judge by


def staging_verdict(share: float, reps: int) -> str:
    """PASS/MISS of the staging share (link seconds / stall seconds, medians of ``reps``
    each) against :data:`STAGING_TARGET`; ``n/a`` from fewer than :data:`MIN_SAMPLES`."""
    if reps < MIN_SAMPLES:
        return f"n/a (n={reps}: at least {MIN_SAMPLES} samples a side for a verdict, --reps)"
    return "PASS" if share >= STAGING_TARGET else "MISS"


def _state(gib: float) -> dict[str, Any]:
    """A GPT-like state on the device: large fp32 and bf16 matrices, vectors and a scalar."""
    import torch

    d = 4096
    matrices = max(int(gib * GIB // (d * d * 4)), 1)
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = {f"{i}.w": torch.randn(d, d, device="cuda", generator=gen)
              for i in range(matrices - 2)}
    return {"model": {**layers,
                      "emb": torch.randn(d, d, device="cuda", generator=gen).bfloat16(),
                      "head": torch.randn(2 * d, d // 2, device="cuda", generator=gen),
                      "norms": [torch.ones(d, device="cuda") for _ in range(8)],
                      "step": torch.tensor(7, device="cuda")}}


def _tensors(state: dict[str, Any]) -> list[Any]:
    model = state["model"]
    return [v for v in model.values() if not isinstance(v, list)] + model["norms"]


def link(nbytes: int, reps: int) -> float:
    """Seconds of one pinned device-to-host copy of ``nbytes`` (median; CUDA events)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst.copy_(src, non_blocking=True)  # warm-up
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def per_tensor(tensors: list[Any], reps: int) -> float:
    """Seconds to copy each tensor into its own pinned buffer (wall, median)."""
    import torch

    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    times = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for dst, src in zip(pinned, tensors):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def engine(state: dict[str, Any], reps: int, root: str) -> dict[str, Any]:
    """Stall and persist of blocking-staging saves (after one untimed save: plan, staging
    area), and a load back onto the device, bit for bit. The step before each save's is
    deleted after it, untimed (as in ``bench.engine``: retention's deletes, which ``wait()``
    waits for, are no part of a persist)."""
    import torch

    from antifragile.engine import CheckpointEngine
    from antifragile.engine._paths import step_dir
    from bench._machine import remove

    stalls, persists = [], []
    with CheckpointEngine(root, keep_last=None) as ckpt:
        ckpt.save(0, state, blocking=True)
        for i in range(1, reps + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            handle = ckpt.save(i, state)
            handle.wait()
            persists.append(time.perf_counter() - t0)
            stalls.append(handle.stall_s)
            remove(os.path.join(ckpt.url, step_dir(i - 1)))
        target = {"model": {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else
                            [torch.zeros_like(x) for x in v] for k, v in state["model"].items()}}
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loaded = ckpt.load(target)
        torch.cuda.synchronize()
        load_s = time.perf_counter() - t0
    equal = all(torch.equal(a, b) for a, b in zip(_tensors(target), _tensors(state)))
    on_device = all(t.is_cuda for t in _tensors(target))
    return {"stall_s": statistics.median(stalls), "persist_s": statistics.median(persists),
            "load_s": load_s, "loaded_step": loaded, "bitwise_equal": equal and on_device}


def trainer(pairs: int) -> dict[str, Any]:
    """``bench.trainer`` on the device: dp=tp=pp=1 (one GPU), async checkpoints every 20."""
    from bench import trainer as bench_trainer

    args = argparse.Namespace(dp=1, tp=1, pp=1, steps=120, every=20, warmup=21, layers=4,
                              d_model=512, device="cuda")
    runs, overheads = [], []
    with tempfile.TemporaryDirectory(prefix="gpu-trainer-") as tmp:
        for i in range(pairs):
            # which run of a pair goes first alternates, as in bench.trainer: a device that
            # warms up (or slows down) over a pair would otherwise always favour the same side
            if i % 2:
                ckpt = bench_trainer._run(args, Path(tmp) / f"ckpt-{i}", args.every)
                base = bench_trainer._run(args, Path(tmp) / f"none-{i}", None)
            else:
                base = bench_trainer._run(args, Path(tmp) / f"none-{i}", None)
                ckpt = bench_trainer._run(args, Path(tmp) / f"ckpt-{i}", args.every)
            overheads.append(ckpt["mean_step_s"] / base["mean_step_s"] - 1.0)
            runs.append({"none": base, "ckpt": ckpt, "overhead": overheads[-1]})
    return {"runs": runs, "overhead": statistics.median(overheads)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=finite(above=0), default=3.0,
                   help="size of the state on the device")
    p.add_argument("--reps", type=at_least(1), default=3,
                   help="timed repetitions (default 3; the staging target's verdict needs 3)")
    p.add_argument("--trainer-pairs", type=at_least(0), default=3,
                   help="0: no trainer runs; a verdict needs at least 3")
    p.add_argument("--root", help="checkpoint folder (default: a temporary one)")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench.gpu: no CUDA device here; nothing measured")
        return 3
    state = _state(args.gib)
    tensors = _tensors(state)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "bytes": nbytes, "tensors": len(tensors)}
    gib = nbytes / GIB
    print(f"{out['device']}, torch {out['torch']}: state {gib:.2f} GiB in {len(tensors)} tensors")
    out["link_s"] = link(nbytes, args.reps)
    print(f"  link: one pinned D2H copy        {gib / out['link_s']:7.2f} GiB/s")
    out["per_tensor_s"] = per_tensor(tensors, args.reps)
    print(f"  each tensor to its pinned buffer {gib / out['per_tensor_s']:7.2f} GiB/s")
    with tempfile.TemporaryDirectory(prefix="gpu-engine-", dir=args.root) as root:
        out["engine"] = e = engine(state, args.reps, root)
    out["staging_share"] = staging_share = out["link_s"] / e["stall_s"]
    out["staging_verdict"] = staging_verdict(staging_share, args.reps)
    print(f"  engine staging (save() stall)    {gib / e['stall_s']:7.2f} GiB/s = "
          f"{staging_share:.2f}x the link (target >= {STAGING_TARGET}x) {out['staging_verdict']}")
    print(f"  engine persist {e['persist_s']:.2f} s ({gib / e['persist_s']:.2f} GiB/s), load "
          f"onto the device {e['load_s']:.2f} s ({gib / e['load_s']:.2f} GiB/s), bit for bit: "
          f"{e['bitwise_equal']}")
    ok = e["bitwise_equal"]
    if args.trainer_pairs:
        out["trainer"] = t = trainer(args.trainer_pairs)
        for i, r in enumerate(t["runs"]):
            print(f"  trainer pair {i + 1}: mean step {r['none']['mean_step_s'] * 1e3:.2f} ms "
                  f"without, {r['ckpt']['mean_step_s'] * 1e3:.2f} ms with checkpoints every 20 "
                  f"({r['ckpt']['checkpoints']} committed, stall "
                  f"{r['ckpt']['mean_stall_s'] * 1e3:.2f} ms, persist "
                  f"{r['ckpt']['mean_persist_s'] * 1e3:.1f} ms): {r['overhead'] * 100:+.2f}%")
        from bench import trainer as bench_trainer

        t["verdict"] = verdict = bench_trainer.overhead_verdict(
            t["overhead"], [r["ckpt"] for r in t["runs"]])
        print(f"  trainer checkpoint overhead, median of {args.trainer_pairs} pairs: "
              f"{t['overhead'] * 100:+.2f}% (target <= 2%) {verdict}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
