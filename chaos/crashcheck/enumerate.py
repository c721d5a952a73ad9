"""Every state a crash could leave, from a recording (pure functions, no I/O).

The model: a crash at time T (the whole job dies) leaves every mutation acknowledged before T
applied, none issued after T, and any subset of those in flight at T (issued before, answered
after) applied or not. Cut points are taken between consecutive distinct issue/ack times, so
every distinct (acknowledged, in-flight) pair is visited once. In-flight sets of up to
``max_inflight_exhaustive`` mutations have all their subsets enumerated; a larger one gets
``sample_per_cut`` seeded draws (besides the empty and the full subset; a subset drawn again is
visited once), and the result says so (``sampled_cuts``).

A state is the bucket's final content, ``{key: body digest}`` (absent: no such object);
states are deduplicated on it. Applied mutations take effect in issue order; two in-flight
writes of one key may have landed in either order (and a COPY in flight beside a write of its
source may have read either), which this model does not branch on: such overlaps are counted
(``same_key_overlaps``) so a report can say whether it mattered.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from antifragile.chaos.crashcheck.record import Mutation


@dataclass(slots=True)
class CrashState:
    """One distinct state: its objects, and the first (earliest) crash found to leave it."""

    id: int
    objects: dict[str, str]  # key -> body digest
    cut_s: float  # the crash time
    applied: list[int]  # indexes of the visible mutations applied
    in_flight: list[int]  # indexes of mutations in flight at the cut
    in_flight_applied: list[int]  # which of those the state applies
    cuts: int = 1  # how many (cut, subset) pairs leave this state

    def fingerprint(self) -> str:
        return fingerprint(self.objects)


@dataclass(slots=True)
class Enumeration:
    states: list[CrashState]
    cut_points: int
    crash_points: int  # (cut, subset) pairs visited
    sampled_cuts: int  # cuts whose in-flight set was sampled, not enumerated
    max_in_flight: int
    same_key_overlaps: int
    distinct: int = 0  # distinct states found (``states`` holds them all unless capped)
    capped: bool = False  # more distinct states existed than max_states kept
    final: int = 0  # the id of the state after the save (every mutation applied): kept
    notes: list[str] = field(default_factory=list)


def fingerprint(objects: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(sorted(objects.items())).encode()).hexdigest()[:16]


def apply(base: dict[str, str], mutations: Iterable[Mutation]) -> dict[str, str]:
    """``base`` with ``mutations`` applied in the order given."""
    objects = dict(base)
    for m in mutations:
        if m.kind in ("put", "multipart_complete"):
            assert m.digest is not None
            objects[m.key] = m.digest
        elif m.kind == "copy":
            if m.source in objects:
                objects[m.key] = objects[m.source]
        elif m.kind == "delete":
            objects.pop(m.key, None)
    return objects


def cut_points(mutations: list[Mutation]) -> list[float]:
    """One time strictly between each pair of consecutive distinct event times, plus one
    before the first and one after the last."""
    times = sorted({t for m in mutations for t in (m.issued_s, m.acked_s)})
    if not times:
        return [0.0]
    cuts = [times[0] - 1e-3]
    cuts += [(a + b) / 2 for a, b in itertools.pairwise(times)]
    cuts.append(times[-1] + 1e-3)
    return cuts


def _subsets(in_flight: list[Mutation], exhaustive: int, samples: int,
             rng: random.Random) -> Iterator[tuple[Mutation, ...]]:
    if len(in_flight) <= exhaustive:
        for r in range(len(in_flight) + 1):
            yield from itertools.combinations(in_flight, r)
        return
    drawn: set[tuple[int, ...]] = set()
    for draw in range(samples + 2):  # the empty and the full set first, then seeded draws
        subset = (() if draw == 0 else tuple(in_flight) if draw == 1
                  else tuple(m for m in in_flight if rng.random() < 0.5))
        indexes = tuple(m.index for m in subset)
        if indexes not in drawn:  # a repeat is no other crash: each one is visited once
            drawn.add(indexes)
            yield subset


def enumerate_states(base: dict[str, str], mutations: list[Mutation], *,
                     max_inflight_exhaustive: int = 12, sample_per_cut: int = 4096,
                     max_states: int | None = None, seed: int = 0) -> Enumeration:
    """Every distinct crash state of a save that started from ``base``."""
    visible = [m for m in mutations if m.visible]
    rng = random.Random(seed)
    seen: dict[str, CrashState] = {}
    after = ""
    crash_points = sampled = widest = 0
    cuts = cut_points(visible)
    for cut in cuts:
        done = [m for m in visible if m.acked_s < cut]
        in_flight = [m for m in visible if m.issued_s < cut < m.acked_s]
        widest = max(widest, len(in_flight))
        sampled += len(in_flight) > max_inflight_exhaustive
        for subset in _subsets(in_flight, max_inflight_exhaustive, sample_per_cut, rng):
            crash_points += 1
            chosen = sorted([*done, *subset], key=lambda m: (m.issued_s, m.index))
            objects = apply(base, chosen)
            key = fingerprint(objects)
            after = key  # the last cut applies every mutation: the state after the save
            if key in seen:
                seen[key].cuts += 1
                continue
            seen[key] = CrashState(len(seen), objects, cut, sorted(m.index for m in chosen),
                                   [m.index for m in in_flight], [m.index for m in subset])
    states = list(seen.values())
    distinct = len(states)
    capped = max_states is not None and len(states) > max_states
    if capped:  # a seeded sample that always holds the state before and after the save
        assert max_states is not None
        final = seen[after].id
        # a cap of one keeps the state after the save: the verdict rests on it
        ends = sorted({0, final}) if max_states > 1 else [final]
        rest = [i for i in range(len(states)) if i not in ends]
        keep = sorted(ends + random.Random(seed).sample(rest, max_states - len(ends)))
        states = [states[i] for i in keep]
    return Enumeration(states, len(cuts), crash_points, sampled, widest,
                       _same_key_overlaps(visible), distinct, capped, seen[after].id)


def _same_key_overlaps(visible: list[Mutation]) -> int:
    """Pairs in flight together that touch one key: both write it, or one is a COPY that
    reads it (the copy may have read it before or after the other landed)."""
    count = 0
    for a, b in itertools.combinations(visible, 2):
        shared = (a.key == b.key or (a.kind == "copy" and a.source == b.key)
                  or (b.kind == "copy" and b.source == a.key))
        if shared and a.issued_s < b.acked_s and b.issued_s < a.acked_s:
            count += 1
    return count
