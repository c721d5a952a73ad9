"""Scenario files (DESIGN 4.1): YAML validated into typed models before anything starts.

Every error names the file, the key path and the reason, e.g.
``scenarios/x.yaml: faults.0.rank: rank 9 is outside the world of 8 ranks``.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictInt,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from antifragile.chaos.faults import FAULT_CONFIGS, FaultConfig
from antifragile.chaos.faults.base import Seconds, memory_mib
from antifragile.trainer.progress import (
    HANG_FLOOR_S,
    MIN_LEASE_S,
    STALL_ESCALATION,
    too_short_for_a_lease,
)

#: emulated hosts a run can have: ``chaos.infra.netns.MAX_HOSTS``
MAX_NODES = 90
#: The shipped scenarios (``chaos list``): the repository's ``scenarios/`` folder.
SCENARIOS = Path(__file__).resolve().parent.parent / "scenarios"


#: the engine's bound on a step (``engine._paths.MAX_STEP``), here without importing the engine
#: (and torch): ``chaos validate`` and ``chaos list`` answer at once
MAX_STEP = 2**62

_WORKER_MIB = 400  # resident memory of one CPU trainer worker (torch + a small model), measured
WORKER_LIMIT_REASON = f"one worker needs ~{_WORKER_MIB} MiB; at most 16 per CPU core"


def max_workers() -> int:
    """How many trainer worker processes this machine can hold."""
    return max(1, min(memory_mib() // _WORKER_MIB, 16 * (os.cpu_count() or 1)))


class ScenarioError(Exception):
    """Bad scenario input; the message is meant for the user as is (no traceback)."""


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
    micro_batches: Annotated[StrictInt, Field(ge=1)] = 4
    schedule: Literal["gpipe", "1f1b"] = "1f1b"
    collective_timeout_s: Annotated[Seconds, Field(gt=0)] = 60.0
    #: no training progress for this long is a hang; None: adaptive (max(10 s, 20 x p99 of
    #: the intervals between progress bumps))
    hang_timeout_s: Annotated[Seconds, Field(gt=0)] | None = None
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
        if self.lease_s is not None and self.recovery != "in_process":
            raise ValueError("lease_s: leases are held only under recovery in_process (in "
                             "restart mode torchrun's agents watch the workers)")
        if self.lease_s is not None and self.hang_timeout_s is not None \
                and self.lease_s >= STALL_ESCALATION * self.hang_timeout_s:
            raise ValueError(f"lease_s: {self.lease_s:g} s is not below the watchdog's stall "
                             f"escalation, {STALL_ESCALATION:g} x hang_timeout_s = "
                             f"{STALL_ESCALATION * self.hang_timeout_s:g} s: "
                             "survivors waiting for a lost host would be killed by their own "
                             "watchdogs before it is declared lost")
        if self.lease_s is None and self.recovery == "in_process" \
                and self.hang_timeout_s is not None \
                and (why := too_short_for_a_lease(self.hang_timeout_s)):
            raise ValueError(f"hang_timeout_s: {why}; set hang_timeout_s above "
                             f"{MIN_LEASE_S / STALL_ESCALATION:.2f}")
        if self.lease_s is not None and self.hang_timeout_s is None \
                and self.lease_s >= STALL_ESCALATION * HANG_FLOOR_S:
            raise ValueError(f"lease_s: {self.lease_s:g} s is not below the watchdog's stall "
                             "escalation under the adaptive hang timeout, "
                             f"{STALL_ESCALATION:g} x its floor of {HANG_FLOOR_S:g} s = "
                             f"{STALL_ESCALATION * HANG_FLOOR_S:g} s: set hang_timeout_s, or a "
                             "shorter lease_s")
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
        if p.pp > 1 and ((self.batch_size // p.dp) % self.micro_batches
                         or self.micro_batches < p.pp):
            raise ValueError(f"micro_batches {self.micro_batches} must divide the per-replica "
                             f"batch {self.batch_size // p.dp} and be >= pp {p.pp}")
        if self.nodes > 1 and p.world_size % self.nodes:
            raise ValueError(f"{p.world_size} ranks cannot be split over {self.nodes} nodes")
        return self


_PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")


def is_python(arg: str) -> bool:
    """``trainer.command[0]`` values that mean "the Python interpreter chaos runs in"."""
    return _PYTHON.match(arg) is not None


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
    #: added to every rank's environment
    env: dict[str, str | int | float] = {}
    #: the script reports steps through ``antifragile.probe``: needed by ``at_step`` faults
    #: and by the step, recovery and lost-step measurements (false: time-based faults only)
    probe: bool = True
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
        """Texts and numbers; YAML's booleans would become "1"/"0" (not what was written)."""
        for k, v in env.items() if isinstance(env, dict) else ():
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
        """What a process's environment can hold (the OS refuses the rest when the job starts)."""
        for k, v in env.items():
            if not k or "=" in k or "\0" in k:
                raise ValueError(f"{k!r} is not an environment variable name (empty, or it "
                                 "holds '=' or a NUL byte)")
            if "\0" in str(v):
                raise ValueError(f"{k}: a value cannot hold a NUL byte")
        return {k: str(v) for k, v in env.items()}

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
        if is_python(first):
            script = 1
            while script < len(out) and out[script].startswith("-"):
                if out[script] in ("-c", "-m"):  # code or a module, not a script file
                    return out
                script += 2 if out[script] in ("-W", "-X") else 1  # interpreter options
            if script < len(out):
                found = _find_file(out[script], bases)
                if found is None:
                    raise ValueError(f"command[{script}]: script {out[script]!r} not found "
                                     f"(looked relative to {where})")
                out[script] = found
            return out
        if os.sep in first or first.endswith(".py"):
            found = _find_file(first, bases)
            if found is None:
                raise ValueError(f"command[0]: {first!r} not found (looked relative to "
                                 f"{where})")
            if not found.endswith(".py") and not os.access(found, os.X_OK):
                raise ValueError(f"command[0]: {found} is not executable")
            out[0] = found
            return out
        if shutil.which(first) is None:
            raise ValueError(f"command[0]: {first!r} is not an executable on PATH")
        return out


def _find_file(name: str, bases: list[Path]) -> str | None:
    for base in bases:
        path = (base / os.path.expanduser(name))
        try:
            if path.is_file():
                return str(path.resolve())
        except OSError:  # a name too long, a folder it may not look into: not there either
            continue
    return None


#: settings of the built-in trainer, refused beside ``trainer.command``
_BUILTIN_ONLY = frozenset(TrainerSpec.model_fields) - frozenset(CommandSpec.model_fields)
#: ``checkpoint`` settings that the built-in trainer takes and a command's script decides
_SCRIPT_DECIDES = ("every_steps", "async", "keep_last")
#: fault kinds a command trainer can be given (the others need the built-in trainer's
#: save-phase pause points, emulated hosts or supervisor), and why not
_COMMAND_REFUSES = {
    "crash_during_save": "needs the built-in trainer's save-phase pause points",
    "drop_link": "needs emulated hosts, which run only the built-in trainer",
    "host_down": "needs emulated hosts, which run only the built-in trainer",
}


def _trainer_kind(value: Any) -> str:
    if isinstance(value, CommandSpec) or (isinstance(value, dict) and "command" in value):
        return "command-trainer"
    return "builtin-trainer"


TrainerChoice = Annotated[
    Annotated[TrainerSpec, Tag("builtin-trainer")] | Annotated[CommandSpec, Tag("command-trainer")],
    Discriminator(_trainer_kind)]


#: ``checkpoint.storage_options`` -> the environment variable it becomes for chaos, its S3 checks
#: and every rank (the names s3fs and the engine take in ``storage_options``)
S3_OPTION_VARS = {"endpoint_url": "AWS_ENDPOINT_URL", "key": "AWS_ACCESS_KEY_ID",
                  "secret": "AWS_SECRET_ACCESS_KEY", "token": "AWS_SESSION_TOKEN",
                  "region_name": "AWS_DEFAULT_REGION"}


class CheckpointSpec(_Strict):
    url: str | None = None
    #: for an s3:// url: the endpoint and credentials, over the environment's AWS_* variables
    storage_options: dict[str, str] | None = None
    every_steps: Annotated[StrictInt, Field(ge=1)] = 10
    async_: bool = Field(True, alias="async")
    keep_last: Annotated[StrictInt, Field(ge=1)] = 3
    #: the engine under test: ours, torch.distributed.checkpoint, or torchsnapshot
    engine: Literal["antifragile", "dcp", "torchsnapshot"] = "antifragile"

    @field_validator("url")
    @classmethod
    def _bucket(cls, url: str | None) -> str | None:
        if url is not None and "\0" in url:  # it goes into the trainer's argv and environment
            raise ValueError(f"{url!r} holds a NUL byte")
        if url is not None and url.startswith("s3://") and not url[5:].split("/", 1)[0]:
            raise ValueError(f"{url} names no bucket (give s3://bucket/prefix)")
        return url

    @field_validator("engine")
    @classmethod
    def _peer_storage(cls, engine: str, info: ValidationInfo) -> str:
        url = info.data.get("url")
        if engine != "antifragile" and url and "://" in url and not url.startswith("file://"):
            raise ValueError(f"{engine} is run on local storage only, but url is {url} "
                             "(use engine antifragile, or a local path)")
        return engine

    @model_validator(mode="after")
    def _s3_options(self) -> CheckpointSpec:
        if self.storage_options is None:
            return self
        if not (self.url or "").startswith("s3://"):
            where = self.url or "the run's local folder"
            raise ValueError(f"storage_options: only for an s3:// url, not {where}")
        for key, value in self.storage_options.items():
            if key not in S3_OPTION_VARS:
                raise ValueError(f"storage_options.{key}: unknown option (known: "
                                 f"{', '.join(S3_OPTION_VARS)})")
            if "\0" in value:  # it goes into the environment, which cannot hold one
                raise ValueError(f"storage_options.{key}: holds a NUL byte")
        return self

    def s3_environment(self) -> dict[str, str]:
        """``storage_options`` as the AWS_* variables (the endpoint under both of botocore's
        names, so it wins over an ``AWS_ENDPOINT_URL_S3`` of the environment)."""
        env = {S3_OPTION_VARS[k]: v for k, v in (self.storage_options or {}).items()}
        if "AWS_ENDPOINT_URL" in env:
            env["AWS_ENDPOINT_URL_S3"] = env["AWS_ENDPOINT_URL"]
        return env


class Expect(_Strict):
    bitwise_equal_to_reference: bool = True
    max_recovery_s: Annotated[Seconds, Field(gt=0)] | None = None
    max_lost_steps: Annotated[StrictInt, Field(ge=0)] | None = None


class Scenario(_Strict):
    name: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str = ""
    #: seeds the trainer's generators (and the faults' choices): a 64-bit signed, non-negative
    seed: Annotated[StrictInt, Field(ge=0, le=2**63 - 1)] = 0
    trainer: TrainerChoice = TrainerSpec()
    checkpoint: CheckpointSpec = CheckpointSpec.model_validate({})  # by alias: "async"
    faults: list[Annotated[FaultConfig, Field(discriminator="kind")]] = []
    expect: Expect = Expect()

    @field_validator("name")
    @classmethod
    def _folder_name(cls, name: str) -> str:
        """The name is a folder name (``chaos suite``: ``OUT/<name>/``, cleared before the
        run): ``.`` and ``..`` would name OUT itself or its parent."""
        if name in (".", ".."):
            raise ValueError(f"{name!r} names no folder of its own (reports go to a folder "
                             "named after the scenario): use letters or digits")
        return name

    @property
    def is_command(self) -> bool:
        """The user's own script (``trainer.command``) rather than the built-in trainer."""
        return isinstance(self.trainer, CommandSpec)

    @model_validator(mode="before")
    @classmethod
    def _command_or_builtin(cls, data: Any) -> Any:
        trainer = data.get("trainer") if isinstance(data, dict) else None
        if isinstance(trainer, dict) and "command" in trainer:
            builtin = sorted(_BUILTIN_ONLY & set(trainer))
            if builtin:
                raise ValueError(f"trainer.{builtin[0]}: a setting of the built-in trainer; "
                                 "with trainer.command your script decides it (give command, "
                                 "nproc_per_node, nodes, env, probe, detect_timeout_s)")
            checkpoint = data.get("checkpoint")
            decided = [k for k in _SCRIPT_DECIDES
                       if isinstance(checkpoint, dict) and k in checkpoint]
            if decided:
                raise ValueError(f"checkpoint.{decided[0]}: with trainer.command your script "
                                 "decides when and how it checkpoints (give url, engine)")
        return data

    @model_validator(mode="after")
    def _command_faults(self) -> Scenario:
        t = self.trainer
        if not isinstance(t, CommandSpec):
            return self
        for i, fault in enumerate(self.faults):
            at = f"faults.{i}"
            if fault.kind in _COMMAND_REFUSES:
                raise ValueError(f"{at}.kind: {fault.kind} {_COMMAND_REFUSES[fault.kind]}; a "
                                 "command trainer takes kill_rank, hang_rank (mode process), "
                                 "corrupt_shard, storage_outage and disk_full")
            if getattr(fault, "mode", None) == "thread" and fault.kind == "hang_rank":
                raise ValueError(f"{at}.mode: hang_rank mode thread is noticed only by the "
                                 "built-in trainer's supervisor; use mode process")
            if isinstance(getattr(fault, "rank", None), BaseModel):
                raise ValueError(f"{at}.rank: coordinates need the built-in trainer's mesh; "
                                 f"name a rank (0..{t.world_size - 1}) or random")
            if fault.at_checkpoint is not None:
                raise ValueError(f"{at}.at_checkpoint: a command trainer's checkpoints are "
                                 "its own; use at_step (with the probe), at_s or mtbf_s")
            if fault.at_step is not None and not t.probe:
                raise ValueError(f"{at}.at_step: at_step needs the script to report its steps "
                                 "through antifragile.probe (trainer.probe is false); use "
                                 "at_s or mtbf_s")
        if not t.probe:
            for key in ("max_recovery_s", "max_lost_steps"):
                if getattr(self.expect, key) is not None:
                    raise ValueError(f"expect.{key}: cannot be measured without the probe "
                                     "(trainer.probe is false): the script reports no steps")
        return self

    @model_validator(mode="after")
    def _faults_fit(self) -> Scenario:
        for i, fault in enumerate(self.faults):
            if isinstance(self.trainer, CommandSpec):  # steps and checkpoints: the script's
                dims, steps, checkpoints = (self.trainer.world_size, 1, 1), 2**62, 2**62
            else:
                p = self.trainer.parallel
                dims, steps = (p.dp, p.pp, p.tp), self.trainer.steps
                checkpoints = steps // self.checkpoint.every_steps
            problem = fault.check(dims, steps, checkpoints)
            problem = problem or fault.check_storage(self.checkpoint.url)
            problem = problem or fault.check_nodes(self.trainer.nodes)
            if isinstance(self.trainer, TrainerSpec):  # a script's checkpoints are its own
                problem = problem or fault.check_checkpoints(self.checkpoint.every_steps,
                                                             self.trainer.steps)
                problem = problem or fault.check_trainer(self.trainer)
                problem = problem or fault.check_engine(self.checkpoint.engine)
            if problem:
                key, reason = problem
                raise ValueError(f"faults.{i}{'.' + key if key else ''}: {reason}")
        return self


_TAGS = frozenset(FAULT_CONFIGS) | {"builtin-trainer", "command-trainer"}


def _format_error(path: str, exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"]
                       if not str(x).startswith("function-") and str(x) not in _TAGS)
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        elif err["type"] == "union_tag_not_found":  # a fault entry without its kind
            loc = f"{loc}.kind" if loc else "kind"
            msg = f"missing (known: {', '.join(sorted(FAULT_CONFIGS))})"
        elif err["type"] in ("model_type", "dict_type"):  # pydantic's names out of the message
            msg = _not_a_mapping(err["input"])
        elif err["type"] == "union_tag_invalid":
            msg = (f"unknown fault kind {err['input'].get('kind')!r} "
                   f"(known: {', '.join(sorted(FAULT_CONFIGS))})")
        elif err["type"] in ("int_type", "float_type") and isinstance(err["input"], str) \
                and _EXPONENT_TEXT.match(err["input"]):
            msg = _exponent_text(err["input"], whole=err["type"] == "int_type")
        lines.append(f"{path}: {loc}: {msg}" if loc else f"{path}: {msg}")
    return "\n".join(lines)


#: a number with an exponent that YAML 1.1 (PyYAML) reads as text: ``5e1``, ``1.5e3``, ``1e-3``
#: (it takes an exponent only after a dot and with a sign: ``5.0e+1``)
_EXPONENT_TEXT = re.compile(r"^([-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+))([eE])([-+]?)([0-9]+)$")


def _exponent_text(text: str, *, whole: bool) -> str:
    """Why ``text``, written as a number, is refused: pydantic's "Input should be a valid
    number" named no reason for what the user wrote as one."""
    if whole:
        return (f"{text!r} is text to YAML, not a number; a whole number is due here: write "
                "its digits")
    found = _EXPONENT_TEXT.match(text)
    assert found is not None
    mantissa, e, sign, digits = found.groups()
    signed, unsigned = mantissa[:1] in "+-", mantissa.lstrip("+-")
    unsigned = unsigned if "." in unsigned else f"{unsigned}.0"
    unsigned = f"0{unsigned}" if unsigned.startswith(".") else unsigned  # YAML needs a digit
    number = f"{mantissa[0] if signed else ''}{unsigned}{e}{sign or '+'}{digits}"
    return (f"{text!r} is text to YAML, not a number: it reads an exponent only after a dot "
            f"and with a sign (write {number})")


def _not_a_mapping(value: Any) -> str:
    if value is None:
        return "is empty: give its keys (key: value lines), or leave it out"
    return f"must be a mapping (key: value lines), got {type(value).__name__} {value!r:.40}"


def parse_scenario(data: Any, *, path: str = "<scenario>") -> Scenario:
    """``path`` names the file in errors; a command's script is looked for next to it first."""
    if data is None:
        raise ScenarioError(f"{path}: the file holds no scenario (only comments?); a scenario "
                            "needs at least a name")
    if not isinstance(data, dict):
        raise ScenarioError(f"{path}: a scenario must be a mapping (key: value lines), got "
                            f"{type(data).__name__}")
    base_dirs = [Path(path).resolve().parent] if os.path.isfile(path) else []
    try:
        return Scenario.model_validate(data, context={"base_dirs": base_dirs})
    except ValidationError as exc:
        raise ScenarioError(_format_error(path, exc)) from None


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: Any, line: int) -> None:
        super().__init__(f"line {line}: duplicate key {key!r}")
        self.key, self.line = key, line


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping: plain YAML keeps the
    last, so a second ``faults:`` would silently drop the first's faults. Keys merged in with
    ``<<`` may still be overridden (that is what a merge is for)."""

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                except TypeError:  # unhashable: the base class says so
                    continue
                if duplicate:
                    raise _DuplicateKey(key, key_node.start_mark.line + 1)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_scenario(path: str | Path, *, seed: int | None = None) -> Scenario:
    """Read and validate a scenario file; ``seed`` overrides the file's."""
    path = str(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ScenarioError(f"{path}: not UTF-8 text (byte {exc.start}: "
                            f"{raw[exc.start:exc.start + 1]!r})") from None
    if not text.strip():
        raise ScenarioError(f"{path}: the file is empty (a scenario needs at least a name)")
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: no arbitrary objects
    except _DuplicateKey as exc:
        raise ScenarioError(f"{path}: {exc}") from None
    except RecursionError:  # the YAML composer recurses once per level of nesting
        raise ScenarioError(f"{path}: nested too deeply to be a scenario") from None
    except yaml.reader.ReaderError as exc:  # a character YAML refuses: a position, no mark
        before = text[:exc.position]
        line, column = before.count("\n") + 1, len(before) - before.rfind("\n")
        raise ScenarioError(f"{path}: YAML syntax error (line {line}, column {column}): "
                            f"unacceptable character #x{exc.character:04x}: {exc.reason}"
                            ) from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" (line {where.line + 1}, column {where.column + 1})" if where else ""
        raise ScenarioError(f"{path}: YAML syntax error{at}: "
                            f"{getattr(exc, 'problem', None) or exc}") from None
    if seed is not None and isinstance(data, dict):
        data = {**data, "seed": seed}
    return parse_scenario(data, path=path)
