"""What every fault shares: its trigger, its target, and how it is injected (from outside)."""

from __future__ import annotations

import logging
import os
import random
import reprlib
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    StrictFloat,
    StrictInt,
    Tag,
)

from antifragile.chaos.infra.weed import process_state, start_time

if TYPE_CHECKING:
    from antifragile.chaos.infra.netns import Network
    from antifragile.chaos.infra.proxy import FaultProxy
    from antifragile.chaos.infra.seaweedfs import SeaweedCluster
    from antifragile.chaos.infra.volume import Volume

log = logging.getLogger(__name__)

#: A time in seconds: a number (not a YAML ``true``), finite (an infinite or NaN time divides
#: by zero in the mtbf arrivals, or kills the timer thread that ends a fault, so a stopped rank
#: is never continued) and no longer than a timer can wait.
Seconds = Annotated[StrictFloat, Field(allow_inf_nan=False, le=threading.TIMEOUT_MAX)]


_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother = 2, 60, 60


def shown(value: Any) -> str:
    """``repr(value)`` in short, for an error about a value from a scenario file: a YAML alias
    makes a list of 9**9 texts out of ten lines, and its whole repr takes minutes and
    gigabytes."""
    return _SHOWN.repr(value)


class Coordinates(BaseModel):
    """A rank named by its parallel coordinates."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    dp: Annotated[StrictInt, Field(ge=0)] = 0
    pp: Annotated[StrictInt, Field(ge=0)] = 0
    tp: Annotated[StrictInt, Field(ge=0)] = 0


def _rank_input(value: Any) -> Any:
    """One clear error for what is no rank at all (a YAML ``true`` is not rank 1)."""
    if isinstance(value, bool) or not (isinstance(value, int | dict | Coordinates)
                                       or value == "random"):
        raise ValueError(f"{shown(value)} is not a rank: give a rank number, random, or "
                         "coordinates {dp, pp, tp}")
    return value


def _rank_kind(value: Any) -> str:
    return "rank-coordinates" if isinstance(value, dict | Coordinates) else (
        "rank-random" if value == "random" else "rank-number")


#: the union's branch tags: a bad value is checked against its own branch only (coordinates
#: with an unknown key were three errors, two of them naming pydantic's int and 'random'
#: branches); the scenario's errors leave the tags out of the key path
RANK_TAGS = frozenset({"rank-number", "rank-random", "rank-coordinates"})

RankTarget = Annotated[
    Annotated[
        Annotated[StrictInt, Tag("rank-number")] | Annotated[Literal["random"], Tag("rank-random")]
        | Annotated[Coordinates, Tag("rank-coordinates")],
        Discriminator(_rank_kind)],
    BeforeValidator(_rank_input)]


class FaultBase(BaseModel):
    """Trigger: exactly one of ``at_step`` (the first time any rank finishes that step),
    ``at_checkpoint`` (the n-th checkpoint of the run), ``mtbf_s`` (seeded exponential
    arrivals, mean ``mtbf_s`` seconds, until the run ends) or ``at_s`` (once, that many seconds
    after the job started, at the first moment all its ranks are up). ``mtbf_s`` and ``at_s``
    need nothing from the trainer: they work on any training script. ``on_pass`` (with
    ``at_step`` or ``at_checkpoint``): the n-th time the job gets there, counting the passes
    made again after a recovery resumed from an earlier step; the same fault at the same step
    on passes 1, 2, 3 is a crash loop."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    #: whether the fault can end the job's attempt (so the job gets to a step again after its
    #: recovery: another fault's ``on_pass`` beyond 1); False for faults on stored data only
    ends_attempt: ClassVar[bool] = True
    at_step: Annotated[StrictInt, Field(ge=1)] | None = None
    at_checkpoint: Annotated[StrictInt, Field(ge=1)] | None = None
    mtbf_s: Annotated[Seconds, Field(gt=0)] | None = None
    at_s: Annotated[Seconds, Field(ge=0)] | None = None
    on_pass: Annotated[StrictInt, Field(ge=1)] = 1

    def check(self, dims: tuple[int, int, int], steps: int, checkpoints: int
              ) -> tuple[str, str] | None:
        """(key, reason) if this fault cannot happen in a run of ``dims`` = (dp, pp, tp)."""
        triggers = [t for t in ("at_step", "at_checkpoint", "mtbf_s", "at_s")
                    if getattr(self, t) is not None]
        if len(triggers) != 1:
            return "", "give exactly one trigger: at_step, at_checkpoint, mtbf_s or at_s"
        if self.on_pass != 1 and self.at_step is None and self.at_checkpoint is None:
            return "on_pass", ("a pass counts the times the job gets to a step: it needs "
                               "at_step or at_checkpoint")
        if self.at_step is not None and self.at_step >= steps:
            return "at_step", f"step {self.at_step} is not before the last step ({steps})"
        if self.at_checkpoint is not None and self.at_checkpoint > checkpoints:
            return "at_checkpoint", f"the run takes only {checkpoints} checkpoint(s)"
        rank = getattr(self, "rank", None)
        world_size = dims[0] * dims[1] * dims[2]
        if isinstance(rank, int) and not 0 <= rank < world_size:
            return "rank", f"rank {rank} is outside the world of {world_size} ranks"
        if isinstance(rank, Coordinates) and any(
                c >= n for c, n in zip((rank.dp, rank.pp, rank.tp), dims)):
            return "rank", f"{rank.model_dump()} is outside the mesh (dp, pp, tp) = {dims}"
        return None

    def check_storage(self, url: str | None) -> tuple[str, str] | None:
        """(key, reason) if this fault cannot act on checkpoints stored at ``url`` (None: a
        folder in the run directory)."""
        return None

    def check_nodes(self, nodes: int) -> tuple[str, str] | None:
        """(key, reason) if this fault cannot happen on ``nodes`` (emulated) hosts."""
        return None

    def check_trainer(self, trainer: Any) -> tuple[str, str] | None:
        """(key, reason) if this fault cannot end well with the built-in ``trainer``
        (a ``TrainerSpec``: recovery mode, spares, nodes)."""
        return None

    def check_engine(self, engine: str) -> tuple[str, str] | None:
        """(key, reason) if this fault cannot happen to the built-in trainer checkpointing
        with ``engine`` (``checkpoint.engine``)."""
        return None

    def check_checkpoints(self, every_steps: int, steps: int) -> tuple[str, str] | None:
        """(key, reason) if this fault names a checkpoint that the built-in trainer, saving
        every ``every_steps`` of ``steps`` steps, does not have when the fault fires, or one
        it cannot fire at to any effect: the last step's, whose save blocks until committed,
        so a fault held at the end of that step finds nothing left to train (as ``at_step``
        at the last step, refused by ``check``)."""
        if self.at_checkpoint is not None and self.at_checkpoint * every_steps >= steps:
            return "at_checkpoint", (f"checkpoint {self.at_checkpoint} is the last step's "
                                     f"(step {steps}), saved before the run ends: a fault "
                                     "there fires when nothing is left to train; name an "
                                     "earlier checkpoint")
        return None

    def trigger_step(self, every_steps: int) -> int | None:
        """The step a step- or checkpoint-triggered fault fires at (None: time-triggered)."""
        if self.at_checkpoint is not None:
            return self.at_checkpoint * every_steps
        return self.at_step


@dataclass(slots=True)
class Injection:
    """What was done, when, to whom: the runner's half of the timeline.

    ``skipped``: the fault's mechanism is unavailable here (no network namespaces, no proxy in
    front of S3); the scenario was not tested as written (verdict ``skipped``). ``missed``: the
    mechanism was there but the fault found nothing to act on when it was due (no committed
    checkpoint to corrupt, the rank had already exited); the fault did not happen (verdict
    ``fail``). ``fault_index``: which fault of the scenario's ``faults`` this is (set by the
    runner; an ``mtbf_s`` fault has one injection per arrival)."""

    kind: str
    t: float
    step: int | None = None
    rank: int | None = None
    skipped: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    missed: str | None = None
    fault_index: int | None = None


class Endings:
    """The ends of a run's faults that last ``duration_s`` (restore a link, continue a stopped
    rank, stop a fill, heal a proxy, restart a volume server): each runs at its time, or when
    the run ends first (``end_now``), never later. A fault's end that outlived its run acted
    on the next run of ``chaos suite`` or ``chaos tune`` in the same process (a volume server
    of the next run's cluster restarted, a pid that is now another process continued), and
    left the next run's network, cluster or volume in its state. An end made with the run
    (``on_time`` False) undoes the fault but records nothing: the report still says the
    fault had not ended when the run did."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._due: list[tuple[threading.Timer, Callable[[bool], None]]] = []
        self._closed = False

    def after(self, seconds: float, end: Callable[[bool], None]) -> None:
        """Run ``end(on_time)`` once: ``end(True)`` ``seconds`` from now, or ``end(False)`` at
        ``end_now`` if that comes first (at once if the run has ended)."""
        once = threading.Lock()
        done = [False]

        def run_once(on_time: bool = True) -> None:
            with once:  # end_now waits for an end the timer has begun
                if not done[0]:
                    done[0] = True
                    try:
                        end(on_time)
                    except Exception:  # each fault records its own; this one did not
                        log.exception("a fault's end failed")

        timer = threading.Timer(seconds, run_once)
        timer.daemon = True
        with self._lock:
            closed = self._closed
            if not closed:
                self._due.append((timer, run_once))
                timer.start()
        if closed:
            run_once(False)

    def end_now(self) -> None:
        """The run ended: every end not yet made is made now, in the order they were due;
        also those after one that a Ctrl-C or SIGTERM interrupted, which is raised after."""
        with self._lock:
            self._closed = True
            due, self._due = self._due, []
        interrupted: BaseException | None = None
        for timer, run_once in due:
            timer.cancel()
            try:
                run_once(False)
            except BaseException as exc:  # only what run_once lets through: an interrupt
                interrupted = interrupted or exc
        if interrupted is not None:
            raise interrupted


KILL_WAIT_S = 2.0  # how long ``Target.signal`` waits for a SIGKILLed process to be dead


@dataclass(slots=True)
class Target:
    """The running job as the faults see it. A rank is its pid *and* its process's start
    time (``started``): pids are recycled, and once a rank has died and been reaped its pid
    may be another process's, even one that is not the job's, which no fault may signal,
    stop or trace (``runs``). A rank given no start time is the process its pid names when
    the target is made."""

    pids: dict[int, int]  # rank -> worker pid of the current attempt
    coordinates: dict[int, tuple[int, int, int]]  # rank -> (dp, pp, tp)
    ckpt_url: str
    rng: random.Random
    ckpt_engine: str = "antifragile"  # what saves the checkpoints (checkpoint.engine)
    #: the steps whose save a rank staged (its events): one may still persist without having
    #: written anything yet
    staged: frozenset[int] = frozenset()
    network: Network | None = None  # the emulated hosts when trainer.nodes > 1
    network_error: str | None = None  # why there are none although trainer.nodes > 1
    storage_proxy: FaultProxy | None = None  # in front of S3, for storage_outage
    storage_proxy_unavailable: str | None = None  # why there is none, if one was wanted
    storage_cluster: SeaweedCluster | None = None  # the S3 store chaos started, for node faults
    storage_cluster_unavailable: str | None = None  # why there is none
    volume: Volume | None = None  # the file system chaos mounted for the checkpoints
    volume_unavailable: str | None = None  # why there is none, if one was wanted
    hit: set[int] = field(default_factory=set)  # ranks a fault already signalled (this point)
    endings: Endings = field(default_factory=Endings)  # when faults that last end
    #: rank -> its process's start time (``start_time``), read when the job named it; None:
    #: it had exited by then
    started: dict[int, int | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for rank, pid in self.pids.items():
            self.started.setdefault(rank, start_time(pid))

    def runs(self, rank: int) -> bool:
        """Whether ``rank``'s process still runs: its pid is alive and still names it."""
        pid, started = self.pids[rank], self.started.get(rank)
        return started is not None and alive(pid) and start_time(pid) == started

    def resolve(self, rank: RankTarget) -> int:
        if rank == "random":  # a rank no other fault of the same moment has hit, if any
            return self.rng.choice(sorted(set(self.pids) - self.hit) or sorted(self.pids))
        if isinstance(rank, Coordinates):
            wanted = (rank.dp, rank.pp, rank.tp)
            for r, coords in self.coordinates.items():
                if coords == wanted:
                    return r
            raise ValueError(f"no rank at {wanted}")
        assert isinstance(rank, int)
        return rank

    def signal(self, rank: int, sig: int) -> str | None:
        """Send ``sig`` to ``rank``'s worker: None once sent, else why it was not (the process
        had exited; a zombie not yet reaped counts, since a signal to one succeeds and does
        nothing; so does a pid that names another process now: see ``runs``). A worker that
        leads its process group (torchrun starts each in a session of its own; a user's
        wrapper script is one) gets it with everything it started: a shell killed alone
        leaves its training process running, orphaned.

        A SIGKILL returns once the process is dead (a zombie, or gone; at most
        ``KILL_WAIT_S``): the kernel delivers it a moment after kill(2) returns, and another
        fault of the same moment (a second kill of the rank) must find it dead, not be
        recorded as made and take credit for this one's death."""
        pid = self.pids[rank]
        if self.runs(rank):
            try:
                send(pid, sig)
                self.hit.add(rank)
            except ProcessLookupError:
                pass
            else:
                if sig == signal.SIGKILL:
                    deadline = time.monotonic() + KILL_WAIT_S
                    while alive(pid) and time.monotonic() < deadline:
                        time.sleep(0.002)
                return None
        return f"rank {rank} (pid {pid}) had already exited"


def memory_mib() -> int:
    """This machine's memory (``MemTotal``); 16 GiB where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    except (OSError, StopIteration, ValueError):
        kib = 16 * 2**20
    return kib // 1024


def send(pid: int, sig: int) -> None:
    """``sig`` to ``pid``, or to its process group where it leads one (see ``Target.signal``)."""
    if os.getpgid(pid) == pid:
        os.killpg(pid, sig)
    else:
        os.kill(pid, sig)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited and not yet reaped, does not)."""
    state = process_state(pid)
    return state is not None and state not in "ZX"
