"""Storage backends: a local path, S3 (through obstore) or any other fsspec URL, behind one small
interface."""

from __future__ import annotations

import os
from typing import Any

from ..errors import CheckpointError
from ._base import PERMANENT, CountingStorage, RetryingStorage, Storage
from ._local import LocalStorage

__all__ = ["PERMANENT", "CountingStorage", "LocalStorage", "RetryingStorage", "Storage",
           "local_root", "no_folder_at", "open_storage"]


def local_root(url: str) -> str | None:
    """The folder of a local checkpoint URL (a plain path or ``file://``); None for fsspec."""
    return url.removeprefix("file://") if "://" not in url or url.startswith("file://") else None


def open_storage(url: str, storage_options: dict[str, Any] | None = None) -> RetryingStorage:
    """Open a checkpoint root: a plain path or ``file://`` is local, ``s3://`` is S3, anything
else goes through fsspec. A local root takes no ``storage_options`` (refused, not ignored)."""
    if not isinstance(url, str) or not url:
        raise CheckpointError(f"checkpoint url must be a non-empty string, got {url!r}")
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
