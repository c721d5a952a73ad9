"""Storage backends: a local path, S3 (through obstore) or any other fsspec URL, behind one small
interface."""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Mapping
from typing import Any

from ..errors import CheckpointError
from ._base import PERMANENT, CountingStorage, RetryingStorage, Storage
from ._local import LocalStorage

__all__ = ["PERMANENT", "READ_ONLY_SCHEMES", "CountingStorage", "LocalStorage", "RetryingStorage",
           "Storage", "local_root", "no_folder_at", "no_storage_for", "open_storage"]


def local_root(url: str) -> str | None:
    """The folder of a local checkpoint URL (a plain path or ``file://``); None for fsspec."""
    return url.removeprefix("file://") if "://" not in url or url.startswith("file://") else None


#: fsspec protocols that read but cannot hold checkpoints: a checkpoint root is written (its
#: objects, a COMMIT), listed and pruned (keep_last)
READ_ONLY_SCHEMES = frozenset({"http", "https"})


def _short_form(url: str) -> str | None:
    """Why ``url``, a scheme without its ``//``, is refused, else None: ``file:/abs`` (RFC
    8089's short form), ``file:``, ``s3:/bucket`` or ``s3:bucket`` (typos of s3://), which a
    local path would take for a folder named ``file:`` or ``s3:`` in the working directory."""
    if "://" in url:
        return None
    head = url[:5].lower()
    if head == "file:":
        return "not a file URL (give file:///abs/path or a plain path)"
    if head[:3] == "s3:":
        return "not an S3 URL (give s3://bucket/prefix)"
    return None


def no_storage_for(url: str) -> str | None:
    """Why no checkpoint can be written under ``url``, by its form and scheme, else None: a
    malformed URL, a scheme that only reads (http, https), or one that no installed fsspec
    implementation serves (a typo, or ``S3://``: schemes are read as given). A local path and
    ``s3://`` are served, but not their short forms (``file:/abs``, ``s3:/bucket``: a folder
    ``file:`` or ``s3:`` to a local path). The one check of a checkpoint root that chaos (a
    scenario's ``checkpoint.url``) and the trainer (``--ckpt-url``) make before anything runs;
    :func:`open_storage`, which also opens checkpoints to read (``chaos ckpt``), makes only the
    short forms' part of it."""
    scheme, sep, _ = url.partition("://")
    if not sep or scheme == "file":
        return _short_form(url)
    try:
        urllib.parse.urlsplit(url)  # what fsspec and the S3 clients parse it with
    except ValueError as exc:
        return f"not a valid URL ({exc})"
    if scheme in ("s3", "s3a"):
        return None
    if scheme.lower() in READ_ONLY_SCHEMES:
        return (f"{scheme}:// storage only reads, and checkpoints are written (give a local "
                "folder or s3://bucket/prefix)")
    import fsspec

    try:
        fsspec.get_filesystem_class(scheme)
    except (ValueError, ImportError) as exc:
        return f"no storage for {scheme}:// ({exc})"
    return None


def open_storage(url: str, storage_options: dict[str, Any] | None = None) -> RetryingStorage:
    """Open a checkpoint root: a plain path or ``file://`` is local, ``s3://`` is S3, anything
else goes through fsspec. A local root takes no ``storage_options`` (refused, not ignored)."""
    if not isinstance(url, str) or not url:
        raise CheckpointError(f"checkpoint url must be a non-empty string, got {url!r}")
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise CheckpointError(f"cannot open {url}: storage_options must be a mapping, not a "
                              f"{type(storage_options).__name__}")
    why = _short_form(url)
    if why:
        raise CheckpointError(f"cannot open {url}: {why}")
    root = local_root(url)
    if root is not None:
        if storage_options:
            names = ", ".join(map(str, storage_options))
            raise CheckpointError(f"{url} is a local folder: storage_options ({names}) are "
                                  "for s3:// (or another fsspec) URLs")
        if os.path.exists(root) and not os.path.isdir(root):
            raise CheckpointError(f"{url} is a file, not a checkpoint folder")
        why = no_folder_at(root)
        if why:
            raise CheckpointError(f"{url}: {why}")
        return RetryingStorage(LocalStorage(root))
    protocol = url.split("://", 1)[0]
    try:
        if protocol in ("s3", "s3a"):
            from ._s3 import S3Storage

            return RetryingStorage(S3Storage(url, storage_options))
        from ._fsspec import FsspecStorage

        return RetryingStorage(FsspecStorage(url, storage_options))
    except ImportError as exc:
        hint = " (pip install 'antifragile[s3]')" if protocol == "s3" else ""
        raise CheckpointError(f"cannot open {url}: {exc}{hint}") from None
    except (ValueError, TypeError, OSError) as exc:  # fsspec's, when its options do not fit
        raise CheckpointError(f"cannot open {url}: {exc}") from None


def no_folder_at(root: str) -> str | None:
    """Why no folder can be made at ``root``: the nearest of it and its parents that is there
    is a file or a link to nothing (a disk not mounted). Its saves failed, and its listing was
    empty: a load said "no committed checkpoint", and a trainer started from scratch."""
    path = os.path.abspath(root)
    while not os.path.lexists(path):
        path = os.path.dirname(path)
    if os.path.isdir(path):
        return None
    if os.path.islink(path) and not os.path.exists(path):
        return f"{path} is a link to {os.readlink(path)}, which does not exist"
    return f"{path} is a file, not a folder"
