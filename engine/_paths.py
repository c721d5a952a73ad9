"""Names on storage: step folders, array names, records and markers.

Everything read back from storage that becomes a path is validated here, so hostile metadata
(``..``, absolute paths, separators) can never address anything outside the checkpoint.
"""

from __future__ import annotations

import re
from collections.abc import Collection

from .errors import CheckpointCorruptError, CheckpointError

# 2: manifest of part CRCs + digests, sealed records and COMMIT; 3: chunk keys ``c.1.0``;
# 4: as 3, with each non-finite float among the JSON values stored as a str (format 3 wrote
# bare ``NaN`` / ``Infinity``, which is not JSON; 4 was written only for a step holding one);
# 5: as 4, the COMMIT's manifest stored as columns (``_format.Manifest.columns``). An engine
# that reads formats up to 4 refuses a step of format 5 as another engine's (it would find no
# manifest and call the step damaged).
FORMAT_VERSION = 5
READABLE_FORMATS = (2, 3, 4, 5)
STEP_DIGITS = 9
MAX_STEP = 2**62  # steps travel in the ranks' int64 all-reduces, negated too
COMMIT = "COMMIT"
ABORT = "ABORT"
QUARANTINE = "QUARANTINE"  # a damaged step's COMMIT, moved aside with the reason
QUARANTINE_LOG = "quarantined"  # every QUARANTINE note also, outside the step folders
RECORDS_DIR = ".ranks"

_STEP_RE = re.compile(rf"^step_([0-9]{{{STEP_DIGITS},}})$")  # \d: any script's digits
_BAD_COMPONENT = re.compile(r"[/\\\x00-\x1f]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")  # str.encode() refuses them: no name on storage
_RESERVED = {"", ".", "..", "zarr.json", COMMIT, ABORT, QUARANTINE, RECORDS_DIR}


def step_dir(step: int) -> str:
    """The folder (zarr group) of a step: ``step_000000120``."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"step must be a non-negative int, got {step!r}")
    if step >= MAX_STEP:
        raise CheckpointError(f"step must be < 2**62, got {step}")
    return f"step_{step:0{STEP_DIGITS}d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a folder name, or None when the name is not a step folder: only the names
    ``step_dir`` gives are (an alias, ``step_0000000005`` beside ``step_000000005``, would be
    looked up, loaded and deleted under the other name)."""
    match = _STEP_RE.match(name)
    if match is None:
        return None
    step = int(match.group(1))
    return step if step < MAX_STEP and name == step_dir(step) else None


def is_index(text: str) -> bool:
    """Whether ``text`` is a non-negative int in ASCII digits (a rank, a chunk coordinate):
    ``str.isdigit()`` also takes '²', which ``int()`` refuses."""
    return text.isascii() and text.isdigit()


def record_key(step: int, rank: int) -> str:
    return f"{step_dir(step)}/{RECORDS_DIR}/{rank}.json"


def chunk_separator(version: int) -> str:
    """The zarr chunk-key separator of a checkpoint format: ``w/c/1/0`` in 2, ``w/c.1.0`` in 3.

    Format 3 stores an array's shard objects beside its ``zarr.json``; with ``/`` every grid
    level was a folder of its own (a 103-array step: 269 folders for 281 files, against 107),
    and a folder is a metadata operation: on a local disk ~0.3 ms each, on a parallel file
    system a round trip to its metadata server."""
    return "/" if version == 2 else "."


def check_component(component: str, *, where: str, saving: bool = False) -> str:
    """Return ``component`` if it is a safe single path component, else raise saying why.
    ``saving``: a state's key, refused with a DEL too (S3 cannot hold it; an array name read
    from storage is not, so a local checkpoint written before this check still verifies)."""
    why = None
    if not isinstance(component, str):
        why = "it is not a str"
    elif component in _RESERVED:
        why = "the name is reserved (empty, '.', '..' or one the checkpoint format uses)"
    elif component.startswith("."):
        why = "it starts with '.' (the format's own names do)"
    elif found := _BAD_COMPONENT.search(component):
        why = (f"it holds {found.group()!r}" if found.group() in "/\\"
               else "it holds a control character")
    elif saving and "\x7f" in component:
        why = "it holds a control character (DEL, which S3 refuses in a name)"
    elif _SURROGATE.search(component):
        why = "it holds a lone surrogate (not valid Unicode, so no file or object name)"
    elif len(component.encode()) > 255:
        why = "it is longer than 255 bytes (a file system's limit on a name)"
    if why is not None:
        raise CheckpointError(f"{where}: {component!r} cannot be a name on storage: {why}")
    return component


def check_array_name(name: str, *, step: int | None = None) -> str:
    """Validate an array name read from storage (``model/layers.0.attn.wq.weight``)."""
    where = f"step {step}" if step is not None else "checkpoint"
    if not isinstance(name, str) or not name:
        raise CheckpointCorruptError(f"{where}: invalid array name {name!r}")
    try:
        for component in name.split("/"):
            check_component(component, where=where)
    except CheckpointError as exc:
        raise CheckpointCorruptError(f"{where}: hostile array name {name!r} ({exc})") from None
    return name


_CONTROL = re.compile(r"[\\\x00-\x09\x0b-\x1f]")  # a backslash or control character, not \n


def check_object_keys(keys: Collection[str], *, step: int) -> None:
    """:func:`check_object_key` of each of ``keys``, in a few passes over them all while none is
    bad (a COMMIT lists every object of the step: a call per key was 0.2 s of every load's
    parse at 4,096 ranks): every component between newlines, one key's after another's."""
    joined = "\n".join(keys)
    parts = "\n" + joined.replace("/", "\n") + "\n"
    if (joined.count("\n") != max(len(keys) - 1, 0) or _CONTROL.search(joined)
            or any(bad in parts for bad in ("\n\n", "\n.\n", "\n..\n"))):
        for key in keys:  # the one to name
            check_object_key(key, step=step)


def check_object_key(key: str, *, step: int) -> str:
    """Validate an object key read from a COMMIT manifest (relative to the step folder)."""
    if not isinstance(key, str) or not key or any(
            c in ("", ".", "..") or _BAD_COMPONENT.search(c) for c in key.split("/")):
        raise CheckpointCorruptError(f"step {step}: hostile object key {key!r} in the manifest")
    return key
