"""The processes crashcheck starts (``python -m antifragile.chaos.crashcheck.worker``).

``save``: one rank of the saving job (``RANK``/``WORLD_SIZE``/``MASTER_*`` in the environment,
gloo ranks on CPU). It saves the base steps, prints ``{"base": ...}``, waits for a line on
stdin (the recorder starts meanwhile), saves the recorded step and prints ``{"saved": ...}``.
Its S3 endpoint is the recording proxy.

``check``: a checker that never saw the save. It reads one crash state per line on stdin,
rebuilds it under a fresh prefix of the bucket (one PUT per object, bodies from the recording's
folder, each object byte for byte its recorded body), loads it with a brand-new engine instance
per rule and prints one JSON line per state. Its S3 endpoint is the server itself.

The rebuild goes through the engine's own S3 storage (obstore, with the engine's retries), not
botocore: measured on loopback SeaweedFS (2 cores), 36 small PUTs from 8 threads cost botocore
~0.11 s of CPU (~3 ms a PUT, under the GIL) and 0.14-0.17 s wall, obstore ~0.01 s and 0.05 s;
a default-tier state's rebuild went from ~0.27 s to ~0.12 s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REBUILD_THREADS = 8  # a state's objects are PUT this many at a time


def _say(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def _save_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from antifragile.chaos.crashcheck import engines

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    plan = json.loads(args.plan)
    digests: dict[str, str] = {}
    for step, attempt, keep_last, drop_marker in plan["base"]:
        engines.save(args.engine, args.url, step, attempt=attempt, keep_last=keep_last)
        if world > 1:
            dist.barrier()
        if drop_marker and rank == 0:  # a save that crashed just before its marker
            _drop_marker(args.engine, args.url, step)
        if world > 1:
            dist.barrier()
        digests[f"{step}/{attempt}"] = engines.digest(engines.make_state(step, attempt))
    if rank == 0:
        _say({"base": digests})
        sys.stdin.readline()  # the recorder starts now
    if world > 1:
        dist.barrier()
    step, attempt, keep_last = plan["record"]
    t0 = time.monotonic()
    error: tuple[str, bool] | None = None  # (what it raised, whether that is a refusal)
    try:
        engines.save(args.engine, args.url, step, attempt=attempt, keep_last=keep_last)
    except Exception as exc:  # an engine may refuse the save (e.g. a committed step)
        error = (f"rank {rank}: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}",
                 engines.refuses_committed(args.engine, exc))
    errors: list[tuple[str, bool] | None] = [error]
    if world > 1:  # rank 0 says every rank's error: one on another rank alone is no less
        errors = [None] * world
        dist.all_gather_object(errors, error)
    failed = [e for e in errors if e is not None]
    if rank == 0:
        _say({"saved": engines.digest(engines.make_state(step, attempt)),
              "save_s": time.monotonic() - t0,
              "error": "; ".join(text for text, _ in failed) or None,
              "refused": bool(failed) and all(refused for _, refused in failed)})
    if world > 1:
        dist.destroy_process_group()


def _drop_marker(engine: str, url: str, step: int) -> None:
    import fsspec

    from antifragile.chaos.crashcheck import engines

    marker = "COMMIT" if engine == "antifragile" else engines.MARKERS[engine]
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.rm_file(f"{url.removeprefix('s3://')}/{engines.step_name(step)}/{marker}")


def _check_main(args: argparse.Namespace) -> None:
    import logging
    import warnings
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from antifragile.chaos.crashcheck import engines
    from antifragile.engine.storage import open_storage

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    _share_botocore_data()
    storage = open_storage(f"s3://{args.bucket}")
    pool = ThreadPoolExecutor(REBUILD_THREADS)
    bodies = Path(args.bodies)
    _say({"ready": True})
    for line in sys.stdin:
        task = json.loads(line)
        prefix = task["prefix"]
        t0 = time.monotonic()
        puts = [pool.submit(storage.write, f"{prefix}/{key}", [(bodies / body).read_bytes()])
                for key, body in sorted(task["objects"].items())]
        for put in puts:
            put.result()
        rebuild_s = time.monotonic() - t0
        results = {}
        for rule in task["rules"]:  # read-only rules first: the engine's may quarantine
            t1 = time.monotonic()
            try:
                step, loaded, skipped = engines.load(args.engine, rule,
                                                     f"s3://{args.bucket}/{prefix}")
                results[rule] = {"step": step, "digest": loaded, "skipped": skipped}
            except engines.NothingToLoad as exc:
                results[rule] = {"nothing": str(exc)}
            except BaseException as exc:  # DCP's CheckpointException is a BaseException
                if isinstance(exc, KeyboardInterrupt | SystemExit):
                    raise
                results[rule] = {"error": _one_line(exc)}
            results[rule]["load_s"] = round(time.monotonic() - t1, 4)
        _say({"id": task["id"], "rebuild_s": round(rebuild_s, 4), "results": results})


def _share_botocore_data() -> None:
    """Parse botocore's API description files (the S3 service model, endpoints) once per
    checker, not once per engine instance: every engine still makes its own session, client
    and connections, but re-reading ~1 MB of JSON per state cost about a third of a load."""
    import functools

    import botocore.loaders
    import botocore.session

    botocore.session.create_loader = functools.cache(botocore.loaders.create_loader)


def _one_line(exc: BaseException) -> str:
    """``Type: message`` on one line; for DCP's CheckpointException (every rank's traceback
    in its text), the first failing rank's own exception."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, (inner, _) = min(failures.items())
        return f"{type(exc).__name__} (rank {rank}): {_one_line(inner)}"
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="antifragile.chaos.crashcheck.worker")
    sub = parser.add_subparsers(dest="command", required=True)
    save = sub.add_parser("save")
    save.add_argument("--engine", required=True)
    save.add_argument("--url", required=True)
    save.add_argument("--plan", required=True)
    check = sub.add_parser("check")
    check.add_argument("--engine", required=True)
    check.add_argument("--bucket", required=True)
    check.add_argument("--bodies", required=True)
    args = parser.parse_args(argv)
    if args.command == "save":
        _save_main(args)
    else:
        _check_main(args)


if __name__ == "__main__":
    main()
    # done and said: no interpreter teardown, where a peer's daemon threads (torchsnapshot's,
    # at 2 ranks) still in C++ aborted a saving job ("terminate called without an active
    # exception", exit -6) in ~1 of 6, failing its whole case
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
