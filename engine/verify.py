"""Verification of a committed step: every object read back and checked, coverage complete.

A quarantined step is verified against the COMMIT its quarantine moved aside: the report says
it is quarantined and why, and what is damaged now."""

from __future__ import annotations

import math
from concurrent.futures import Executor
from dataclasses import dataclass, field
from itertools import product

from ._paths import step_dir
from ._restore import check_attributes
from .commit import parse_marker
from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    StorageError,
)
from .load import StepReader, StoredTensor, split_cell_key
from .plan import ArraySpec
from .quarantine import read_quarantine
from .storage import Storage


@dataclass(frozen=True, slots=True)
class Problem:
    """One damaged or missing object: which array (when known), which key, and why."""

    key: str
    array: str | None
    reason: str


@dataclass(slots=True)
class VerifyReport:
    step: int
    ok: bool = True
    objects: int = 0
    nbytes: int = 0
    problems: list[Problem] = field(default_factory=list)
    quarantined: str | None = None  # why the step was quarantined (read against its moved
    # aside manifest), None for a committed step

    def add(self, key: str, array: str | None, reason: str) -> None:
        self.ok = False
        self.problems.append(Problem(key, array, reason))

    @property
    def bad_arrays(self) -> list[str]:
        return sorted({p.array for p in self.problems if p.array})

    def summary(self) -> str:
        head = [f"step {self.step}: QUARANTINED: {self.quarantined}"] if self.quarantined else []
        if not self.problems:  # a quarantined step is never "ok": it does not load
            state = "every object reads intact now" if self.quarantined else "ok"
            return "\n".join([*head, f"step {self.step}: {state} ({self.objects} objects, "
                                      f"{self.nbytes} bytes)"])
        lines = [*head, f"step {self.step}: DAMAGED ({len(self.problems)} problem(s))"]
        lines += [f"  {p.array or '-'}  {p.key}: {p.reason}" for p in self.problems[:50]]
        return "\n".join(lines)


def _array_of(key: str) -> str | None:
    cell = split_cell_key(key)
    return cell[0] if cell else None


def verify_step(storage: Storage, step: int, pool: Executor) -> VerifyReport:
    """Read every object of ``step`` (size, crc32c of every part, each part the one the manifest
    records) and check that the manifest covers every shard of every array the step's index
    names. A quarantined step is read against its moved-aside manifest (never ``ok``). A step
    neither committed nor quarantined raises CheckpointNotFoundError: nothing to verify is not
    damage (a step number mistyped, or deleted by retention), nor is storage failing: its
    StorageError is raised. Nor is a step that went away while it was read (deleted by the
    retention of a job saving beside this reader, quarantined, saved again): its missing or
    replaced objects raise CheckpointNotFoundError saying so, not a damage report."""
    step_dir(step)  # a step that cannot be one is the caller's mistake, raised: not damage
    report = VerifyReport(step)
    moved: bytes | None = None  # the COMMIT a quarantine moved aside, read against
    try:
        try:
            reader = StepReader(storage, step)
        except CheckpointNotFoundError:
            found = read_quarantine(storage, step)
            if found is None:
                raise
            report.ok, report.quarantined = False, str(found[0].get("reason"))
            moved = found[1]
            reader = StepReader(storage, step, marker=moved)
        reader.manifest.check_all(where=f"step {step}: COMMIT marker")  # a load checks its own
    except CheckpointNotFoundError:
        raise  # only the COMMIT's absence raises it: the step is not there to be damaged
    except (StorageError, CheckpointFormatError):  # neither says anything of the data
        raise
    except CheckpointError as exc:  # the marker or the group metadata: name which
        if moved is not None:
            _raise_if_gone(storage, step, moved)
        key = exc.key if isinstance(exc, CheckpointCorruptError) and exc.key else "COMMIT"
        report.add(key, None, str(exc))
        return report

    def parse(job: tuple[str, StoredTensor]) -> tuple[ArraySpec | None, str | None]:
        """One array, all at once on the pool: its layout (from the group's index, or from
        its zarr.json in checkpoints of earlier versions), and what is wrong with its
        zarr.json (read and checked here: it must describe the layout the index records)."""
        name, tensor = job
        try:
            spec = reader.array(name, tensor)
        except StorageError:
            raise
        except CheckpointError as exc:
            return None, str(exc)
        if tensor.layouts is None:
            return spec, None  # read from the document itself, which is checked
        try:
            if reader.array_document(name, tensor) != spec:
                return spec, (f"step {step}, array {name!r}: zarr.json describes a layout that "
                              "differs from the group's index")
        except StorageError:
            raise
        except CheckpointError as exc:
            return spec, str(exc)
        return spec, None

    try:
        check_attributes(reader)
    except CheckpointError as exc:  # what a load of any target would refuse
        report.add("zarr.json", None, str(exc))
    jobs = [(n, t) for t in reader.tensors.values() for n in t.arrays]
    specs: dict[str, ArraySpec] = {}
    read: set[str] = set()  # array documents read and checked here
    for (name, tensor), (spec, error) in zip(jobs, pool.map(parse, jobs)):
        index_failed = spec is None and tensor.layouts is not None
        if not index_failed:
            read.add(f"{name}/zarr.json")
        if error is not None:
            report.add("zarr.json" if index_failed else f"{name}/zarr.json", name, error)
        if spec is not None:
            specs[name] = spec
    cells: dict[str, tuple[ArraySpec, tuple[int, ...]]] = {}
    for tensor in reader.tensors.values():
        covered = 0
        for name in tensor.arrays:
            if name not in specs:
                continue
            spec = specs[name]
            covered += math.prod(spec.shape)
            if not math.prod(spec.shape):
                continue
            grid = [range(math.ceil(n / c)) for n, c in zip(spec.shape, spec.shard_shape)]
            for cell in product(*grid):
                key = spec.cell_key(cell)
                cells[key] = (spec, cell)
                if key not in reader.manifest.objects:
                    report.add(key, name, "shard not in the COMMIT manifest")
        if covered != math.prod(tensor.shape):
            report.add("zarr.json", None, f"the arrays of tensor {tensor.path!r} cover {covered} "
                       f"of its {math.prod(tensor.shape)} elements")
        elif all(name in specs for name in tensor.arrays):
            try:
                reader.arrays_of(tensor)  # as many elements as the tensor: no overlap either
            except CheckpointError as exc:
                report.add("zarr.json", None, str(exc))

    def check(key: str) -> tuple[str, int, str | None]:
        try:
            data = reader.read_object(key)
            if key in cells:
                reader.check_cell(*cells[key], data)
            else:
                reader.check_document(key, data)
            return key, len(data), None
        except StorageError:
            raise
        except CheckpointError as exc:
            return key, 0, str(exc)

    report.objects += sum(key in read for key in reader.manifest.objects)
    report.nbytes += sum(n for key, (n, *_) in reader.manifest.objects.items() if key in read)
    todo = sorted(key for key in reader.manifest.objects if key not in read)
    for key, nbytes, error in pool.map(check, todo):
        report.objects += 1
        report.nbytes += nbytes
        if error:
            report.add(key, _array_of(key), error)
    if report.problems:  # of the save read, or is it gone (a reader beside a training job)?
        if moved is None:
            went = reader.gone()
            if went is not None and not _quarantined_as_read(storage, reader, report):
                raise went
        else:
            _raise_if_gone(storage, step, moved)
    return report


def _quarantined_as_read(storage: Storage, reader: StepReader, report: VerifyReport) -> bool:
    """Whether the save ``reader`` read was quarantined meanwhile (another reader found it
    damaged too): the damage report stands, and says so."""
    try:
        found = read_quarantine(storage, reader.step)
        if found is None or parse_marker(found[1], reader.step, lazy=True)[0].get(
                "nonce") != reader.commit["nonce"]:
            return False
    except CheckpointError:
        return False
    report.quarantined = str(found[0].get("reason"))
    return True


def _raise_if_gone(storage: Storage, step: int, moved: bytes) -> None:
    """CheckpointNotFoundError where quarantined ``step``, verified against the COMMIT its
    note holds (``moved``), is no longer that quarantined save: deleted (retention, or saved
    again) while it was read. Its objects missing then is not damage."""
    try:
        found = read_quarantine(storage, step)
    except CheckpointError:
        return  # a damaged note: the report stands
    if found is None or found[1] != moved:
        raise CheckpointNotFoundError(f"step {step} was deleted while it was verified (by "
                                      "retention, or saved again, in the job writing this "
                                      "root?)")
