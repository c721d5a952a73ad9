"""What every command shares: one-line errors (exit 2), loading a scenario file, making the
output folder."""

from __future__ import annotations

import contextlib
import math
import os
import urllib.parse
from pathlib import Path
from typing import NoReturn

import click

from antifragile.chaos.scenario import Scenario, ScenarioError, load_scenario


def fail(message: str, code: int = 2) -> NoReturn:
    """Print ``error: message`` on stderr and exit (2: bad input)."""
    click.echo(f"error: {message}", err=True)
    raise SystemExit(code)


def load(file: str, seed: int | None = None) -> Scenario:
    """The validated scenario, or exit 2 naming the file, the key path and the reason."""
    try:
        return load_scenario(file, seed=seed)
    except ScenarioError as exc:
        fail(str(exc))


def needs_reference(file: str) -> str:
    """Why ``--no-reference`` cannot run the scenario of ``file`` (it expects bitwise equality)."""
    return (f"{file}: expect.bitwise_equal_to_reference is true, but --no-reference skips the "
            f"reference run it is checked against (set it to false, or drop --no-reference)")


def out_path(path: str, option: str = "--out") -> Path:
    """``path``, checked as an output folder without making it: a file there, or a name the
    file system refuses to look up (too long: ``Path.exists`` raises for it), is bad input;
    so is an empty one (an unset variable, ``--out "$OUT"``: the current folder)."""
    if not path:
        fail(f"{option}: empty; leave the option out for the default folder")
    folder = Path(path)
    try:
        is_file = folder.exists() and not folder.is_dir()
    except OSError as exc:
        fail(f"{option} {path}: {exc.strerror or exc}")
    if is_file:
        fail(f"{option} {path}: is a file, not a folder")
    return folder


def out_folder(path: str, option: str = "--out") -> Path:
    """The output folder, made now: one that cannot be made (a file on its way, a read-only
    or virtual file system) is bad input, reported before any work instead of a traceback
    after it."""
    folder = out_path(path, option)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail(f"{option} {path}: cannot create the folder: {exc.strerror or exc}")
    return folder


def fresh_folder(path: str, option: str = "--out") -> Path:
    """A default output folder of its own (``reports/<name>-<UTC time>``), made now: ``path``,
    or ``path-2``, ``path-3``, ... where another command made it first. Two runs started
    within one second (side by side in a CI matrix) were given the same folder and cleared
    each other's run and checkpoints."""
    base = out_path(path, option)
    try:
        base.parent.mkdir(parents=True, exist_ok=True)
        for n in range(1, 1000):
            folder = base if n == 1 else base.with_name(f"{base.name}-{n}")
            try:
                folder.mkdir()
            except FileExistsError:
                continue
            return folder
    except OSError as exc:
        fail(f"{option} {path}: cannot create the folder: {exc.strerror or exc}")
    fail(f"{option} {path}: the folder and 998 numbered ones exist; give --out")


def drop_if_empty(folder: Path) -> None:
    """Remove an output folder made for a command that then refused its input, if nothing was
    written to it."""
    with contextlib.suppress(OSError):
        os.rmdir(folder)


def seconds_at_least_zero(option: str, value: float) -> float:
    """``value``, or exit 2 when it is negative, infinite or NaN (``x > nan`` is never true,
    so a NaN threshold would silently turn a check off)."""
    if not (math.isfinite(value) and value >= 0):
        fail(f"{option} {value}: must be a finite number >= 0 seconds")
    return value


def is_endpoint(url: str, schemes: tuple[str, ...] = ("http", "https")) -> bool:
    """``url`` is an endpoint: one of ``schemes``, a host and a numeric port, if any. Checked
    before S3 is opened, where botocore's refusal named the bucket, not the option."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:  # "http://[::1": an unclosed IPv6 address
        return False
    return parts.scheme in schemes and bool(parts.hostname)
