"""``chaos ckpt``: list, verify and inspect checkpoints written by the engine."""

from __future__ import annotations

import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import click

from antifragile.chaos.cli.common import fail as _fail
from antifragile.chaos.cli.common import is_endpoint
from antifragile.chaos.report import strict_json


def _options(endpoint_url: str | None, pairs: tuple[str, ...], url: str = ""
             ) -> dict[str, Any] | None:
    """fsspec options from the flags. For ``s3://`` URLs the bucket is asked once first, with
    short timeouts, so that a bad endpoint, bucket or credentials is a one-line error (exit 2)
    within seconds instead of the engine's patient retrying. A local path must exist: a typo
    is bad input, not "no committed checkpoint" (a file there is refused by ``open_storage``),
    and takes no endpoint or storage option."""
    from antifragile.engine.storage import local_root

    if not url:  # "$CKPT" unset: ": no such folder" named nothing
        _fail("URL: empty (give a checkpoint folder or URL)")
    if endpoint_url == "":  # "$ENDPOINT" unset: AWS_ENDPOINT_URL or AWS itself was asked
        _fail("--endpoint-url: empty; leave the option out for AWS_ENDPOINT_URL (or AWS), or "
              "give http://host:port")
    root = local_root(url)
    if root is not None and not os.path.exists(root):
        _fail(f"{url}: no such folder")
    flag = "--endpoint-url" if endpoint_url else "--storage-option" if pairs else None
    if root is not None and flag:  # a local folder takes neither: it would be ignored
        _fail(f"{flag}: {url} is a local folder; {flag} is for s3:// (or another fsspec) URLs")
    if endpoint_url and not is_endpoint(endpoint_url):
        _fail(f"--endpoint-url {endpoint_url}: not an endpoint URL (give http://host:port or "
              "https://host)")
    options: dict[str, Any] = {}
    if endpoint_url:
        options["endpoint_url"] = endpoint_url
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint="--storage-option")
        # a flag's "false" is a bool (as text it is true: anon=false would sign nothing)
        given = {"true": True, "false": False}.get(value.lower(), value)
        if key in options and options[key] != given:  # no value shown: it may be a secret
            raise click.BadParameter(f"{key} given twice, with two values (one is dropped): "
                                     "give it once", param_hint="--storage-option")
        options[key] = given
    if url.startswith(("s3://", "s3a://")):  # both S3 to the engine
        from antifragile.chaos.infra.s3 import S3SetupError, check_bucket

        try:
            check_bucket(url, options=options)
        except S3SetupError as exc:
            _fail(str(exc))
    return options or None


def _none_under(url: str, what: str | None = None) -> str:
    """``what`` (there is none of ours), naming a peer engine's committed steps at ``url`` (a
    run of ``checkpoint.engine: dcp`` or ``torchsnapshot``): ``chaos ckpt`` reads ours."""
    from antifragile.chaos.observe.checker import steps_named
    from antifragile.trainer.ckpt_backends import foreign_steps

    found = [f"it holds committed {engine} checkpoints ({steps_named(steps)}), which chaos ckpt "
             "does not read (it reads antifragile.engine's)"
             for engine, steps in foreign_steps("antifragile", url).items()]
    return "; ".join([what or f"no committed checkpoint under {url}", *found])


def _human(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024  # type: ignore[assignment]
    return str(nbytes)


_storage_flags = [
    click.argument("url"),
    click.option("--endpoint-url", help="S3 endpoint (else the standard AWS env vars apply)."),
    click.option("--storage-option", "pairs", multiple=True, metavar="KEY=VALUE",
                 help="A storage option (s3fs's names for s3://, fsspec's for other URLs; "
                      "repeatable)."),
]


def storage_args(fn: Any) -> Any:
    for flag in reversed(_storage_flags):
        fn = flag(fn)
    return fn


@click.group()
def ckpt() -> None:
    """List, verify and inspect checkpoints."""


@ckpt.command("ls")
@storage_args
def ls(url: str, endpoint_url: str | None, pairs: tuple[str, ...]) -> None:
    """List committed steps with their size, and quarantined steps with the reason. A step
    whose COMMIT (or a quarantine note) is damaged is listed so and the exit code is 1;
    storage that fails (refused, unreachable) ends the listing with exit 2: that says nothing
    about the data."""
    from antifragile.engine import CheckpointError, CheckpointNotFoundError
    from antifragile.engine.commit import committed_steps, read_marker
    from antifragile.engine.errors import CheckpointFormatError, StorageError
    from antifragile.engine.quarantine import quarantine_log, quarantined_steps, read_quarantine
    from antifragile.engine.storage import open_storage

    damaged = False
    try:
        storage = open_storage(url, _options(endpoint_url, pairs, url))
        steps = committed_steps(storage)
        hidden = quarantined_steps(storage)
        # the COMMITs the steps quarantined now moved aside (listed with the steps): a note of
        # the log is one of those when it holds the same COMMIT (two processes that quarantine
        # one step at once each write a note, with its own time: one quarantine, not two)
        shown: set[tuple[int, str]] = set()
        if steps or hidden:
            click.echo(f"{'step':>12}  {'bytes':>12}  {'objects':>8}  world")
        else:
            click.echo(_none_under(url))
        # a step quarantined between the two listings (a load beside this) is in both
        for step in sorted({*steps, *hidden}):
            if step in hidden:
                try:
                    found = read_quarantine(storage, step)
                except StorageError:
                    raise
                except CheckpointError as exc:  # its moved-aside COMMIT: the others still count
                    damaged = True
                    click.echo(f"{step:>12}  DAMAGED: {exc} (chaos ckpt verify --step {step})")
                    continue
                if found:
                    shown.add((step, str(found[0].get("commit_b64"))))
                click.echo(f"{step:>12}  quarantined: {found[0].get('reason') if found else '?'}")
                continue
            try:
                marker, manifest = read_marker(storage, step)
            except CheckpointNotFoundError:  # deleted since the listing (retention): not damage
                continue
            except StorageError:  # storage failing says nothing of the data: exit 2
                raise
            except CheckpointFormatError as exc:  # intact for all we know: not damage
                click.echo(f"{step:>12}  {exc}")
                continue
            except CheckpointError as exc:  # the other steps are still worth listing
                damaged = True
                click.echo(f"{step:>12}  DAMAGED: {exc} (chaos ckpt verify --step {step})")
                continue
            click.echo(f"{step:>12}  {_human(int(marker.get('nbytes', 0))):>12}  "
                       f"{len(manifest.objects):>8}  {marker.get('world_size', '?')}")
        notes, damaged_notes = quarantine_log(storage)
        for step, note in notes:  # steps saved again or retired since
            if (step, str(note.get("commit_b64"))) not in shown:
                shown.add((step, str(note.get("commit_b64"))))  # each earlier one once
                when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(note.get("time", 0)))
                click.echo(f"{step:>12}  quarantined earlier ({when}): {note.get('reason')}")
        for note_error in damaged_notes:  # the others are still listed
            damaged = True
            click.echo(f"{'':>12}  DAMAGED: {note_error}")
    except CheckpointError as exc:
        _fail(str(exc))
    if damaged:
        raise SystemExit(1)


@ckpt.command("verify")
@storage_args
@click.option("--step", type=click.IntRange(min=0),
              help="Only this step (default: every committed step).")
def verify(url: str, endpoint_url: str | None, pairs: tuple[str, ...], step: int | None) -> None:
    """Read every object back and check checksums and coverage. Exit 1 on damage; exit 2 for
    a step that is not committed (mistyped, or deleted by retention since it was listed), or
    storage that fails (refused, unreachable: that says nothing about the data), or (no
    damage found) a step of a format this engine does not read (the others are verified).

    Quarantined steps are listed with the reason (they are hidden from loading, so they do not
    make the exit code 1, unless every step is: then nothing loads); ``--step N`` of a
    quarantined step reads it against the manifest its quarantine kept and says what is
    damaged.
    """
    from antifragile.engine import CheckpointError
    from antifragile.engine.commit import committed_steps
    from antifragile.engine.errors import CheckpointFormatError, StorageError
    from antifragile.engine.quarantine import quarantined_steps, read_quarantine
    from antifragile.engine.storage import open_storage
    from antifragile.engine.verify import verify_step

    try:
        storage = open_storage(url, _options(endpoint_url, pairs, url))
        committed = committed_steps(storage)
        hidden = quarantined_steps(storage)
        if step is not None and step not in committed and step not in hidden:
            _fail(_none_under(url, f"step {step} is not a committed checkpoint under {url} "
                              f"(committed: {committed or 'none'})"))
        # a step quarantined between the two listings (a load beside this) is in both: it is
        # listed with the quarantined ones, not verified as a committed one
        steps = [step] if step is not None else [s for s in committed if s not in hidden]
        if not steps and not hidden:
            _fail(_none_under(url))
        damaged = unread = False
        verified = 0  # steps a load can see, read and reported
        with ThreadPoolExecutor(8) as pool:
            for s in steps:
                try:
                    report = verify_step(storage, s, pool)
                except CheckpointFormatError as exc:  # intact for all we know: not damage,
                    if step is not None:  # and the steps after it are still verified
                        raise
                    click.echo(str(exc))
                    unread = True
                    continue
                if step is None and report.quarantined is not None:
                    hidden.append(s)  # quarantined since the listings: listed below with them
                    continue
                click.echo(report.summary())
                damaged |= not report.ok
                verified += 1
        if step is None:
            for s in hidden:
                try:
                    found = read_quarantine(storage, s)
                except StorageError:
                    raise
                except CheckpointError as exc:  # its note holds the COMMIT: damage, listed
                    damaged = True
                    click.echo(f"step {s}: QUARANTINED, and DAMAGED: {exc}")
                    continue
                click.echo(f"step {s}: QUARANTINED: {found[0].get('reason') if found else '?'}")
            if not verified and not unread:  # what a load raises too: nothing it can load
                damaged = True
                click.echo(f"no intact step under {url}: every step is quarantined")
    except CheckpointError as exc:
        _fail(str(exc))
    if damaged or unread:
        raise SystemExit(1 if damaged else 2)


@ckpt.command("inspect")
@storage_args
@click.option("--step", type=click.IntRange(min=0), required=True,
              help="The step to describe.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def inspect(url: str, endpoint_url: str | None, pairs: tuple[str, ...], step: int,
            as_json: bool) -> None:
    """Arrays, shapes, dtypes, bytes and layout of one committed step. Exit 1 when its COMMIT
    or group document is damaged (it reads no shard object: verify does); exit 2 for a
    step that is not committed or storage that fails."""
    from antifragile.engine import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
    from antifragile.engine._paths import is_index
    from antifragile.engine._ranks import rank_array
    from antifragile.engine.load import StepReader, split_cell_key
    from antifragile.engine.storage import open_storage

    try:
        reader = StepReader(open_storage(url, _options(endpoint_url, pairs, url)), step)
        reader.manifest.check_all(where=f"step {step}: COMMIT marker")  # sizes are shown
        with ThreadPoolExecutor(8) as pool:
            reader.load_arrays(list(reader.tensors.values()), pool)
        rows = []
        for path, tensor in sorted(reader.tensors.items()):
            for name in tensor.arrays:
                spec = reader.array(name, tensor)
                nbytes = sum(n for k, (n, _) in reader.manifest.objects.items()
                             if (split_cell_key(k) or ("",))[0] == name)
                shards = math.prod(math.ceil(n / c) for n, c in zip(spec.shape, spec.shard_shape))
                rows.append({"array": name, "tensor": path, "dtype": spec.dtype,
                             "shape": list(spec.shape), "offset": list(spec.offset),
                             "shard_shape": list(spec.shard_shape), "shards": shards,
                             "bytes": nbytes})
        values = {k: v for k, v in reader.values.items()  # "." paths: the engine's own
                  if not k.startswith(".") and k not in reader.values_by_rank}
        # a value that differed between the ranks (a sampler offset): each rank's copy, keyed
        # as read() keys it; only the shared ones were shown, as if it had not been saved
        for path, by_rank in sorted(reader.values_by_rank.items()):
            if path.startswith("."):
                continue
            if not all(is_index(rank) for rank in by_rank):
                raise CheckpointCorruptError(f"step {step}: malformed per-rank values of "
                                             f"{path!r}")
            values.update((rank_array(path, int(rank)), by_rank[rank])
                          for rank in sorted(by_rank, key=int))
        metadata = reader.attrs.get("metadata") or {}  # save(metadata=...): shown only
    except CheckpointCorruptError as exc:  # damage, as ls and verify say: not bad input
        _fail(str(exc), 1)
    except CheckpointNotFoundError as exc:
        _fail(_none_under(url, str(exc)))
    except CheckpointError as exc:
        _fail(str(exc))
    layout = reader.attrs.get("layout")  # shown only, never loaded: not checked by the reader
    layout = layout if isinstance(layout, dict) else {}
    by_rank = reader.commit.get("requests")
    by_rank = by_rank if isinstance(by_rank, dict) else {}
    requests = {
        # what each rank's save requested through its record (waiting for COMMIT excluded)
        "save": sum(n for n in by_rank.values() if isinstance(n, int)),
        "save_by_rank": by_rank,
        # a load of the whole step in one process: COMMIT, zarr.json, the shard objects
        # (and each array's zarr.json where the group's index lacks its layout: older saves)
        "load": 2 + sum(r["shards"] for r in rows) + sum(
            len(t.arrays) for t in reader.tensors.values() if t.layouts is None),
    }
    if as_json:
        click.echo(strict_json({"step": step, "layout": layout, "values": values,
                                "metadata": metadata, "requests": requests, "arrays": rows},
                               indent=2))
        return
    click.echo(f"step {step}  world_size {layout.get('world_size')}  "
               f"meshes {layout.get('meshes')}  {_human(int(reader.commit.get('nbytes', 0)))}")
    click.echo(f"requests: save {requests['save']} (all ranks, through their records), "
               f"load {requests['load']} (the whole step, one process)")
    width = max((len(r["array"]) for r in rows), default=5)
    click.echo(f"{'array':<{width}}  {'dtype':<9} {'shape':<18} {'shard':<18} {'bytes':>10}")
    for r in rows:
        click.echo(f"{r['array']:<{width}}  {r['dtype']:<9} {r['shape']!s:<18} "
                   f"{r['shard_shape']!s:<18} {_human(r['bytes']):>10}")
    if values:
        click.echo(f"values: {', '.join(sorted(values))}")
    if metadata:
        click.echo(f"metadata: {strict_json(metadata)}")
