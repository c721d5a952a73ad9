"""``chaos crashcheck``: every crash state of a save, enumerated and checked, for one engine."""

from __future__ import annotations

import importlib.util
import math
from datetime import UTC, datetime
from pathlib import Path

import click

from antifragile.chaos.cli.common import (
    drop_if_empty,
    fail,
    fresh_folder,
    is_endpoint,
    out_folder,
    out_path,
)

ENGINES = ("antifragile", "dcp", "torchsnapshot")  # chaos/crashcheck/pipeline.py's, unimported
CASES = ("save", "retention", "overwrite", "overwrite-committed")
# 2^20 subsets of one cut's in-flight set take ~30 s to enumerate and may hold as many distinct
# states in memory, each to be loaded by a checker; 2^30 takes hours. Larger sets are sampled.
MAX_INFLIGHT = 20
MAX_LATENCY_MS = 1000  # each of the recorded save's requests is held this long


@click.command("crashcheck")
@click.option("--engine", required=True, help=f"One of {', '.join(ENGINES)}.")
@click.option("--ranks", type=int, default=1, show_default=True,
              help="Ranks of the saving job (gloo, CPU).")
@click.option("--retention", is_flag=True, help="Check the save whose commit triggers "
              "retention (keep_last=2 deleting the oldest step): --case retention. Alone it "
              "replaces the default cases; with --case it is checked after those cases.")
@click.option("--case", "cases", multiple=True, help="A case to check (repeatable): "
              f"{', '.join(CASES)}. Default: save, overwrite, overwrite-committed.")
@click.option("--max-states", type=int, help="Check at most this many distinct states "
              "(a seeded sample, reported as such).")
@click.option("--max-inflight", type=int, default=12, show_default=True,
              help="In-flight sets up to this size have every subset enumerated; larger "
              f"ones are sampled. At most {MAX_INFLIGHT}.")
@click.option("--out", help="Report folder (default reports/crashcheck-<engine>-<UTC time>).")
@click.option("--endpoint-url", help="S3 endpoint (plain http://); default AWS_ENDPOINT_URL, "
              "else a local SeaweedFS cluster started for the run.")
@click.option("--rule", "rules", multiple=True, help="Load rule (repeatable): engine "
              "(antifragile), marker (the peers' documented one), newest-folder (newest "
              "step folder, no fallback). Default: the engine's documented rule, and "
              "newest-folder for the peers. The documented rule is always among them: the "
              "verdict is judged on it.")
@click.option("--checkers", type=int, default=2, show_default=True,
              help="Checker processes loading states in parallel.")
@click.option("--latency-ms", type=float, default=20.0, show_default=True,
              help="Latency the recording proxy adds to each request.")
@click.option("--seed", type=int, default=0, show_default=True)
def crashcheck_cmd(engine: str, ranks: int, retention: bool, cases: tuple[str, ...],
                   max_states: int | None, max_inflight: int, out: str | None,
                   endpoint_url: str | None, rules: tuple[str, ...], checkers: int,
                   latency_ms: float, seed: int) -> None:
    """Record a save on S3, build every state a crash could leave, load each one in a process
    that never saw the save, and count old / new / refused / torn / lost.

    Exit 0 when the documented load rule gave no refused, torn, lost or unchecked state
    and loaded step k+1 from the state the save left uncrashed; 1 otherwise; 2 bad input."""
    cases, rules = tuple(dict.fromkeys(cases)), tuple(dict.fromkeys(rules))  # repeats once
    if engine not in ENGINES:
        fail(f"--engine {engine!r}: unknown engine (known: {', '.join(ENGINES)})")
    # optional extras: the saving job imports them only once the endpoint and checkers run
    extras = {"antifragile": ("obstore", "s3"), "dcp": ("s3fs", "s3"),
              "torchsnapshot": ("torchsnapshot", "peers")}
    for package, extra in dict.fromkeys((extras[engine], ("s3fs", "s3"))):
        if importlib.util.find_spec(package) is None:
            fail(f"--engine {engine}: {package} is not installed "
                 f"(pip install 'antifragile[{extra}]')")
    if ranks < 1:
        fail(f"--ranks {ranks}: a saving job needs at least 1 rank")
    for name in cases:
        if name not in CASES:
            fail(f"--case {name!r}: unknown case (known: {', '.join(CASES)})")
    known = ("engine", "newest-folder") if engine == "antifragile" else ("marker",
                                                                          "newest-folder")
    for rule in rules:
        if rule not in known:
            fail(f"--rule {rule!r}: not a load rule of {engine} (known: {', '.join(known)})")
    if rules and known[0] not in rules:  # else the verdict would pass having checked nothing
        fail(f"--rule: the verdict is judged on {engine}'s documented load rule, {known[0]}: "
             "give it too")
    if max_states is not None and max_states < 1:
        fail(f"--max-states {max_states}: must be at least 1")
    if max_inflight < 0:
        fail(f"--max-inflight {max_inflight}: must be at least 0")
    if max_inflight > MAX_INFLIGHT:
        fail(f"--max-inflight {max_inflight}: at most {MAX_INFLIGHT} (an in-flight set that "
             f"size has all its 2^{max_inflight} subsets enumerated, at each cut; larger sets "
             "are sampled)")
    if checkers < 1:
        fail(f"--checkers {checkers}: must be at least 1")
    if seed < 0:  # as chaos tune's; random.Random(-n) draws the same sample as random.Random(n)
        fail(f"--seed {seed}: must be at least 0")
    from antifragile.chaos.scenario import WORKER_LIMIT_REASON, max_workers

    if ranks + checkers > max_workers():  # the checkers start before the save, live through it
        fail(f"--ranks {ranks} + --checkers {checkers}: {ranks + checkers} worker processes "
             f"at once; this machine holds at most {max_workers()} ({WORKER_LIMIT_REASON})")
    if not (math.isfinite(latency_ms) and latency_ms >= 0):
        fail(f"--latency-ms {latency_ms}: must be a finite number >= 0")
    if latency_ms > MAX_LATENCY_MS:
        fail(f"--latency-ms {latency_ms:g}: must be a finite number >= 0 and at most "
             f"{MAX_LATENCY_MS} (each of the save's hundreds of requests is held this long)")
    if endpoint_url is not None and not endpoint_url.startswith("http://"):
        fail(f"--endpoint-url {endpoint_url}: the recording proxy needs a plain http:// "
             "endpoint")
    if endpoint_url is not None and not is_endpoint(endpoint_url, ("http",)):
        fail(f"--endpoint-url {endpoint_url}: not an endpoint URL (give http://host:port)")
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    made = out is None or not out_path(out).is_dir()  # a folder of the user's stays
    folder = (out_folder(out) if out is not None
              else fresh_folder(str(Path("reports") / f"crashcheck-{engine}-{stamp}")))
    chosen = cases or (("retention",) if retention else
                       ("save", "overwrite", "overwrite-committed"))
    if retention and cases and "retention" not in cases:
        chosen = (*cases, "retention")

    from antifragile.chaos.crashcheck.check import CheckerError
    from antifragile.chaos.crashcheck.pipeline import SaveError, Settings
    from antifragile.chaos.crashcheck.report import ReportError, verdict, write_all
    from antifragile.chaos.crashcheck.run import crashcheck
    from antifragile.chaos.infra.s3 import S3SetupError

    settings = Settings(engine=engine, ranks=ranks, cases=tuple(chosen), max_states=max_states,
                        max_inflight_exhaustive=max_inflight, latency_s=latency_ms / 1000,
                        checkers=checkers, seed=seed, rules=tuple(rules) or None)
    try:
        doc = crashcheck(settings, endpoint_url=endpoint_url,
                         progress=lambda line: click.echo(line, err=True),
                         on_case=lambda partial: write_all(folder, partial))
    except S3SetupError as exc:
        drop_if_empty(folder)
        fail(str(exc))
    except CheckerError as exc:  # the pool's start; later a dead checker's state is unchecked
        drop_if_empty(folder)
        fail(f"the checker processes could not start: {exc}")
    except SaveError as exc:
        drop_if_empty(folder)
        fail(str(exc))
    except ReportError as exc:  # the report of the cases so far (``on_case``)
        drop_if_empty(folder)
        fail(str(exc))
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C, SIGTERM, SIGHUP (infra.lifetime)
        if made:  # stopped before a case finished: no empty folder claiming a report
            drop_if_empty(folder)
        raise
    try:
        write_all(folder, doc)
    except ReportError as exc:
        drop_if_empty(folder)
        fail(str(exc))
    ok, reasons = verdict(doc)
    click.echo(f"crashcheck {engine} ({ranks} rank{'s' if ranks > 1 else ''}): "
               f"{'OK' if ok else 'FAIL'}  report: {folder / 'crashcheck.md'}")
    for c in doc["cases"]:
        for rule, r in c["rules"].items():
            counts = ", ".join(f"{o} {n}" for o, n in r["counts"].items())
            click.echo(f"  {c['case']}, rule {rule}: {c['states']} states: {counts}")
    for reason in reasons:
        click.echo(f"  - {reason}")
    raise SystemExit(0 if ok else 1)
