"""Scenario files (DESIGN 4.1): YAML validated into typed models before anything starts.

Every error names the file, the key path and the reason, e.g.
``scenarios/x.yaml: faults.0.rank: rank 9 is outside the world of 8 ranks``.
"""

from __future__ import annotations

import math
import os
import re
import urllib.parse
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    Discriminator,
    Field,
    StrictBool,
    StrictInt,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from antifragile.chaos.faults import FAULT_CONFIGS, FaultConfig
from antifragile.chaos.faults.base import RANK_TAGS, Seconds, shown
from antifragile.chaos.scenario.trainer import (
    MAX_NODES,
    MAX_STEP,
    WORKER_LIMIT_REASON,
    CommandSpec,
    ModelSpec,
    Parallel,
    TrainerSpec,
    _Strict,
    is_python,
    max_workers,
    python_runs,
)

__all__ = [  # the trainer block's models and limits are a scenario's too
    "MAX_FILE_BYTES", "MAX_NAME", "MAX_NODES", "MAX_STEP", "SCENARIOS", "WORKER_LIMIT_REASON",
    "CheckpointSpec", "CommandSpec", "Expect", "ModelSpec", "Parallel", "Scenario",
    "ScenarioError", "TrainerSpec", "is_python", "load_scenario", "max_workers",
    "parse_scenario", "python_runs",
]

#: The shipped scenarios (``chaos list``): the repository's ``scenarios/`` folder.
SCENARIOS = Path(__file__).resolve().parent.parent.parent / "scenarios"
#: the largest scenario file read: the shipped ones are a few KiB (PyYAML takes seconds a MiB)
MAX_FILE_BYTES = 1 << 20


class ScenarioError(Exception):
    """Bad scenario input; the message is meant for the user as is (no traceback)."""


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
    async_: StrictBool = Field(True, alias="async")
    keep_last: Annotated[StrictInt, Field(ge=1)] = 3
    #: the engine under test: ours, torch.distributed.checkpoint, or torchsnapshot
    engine: Literal["antifragile", "dcp", "torchsnapshot"] = "antifragile"

    @field_validator("url")
    @classmethod
    def _bucket(cls, url: str | None) -> str | None:
        if url is None:
            return url
        if "\0" in url:  # it goes into the trainer's argv and environment
            raise ValueError(f"{url!r} holds a NUL byte")
        if (url[:3].lower() == "s3:" or url[:6].lower() == "s3a://") and not url.startswith("s3://"):
            # s3:/b, s3:b: a local folder "s3:" to the engine; S3://b, s3a://b: S3 to the
            # engine, but not to chaos's S3 setup (no endpoint, no proxy)
            raise ValueError(f"{url} is not an S3 URL (give s3://bucket/prefix)")
        if url.lower().startswith("memory://"):
            raise ValueError(f"{url} is each process's own memory: the ranks and chaos would "
                             "not see one store (give a local folder or s3://bucket/prefix)")
        if url.startswith("s3://") and not url[5:].split("/", 1)[0]:
            raise ValueError(f"{url} names no bucket (give s3://bucket/prefix)")
        # well formed, writable, known and its package installed; no short form (file:/abs)
        from antifragile.engine.storage import no_storage_for

        why = no_storage_for(url)
        if why:
            raise ValueError(f"{url}: {why}")
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
            if key == "endpoint_url" and not _is_endpoint(value):  # as the engine refuses
                raise ValueError(f"storage_options.{key}: {value!r} is not an endpoint URL "
                                 "(give http://host:port or https://host)")
        return self

    def s3_environment(self) -> dict[str, str]:
        """``storage_options`` as the AWS_* variables (the endpoint under both of botocore's
        names, so it wins over an ``AWS_ENDPOINT_URL_S3`` of the environment)."""
        env = {S3_OPTION_VARS[k]: v for k, v in (self.storage_options or {}).items()}
        if "AWS_ENDPOINT_URL" in env:
            env["AWS_ENDPOINT_URL_S3"] = env["AWS_ENDPOINT_URL"]
        return env


def _is_endpoint(url: str) -> bool:
    """An http(s) URL with a host and a numeric port, if any (``engine/storage/_s3.py``)."""
    parts = urllib.parse.urlsplit(url)
    try:
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


class Expect(_Strict):
    bitwise_equal_to_reference: StrictBool = True
    max_recovery_s: Annotated[Seconds, Field(gt=0)] | None = None
    max_lost_steps: Annotated[StrictInt, Field(ge=0)] | None = None


#: the longest scenario name: ``reports/<name>-<UTC time>`` stays within a folder name's 255 bytes
MAX_NAME = 200


class Scenario(_Strict):
    name: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str = ""
    #: seeds the trainer's generators and the faults' choices (``chaos/run/draws.py``: each
    #: fault's k-th firing picks the same targets): a 64-bit signed, non-negative
    seed: Annotated[StrictInt, Field(ge=0, le=2**63 - 1)] = 0
    trainer: TrainerChoice = TrainerSpec()
    checkpoint: CheckpointSpec = CheckpointSpec.model_validate({})  # by alias: "async"
    faults: list[Annotated[FaultConfig, Field(discriminator="kind")]] = []
    expect: Expect = Expect()
    #: the longest each run (the fault-free reference, the faulty run) may last before its
    #: job is killed and the run fails (exit 5): a job that deadlocks after a fault
    time_limit_s: Annotated[Seconds, Field(gt=0)] = 3600.0

    @field_validator("name")
    @classmethod
    def _folder_name(cls, name: str) -> str:
        """The name is a folder name (``chaos suite``: ``OUT/<name>/``, cleared before the
        run): ``.`` and ``..`` would name OUT itself or its parent."""
        if name in (".", ".."):
            raise ValueError(f"{name!r} names no folder of its own (reports go to a folder "
                             "named after the scenario): use letters or digits")
        if len(name) > MAX_NAME:  # ASCII, by its pattern: a character is a byte
            raise ValueError(f"{len(name)} characters; a name is at most {MAX_NAME} (it names "
                             "the report folder, reports/<name>-<UTC time>, and a folder name "
                             "is at most 255 bytes)")
        return name

    @property
    def is_command(self) -> bool:
        """The user's own script (``trainer.command``) rather than the built-in trainer."""
        return isinstance(self.trainer, CommandSpec)

    @model_validator(mode="before")
    @classmethod
    def _fault_kinds(cls, data: Any) -> Any:
        """A fault's kind that is no text, refused before pydantic looks it up: it writes the
        whole value into its error, and a YAML alias makes a list of 9**9 texts out of ten
        lines (minutes and gigabytes)."""
        faults = data.get("faults") if isinstance(data, dict) else None
        for i, fault in enumerate(faults if isinstance(faults, list) else ()):
            kind = fault.get("kind") if isinstance(fault, dict) else None
            if kind is not None and not isinstance(kind, str):
                raise ValueError(f"faults.{i}.kind: {shown(kind)} is not a fault kind (known: "
                                 f"{', '.join(sorted(FAULT_CONFIGS))})")
        return data

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
                                 "corrupt_shard, storage_outage, storage_node_down and "
                                 "disk_full")
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
        for i, fault in enumerate(self.faults):
            # a pass beyond the first comes only after a recovery rewound the job past the step
            if fault.on_pass > 1 and not any(other.ends_attempt for j, other
                                             in enumerate(self.faults) if j != i):
                step = fault.trigger_step(self.checkpoint.every_steps)
                raise ValueError(f"faults.{i}.on_pass: pass {fault.on_pass} of step {step} "
                                 "never comes: no other fault ends an attempt (a fault on "
                                 "stored data does not), so the job gets to that step once")
        volumes = [(i, f.volume_mib) for i, f in enumerate(self.faults) if f.kind == "disk_full"]
        for i, mib in volumes[1:]:
            if mib != volumes[0][1]:
                raise ValueError(f"faults.{i}.volume_mib: {mib} MiB, but faults.{volumes[0][0]} "
                                 f"(disk_full) asks for {volumes[0][1]} MiB: the run's "
                                 "checkpoints go to one volume; give every disk_full the same "
                                 "volume_mib")
        return self


_TAGS = frozenset(FAULT_CONFIGS) | {"builtin-trainer", "command-trainer"} | RANK_TAGS


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
        elif err["type"] in ("model_type", "dict_type", "model_attributes_type"):
            # pydantic's names out of the message (model_attributes_type: a fault entry)
            msg = _not_a_mapping(err["input"])
        elif err["type"] == "union_tag_invalid":
            msg = (f"unknown fault kind {shown(err['input'].get('kind'))} "
                   f"(known: {', '.join(sorted(FAULT_CONFIGS))})")
        elif err["type"] in ("int_type", "float_type") and isinstance(err["input"], str) \
                and _EXPONENT_TEXT.match(err["input"]):
            msg = _exponent_text(err["input"], whole=err["type"] == "int_type")
        if found := _COMMAND_ARG.match(msg):  # a check of the command line as a whole
            loc, msg = f"{loc.removesuffix('.command')}.command.{found[1]}", msg[found.end():]
        lines.append(f"{path}: {loc}: {msg}" if loc else f"{path}: {msg}")
    return "\n".join(lines)


#: how the checks of ``trainer.command`` as a whole name the argument at fault: moved into
#: the location, written as pydantic writes a list's item (``trainer.command.1``, as
#: ``faults.0``), not as a second location after the first
_COMMAND_ARG = re.compile(r"^command\[(\d+)\]: ")


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
    if not math.isfinite(float(number)):  # the number suggested would be refused in turn
        return (f"{text!r} is text to YAML, not a number; as a number it would be too large: "
                "not finite (a finite number is due here)")
    return (f"{text!r} is text to YAML, not a number: it reads an exponent only after a dot "
            f"and with a sign (write {number})")


def _not_a_mapping(value: Any) -> str:
    if value is None:
        return "is empty: give its keys (key: value lines), or leave it out"
    return f"must be a mapping (key: value lines), got {type(value).__name__} {shown(value):.40}"


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


class _TwoReadings(yaml.YAMLError):
    def __init__(self, line: int, where: str, reading: str) -> None:
        super().__init__(f"line {line}: {where}{reading}")


_INT, _FLOAT, _BOOL = (f"tag:yaml.org,2002:{t}" for t in ("int", "float", "bool"))


def _two_readings(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> str | None:
    """How YAML 1.1 (PyYAML) and YAML 1.2 (the core schema: most other readers, and most
    users' expectation) read a plain scalar apart, or None where they agree."""
    text = node.value
    if node.tag == _BOOL:
        if text.lower() in ("true", "false"):
            return None
        value = "true" if loader.construct_yaml_bool(node) else "false"
        return (f"{text} is {value} to YAML 1.1 but text to YAML 1.2: write {value}, or quote "
                "it for text")
    if node.tag not in (_INT, _FLOAT):
        return None
    number = loader.construct_yaml_int(node) if node.tag == _INT else \
        loader.construct_yaml_float(node)
    body = text.lstrip("+-")
    if node.tag == _INT and "_" not in text and ":" not in text and re.fullmatch("0[0-7]+", body):
        decimal = int(text, 10)
        if decimal == number:  # 00 to 07
            return None
        return (f"{text} is octal {number} to YAML 1.1 but {decimal} to YAML 1.2: write "
                f"{number} or {decimal} without the leading zero")
    if ":" in text:
        read = f"{number!r} (base 60)"
    elif body[:2] in ("0b", "0B") and "_" not in text:
        read = f"binary {number!r}"
    elif "_" in text or (body[:2] in ("0x", "0X") and body != text):  # 1.2: hex has no sign
        read = repr(number)
    else:
        return None
    return (f"{text} is {read} to YAML 1.1 but text to YAML 1.2: write {number!r}, or quote "
            "it for text")


def _env_reading(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> str | None:
    """Why a plain value under ``trainer.env`` (text, for the environment) needs quotes: a
    boolean, or a number that reaches the script as other text than written (``3.10``: "3.1",
    ``0x10``: "16"); None where it does not."""
    quote = f"quote it ('{node.value}') for that text"
    if node.tag == _BOOL:
        return f"{node.value} is a boolean to YAML, not text: {quote}"
    if node.tag not in (_INT, _FLOAT):
        return None
    number = loader.construct_yaml_int(node) if node.tag == _INT else \
        loader.construct_yaml_float(node)
    return None if str(number) == node.value else \
        f"{node.value} would reach the script as {str(number)!r}: {quote}"


def _command_reading(node: yaml.ScalarNode) -> str | None:
    """Why a plain item of ``trainer.command`` (an argument, text) needs quotes: YAML reads it
    as a number or a boolean (``--steps, 60``), which no command line holds; None for text."""
    if node.tag not in (_INT, _FLOAT, _BOOL):
        return None
    kind = "a boolean" if node.tag == _BOOL else "a number"
    return (f"{node.value} is {kind} to YAML, not text: quote it ('{node.value}'); a command "
            "line is text")


def _refuse_two_readings(loader: yaml.SafeLoader, root: yaml.Node) -> None:
    """Refuse a plain number or boolean that YAML 1.1 and 1.2 read apart (``017``: 15 or 17;
    ``1:30``: 90 or text; ``no``: false or text), naming its line and key path."""
    seen: set[int] = set()
    todo: list[tuple[yaml.Node, str, bool]] = [(root, "", False)]
    while todo:
        node, path, is_key = todo.pop()
        if id(node) in seen:  # an alias: checked where its anchor is
            continue
        seen.add(id(node))
        if isinstance(node, yaml.ScalarNode):
            if node.style is None and (reading := (
                    _env_reading(loader, node) if not is_key and path.startswith("trainer.env.")
                    else _command_reading(node) if not is_key
                    and path.startswith("trainer.command.")
                    else _two_readings(loader, node))):
                where = (f"{path}: " if path else "") + ("the key " if is_key else "")
                raise _TwoReadings(node.start_mark.line + 1, where, reading)
        elif isinstance(node, yaml.SequenceNode):
            todo.extend((item, f"{path}.{i}" if path else str(i), False)
                        for i, item in reversed(list(enumerate(node.value))))
        elif isinstance(node, yaml.MappingNode):
            for key_node, value_node in reversed(node.value):
                if key_node.tag == "tag:yaml.org,2002:merge":  # its keys are this mapping's
                    merged = value_node.value if isinstance(value_node, yaml.SequenceNode) \
                        else [value_node]
                    todo.extend((m, path, False) for m in reversed(merged))
                    continue
                name = key_node.value if isinstance(key_node, yaml.ScalarNode) else "?"
                todo.append((value_node, f"{path}.{name}" if path else str(name), False))
                todo.append((key_node, path, True))


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping: plain YAML keeps the
    last, so a second ``faults:`` would silently drop the first's faults. Keys merged in with
    ``<<`` may still be overridden (that is what a merge is for)."""

    def construct_document(self, node: yaml.Node) -> Any:
        _refuse_two_readings(self, node)
        return super().construct_document(node)

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
            raw = f.read(MAX_FILE_BYTES + 1)  # /dev/zero would be read until memory ran out
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise ScenarioError(f"{path}: larger than {MAX_FILE_BYTES >> 20} MiB: not a scenario "
                            "file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ScenarioError(f"{path}: not UTF-8 text (byte {exc.start}: "
                            f"{raw[exc.start:exc.start + 1]!r})") from None
    if not text.strip():
        raise ScenarioError(f"{path}: the file is empty (a scenario needs at least a name)")
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: no arbitrary objects
    except (_DuplicateKey, _TwoReadings) as exc:
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
