"""A scenario's ``trainer:`` block: the built-in trainer's settings (``TrainerSpec``) or the
user's own script (``CommandSpec``), and what this machine can hold."""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import io
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from antifragile.chaos.faults.base import Seconds, memory_mib
from antifragile.trainer.footprint import available_bytes, min_process_bytes, too_large
from antifragile.trainer.progress import (
    MIN_COLLECTIVE_TIMEOUT_S,
    MIN_HANG_TIMEOUT_S,
    MIN_LEASE_S,
    lease_conflict,
)

#: emulated hosts a run can have: ``chaos.infra.netns.MAX_HOSTS``
MAX_NODES = 90


#: the engine's bound on a step (``engine._paths.MAX_STEP``), here without importing the engine
#: (and torch): ``chaos validate`` and ``chaos list`` answer at once
MAX_STEP = 2**62

_WORKER_MIB = 400  # resident memory of one CPU trainer worker (torch + a small model), measured
WORKER_LIMIT_REASON = f"one worker needs ~{_WORKER_MIB} MiB; at most 16 per CPU core"


def max_workers() -> int:
    """How many trainer worker processes this machine can hold."""
    return max(1, min(memory_mib() // _WORKER_MIB, 16 * (os.cpu_count() or 1)))



class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Parallel(_Strict):
    dp: Annotated[StrictInt, Field(ge=1)] = 1
    tp: Annotated[StrictInt, Field(ge=1)] = 1
    pp: Annotated[StrictInt, Field(ge=1)] = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp


class ModelSpec(_Strict):
    layers: Annotated[StrictInt, Field(ge=1)] = 4
    d_model: Annotated[StrictInt, Field(ge=1)] = 64
    heads: Annotated[StrictInt, Field(ge=1)] = 4
    vocab: Annotated[StrictInt, Field(ge=2)] = 256
    seq_len: Annotated[StrictInt, Field(ge=1)] = 32


class TrainerSpec(_Strict):
    parallel: Parallel = Parallel()
    nodes: Annotated[StrictInt, Field(ge=1)] = 1
    model: ModelSpec = ModelSpec()
    steps: Annotated[StrictInt, Field(ge=1)] = 60
    batch_size: Annotated[StrictInt, Field(ge=1)] = 8
    #: micro-batches per step through the pipeline, and its schedule (parallel.pp > 1; at
    #: pp 1 each replica runs its batch in one pass)
    micro_batches: Annotated[StrictInt, Field(ge=1)] = 4
    schedule: Literal["gpipe", "1f1b"] = "1f1b"
    #: each collective's, the store connection's and the workers' start's timeout (at least
    #: 1 s, as the trainer checks)
    collective_timeout_s: Annotated[Seconds, Field(ge=MIN_COLLECTIVE_TIMEOUT_S)] = 60.0
    #: no training progress for this long is a hang; None: adaptive (max(10 s, 20 x p99 of
    #: the intervals between progress bumps))
    hang_timeout_s: Annotated[Seconds, Field(ge=MIN_HANG_TIMEOUT_S)] | None = None
    #: after a rank fails: torchrun restarts the group, or the survivors re-form it in process
    #: with a warm spare (falling back to a restart when no spare is left)
    recovery: Literal["restart", "in_process"] = "restart"
    #: in_process: a worker slot whose supervisor renews no lease for this long is lost,
    #: with its host (default: 5 s, or 1.5 x hang_timeout_s where that is shorter, at least
    #: 1 s; at least 1 s given, as the trainer checks)
    lease_s: Annotated[Seconds, Field(ge=MIN_LEASE_S)] | None = None
    #: warm spare workers for in_process recovery (default one per node there, 0 otherwise)
    spares: Annotated[StrictInt, Field(ge=0)] | None = None

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    @field_validator("steps")
    @classmethod
    def _checkpointable(cls, steps: int) -> int:
        """The run ends with a checkpoint of its last step, and the engine refuses a step of
        2**62 or more (steps travel in the ranks' int64 all-reduces): such a run was "ok",
        then trained until chaos run's time limit and ended with no verdict."""
        if steps >= MAX_STEP:
            raise ValueError(f"{steps} steps: the engine saves steps below 2**62 (the run's "
                             "final checkpoint is of its last step)")
        return steps

    @field_validator("nodes")
    @classmethod
    def _addressable(cls, nodes: int) -> int:
        """Each node is an emulated host with an address of its own (``chaos/infra/netns.py``;
        chaos.infra imports this module, so its ``MAX_HOSTS`` is repeated here)."""
        if nodes > MAX_NODES:
            raise ValueError(f"{nodes} nodes: chaos runs at most {MAX_NODES} emulated hosts (one "
                             "address each on its emulated network)")
        return nodes

    @property
    def spare_workers(self) -> int:
        if self.spares is not None:
            return self.spares
        return self.nodes if self.recovery == "in_process" else 0

    @model_validator(mode="after")
    def _recovery(self) -> TrainerSpec:
        if self.spares and self.recovery != "in_process":
            raise ValueError(f"spares: {self.spares} spare(s) are used only by recovery "
                             "in_process (restart mode starts new processes instead)")
        if why := lease_conflict(self.recovery, self.lease_s, self.hang_timeout_s):
            raise ValueError(why)
        total = self.parallel.world_size + self.spare_workers
        if self.nodes > 1 and total % self.nodes:
            key = "spares" if self.spare_workers else "nodes"  # what the user may change
            raise ValueError(f"{key}: {self.parallel.world_size} ranks + {self.spare_workers} "
                             f"spare(s) = {total} workers cannot be split evenly over "
                             f"{self.nodes} nodes (torchrun starts as many on each)")
        limit = max_workers()
        if total > limit:
            key = "spares" if self.spare_workers else "parallel"
            raise ValueError(f"{key}: {self.parallel.world_size} ranks + "
                             f"{self.spare_workers} spare(s) = {total} worker processes; "
                             f"this machine holds at most {limit} ({WORKER_LIMIT_REASON})")
        return self

    @model_validator(mode="after")
    def _consistent(self) -> TrainerSpec:
        p = self.parallel
        if self.batch_size % p.dp:
            raise ValueError(f"batch_size {self.batch_size} is not divisible by dp {p.dp}")
        if self.model.heads % p.tp:
            raise ValueError(f"model.heads {self.model.heads} is not divisible by tp {p.tp}")
        if self.model.d_model % self.model.heads:
            raise ValueError(f"model.d_model {self.model.d_model} is not divisible by heads")
        rows = -(-self.model.vocab // p.tp)  # the embedding's rows per tp rank (torch.chunk)
        if rows * (p.tp - 1) >= self.model.vocab:  # as the trainer refuses (trainer.config)
            raise ValueError(f"model.vocab {self.model.vocab} leaves tp rank "
                             f"{-(-self.model.vocab // rows)} of {p.tp} no rows of the embedding "
                             f"(split in chunks of {rows}): use a vocab that leaves every tp "
                             "rank some (a multiple of tp does) or a smaller tp")
        if self.model.layers < p.pp:
            raise ValueError(f"{self.model.layers} layers cannot fill {p.pp} pipeline stages")
        if p.pp > 1 and (self.batch_size // p.dp) % self.micro_batches:
            raise ValueError(f"micro_batches {self.micro_batches} must divide the per-replica "
                             f"batch {self.batch_size // p.dp}")
        if p.pp > 1 and self.schedule == "1f1b" and self.micro_batches < p.pp:
            # as the trainer refuses (trainer.config): GPipe takes any number
            raise ValueError(f"micro_batches {self.micro_batches} cannot fill {p.pp} pipeline "
                             "stages with schedule 1f1b: give micro_batches >= pp or schedule "
                             "gpipe")
        if self.nodes > 1 and p.world_size % self.nodes:
            raise ValueError(f"{p.world_size} ranks cannot be split over {self.nodes} nodes")
        m = self.model  # as the trainer refuses (trainer.config): each worker would, exit 2
        parts = min_process_bytes(layers=m.layers, d_model=m.d_model, heads=m.heads,
                                  vocab=m.vocab, seq_len=m.seq_len, mlp_ratio=4,
                                  micro_batch=max(self.batch_size // p.dp
                                                  // (self.micro_batches if p.pp > 1 else 1), 1),
                                  tp=p.tp, pp=p.pp)
        options = {"vocab": ("model.vocab", m.vocab), "seq_len": ("model.seq_len", m.seq_len),
                   "d_model": ("model.d_model", m.d_model),
                   "batch_size": ("batch_size", self.batch_size)}
        if why := too_large(parts, options, available_bytes()):
            raise ValueError(why)
        return self


_PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")


def is_python(arg: str) -> bool:
    """``trainer.command[0]`` values that mean "the Python interpreter chaos runs in"."""
    return _PYTHON.match(arg) is not None


def python_runs(command: list[str]) -> tuple[str, int] | None:
    """What a ``python ...`` command runs: ``("script", i)``, ``("-m", i)`` or ``("-c", i)``
    with the index of the option (``-m``/``-c``, or ``-m<module>``/``-c<code>``) or of the
    script, past the interpreter's options; None for another program or a ``python`` that
    runs nothing (it would read its program from standard input)."""
    if not is_python(command[0]):
        return None
    i = 1
    while i < len(command) and command[i].startswith("-"):
        if command[i][:2] in ("-c", "-m"):
            return command[i][:2], i
        i += 2 if command[i] in ("-W", "-X") else 1  # interpreter options
    return ("script", i) if i < len(command) else None


#: What chaos tells a command trainer (README, "Chaos-test your own trainer"): where to write
#: events and find pause points, where to checkpoint (and resume from), and that it runs under
#: chaos (``chaos.infra.launch.command_env``).
RUN_DIR_ENV, CKPT_URL_ENV, CHAOS_ENV = "ANTIFRAGILE_RUN_DIR", "ANTIFRAGILE_CKPT_URL", \
    "ANTIFRAGILE_CHAOS"
# what every rank of a command trainer gets from torchrun (its agent's worker environment)
# and from chaos, whatever the scenario's ``env`` says
_TORCHRUN = ("torchrun", "from nproc_per_node and nodes")
_SET_FOR_EVERY_RANK = {
    **dict.fromkeys(("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME",
                     "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE",
                     "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
                     "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
                     "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE"), _TORCHRUN),
    RUN_DIR_ENV: ("chaos", "the run's folder"),
    CKPT_URL_ENV: ("chaos", "from checkpoint.url"),
    CHAOS_ENV: ("chaos", "1 under chaos"),
}


class CommandSpec(_Strict):
    """``trainer: {command: [...]}``: the user's own training script, run by chaos under
    torchrun (``--nproc-per-node``, ``--max-restarts``) with ``ANTIFRAGILE_RUN_DIR``,
    ``ANTIFRAGILE_CKPT_URL`` and ``ANTIFRAGILE_CHAOS=1`` in its environment (README, "Chaos-test
    your own trainer"). The script decides its parallelism, steps and checkpoint interval."""

    #: argv of one rank; ``python``/``python3`` is the interpreter chaos runs in, and a script
    #: path is resolved relative to the scenario file, then the working directory
    command: Annotated[list[str], Field(min_length=1)]
    nproc_per_node: Annotated[StrictInt, Field(ge=1)] = 1
    #: one host: emulated hosts (network namespaces) run only the built-in trainer for now
    nodes: Annotated[StrictInt, Field(ge=1)] = 1
    #: added to every rank's environment (a number as its text: the loader refuses one that
    #: would not reach the script as written, ``3.10`` as "3.1")
    env: dict[str, str | int | float] = {}
    #: the script reports steps through ``antifragile.probe``: needed by ``at_step`` faults
    #: and by the step, recovery and lost-step measurements (false: time-based faults only)
    probe: StrictBool = True
    #: the longest the job takes to notice a dead or hung peer (the script's own process-group
    #: timeout or watchdog): a fault counts as the cause of a restart within this (+ teardown)
    detect_timeout_s: Annotated[Seconds, Field(gt=0)] = 60.0

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nodes

    @property
    def spare_workers(self) -> int:
        return 0

    @field_validator("nproc_per_node")
    @classmethod
    def _fits(cls, nproc: int) -> int:
        """As many rank processes as this machine can hold, at the least a trainer's worker
        needs (a typo such as 100000 had torchrun start them all)."""
        limit = max_workers()
        if nproc > limit:
            raise ValueError(f"{nproc} processes; this machine holds at most {limit} "
                             f"({WORKER_LIMIT_REASON})")
        return nproc

    @field_validator("nodes")
    @classmethod
    def _one_host(cls, nodes: int) -> int:
        if nodes != 1:
            raise ValueError(f"{nodes} nodes: a command trainer runs on one host for now "
                             "(emulated hosts run only the built-in trainer); use nodes: 1")
        return nodes

    @field_validator("env", mode="before")
    @classmethod
    def _env_values(cls, env: Any) -> Any:
        """Texts and numbers; YAML's booleans would become "1"/"0" (not what was written).
        Names are text: a boolean, number or null name was refused as "trainer.env.1.[key]"."""
        for k, v in env.items() if isinstance(env, dict) else ():
            if not isinstance(k, str):
                shown = ("null" if k is None else str(k).lower() if isinstance(k, bool)
                         else str(k))
                kind = "null" if k is None else type(k).__name__
                raise ValueError(f"{shown} is a name YAML reads as a {kind}, not text: quote "
                                 f"it ('{shown}')")
            if isinstance(v, bool):
                raise ValueError(f"{k}: {v} is a YAML boolean (true/false/yes/no/on/off); quote "
                                 f"the text the variable should hold, e.g. '{str(v).lower()}'")
            if v is None:
                raise ValueError(f"{k}: no value (null); give a text or a number, '' for empty")
            if not isinstance(v, (str, int, float)):
                raise ValueError(f"{k}: a {type(v).__name__} is not a text or a number")
        return env

    @field_validator("env")
    @classmethod
    def _env_text(cls, env: dict[str, Any]) -> dict[str, str]:
        """What a process's environment can hold (the OS refuses the rest when the job starts),
        none of the variables that torchrun or chaos set for every rank over it, and none that
        torchrun takes for an option its command line does not give (``PET_<OPTION>``)."""
        for k, v in env.items():
            if not k or "=" in k or "\0" in k:
                raise ValueError(f"{k!r} is not an environment variable name (empty, or it "
                                 "holds '=' or a NUL byte)")
            if k in _SET_FOR_EVERY_RANK:
                who, source = _SET_FOR_EVERY_RANK[k]
                raise ValueError(f"{k}: {who} sets it for every rank ({source}); a value here "
                                 "would be replaced")
            if k.startswith("PET_"):  # ``env`` is torchrun's environment too
                option = "--" + k.removeprefix("PET_").lower().replace("_", "-")
                raise ValueError(f"{k}: torchrun reads it as its option {option}; chaos "
                                 "launches torchrun itself (nproc_per_node, one host, its "
                                 "restarts), so a value here would change that launch")
            if "\0" in str(v):
                raise ValueError(f"{k}: a value cannot hold a NUL byte")
        return {k: str(v) for k, v in env.items()}

    @model_validator(mode="after")
    def _module_found(self) -> CommandSpec:
        """``python -m <module>``: its top-level package is somewhere a rank looks (the
        working directory, the scenario's ``PYTHONPATH``, the interpreter's own path), found
        without importing it; a typo failed every rank after the reference's start-up."""
        found = python_module(self.command)
        if found is None:
            return self
        i, module = found
        top = module.split(".")[0]
        if not all(part.isidentifier() for part in module.split(".")):
            raise ValueError(f"command[{i}]: {module!r} is not a module name (give a dotted "
                             "name such as pkg.train; a file runs as [python, path/to/it.py])")
        cwd = os.getcwd()
        pythonpath = [*filter(None, str(self.env.get("PYTHONPATH", "")).split(os.pathsep))]
        if (importlib.machinery.PathFinder.find_spec(top, [cwd, *pythonpath]) is None
                and top not in sys.modules and importlib.util.find_spec(top) is None):
            given = (f" in env's PYTHONPATH ({os.pathsep.join(pythonpath)})," if pythonpath
                     else "")
            raise ValueError(f"command[{i}]: module {top!r} not found (looked in {cwd}, the "
                             f"working directory,{given} and on the interpreter's path)")
        return self

    @model_validator(mode="after")
    def _trainer_options(self) -> CommandSpec:
        """``python -m antifragile.trainer ...``: its options pass the trainer's own checks
        (``trainer.config.check_args``). A mistake fails every worker the same way, exit 2,
        and torchrun restarted them all ``max_restarts`` times (52 with an mtbf fault) before
        the run ended. Only such a command imports the trainer (and torch) here."""
        found = python_module(self.command)
        if found is None or found[1] != "antifragile.trainer":
            return self
        from antifragile.trainer.config import ConfigError, check_args

        options = self.command[found[0] + 1:]
        shown = f"command: python -m antifragile.trainer {' '.join(options)}"
        try:  # argparse prints a help it is asked for (--help, -h, --hel), then exits
            with contextlib.redirect_stdout(io.StringIO()):
                check_args(options)
        except ConfigError as exc:
            raise ValueError(f"{shown}: {exc}") from None
        except SystemExit:
            raise ValueError(f"{shown}: the trainer prints its help and exits: it trains "
                             "nothing") from None
        return self

    @field_validator("command")
    @classmethod
    def _resolve(cls, command: list[str], info: ValidationInfo) -> list[str]:
        """Absolute paths for the executable and the script, or why they cannot be found."""
        for i, arg in enumerate(command):  # no process takes one
            if "\0" in arg:
                raise ValueError(f"command[{i}]: {arg!r} holds a NUL byte")
        bases = [*((info.context or {}).get("base_dirs") or []), Path.cwd()]
        where = " or ".join(dict.fromkeys(str(b) for b in bases))
        out = list(command)
        first = command[0]
        if (launcher := _launcher_at(command)) is not None:
            raise ValueError(f"command[{launcher}]: {command[launcher]!r} is torchrun: chaos "
                             "runs the command under torchrun itself (nproc_per_node ranks); "
                             "give one rank's command line, e.g. [python, train.py, ...]")
        if is_python(first):
            runs = python_runs(out)
            if runs is None:  # ranks would read chaos's standard input (a terminal: forever)
                raise ValueError(f"command: {' '.join(command)} runs nothing (give a script, "
                                 "-m module or -c code)")
            if runs[0] != "script" and runs[1] + 1 == len(out) and len(out[runs[1]]) == 2:
                raise ValueError(f"command[{runs[1]}]: {runs[0]} needs its "
                                 f"{'module' if runs[0] == '-m' else 'code'} after it")
            if runs[0] == "script":  # not code or a module (-c, -m)
                script = runs[1]
                found = _find_file(out[script], bases)
                if found is None:
                    raise ValueError(f"command[{script}]: script {out[script]!r} "
                                     f"{_not_found(out[script], bases, where)}")
                out[script] = found
            return out
        if os.sep in first or first.endswith(".py"):
            found = _find_file(first, bases)
            if found is None:
                raise ValueError(f"command[0]: {first!r} {_not_found(first, bases, where)}")
            if not found.endswith(".py") and not os.access(found, os.X_OK):
                raise ValueError(f"command[0]: {found} is not executable")
            out[0] = found
            return out
        if shutil.which(first) is None:
            raise ValueError(f"command[0]: {first!r} is not an executable on PATH")
        return out


#: torchrun's module names (``python -m``): a launcher, not a rank's program
_TORCHRUN_MODULES = ("torch.distributed.run", "torch.distributed.launch")


def _launcher_at(command: list[str]) -> int | None:
    """Where ``command`` starts torchrun (``torchrun ...``, ``python -m torch.distributed.run``
    or ``.launch``): the index of that argument; None for a rank's own command line. Each rank
    would start a torchrun of its own, its ranks writing into the outer ranks' event files."""
    if os.path.basename(command[0]) == "torchrun":
        return 0
    found = python_module(command)
    return found[0] if found is not None and found[1] in _TORCHRUN_MODULES else None


def python_module(command: list[str]) -> tuple[int, str] | None:
    """Where a ``python -m`` command names its module (``-m<module>`` or ``-m <module>``) and
    the module ("" when nothing follows ``-m``); None for any other command."""
    runs = python_runs(command)
    if runs is None or runs[0] != "-m":
        return None
    i = runs[1] if len(command[runs[1]]) > 2 else runs[1] + 1
    return i, command[i].removeprefix("-m") if i < len(command) else ""


def _not_found(name: str, bases: list[Path], where: str) -> str:
    """Why no file ``name`` was found: a folder of that name, or nothing there."""
    for base in bases:
        try:
            if (base / os.path.expanduser(name)).is_dir():
                return "is a folder, not a file"
        except OSError:  # a name too long, a folder it may not look into
            continue
    return f"not found (looked relative to {where})"


def _find_file(name: str, bases: list[Path]) -> str | None:
    for base in bases:
        path = (base / os.path.expanduser(name))
        try:
            if path.is_file():
                return str(path.resolve())
        except OSError:  # a name too long, a folder it may not look into: not there either
            continue
    return None
