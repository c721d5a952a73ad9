"""The verdict: every fault was made and had its effect, the faulty run's final state equals the
reference run's bit for bit, and every bound holds.

Verdicts: ``pass`` (everything above holds), ``fail`` (something does not, each reason said),
``skipped`` (nothing failed, but a fault could not be made here, so the scenario was not tested
as written), ``nondeterministic`` (``--check-determinism``: two fault-free runs already differ,
so a difference after faults says nothing about recovery). ``fail`` wins over ``skipped``;
``nondeterministic`` over both.

The final state of a command trainer (the user's script) is its newest committed checkpoint,
read back through the engine's own reader (``trainer.ckpt_backends``: ours, DCP, torchsnapshot).
"""

from __future__ import annotations

import os
import pickle
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from antifragile.chaos.observe.measure import FaultTimings
from antifragile.chaos.scenario import Scenario
from antifragile.engine import CheckpointError, CheckpointNotFoundError
from antifragile.engine._dtypes import as_bytes
from antifragile.engine.quarantine import quarantined_steps
from antifragile.engine.storage import local_root, open_storage
from antifragile.trainer.ckpt_backends import committed_steps, foreign_steps, read_checkpoint
from antifragile.trainer.ckpt_backends.base import MARKERS, first_line


@dataclass(slots=True)
class Verdict:
    verdict: str = "pass"
    reasons: list[str] = field(default_factory=list)
    bitwise_equal: bool | None = None
    differs: list[str] = field(default_factory=list)  # every entry that differs, named

    def fail(self, reason: str) -> None:
        self.verdict = "fail"
        self.reasons.append(reason)


@dataclass(slots=True)
class Comparison:
    """The two final checkpoints, entry by entry: ``differs`` names the entries whose bits,
    dtype, shape, type or presence differ; ``error`` says why they could not be compared (a
    checkpoint that cannot be read, or nothing to compare); ``compared_bytes`` counts the tensor
    bytes found equal or not."""

    differs: list[str] = field(default_factory=list)
    error: str | None = None
    compared_bytes: int = 0

    @property
    def equal(self) -> bool:
        return self.error is None and not self.differs


def _tensor_bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s values: a conjugate or negative view (torch.load keeps the bit)
    shows other values than its memory holds, and a view of it as bytes is refused."""
    return as_bytes(t.detach().cpu().resolve_conj().resolve_neg().contiguous())


def same_tensor(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Bit for bit: dtype, shape and every byte (+0.0 and -0.0 differ, a NaN equals the same NaN
    and not one with another payload)."""
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(_tensor_bits(x),
                                                                     _tensor_bits(y))


#: types whose ``==`` is already exact once both sides have the same type
_EXACT_EQ = (type(None), bool, int, str, bytes)


def same_value(x: Any, y: Any) -> bool:
    """Bit for bit, by type: ``1``, ``1.0`` and ``True`` all differ; floats and complex numbers
    by their bits (``-0.0`` differs from ``0.0``, a NaN equals the same NaN); numpy arrays and
    scalars by dtype, shape and bytes; containers element by element (a dict's keys too); any
    other object by its pickle. A value with no such comparison (it cannot be pickled)
    differs."""
    return _differs(x, y) is None


_DIFFERENT = "different"


def _differs(x: Any, y: Any) -> str | None:
    """None when equal bit for bit; else ``_DIFFERENT``, or why they cannot be compared."""
    if type(x) is not type(y):
        return _DIFFERENT
    same: bool
    if isinstance(x, torch.Tensor):
        same = same_tensor(x, y)
    elif isinstance(x, np.ndarray | np.generic):  # before float: np.float64 is a float
        if x.dtype != y.dtype or x.shape != y.shape:
            return _DIFFERENT
        if x.dtype.hasobject:  # the bytes are pointers: compare what they point to
            return _differs(x.tolist(), y.tolist())
        same = x.tobytes() == y.tobytes()
    elif isinstance(x, float):
        same = struct.pack("<d", x) == struct.pack("<d", y)
    elif isinstance(x, complex):
        same = struct.pack("<dd", x.real, x.imag) == struct.pack("<dd", y.real, y.imag)
    elif isinstance(x, _EXACT_EQ):
        same = x == y
    elif isinstance(x, dict):
        if x.keys() != y.keys():
            return _DIFFERENT
        # keys too by type and bits (1, 1.0 and True are one key to a dict): y's own key
        y_key = {k: k for k in y}
        return next((w for w in (_differs(k, y_key[k]) or _differs(x[k], y[k]) for k in x)
                     if w), None)
    elif isinstance(x, list | tuple):
        if len(x) != len(y):
            return _DIFFERENT
        return next((w for w in (_differs(a, b) for a, b in zip(x, y)) if w), None)
    elif isinstance(x, set | frozenset):  # no order to pair by: each needs a bitwise match
        rest = list(y)
        for a in x:
            match = next((i for i, b in enumerate(rest) if same_value(a, b)), None)
            if match is None:
                return _DIFFERENT
            rest.pop(match)
        return None if not rest else _DIFFERENT
    else:
        try:
            same = pickle.dumps(x) == pickle.dumps(y)
        except Exception as exc:  # unpicklable: no bit-exact comparison, so not "equal"
            return f"{type(x).__name__} cannot be pickled: {type(exc).__name__}: {exc}"
    return None if same else _DIFFERENT


def compare_final(faulty_url: str, reference_url: str, step: int, *,
                  engine: str = "antifragile") -> Comparison:
    """Compare the final checkpoints (model, optimizer, training state) of the two runs, both
    written by ``engine`` (each backend's reader gives flat ``{key: tensor | value}``), bit for
    bit. Comparing nothing is an error, not equality."""
    try:
        got = read_checkpoint(engine, faulty_url, step)
        want = read_checkpoint(engine, reference_url, step)
    except CheckpointError as exc:
        return Comparison(error=f"cannot read the final checkpoint of step {step}: {exc}")
    except _read_errors() as exc:  # a peer engine's own error on a damaged or missing file
        return Comparison(error=f"cannot read the final {engine} checkpoint of step {step}: "
                                f"{_one_line(exc)}")
    out = Comparison(differs=sorted(set(got) ^ set(want)))
    for key in sorted(set(got) & set(want)):
        x, y = got[key], want[key]
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            out.compared_bytes += x.numel() * x.element_size()
        why = _differs(x, y)
        if why == _DIFFERENT:
            out.differs.append(key)
        elif why is not None:  # reported as differing, and why: never trusted to ==
            out.differs.append(f"{key} (uncomparable: {why})")
    out.differs.sort()
    if out.compared_bytes == 0:
        out.error = (f"nothing to compare: the final {engine} checkpoints of step {step} hold "
                     f"no tensor data ({len(got)} and {len(want)} entries)")
    return out


def newest_committed(engine: str, url: str) -> int | None:
    """The newest step ``engine`` sees committed at ``url`` (a command trainer's final state)."""
    try:
        steps = committed_steps(engine, url)
    except Exception:  # unreadable storage: nothing committed as far as anyone can tell
        return None
    return steps[-1] if steps else None


def determinism(engine: str, first_url: str, second_url: str,
                step: int | None = None) -> Comparison:
    """Two fault-free runs' final checkpoints compared (``step``: the built-in trainer's last;
    None: each run's newest committed, which must be the same step)."""
    if step is None:
        a, b = newest_committed(engine, first_url), newest_committed(engine, second_url)
        if a is None or a != b:
            return Comparison(error=f"the two fault-free runs' newest committed checkpoints "
                                    f"are steps {a} and {b}")
        step = a
    return compare_final(second_url, first_url, step, engine=engine)


def final_committed(engine: str, url: str, step: int) -> bool:
    """Whether ``engine`` sees a committed checkpoint of ``step`` at ``url``."""
    try:
        return step in committed_steps(engine, url)
    except Exception:  # unreadable storage: not committed as far as anyone can tell
        return False


def verify_committed(url: str, engine: str = "antifragile") -> dict[int, list[str]]:
    """Every committed step still stored under ``url`` read back in full (ours: sizes,
    checksums, coverage; a peer engine's: every entry through its own reader): step -> its
    problems (empty: intact). After a storage fault this is the proof that no save committed
    torn. Each engine's steps are listed by that engine: ours sees no COMMIT in a DCP folder,
    and would find nothing to verify."""
    if engine != "antifragile":
        return _read_back_committed(url, engine)
    from concurrent.futures import ThreadPoolExecutor

    from antifragile.engine.commit import committed_steps
    from antifragile.engine.storage import open_storage
    from antifragile.engine.verify import verify_step

    try:
        storage = open_storage(url)
        steps = committed_steps(storage)
    except CheckpointError as exc:
        return {-1: [f"cannot list the committed steps: {exc}"]}
    def problems(step: int, pool: ThreadPoolExecutor) -> list[str]:
        try:
            report = verify_step(storage, step, pool)
        except CheckpointNotFoundError as exc:  # listed as committed, its COMMIT gone since
            return [f"COMMIT: {exc}"]
        except CheckpointError as exc:  # storage failing: nothing proves the step intact
            return [f"could not be read back: {exc}"]
        return [f"{p.key}: {p.reason}" for p in report.problems]

    with ThreadPoolExecutor(8) as pool:
        return {step: problems(step, pool) for step in steps}


def _read_errors() -> tuple[type[BaseException], ...]:
    """What a peer engine's reader raises on a damaged or missing file: DCP gathers its
    failures into a CheckpointException, which derives from BaseException, not Exception."""
    from torch.distributed.checkpoint.api import CheckpointException

    return Exception, CheckpointException


def _one_line(exc: BaseException) -> str:
    """``Type: message`` on one line; for DCP's CheckpointException (every rank's traceback
    in its text), the first failing rank's error."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, (error, _) = min(failures.items())
        return f"rank {rank}: {first_line(error)}"
    return first_line(exc)


def _read_back_committed(url: str, engine: str) -> dict[int, list[str]]:
    """A peer engine's committed steps, each read back whole (it keeps no checksums: a step
    that reads back is all it can show)."""
    try:
        steps = committed_steps(engine, url)
    except Exception as exc:  # a peer engine's own error on a folder it cannot list
        return {-1: [f"cannot list the committed steps: {type(exc).__name__}: {exc}"]}
    found: dict[int, list[str]] = {}
    for step in steps:
        try:
            read_checkpoint(engine, url, step)
        except _read_errors() as exc:  # torn files raise whatever the peer's reader raises
            found[step] = [f"could not be read back: {_one_line(exc)}"]
        else:
            found[step] = []
    return found


def steps_out_of_order(events: list[dict[str, Any]]) -> str | None:
    """Why the steps a command trainer reported cannot be measured from: a rank whose
    ``step_end`` steps did not grow within one attempt (the step within an epoch, a
    micro-batch count, a step reported twice); None when each grew. Faults due at a step, lost
    steps and where the run ended are all read from these numbers, and were taken at face
    value (a script that reported 1..6 each epoch passed, its fault landing in some epoch).
    A restore the rank reported (``restore_end``: a script that rolls back in process after a
    loss spike) sets where its next step must start."""
    newest: dict[tuple[int, int], int] = {}
    for e in events:
        if e["event"] not in ("step_end", "restore_end"):
            continue
        key = (e["rank"], e["attempt"])
        if e["event"] == "restore_end":
            if isinstance(e.get("step"), int):
                newest[key] = e["step"]
            continue
        before = newest.get(key)
        if before is not None and e["step"] <= before:
            return (f"rank {e['rank']} reported step {e['step']} after step {before} (attempt "
                    f"{e['attempt']}): probe.step_end takes the global step, larger at each "
                    "call (not the step within an epoch), so the steps faults are due at, "
                    "the lost steps and the last step reported mean nothing here")
        newest[key] = e["step"]
    return None


def why_no_checkpoint(engine: str, url: str) -> str:
    """Why a script left no ``engine`` checkpoint at ``url``: another engine's steps there (a
    DCP script whose scenario leaves ``checkpoint.engine`` at its default), what else a local
    folder holds (a DCP script's ``step_10``, which did checkpoint to the URL: only the folder
    name was not the one read), steps of ours quarantined as damaged with none committed
    (the script saved through the engine: a fault damaged its only steps), or nothing."""
    for other, steps in foreign_steps(engine, url).items():
        return (f"it holds committed {other} checkpoints ({steps_named(steps)}): set "
                f"checkpoint.engine: {other}")
    names = _local_entries(url)
    if not names:
        return "the script must checkpoint to $ANTIFRAGILE_CKPT_URL"
    held = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    if engine == "antifragile":
        hidden = _quarantined(url)
        if hidden:
            return (f"{steps_named(hidden)} {'were' if len(hidden) > 1 else 'was'} "
                    f"quarantined as damaged (`chaos ckpt ls {url}` says why) and no other "
                    "step committed: there "
                    "load and agreed_steps raise CheckpointCorruptError rather than start "
                    "over, so the script had nothing to resume from")
        return (f"it holds {held}, but no committed step of antifragile.engine."
                "CheckpointEngine: save through CheckpointEngine($ANTIFRAGILE_CKPT_URL)")
    return (f"it holds {held}, but no folder step_<9 digits> with {MARKERS[engine]} in it: "
            'write the checkpoint of step N to f"{url}/step_{N:09d}"')


def steps_named(steps: list[int]) -> str:
    """"step 5", or "steps 5, 10, 15": the newest three of ``steps`` (sorted)."""
    return f"step{'s' if len(steps) > 1 else ''} " + ", ".join(map(str, steps[-3:]))


def _quarantined(url: str) -> list[int]:
    """The steps of our engine's checkpoint at local ``url`` hidden by quarantine (none for a
    remote URL: its store may be gone when the verdict is made)."""
    if local_root(url) is None:
        return []
    try:
        return quarantined_steps(open_storage(url))
    except (CheckpointError, OSError):
        return []


def _local_entries(url: str) -> list[str]:
    """The names in a local folder ``url``, sorted; none for a remote URL or no folder."""
    root = local_root(url)
    if root is None:
        return []
    try:
        return sorted(os.listdir(root))
    except OSError:
        return []


def _due(s: Scenario, t: FaultTimings) -> tuple[int, int] | None:
    """(step, pass): the step the job must have ended last when fault ``t`` hit it, and the
    n-th time it got there: a step- or checkpoint-triggered fault's, held at the end of that
    step. None: no such step to check (a time-triggered fault; one held in a save phase,
    whose training loop may go on)."""
    if t.fault_index is None or not 0 <= t.fault_index < len(s.faults):
        return None
    fault = s.faults[t.fault_index]
    step = fault.trigger_step(s.checkpoint.every_steps)
    if step is None or getattr(fault, "phase", None) is not None:
        return None
    return step, fault.on_pass


def judge(s: Scenario, *, returncode: int, timings: list[FaultTimings], final_step: int | None,
          faulty_url: str, reference_url: str | None, final_committed: bool,
          committed: dict[int, list[str]] | None = None, expected_step: int | None = None,
          determinism: Comparison | None = None, last_step: int | None = None,
          reference_last_step: int | None = None, run_log: str | None = None,
          step_order: str | None = None) -> Verdict:
    """``final_committed``: the faulty run's checkpoint of the last step is committed (what a
    resumed job would load); without it nothing proves the run's end state survived.
    ``committed``: :func:`verify_committed`'s findings, when they were taken (after a fault on
    storage, every committed step left must read back intact).

    A command trainer: ``final_step`` is the faulty run's newest committed step and
    ``expected_step`` the reference run's (None without a reference); they must match.
    ``last_step`` and ``reference_last_step``: the newest step each run reported through the
    probe (``reference_last_step`` None: the reference reported none, or there is none); they
    must match too, and a run that reported steps needs a reference that did (the same
    script: its event files were lost). A script that exits 0 before its last step, or trains
    past it, after its newest checkpoint (one that does not checkpoint its last step) leaves
    that checkpoint equal to the reference's: only the steps it reported show the run ended
    elsewhere.

    Every fault of the scenario must have been injected (each ``mtbf_s`` fault at least once)
    and have had its effect (``FaultTimings.effect_observed``), a step- or checkpoint-triggered
    one at its step (held at the end of it), no earlier than its pass there; a fault that
    caused a restart must have been recovered from, and a step trained after that restore
    by at least one of its firings (else the final state compared is the one saved before
    the fault). ``determinism``: a second fault-free run compared with the reference
    (``--check-determinism``). ``run_log``: the faulty run's torchrun log, named with a
    failed exit. ``step_order``: :func:`steps_out_of_order`'s finding on a command trainer's
    events (steps that did not grow: every step-based figure is void)."""
    v = Verdict()
    for step, problems in sorted((committed or {}).items()):
        if problems:
            v.fail(f"committed step {step} does not verify: {'; '.join(problems[:3])}")
    engine = s.checkpoint.engine
    if returncode != 0:
        v.fail(f"the trainer exited with code {returncode}"
               + (f" (its log: {run_log})" if run_log else ""))
    if s.is_command:
        if step_order is not None:
            v.fail(step_order)
        if final_step is None:
            v.fail(f"the script left no committed {engine} checkpoint at {faulty_url} "
                   f"({why_no_checkpoint(engine, faulty_url)})")
        elif expected_step is not None and final_step != expected_step:
            v.fail(f"the newest committed checkpoint is step {final_step}, the reference "
                   f"run's is step {expected_step}")
        if reference_url is not None and reference_last_step is None and last_step is not None:
            v.fail(f"the last step reported was {last_step}, but the reference run's reported "
                   "steps are missing (its event files gone or unreadable): where the run "
                   "ended cannot be checked")
        elif reference_last_step is not None and last_step != reference_last_step:
            v.fail(f"the last step reported was {last_step}, the reference run's "
                   f"{reference_last_step}" + (": the run ended elsewhere (a script that "
                   "exits 0 early, or trains on, after its newest checkpoint)"
                   if returncode == 0 else ""))
        expected_step = final_step if expected_step is None else expected_step
    else:
        expected_step = s.trainer.steps
        if final_step != expected_step:
            v.fail(f"the run ended at step {final_step}, not {expected_step}")
        if not final_committed:
            v.fail(f"no committed checkpoint of the final step {expected_step}")
    bitwise_reasons = []
    if reference_url is None:
        if s.expect.bitwise_equal_to_reference:
            v.fail("expect.bitwise_equal_to_reference is true, but there is no reference run "
                   "to compare with (--no-reference)")
    elif final_step == expected_step and expected_step is not None:
        comparison = compare_final(faulty_url, reference_url, expected_step, engine=engine)
        v.bitwise_equal = comparison.equal
        v.differs = list(comparison.differs)
        if not comparison.equal and s.expect.bitwise_equal_to_reference:
            if comparison.error:
                bitwise_reasons.append(comparison.error)
            if comparison.differs:
                bitwise_reasons.append(
                    f"final state differs from the reference in {len(comparison.differs)} "
                    f"entries, e.g. {comparison.differs[:3]}" + (
                        ": the resumed script did not carry over all its steps depend on "
                        "(an entry it does not save or load back; its random generators, "
                        "torch's, numpy's, random's, for dropout or shuffling; its data "
                        "position; a scheduler)" + (", or it differs even without faults "
                        "(--check-determinism tells)" if determinism is None else "")
                        if s.is_command else ""))
            for reason in bitwise_reasons:
                v.fail(reason)
    fired = {t.fault_index for t in timings}
    for index, fault in enumerate(s.faults):  # each fault, not each kind: one mtbf_s fault
        if index not in fired:                # firing twice hides none of its kind that did not
            due = fault.trigger_step(s.checkpoint.every_steps)
            if s.is_command and due is not None and reference_last_step is not None \
                    and due > reference_last_step:  # validate cannot know a script's steps
                v.fail(f"faults.{index} ({fault.kind}): never injected: its at_step {due} is "
                       f"after step {reference_last_step}, the last the fault-free run "
                       "reported")
            else:
                v.fail(f"faults.{index} ({fault.kind}): never injected (its trigger was never "
                       "reached)")
    # the faults that some firing of theirs ended an attempt whose restore was trained on
    # from: a random arrival that also struck after the last step proved its recovery there
    trained_after = {t.fault_index for t in timings if t.ended_attempt is not None
                     and t.restored_step is not None and expected_step is not None
                     and t.restored_step < expected_step}
    skipped = []
    for t in timings:
        if t.skipped:
            skipped.append(f"{t.kind} at step {t.injected_step}: skipped: {t.skipped}")
            continue
        due = None if t.missed else _due(s, t)
        if due is not None and t.injected_step != due[0]:
            v.fail(f"faults.{t.fault_index} ({t.kind}): due at step {due[0]}, but it hit the "
                   f"job at step {t.injected_step}")
        elif due is not None and t.times_at_step is not None and t.times_at_step < due[1]:
            v.fail(f"faults.{t.fault_index} ({t.kind}): due on pass {due[1]} of step "
                   f"{due[0]}, but the job had got there {t.times_at_step} time(s) when it hit")
        if not t.effect_observed:
            v.fail(f"{t.kind} at step {t.injected_step}: no observable effect: {t.effect}")
            continue
        if t.outage is not None and not t.outage["training_continued"]:
            steps = t.outage["steps_during_outage"]
            v.fail(f"{t.kind} at step {t.injected_step}: training did not go on during the "
                   "outage (" + ("a restart followed it)" if steps is None
                                 else f"{steps} steps, or a restart)"))
        if t.outage is not None and t.outage.get("error"):
            v.fail(f"{t.kind} at step {t.injected_step}: storage did not come back: "
                   f"{t.outage['error']}")
        if t.ended_attempt is not None and t.recovery_s is None and t.interrupted_by_t is None:
            came_back = t.unmeasured is not None and t.restart_s is not None
            if not came_back:
                why = (f"did not come back after attempt {t.ended_attempt}" if t.restart_s is None
                       else f"came back after attempt {t.ended_attempt}"
                       + ("" if t.restored_step is None else
                          f"{',' if t.retrained_to_step is not None else ' and'} restored "
                          f"step {t.restored_step}")
                       + (", but reported no step after it" if t.retrained_to_step is None
                          else f" and trained up to step {t.retrained_to_step}, but never "
                          f"back to step {t.injected_step}, where the fault hit it"))
                v.fail(f"{t.kind} at step {t.injected_step}: no recovery was observed (the job "
                       f"{why})")
                continue
            for bound in ("max_recovery_s", "max_lost_steps"):
                if getattr(s.expect, bound) is not None and (
                        bound == "max_recovery_s" or t.lost_steps is None):
                    v.fail(f"{t.kind}: expect.{bound} cannot be checked: {t.unmeasured}")
        if t.ended_attempt is not None and t.restored_step is not None \
                and expected_step is not None and t.restored_step >= expected_step \
                and t.fault_index not in trained_after:
            v.fail(f"{t.kind} at step {t.injected_step}: the job restored step "
                   f"{t.restored_step} and trained no step after it: the final state is the "
                   "checkpoint saved before the fault, which proves nothing about the recovery")
        if s.expect.max_recovery_s is not None and t.recovery_s is not None \
                and t.recovery_s > s.expect.max_recovery_s:
            v.fail(f"{t.kind} at step {t.injected_step}: recovery took {t.recovery_s:.1f} s "
                   f"> max_recovery_s {s.expect.max_recovery_s}")
        # cut short: how long it took is unknown, but at least until the next fault hit
        cut_after = None if t.interrupted_by_t is None else t.interrupted_by_t - t.injected_t
        if s.expect.max_recovery_s is not None and cut_after is not None \
                and cut_after > s.expect.max_recovery_s:
            v.fail(f"{t.kind} at step {t.injected_step}: recovery had taken {cut_after:.1f} s "
                   f"> max_recovery_s {s.expect.max_recovery_s} when the next fault cut it "
                   "short")
        if t.restored_step is not None and t.restorable_step is not None \
                and t.restored_step < t.restorable_step:
            restored = ("resumed from step 0 (it started over)" if t.restored_step == 0
                        else f"restored step {t.restored_step}")
            v.fail(f"{t.kind} at step {t.injected_step}: {restored}, although step "
                   f"{t.restorable_step} had committed before the fault and no restore skipped "
                   "it (work lost for no reason" + (": a script must resume from its newest "
                   "checkpoint on start)" if s.is_command else ")"))
        if s.expect.max_lost_steps is not None and t.lost_steps is not None \
                and t.lost_steps > s.expect.max_lost_steps:
            v.fail(f"{t.kind} at step {t.injected_step}: {t.lost_steps} steps lost "
                   f"> max_lost_steps {s.expect.max_lost_steps}")
    if v.verdict == "pass" and skipped:  # nothing failed, but the scenario was not all made
        v.verdict, v.reasons = "skipped", skipped
    if determinism is not None and not determinism.equal:
        why = determinism.error or (f"two fault-free runs differ in {len(determinism.differs)} "
                                    f"entries, e.g. {determinism.differs[:3]}")
        v.verdict = "nondeterministic"
        v.reasons = [f"the trainer is not deterministic: {why}; so the bitwise comparison "
                     "says nothing about recovery"] + [r for r in v.reasons
                                                       if r not in bitwise_reasons]
    return v


def summary(v: Verdict) -> dict[str, Any]:
    return {"verdict": v.verdict, "reasons": v.reasons, "bitwise_equal": v.bitwise_equal}
