"""Scenario files (DESIGN 4.1): YAML validated into typed models before anything starts.

Every error names the file, the key path and the reason, e.g.
``scenarios/x.yaml: faults.0.rank: rank 9 is outside the world of 8 ranks``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from antifragile.chaos.faults import FAULT_CONFIGS, FaultConfig

#: The shipped scenarios (``chaos list``): the repository's ``scenarios/`` folder.
SCENARIOS = Path(__file__).resolve().parent.parent / "scenarios"


_WORKER_MIB = 400  # resident memory of one CPU trainer worker (torch + a small model), measured
_LIMIT_REASON = f"one worker needs ~{_WORKER_MIB} MiB; at most 16 per CPU core"


def max_workers() -> int:
    """How many trainer worker processes this machine can hold."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    except (OSError, StopIteration, ValueError):
        kib = 16 * 2**20
    return max(1, min(kib // 1024 // _WORKER_MIB, 16 * (os.cpu_count() or 1)))


class ScenarioError(Exception):
    """Bad scenario input; the message is meant for the user as is (no traceback)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Parallel(_Strict):
    dp: Annotated[int, Field(ge=1)] = 1
    tp: Annotated[int, Field(ge=1)] = 1
    pp: Annotated[int, Field(ge=1)] = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp


class ModelSpec(_Strict):
    layers: Annotated[int, Field(ge=1)] = 4
    d_model: Annotated[int, Field(ge=1)] = 64
    heads: Annotated[int, Field(ge=1)] = 4
    vocab: Annotated[int, Field(ge=2)] = 256
    seq_len: Annotated[int, Field(ge=1)] = 32


class TrainerSpec(_Strict):
    parallel: Parallel = Parallel()
    nodes: Annotated[int, Field(ge=1)] = 1
    model: ModelSpec = ModelSpec()
    steps: Annotated[int, Field(ge=1)] = 60
    batch_size: Annotated[int, Field(ge=1)] = 8
    micro_batches: Annotated[int, Field(ge=1)] = 4
    schedule: Literal["gpipe", "1f1b"] = "1f1b"
    collective_timeout_s: Annotated[float, Field(gt=0)] = 60.0
    #: no training progress for this long is a hang; None: adaptive (max(10 s, 20 x p99 of
    #: the intervals between progress bumps))
    hang_timeout_s: Annotated[float, Field(gt=0)] | None = None
    #: after a rank fails: torchrun restarts the group, or the survivors re-form it in process
    #: with a warm spare (falling back to a restart when no spare is left)
    recovery: Literal["restart", "in_process"] = "restart"
    #: warm spare workers for in_process recovery (default 1 there, 0 otherwise)
    spares: Annotated[int, Field(ge=0)] | None = None

    @property
    def spare_workers(self) -> int:
        if self.spares is not None:
            return self.spares
        return 1 if self.recovery == "in_process" else 0

    @model_validator(mode="after")
    def _recovery(self) -> TrainerSpec:
        if self.spares and self.recovery != "in_process":
            raise ValueError(f"spares: {self.spares} spare(s) are used only by recovery "
                             "in_process (restart mode starts new processes instead)")
        if self.recovery == "in_process" and self.nodes > 1:
            raise ValueError("recovery in_process runs on one host (nodes: 1): its store is "
                             "the local torchrun agent's")
        limit = max_workers()
        total = self.parallel.world_size + self.spare_workers
        if total > limit:
            raise ValueError(f"spares: {self.parallel.world_size} ranks + "
                             f"{self.spare_workers} spare(s) = {total} worker processes; "
                             f"this machine holds at most {limit} ({_LIMIT_REASON})")
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
        if self.model.layers < p.pp:
            raise ValueError(f"{self.model.layers} layers cannot fill {p.pp} pipeline stages")
        if p.pp > 1 and ((self.batch_size // p.dp) % self.micro_batches
                         or self.micro_batches < p.pp):
            raise ValueError(f"micro_batches {self.micro_batches} must divide the per-replica "
                             f"batch {self.batch_size // p.dp} and be >= pp {p.pp}")
        if self.nodes > 1 and p.world_size % self.nodes:
            raise ValueError(f"{p.world_size} ranks cannot be split over {self.nodes} nodes")
        return self


class CheckpointSpec(_Strict):
    url: str | None = None
    every_steps: Annotated[int, Field(ge=1)] = 10
    async_: bool = Field(True, alias="async")
    keep_last: Annotated[int, Field(ge=1)] = 3
    #: the engine under test: ours, torch.distributed.checkpoint, or torchsnapshot
    engine: Literal["antifragile", "dcp", "torchsnapshot"] = "antifragile"

    @field_validator("engine")
    @classmethod
    def _peer_storage(cls, engine: str, info: ValidationInfo) -> str:
        url = info.data.get("url")
        if engine != "antifragile" and url and "://" in url and not url.startswith("file://"):
            raise ValueError(f"{engine} is run on local storage only, but url is {url} "
                             "(use engine antifragile, or a local path)")
        return engine


class Expect(_Strict):
    bitwise_equal_to_reference: bool = True
    max_recovery_s: Annotated[float, Field(gt=0)] | None = None
    max_lost_steps: Annotated[int, Field(ge=0)] | None = None


class Scenario(_Strict):
    name: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str = ""
    seed: int = 0
    trainer: TrainerSpec = TrainerSpec()
    checkpoint: CheckpointSpec = CheckpointSpec()
    faults: list[Annotated[FaultConfig, Field(discriminator="kind")]] = []
    expect: Expect = Expect()

    @model_validator(mode="after")
    def _faults_fit(self) -> Scenario:
        for i, fault in enumerate(self.faults):
            p = self.trainer.parallel
            problem = fault.check((p.dp, p.pp, p.tp), self.trainer.steps,
                                  self.trainer.steps // self.checkpoint.every_steps)
            problem = problem or fault.check_storage(self.checkpoint.url)
            problem = problem or fault.check_nodes(self.trainer.nodes)
            if problem:
                key, reason = problem
                raise ValueError(f"faults.{i}{'.' + key if key else ''}: {reason}")
        return self


def _format_error(path: str, exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"]
                       if not str(x).startswith("function-") and str(x) not in FAULT_CONFIGS)
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        elif err["type"] == "union_tag_invalid":
            msg = (f"unknown fault kind {err['input'].get('kind')!r} "
                   f"(known: {', '.join(sorted(FAULT_CONFIGS))})")
        lines.append(f"{path}: {loc}: {msg}" if loc else f"{path}: {msg}")
    return "\n".join(lines)


def parse_scenario(data: Any, *, path: str = "<scenario>") -> Scenario:
    if not isinstance(data, dict):
        raise ScenarioError(f"{path}: a scenario must be a mapping, got {type(data).__name__}")
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        raise ScenarioError(_format_error(path, exc)) from None


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
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" (line {where.line + 1}, column {where.column + 1})" if where else ""
        raise ScenarioError(f"{path}: YAML syntax error{at}: "
                            f"{getattr(exc, 'problem', None) or exc}") from None
    if seed is not None and isinstance(data, dict):
        data = {**data, "seed": seed}
    return parse_scenario(data, path=path)
