"""Scenario files: validated before anything starts; every error names file, key and reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from antifragile.chaos.cli import main
from antifragile.chaos.scenario import SCENARIOS, ScenarioError, load_scenario, parse_scenario

BASE: dict[str, Any] = {"name": "t", "trainer": {"parallel": {"dp": 2, "tp": 1, "pp": 1},
                                                 "steps": 20},
                        "checkpoint": {"every_steps": 5}}


def _with(**changes: Any) -> dict[str, Any]:
    return {**BASE, **changes}


@pytest.mark.parametrize(("doc", "message"), [
    (_with(bogus=1), "s.yaml: bogus: unknown key"),
    (_with(faults=[{"kind": "nuke", "at_step": 3}]), "s.yaml: faults.0: unknown fault kind 'nuke'"),
    (_with(faults=[{"kind": "kill_rank", "rank": 5, "at_step": 3}]),
     "s.yaml: faults.0.rank: rank 5 is outside the world of 2 ranks"),
    (_with(faults=[{"kind": "kill_rank", "rank": 0, "at_step": 30}]),
     "s.yaml: faults.0.at_step: step 30 is not before the last step (20)"),
    (_with(faults=[{"kind": "kill_rank", "rank": {"dp": 2}, "at_step": 3}]),
     "s.yaml: faults.0.rank: {'dp': 2, 'pp': 0, 'tp': 0} is outside the mesh"),
    (_with(faults=[{"kind": "kill_rank", "rank": 0}]), "exactly one trigger"),
    (_with(faults=[{"kind": "crash_during_save", "at_checkpoint": 9}]),
     "faults.0.at_checkpoint: the run takes only 4 checkpoint(s)"),
    # accepted, then a run that failed as "never injected (its trigger was never reached)":
    # the peer engines have no save-phase hooks, so the save never paused there
    (_with(checkpoint={"every_steps": 5, "engine": "dcp"},
           faults=[{"kind": "crash_during_save", "at_checkpoint": 2, "phase": "written"}]),
     "s.yaml: faults.0.phase: written is a save phase of engine antifragile (its phase hooks); "
     "engine dcp has none, so the save never pauses there: use phase staged, or engine "
     "antifragile"),
    (_with(checkpoint={"every_steps": 5, "engine": "torchsnapshot"},
           faults=[{"kind": "crash_during_save", "at_checkpoint": 2}]),
     "s.yaml: faults.0.phase: persisting is a save phase of engine antifragile"),
    (_with(faults=[{"kind": "kill_rank", "rank": 0, "mtbf_s": 5.0, "on_pass": 2}]),
     "s.yaml: faults.0.on_pass: a pass counts the times the job gets to a step: it needs "
     "at_step or at_checkpoint"),
    (_with(faults=[{"kind": "kill_rank", "rank": 0, "at_step": 3, "on_pass": 0}]),
     "s.yaml: faults.0.on_pass: Input should be greater than or equal to 1"),
    (_with(faults=[{"kind": "kill_rank", "rank": 0, "at_step": 3, "colour": "red"}]),
     "s.yaml: faults.0.colour: unknown key"),
    (_with(trainer={"steps": "many"}), "s.yaml: trainer.steps: Input should be a valid integer"),
    (_with(trainer={"parallel": {"dp": 3}, "batch_size": 8}), "not divisible by dp 3"),
    # validate said ok; chaos run failed as "the fault-free reference run failed (code 1)",
    # the tail of its log torchrun's summary, the trainer's refusal further up
    (_with(trainer={"parallel": {"tp": 4}, "model": {"vocab": 9}}),
     "s.yaml: trainer: model.vocab 9 leaves tp rank 3 of 4 no rows of the embedding"),
    ({"trainer": {}}, "s.yaml: name: Field required"),
    ([1, 2], "s.yaml: a scenario must be a mapping"),
    (None, "s.yaml: the file holds no scenario (only comments?)"),
    # were pydantic's "Input should be a valid dictionary or instance of TrainerSpec"
    (_with(trainer=None), "s.yaml: trainer: is empty: give its keys (key: value lines), or "
     "leave it out"),
    (_with(trainer={"parallel": 2}), "s.yaml: trainer.parallel: must be a mapping (key: value "
     "lines), got int 2"),
    (_with(checkpoint={"url": "s3:///p"}),
     "s.yaml: checkpoint.url: s3:///p names no bucket (give s3://bucket/prefix)"),
    # typos of s3:// were a local folder "s3:" in the working directory, or (S3://) an fsspec
    # URL that chaos set no S3 endpoint up for
    (_with(checkpoint={"url": "s3:/b/p"}),
     "s.yaml: checkpoint.url: s3:/b/p is not an S3 URL (give s3://bucket/prefix)"),
    (_with(checkpoint={"url": "S3://b/p"}),
     "s.yaml: checkpoint.url: S3://b/p is not an S3 URL (give s3://bucket/prefix)"),
    (_with(checkpoint={"url": "s3:b/p"}),
     "s.yaml: checkpoint.url: s3:b/p is not an S3 URL (give s3://bucket/prefix)"),
    # file:/abs (RFC 8089's short form) and file: were a relative folder "file:" in the
    # working directory: the run passed, its checkpoints somewhere the user did not ask
    (_with(checkpoint={"url": "file:/tmp/ckpt"}),
     "s.yaml: checkpoint.url: file:/tmp/ckpt: not a file URL (give file:///abs/path or a "
     "plain path)"),
    (_with(checkpoint={"url": "file:"}),
     "s.yaml: checkpoint.url: file:: not a file URL (give file:///abs/path or a plain path)"),
    # accepted: memory:// is each process's own (the ranks, the checker and chaos would each
    # see another store), s3a:// S3 to the engine but not to chaos's S3 setup (no endpoint)
    (_with(checkpoint={"url": "memory://ckpt"}),
     "s.yaml: checkpoint.url: memory://ckpt is each process's own memory: the ranks and chaos "
     "would not see one store (give a local folder or s3://bucket/prefix)"),
    (_with(checkpoint={"url": "s3a://b/p"}),
     "s.yaml: checkpoint.url: s3a://b/p is not an S3 URL (give s3://bucket/prefix)"),
    # validate said ok; the reference run failed on them (fsspec: "Protocol not known",
    # "Please install gcsfs")
    (_with(checkpoint={"url": "foo://b/p"}),
     "s.yaml: checkpoint.url: foo://b/p: no storage for foo:// (Protocol not known: foo)"),
    (_with(checkpoint={"url": "gs://b/p"}),
     "s.yaml: checkpoint.url: gs://b/p: no storage for gs:// (Please install gcsfs to access "
     "Google Storage)"),
    (_with(checkpoint={"storage_options": {"endpoint_url": "http://h:1"}}),
     "s.yaml: checkpoint: storage_options: only for an s3:// url, not the run's local folder"),
    (_with(checkpoint={"url": "s3://b/p", "storage_options": {"endpoint": "http://h:1"}}),
     "s.yaml: checkpoint: storage_options.endpoint: unknown option (known: endpoint_url, key, "
     "secret, token, region_name)"),
    # validate said ok; chaos run refused it (exit 2) naming checkpoint.url
    (_with(checkpoint={"url": "s3://b/p", "storage_options": {"endpoint_url": "h:9000"}}),
     "s.yaml: checkpoint: storage_options.endpoint_url: 'h:9000' is not an endpoint URL (give "
     "http://host:port or https://host)"),
    (_with(checkpoint={"url": "s3://b/p", "storage_options": {"endpoint_url": "http://h:x"}}),
     "s.yaml: checkpoint: storage_options.endpoint_url: 'http://h:x' is not an endpoint URL"),
    # accepted, then a ValueError traceback when chaos run put it into the environment
    (_with(checkpoint={"url": "s3://b/p", "storage_options": {"secret": "a\0b"}}),
     "s.yaml: checkpoint: storage_options.secret: holds a NUL byte"),
    # validate said ok; chaos run refused a local one printing the NUL in its error, and an
    # S3 one reached torchrun's argv (a ValueError, after the reference run)
    (_with(checkpoint={"url": "ck\0pt"}), "s.yaml: checkpoint.url: 'ck\\x00pt' holds a NUL byte"),
    (_with(checkpoint={"url": "s3://b/p\0q"}),
     "s.yaml: checkpoint.url: 's3://b/p\\x00q' holds a NUL byte"),
    # was pydantic's "Unable to extract tag using discriminator 'kind'"
    (_with(faults=[{"rank": 0, "at_step": 3}]),
     "s.yaml: faults.0.kind: missing (known: corrupt_shard, crash_during_save"),
    # were pydantic's "Input should be a valid dictionary or object to extract fields from"
    # (a lone "-", or a fault written as its kind alone)
    (_with(faults=[None]), "s.yaml: faults.0: is empty: give its keys (key: value lines), or "
     "leave it out"),
    (_with(faults=["kill_rank"]), "s.yaml: faults.0: must be a mapping (key: value lines), "
     "got str 'kill_rank'"),
    (_with(faults=[[1]]), "s.yaml: faults.0: must be a mapping (key: value lines), got list [1]"),
    # were "trainer: spares: ..." with no spares in the file: the key to change is another
    (_with(trainer={"parallel": {"dp": 2}, "nodes": 4}),
     "s.yaml: trainer: nodes: 2 ranks + 0 spare(s) = 2 workers cannot be split evenly over 4"),
    (_with(trainer={"parallel": {"dp": 4096}, "batch_size": 4096}),
     "s.yaml: trainer: parallel: 4096 ranks + 0 spare(s) = 4096 worker processes; this "
     "machine holds at most"),
    # accepted, then a run that failed as "never injected": with no other fault that ends an
    # attempt (a storage fault or a corrupted shard does not), the job gets to step 10 once
    (_with(faults=[{"kind": "kill_rank", "rank": 0, "at_step": 10, "on_pass": 2}]),
     "s.yaml: faults.0.on_pass: pass 2 of step 10 never comes: no other fault ends an "
     "attempt"),
    (_with(faults=[{"kind": "corrupt_shard", "at_checkpoint": 1},
                   {"kind": "hang_rank", "rank": 1, "at_checkpoint": 2, "on_pass": 3}]),
     "s.yaml: faults.1.on_pass: pass 3 of step 10 never comes: no other fault ends an "
     "attempt"),
])
def test_bad_scenarios_are_rejected_with_the_key_path(doc: Any, message: str) -> None:
    with pytest.raises(ScenarioError) as exc:
        parse_scenario(doc, path="s.yaml")
    assert message in str(exc.value)


def test_fault_targets_by_coordinates() -> None:
    s = parse_scenario(_with(faults=[{"kind": "kill_rank", "rank": {"dp": 1}, "at_step": 3}]))
    assert s.faults[0].rank.dp == 1  # type: ignore[union-attr]


def test_yaml_syntax_error_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\ntrainer: {steps: 3\n")
    with pytest.raises(ScenarioError, match=r"broken.yaml: YAML syntax error \(line 3"):
        load_scenario(path)


@pytest.mark.parametrize(("raw", "where"), [(b"name: x\n\0faults: []\n", "line 2, column 1"),
                                          (b"name: x\x07\n", "line 1, column 8")])
def test_a_character_yaml_refuses_is_one_line_naming_its_place(tmp_path: Path, raw: bytes,
                                                               where: str) -> None:
    """A NUL or another control character (a binary file's bytes that happen to be UTF-8)
    was a two-line error ending in 'in "<unicode string>", position 8', without a line."""
    path = tmp_path / "ctrl.yaml"
    path.write_bytes(raw)
    with pytest.raises(ScenarioError) as exc:
        load_scenario(path)
    assert "\n" not in str(exc.value), str(exc.value)
    assert str(exc.value).startswith(f"{path}: YAML syntax error ({where}): unacceptable "
                                      "character #x"), str(exc.value)


def test_cli_exit_codes_and_no_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(_with(faults=[{"kind": "kill_rank", "rank": 9,
                                                 "at_step": 3}])))
    runner = CliRunner()
    for command in (["validate", str(bad)], ["run", str(bad)]):
        result = runner.invoke(main, command)
        assert result.exit_code == 2
        assert "faults.0.rank: rank 9 is outside" in result.output
        assert "Traceback" not in result.output
    missing = runner.invoke(main, ["validate", str(tmp_path / "none.yaml")])
    assert missing.exit_code == 2 and "cannot read" in missing.output


def test_every_shipped_scenario_is_valid() -> None:
    shipped = sorted(SCENARIOS.rglob("*.yaml"))
    assert any(p.name == "quickstart.yaml" for p in shipped)
    for path in shipped:
        load_scenario(path)
    listing = CliRunner().invoke(main, ["list"])
    assert listing.exit_code == 0 and "quickstart.yaml" in listing.output


_json_leaf = st.none() | st.booleans() | st.integers(-5, 100) | st.floats(allow_nan=False) | \
    st.text(max_size=8)
_docs = st.recursive(_json_leaf, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.sampled_from(
                         ["name", "trainer", "faults", "kind", "rank", "at_step", "parallel",
                          "dp", "steps", "checkpoint", "every_steps", "expect", "x"]),
                         inner, max_size=4), max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(st.one_of(_docs, st.fixed_dictionaries({"name": st.just("f")}, optional={
    "trainer": _docs, "faults": st.lists(_docs, max_size=3), "checkpoint": _docs,
    "expect": _docs, "seed": _json_leaf})))
def test_no_input_crashes_the_loader(doc: Any) -> None:
    """Fuzzed: the loader either accepts a document or raises ScenarioError, nothing else."""
    try:
        parse_scenario(doc, path="fuzz.yaml")
    except ScenarioError as exc:
        assert str(exc).startswith("fuzz.yaml")


def test_the_reference_cache_key_is_what_decides_the_final_state() -> None:
    """Runs that end in the same state share a reference (recovery mode, timeouts and faults
    do not matter); another checkpoint format does not (an old reference could not be read)."""
    from antifragile.chaos.run import pipeline

    base = parse_scenario(BASE)
    same = parse_scenario({**BASE, "trainer": {**BASE["trainer"], "recovery": "in_process",
                                               "hang_timeout_s": 2, "collective_timeout_s": 9},
                           "faults": []})
    other = parse_scenario({**BASE, "seed": 99})
    assert pipeline._reference_key(base) == pipeline._reference_key(same)
    assert pipeline._reference_key(base) != pipeline._reference_key(other)
    from antifragile.engine import _paths

    real, key = _paths.FORMAT_VERSION, pipeline._reference_key(base)
    try:
        _paths.FORMAT_VERSION = real + 1
        assert pipeline._reference_key(base) != key
    finally:
        _paths.FORMAT_VERSION = real


def test_a_reference_of_an_older_trainer_state_is_not_reused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The built-in trainer's checkpoints gained entries (``train``: the seed, the model's
    settings, the data): a reference cached before that ends in another ``train`` than the
    chaos run's, and its verdict failed on ``train`` until the cache was cleared."""
    from antifragile.chaos.run import pipeline
    from antifragile.trainer import checkpoint

    base = parse_scenario(BASE)
    key = pipeline._reference_key(base)
    monkeypatch.setattr(checkpoint, "TRAIN_STATE_VERSION", checkpoint.TRAIN_STATE_VERSION + 1)
    assert pipeline._reference_key(base) != key


def test_a_reference_made_by_other_code_is_not_reused(monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    """A reference is a fault-free run of the code under test: one cached under another torch
    (other kernels, other bits) or before the trainer's code was edited ends elsewhere, and
    every verdict failed on it until the cache was cleared by hand."""
    import torch

    from antifragile.chaos.run import pipeline

    base = parse_scenario(BASE)
    key = pipeline._reference_key(base)
    with monkeypatch.context() as m:
        m.setattr(torch, "__version__", "0.0.1")
        assert pipeline._reference_key(base) != key
    with monkeypatch.context() as m:
        m.setattr(pipeline, "_antifragile_code", lambda: "edited")
        assert pipeline._reference_key(base) != key
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "model.py").write_text("a = 1\n")
    (tmp_path / "notes.txt").write_text("not code")
    before = pipeline.code_digest(tmp_path)
    (tmp_path / "notes.txt").write_text("still not code")
    assert pipeline.code_digest(tmp_path) == before
    (tmp_path / "sub" / "model.py").write_text("a = 2\n")
    assert pipeline.code_digest(tmp_path) != before


def test_a_reference_computed_on_another_processor_is_not_reused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache may be shared (an NFS home, ``ANTIFRAGILE_CACHE`` on shared storage, a CI
    cache restored on another runner): torch picks its CPU kernels by the instruction set it
    finds (and MKL by the processor), other kernels, other bits, and every verdict failed on a
    reference made elsewhere."""
    import torch

    from antifragile.chaos.run import pipeline

    base = parse_scenario(BASE)
    key = pipeline._reference_key(base)
    other = "AVX2" if torch.backends.cpu.get_cpu_capability() != "AVX2" else "AVX512"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: other)
    assert pipeline._reference_key(base) != key


def test_two_runs_that_need_one_reference_make_it_once(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Two chaos runs of one scenario at once (two terminals, a suite beside a run, two test
    workers) both found no reference, and both deleted and wrote the one cache folder: one
    run's fault-free checkpoints under the other's, each deleting what the other wrote."""
    import threading
    import time
    from types import SimpleNamespace

    from antifragile.chaos.run import pipeline

    monkeypatch.setenv("ANTIFRAGILE_CACHE", str(tmp_path))
    made: list[Path] = []

    def fake_run(s: Any, folder: Path, url: str, *, faults: bool, **_: Any) -> SimpleNamespace:
        made.append(folder)
        Path(url).mkdir(parents=True)
        time.sleep(0.5)  # the fault-free run takes a while; the other run arrives meanwhile
        return SimpleNamespace(returncode=0, wall_s=0.5, events=[])

    monkeypatch.setattr(pipeline, "run_scenario", fake_run)
    monkeypatch.setattr(pipeline.checker, "final_committed", lambda *a: True)
    monkeypatch.setattr(pipeline.figures, "goodput", lambda record: 1.0)
    scenario = parse_scenario(BASE)
    urls: list[str] = []
    runs = [threading.Thread(target=lambda: urls.append(
        pipeline._ensure_reference(scenario, lambda _: None))) for _ in range(2)]
    for run in runs:
        run.start()
    for run in runs:
        run.join()
    assert len(made) == 1, made
    assert len(urls) == 2 and urls[0] == urls[1] and Path(urls[0]).is_dir()


@pytest.mark.parametrize(("text", "line", "key"), [
    ("name: x\nfaults:\n  - {kind: kill_rank, rank: 1, at_step: 12}\nfaults: []\n", 4, "faults"),
    ("name: x\nfaults:\n  - {kind: kill_rank, rank: 1, at_step: 12, at_step: 25}\n", 3,
     "at_step"),
    ("name: x\ntrainer:\n  steps: 30\n  parallel: {dp: 2}\n  steps: 40\n", 5, "steps"),
], ids=["top-level", "flow-mapping", "nested"])
def test_duplicate_keys_are_refused_not_last_one_wins(tmp_path: Path, text: str, line: int,
                                                      key: str) -> None:
    """YAML's last-one-wins would silently drop faults (a copy-pasted ``faults: []`` at the
    end) and still pass: a repeated key anywhere is bad input, naming its line."""
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    with pytest.raises(ScenarioError) as exc:
        load_scenario(path)
    assert str(exc.value) == f"{path}: line {line}: duplicate key {key!r}"
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.output.strip() == f"error: {path}: line {line}: duplicate key {key!r}"


@pytest.mark.parametrize("nested", ["[" * 2000 + "]" * 2000, "{a: " * 2000 + "1" + "}" * 2000],
                         ids=["lists", "mappings"])
def test_deeply_nested_yaml_is_a_one_line_error(tmp_path: Path, nested: str) -> None:
    """Was a RecursionError traceback from the YAML composer (exit 1)."""
    path = tmp_path / "deep.yaml"
    path.write_text(f"name: x\nx: {nested}\n")
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert result.output.strip() == f"error: {path}: nested too deeply to be a scenario"


def test_yaml_merge_keys_are_not_duplicates(tmp_path: Path) -> None:
    path = tmp_path / "merge.yaml"
    path.write_text("name: x\ntrainer:\n  <<: {steps: 20, parallel: {dp: 2}}\n  steps: 10\n"
                    "checkpoint: {every_steps: 5}\n")
    assert load_scenario(path).trainer.steps == 10  # type: ignore[union-attr]


def _fault(**fault: Any) -> dict[str, Any]:
    return _with(faults=[fault])


@pytest.mark.parametrize(("doc", "message"), [
    (_fault(kind="corrupt_shard", checkpoint=-3, at_step=12),
     "faults.0.checkpoint: -3 is not a checkpoint: name one by its step (>= 1), or latest"),
    (_fault(kind="corrupt_shard", checkpoint=True, at_step=12),
     "faults.0.checkpoint: True is not a checkpoint"),
    (_fault(kind="corrupt_shard", checkpoint=7, at_step=12),
     "faults.0.checkpoint: the built-in trainer saves every 5 steps (checkpoint.every_steps): "
     "step 7 is never saved"),
    (_fault(kind="corrupt_shard", checkpoint=25, at_step=12),
     "faults.0.checkpoint: step 25 is after the last step (20)"),
    (_fault(kind="corrupt_shard", checkpoint=20, mtbf_s=5),
     "faults.0.checkpoint: step 20 is the last step's checkpoint, saved when no fault can fire "
     "any more"),
    (_fault(kind="corrupt_shard", checkpoint=15, at_step=12),
     "faults.0.checkpoint: step 15 is not saved yet when the fault fires (at step 12)"),
    (_fault(kind="corrupt_shard", checkpoint=15, at_checkpoint=2),
     "faults.0.checkpoint: step 15 is not saved yet when the fault fires (at step 10)"),
    (_fault(kind="corrupt_shard", checkpoint="latest", at_step=4),
     "faults.0.checkpoint: latest: no checkpoint is saved yet when the fault fires (at step "
     "4; the built-in trainer saves its first at step 5, checkpoint.every_steps)"),
    (_fault(kind="crash_during_save", rank={"dp": 1}, at_checkpoint=1, phase="committing"),
     "faults.0.phase: only the coordinator (rank 0) commits: phase committing needs rank: 0"),
    (_fault(kind="kill_rank", rank=True, at_step=3),
     "faults.0.rank: True is not a rank: give a rank number, random, or coordinates"),
    (_fault(kind="kill_rank", rank=1.5, at_step=3), "faults.0.rank: 1.5 is not a rank"),
    (_fault(kind="kill_rank", rank=1, at_step=True),
     "faults.0.at_step: Input should be a valid integer"),
    (_fault(kind="kill_rank", rank=1, at_checkpoint=True),
     "faults.0.at_checkpoint: Input should be a valid integer"),
    (_fault(kind="kill_rank", rank=1, mtbf_s=float("inf")),
     "faults.0.mtbf_s: Input should be a finite number"),
    (_fault(kind="kill_rank", rank=1, at_s=float("nan")),
     "faults.0.at_s: Input should be a finite number"),
    (_fault(kind="kill_rank", rank=1, mtbf_s=True), "faults.0.mtbf_s: Input should be a valid "
     "number"),
    (_fault(kind="hang_rank", rank=1, at_step=3, duration_s=float("inf")),
     "faults.0.duration_s: Input should be a finite number"),
    (_fault(kind="hang_rank", rank=1, at_step=3, duration_s=1e12),
     "faults.0.duration_s: Input should be less than or equal to 9223372036"),
    (_with(checkpoint={"url": "s3://b/p", "every_steps": 5},
           faults=[{"kind": "storage_node_down", "server": True, "at_step": 3}]),
     "faults.0.server: True is not a volume server: give its index (>= 0) or busiest"),
    (_with(seed=2**64), "s.yaml: seed: Input should be less than or equal to "
     "9223372036854775807"),
    (_with(seed=-1), "s.yaml: seed: Input should be greater than or equal to 0"),
    (_with(seed=True), "s.yaml: seed: Input should be a valid integer"),
    (_with(trainer={"steps": True}), "s.yaml: trainer.steps: Input should be a valid integer"),
    (_with(checkpoint={"every_steps": True}),
     "s.yaml: checkpoint.every_steps: Input should be a valid integer"),
    (_with(expect={"max_recovery_s": float("nan")}),
     "s.yaml: expect.max_recovery_s: Input should be a finite number"),
    # the run's checkpoints go to one tmpfs: the largest size was mounted, the others ignored
    (_with(faults=[{"kind": "disk_full", "at_step": 3, "volume_mib": 64},
                   {"kind": "disk_full", "at_step": 9}]),
     "s.yaml: faults.1.volume_mib: 256 MiB, but faults.0 (disk_full) asks for 64 MiB: the "
     "run's checkpoints go to one volume; give every disk_full the same volume_mib"),
    (_with(trainer={"hang_timeout_s": 0.01}),
     "s.yaml: trainer.hang_timeout_s: Input should be greater than or equal to 0.1"),
    (_with(trainer={"collective_timeout_s": float("inf")}),
     "s.yaml: trainer.collective_timeout_s: Input should be a finite number"),
    # validated, then refused by the trainer at launch (exit 2 on every worker)
    (_with(trainer={"collective_timeout_s": 0.5}),
     "s.yaml: trainer.collective_timeout_s: Input should be greater than or equal to 1"),
], ids=lambda v: "" if isinstance(v, dict) else v[:50])
def test_values_that_would_fail_only_at_run_time_are_refused(doc: Any, message: str) -> None:
    """Caught before anything runs, one line each: a checkpoint the run never has (the fault
    would only be "missed" after the whole run), a boolean read as 1, an infinite time (a
    ZeroDivisionError, or a timer thread dying so SIGCONT is never sent), a seed too large."""
    with pytest.raises(ScenarioError) as exc:
        parse_scenario(doc, path="s.yaml")
    assert str(exc.value).startswith("s.yaml: ") and "\n" not in str(exc.value), str(exc.value)
    assert message in str(exc.value)


@pytest.mark.parametrize("fault", [
    {"kind": "kill_rank", "rank": 1, "at_checkpoint": 4},
    {"kind": "hang_rank", "rank": 1, "at_checkpoint": 4, "duration_s": 5},
    {"kind": "corrupt_shard", "at_checkpoint": 4},
    {"kind": "crash_during_save", "rank": 1, "at_checkpoint": 4, "phase": "staged"},
], ids=lambda f: f["kind"])
def test_a_fault_at_the_last_steps_checkpoint_is_refused_like_one_at_the_last_step(
        fault: dict[str, Any]) -> None:
    """``at_checkpoint: 4`` of 20 steps saved every 5 is the end of step 20: the last step's
    save is blocking, so the fault fires after it committed, when nothing is left to train
    (``at_step: 20`` is refused for that). It was accepted, and the run could only fail: a
    restart restored step 20 and trained nothing after it ("proves nothing about the
    recovery"), a corruption no restore read. A ``staged`` crash is held after that save
    committed too."""
    with pytest.raises(ScenarioError) as exc:
        parse_scenario(_fault(**fault), path="s.yaml")
    assert str(exc.value) == (
        "s.yaml: faults.0.at_checkpoint: checkpoint 4 is the last step's (step 20), saved "
        "before the run ends: a fault there fires when nothing is left to train; name an "
        "earlier checkpoint" + (" (or a save phase before staged)"
                                if fault["kind"] == "crash_during_save" else "")), exc.value


def test_a_crash_during_the_last_steps_save_is_accepted() -> None:
    """Killed while the last step's save is persisting: the job restores the checkpoint
    before it and trains the last steps again, a recovery worth testing."""
    parse_scenario(_fault(kind="crash_during_save", rank=1, at_checkpoint=4, phase="persisting"))


def test_a_volume_server_the_cluster_does_not_have_is_refused_at_validation() -> None:
    """``server: 5`` of the two volume servers chaos's SeaweedFS cluster has was accepted: the
    whole run was made, the fault reported skipped (as a mechanism missing here, exit 3), not
    the scenario's mistake (exit 2 before anything runs)."""
    from antifragile.chaos.infra.seaweedfs import VOLUME_SERVERS

    doc = _with(checkpoint={"url": "s3://b/p", "every_steps": 5},
                faults=[{"kind": "storage_node_down", "server": VOLUME_SERVERS, "at_step": 3}])
    with pytest.raises(ScenarioError) as exc:
        parse_scenario(doc, path="s.yaml")
    assert str(exc.value) == (
        f"s.yaml: faults.0.server: the SeaweedFS cluster chaos starts for S3 has "
        f"{VOLUME_SERVERS} volume servers (0..{VOLUME_SERVERS - 1}), not {VOLUME_SERVERS}")
    doc["faults"][0]["server"] = VOLUME_SERVERS - 1
    parse_scenario(doc)


def test_checkpoints_and_ranks_that_exist_are_accepted() -> None:
    for fault in ({"kind": "corrupt_shard", "checkpoint": 10, "at_step": 12},
                  {"kind": "corrupt_shard", "checkpoint": 10, "at_step": 10},
                  {"kind": "corrupt_shard", "checkpoint": 5, "mtbf_s": 5},
                  {"kind": "corrupt_shard", "checkpoint": "latest", "at_step": 5},
                  {"kind": "kill_rank", "rank": "random", "at_s": 2},
                  {"kind": "kill_rank", "rank": {"dp": 1}, "mtbf_s": 30},
                  {"kind": "hang_rank", "rank": 1, "at_step": 3, "duration_s": 2},
                  # rank 0 named by its coordinates is the coordinator too
                  {"kind": "crash_during_save", "rank": {"dp": 0}, "at_checkpoint": 1,
                   "phase": "committing"}):
        parse_scenario(_fault(**fault))
    assert parse_scenario(_with(seed=2**63 - 1)).seed == 2**63 - 1


def test_infinite_times_in_yaml_are_a_one_line_error(tmp_path: Path) -> None:
    path = tmp_path / "inf.yaml"
    path.write_text("name: x\ntrainer: {parallel: {dp: 2}, steps: 30}\n"
                    "faults:\n  - {kind: kill_rank, rank: 1, mtbf_s: .inf}\n")
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.output.strip() == (f"error: {path}: faults.0.mtbf_s: Input should be a finite "
                                     "number")


def test_in_process_on_several_hosts_has_a_spare_per_host_split_evenly() -> None:
    """torchrun starts as many workers on every host: ranks + spares must split evenly."""
    trainer = {**BASE["trainer"], "nodes": 2, "recovery": "in_process"}
    assert parse_scenario({**BASE, "trainer": trainer}).trainer.spare_workers == 2
    with pytest.raises(ScenarioError, match=r"s\.yaml: trainer.*2 ranks \+ 1 spare\(s\) = 3 "
                                            r"workers cannot be split evenly over 2 nodes"):
        parse_scenario({**BASE, "trainer": {**trainer, "spares": 1}}, path="s.yaml")


@pytest.mark.parametrize(("line", "message"), [
    ("trainer: {parallel: {dp: 2}, steps: 30, collective_timeout_s: 5e1}",
     "trainer.collective_timeout_s: '5e1' is text to YAML, not a number: it reads an exponent "
     "only after a dot and with a sign (write 5.0e+1)"),
    ("trainer: {parallel: {dp: 2}, steps: 30}\n"
     "faults: [{kind: kill_rank, rank: 1, mtbf_s: 1.5E3}]",
     "faults.0.mtbf_s: '1.5E3' is text to YAML, not a number: it reads an exponent only "
     "after a dot and with a sign (write 1.5E+3)"),
    ("trainer: {parallel: {dp: 2}, steps: 1e26}",
     "trainer.steps: '1e26' is text to YAML, not a number; a whole number is due here: write "
     "its digits"),
    ("trainer: {parallel: {dp: 2}, steps: 1e400}", "trainer.steps: '1e400' is text to YAML"),
])
def test_a_number_with_an_exponent_yaml_reads_as_text_is_said_so(tmp_path: Path, line: str,
                                                                 message: str) -> None:
    """PyYAML (YAML 1.1) reads ``5e1`` and ``1.5e3`` as strings: the error was "Input should
    be a valid number" for what the user wrote as a number, with no hint why."""
    path = tmp_path / "exp.yaml"
    path.write_text(f"name: x\n{line}\n")
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert result.output.startswith(f"error: {path}: "), result.output
    assert message in result.output, result.output


@pytest.mark.parametrize("steps", [2**62, 10**26])
def test_more_steps_than_the_engine_can_checkpoint_are_refused(tmp_path: Path,
                                                               steps: int) -> None:
    """``steps: 100000000000000000000000000`` was "ok": the run's final checkpoint (at its last
    step) is one the engine refuses (steps stop below 2**62), so chaos run would train until
    its time limit (1 h) and end with no verdict."""
    path = tmp_path / "huge.yaml"
    path.write_text(f"name: x\ntrainer: {{parallel: {{dp: 2}}, steps: {steps}}}\n")
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert result.output.strip() == (
        f"error: {path}: trainer.steps: {steps} steps: the engine saves steps below 2**62 "
        "(the run's final checkpoint is of its last step)")
    assert parse_scenario(_with(trainer={"steps": 2**62 - 1})).trainer.steps == 2**62 - 1
    from antifragile.chaos import scenario
    from antifragile.engine import _paths

    assert scenario.MAX_STEP == _paths.MAX_STEP


@pytest.mark.parametrize("source", ["oversized", "/dev/zero"])
def test_a_file_too_large_to_be_a_scenario_is_refused_unread(tmp_path: Path,
                                                             source: str) -> None:
    """The whole file was read, then parsed: ``chaos validate /dev/zero`` read until memory
    ran out (a MemoryError traceback, or the OOM killer), and 200 MB of YAML took minutes."""
    from antifragile.chaos.scenario import MAX_FILE_BYTES

    if source == "oversized":
        path = tmp_path / "big.yaml"
        path.write_text("name: x\n#" + "x" * MAX_FILE_BYTES + "\n")
    else:
        path = Path(source)
        if not path.exists():
            pytest.skip("no /dev/zero here")
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert result.output.strip() == (f"error: {path}: larger than {MAX_FILE_BYTES >> 20} MiB: "
                                     "not a scenario file"), result.output
    if source == "oversized":  # and one a little smaller is read
        path.write_text("name: x\n#" + "x" * (MAX_FILE_BYTES - 20) + "\n")
        assert CliRunner().invoke(main, ["validate", str(path)]).exit_code == 0


def _alias_bomb(levels: int) -> str:
    """A few lines of YAML that are a list of 9**levels texts: each level aliases the last."""
    lines = ["name: x", "x:", "  - &l0 [" + ", ".join(["lol"] * 9) + "]"]
    lines += [f"  - &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("where", [
    "faults: [{kind: *l7}]", "faults: [{kind: kill_rank, at_step: 1, rank: *l5}]",
    "faults: [{kind: storage_node_down, at_step: 1, server: *l5}]",
    "faults: [{kind: corrupt_shard, at_step: 1, checkpoint: *l5}]",
])
def test_a_value_that_aliases_a_huge_list_is_shown_in_short(tmp_path: Path, where: str) -> None:
    """The error showed the whole value: a YAML alias makes a list of 9**9 texts out of ten
    lines, whose full repr took minutes and gigabytes (``chaos validate`` hung). Shown in
    short, as in ``[[[...], ...], ...]``; a kind is checked before pydantic, which wrote it
    all into its own error (9**8 texts: 10 s)."""
    path = tmp_path / "bomb.yaml"
    path.write_text(_alias_bomb(6 if "kind: *" not in where else 8) + where + "\n")
    with pytest.raises(ScenarioError) as refused:
        load_scenario(path)
    message = str(refused.value)
    assert len(message) < 1000 and "[[" in message and "..." in message, message[:1000]
    if "kind: *" in where:  # refused before pydantic's lookup
        assert "faults.0.kind: [[[...], [...], [...], [...], [...], [...], ...], " in message
        assert "is not a fault kind (known: corrupt_shard, " in message


@pytest.mark.parametrize(("text", "line", "message"), [
    ("name: x\nseed: 017\n", 2,
     "seed: 017 is octal 15 to YAML 1.1 but 17 to YAML 1.2: write 15 or 17 without the "
     "leading zero"),
    ("name: x\nseed: -017\n", 2,
     "seed: -017 is octal -15 to YAML 1.1 but -17 to YAML 1.2: write -15 or -17 without the "
     "leading zero"),
    ("name: x\ntrainer: {parallel: {dp: 2}, steps: 30}\n"
     "faults:\n  - kind: kill_rank\n    rank: 1\n    at_s: 1:30\n", 6,
     "faults.0.at_s: 1:30 is 90 (base 60) to YAML 1.1 but text to YAML 1.2: write 90, or "
     "quote it for text"),
    ("name: x\ntrainer: {parallel: {dp: 2}, steps: 30}\n"
     "faults:\n  - {kind: kill_rank, rank: 1, at_s: 1:30.5}\n", 4,
     "faults.0.at_s: 1:30.5 is 90.5 (base 60) to YAML 1.1 but text to YAML 1.2: write 90.5, "
     "or quote it for text"),
    ("name: x\nseed: 0b101\n", 2,
     "seed: 0b101 is binary 5 to YAML 1.1 but text to YAML 1.2: write 5, or quote it for "
     "text"),
    ("name: x\nseed: 1_000\n", 2,
     "seed: 1_000 is 1000 to YAML 1.1 but text to YAML 1.2: write 1000, or quote it for "
     "text"),
    ("name: x\nexpect: {max_recovery_s: 1_0.5}\n", 2,
     "expect.max_recovery_s: 1_0.5 is 10.5 to YAML 1.1 but text to YAML 1.2: write 10.5, or "
     "quote it for text"),
    ("name: x\nseed: -0x1F\n", 2,
     "seed: -0x1F is -31 to YAML 1.1 but text to YAML 1.2: write -31, or quote it for text"),
    ("name: x\ncheckpoint: {async: off}\n", 2,
     "checkpoint.async: off is false to YAML 1.1 but text to YAML 1.2: write false, or quote "
     "it for text"),
    ("name: no\n", 1,
     "name: no is false to YAML 1.1 but text to YAML 1.2: write false, or quote it for text"),
    ("name: x\nexpect:\n  On: 3\n", 3,
     "expect: the key On is true to YAML 1.1 but text to YAML 1.2: write true, or quote it "
     "for text"),
    ("name: x\nfaults:\n  - &f {kind: kill_rank, rank: 1, at_step: 010}\n  - *f\n", 3,
     "faults.0.at_step: 010 is octal 8 to YAML 1.1 but 10 to YAML 1.2: write 8 or 10 without "
     "the leading zero"),
], ids=["octal", "negative-octal", "base-60", "base-60-float", "binary", "underscore",
        "underscore-float", "signed-hex", "bool-off", "bool-no-as-text", "bool-key",
        "through-an-alias"])
def test_numbers_and_booleans_yaml_1_1_and_1_2_read_apart_are_refused(
        tmp_path: Path, text: str, line: int, message: str) -> None:
    """PyYAML reads YAML 1.1: ``seed: 017`` was seed 15 and ``at_s: 1:30`` 90 seconds,
    silently, where a YAML 1.2 reader (and most users) sees 17 and the text "1:30". A plain
    scalar the two read apart is refused, naming the line, the key and both readings."""
    path = tmp_path / "s.yaml"
    path.write_text(text)
    with pytest.raises(ScenarioError) as exc:
        load_scenario(path)
    assert str(exc.value) == f"{path}: line {line}: {message}"
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert result.output.strip() == f"error: {path}: line {line}: {message}"


def test_numbers_and_booleans_yaml_1_1_and_1_2_read_alike_are_kept(tmp_path: Path) -> None:
    """What both YAML versions read alike stays as it was: plain decimals, 0x hex, 0, true,
    false, a dotted float; and anything quoted is text."""
    path = tmp_path / "s.yaml"
    path.write_text("name: x\nseed: 0x1F\ndescription: 'on 017 1:30'\n"
                    "trainer: {parallel: {dp: 2}, steps: 30, collective_timeout_s: 0.5e+2}\n"
                    "checkpoint: {async: false, every_steps: 10}\n"
                    "faults:\n  - {kind: kill_rank, rank: 0, at_s: 0}\n"
                    "  - {kind: kill_rank, rank: 1, at_s: 10.0}\n")
    s = load_scenario(path)
    assert s.seed == 31 and s.description == "on 017 1:30"
    assert s.trainer.collective_timeout_s == 50.0 and s.checkpoint.async_ is False
    assert [f.at_s for f in s.faults] == [0.0, 10.0]
    path.write_text("name: '017'\nseed: 17\n")
    assert load_scenario(path).name == "017"


@pytest.mark.parametrize(("text", "key"), [
    ("checkpoint: {async: 'off'}", "checkpoint.async"),
    ("checkpoint: {async: 'no'}", "checkpoint.async"),
    ("checkpoint: {async: 0}", "checkpoint.async"),
    ("expect: {bitwise_equal_to_reference: 'false'}", "expect.bitwise_equal_to_reference"),
    ("expect: {bitwise_equal_to_reference: 1}", "expect.bitwise_equal_to_reference"),
    ("trainer: {command: [python, -c, pass], probe: 'off'}\nexpect: {}", "trainer.probe"),
])
def test_a_boolean_is_true_or_false_not_text_or_a_number(tmp_path: Path, text: str,
                                                          key: str) -> None:
    """Quoted, ``'off'`` is text (YAML 1.1's reading of a plain ``off`` is refused with "quote
    it for text"), and ``0`` a number, as a rank is no ``true``: each was read as a boolean
    (``async: 'off'`` a synchronous run, ``bitwise_equal_to_reference: 'false'`` no check)."""
    path = tmp_path / "s.yaml"
    path.write_text(f"name: x\n{text}\n")
    with pytest.raises(ScenarioError) as exc:
        load_scenario(path)
    assert str(exc.value) == f"{path}: {key}: Input should be a valid boolean"


@pytest.mark.parametrize(("fault", "message"), [
    ({"kind": "kill_rank", "at_step": 3, "rank": {"dp": 1, "xx": 0}},
     "faults.0.rank.xx: unknown key"),
    ({"kind": "kill_rank", "at_step": 3, "rank": {"dp": -1}},
     "faults.0.rank.dp: Input should be greater than or equal to 0"),
    ({"kind": "hang_rank", "at_step": 3, "rank": {"tp": "x"}},
     "faults.0.rank.tp: Input should be a valid integer"),
    ({"kind": "kill_rank", "at_step": 3, "rank": 1.5},
     "faults.0.rank: 1.5 is not a rank: give a rank number, random, or coordinates {dp, pp, tp}"),
    ({"kind": "corrupt_shard", "at_step": 3, "checkpoint": "newest"},
     "faults.0.checkpoint: 'newest' is not a checkpoint: name one by its step (>= 1), or latest"),
], ids=["coordinates-unknown-key", "coordinates-negative", "coordinates-text", "float",
        "checkpoint"])
def test_a_bad_value_of_a_union_field_is_one_line_without_pydantic_branch_names(
        fault: dict[str, Any], message: str) -> None:
    """``rank: {dp: 1, xx: 0}`` gave three lines, two of them about the union branches the
    value was never meant for (``rank.int``, ``rank.literal['random']``) and the useful one
    under ``rank.Coordinates.xx``."""
    with pytest.raises(ScenarioError) as exc:
        parse_scenario(_fault(**fault), path="s.yaml")
    assert str(exc.value) == f"s.yaml: {message}"


@pytest.mark.parametrize("number", ["1e400", "-1.5E999"])
def test_an_exponent_number_too_large_to_be_finite_is_said_so(tmp_path: Path,
                                                              number: str) -> None:
    """``at_s: 1e400`` said to write ``1.0e+400``, which was then refused as not finite."""
    path = tmp_path / "big.yaml"
    path.write_text("name: x\ntrainer: {parallel: {dp: 2}, steps: 30}\n"
                    f"faults:\n  - {{kind: kill_rank, rank: 1, at_s: {number}}}\n")
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert result.output.strip() == (
        f"error: {path}: faults.0.at_s: {number!r} is text to YAML, not a number; as a number "
        "it would be too large: not finite (a finite number is due here)")


@pytest.mark.parametrize(("url", "reason"), [
    ("http://example.com/ckpt", "http:// storage only reads, and checkpoints are written "
                                "(give a local folder or s3://bucket/prefix)"),
    ("HTTPS://example.com/ckpt", "HTTPS:// storage only reads, and checkpoints are written "
                                 "(give a local folder or s3://bucket/prefix)"),
    ("http://[::1", "not a valid URL (Invalid IPv6 URL)"),
    ("s3://[::1/ckpt", "not a valid URL (Invalid IPv6 URL)"),
], ids=["http", "https", "malformed-http", "malformed-s3"])
def test_checkpoint_storage_that_cannot_be_written_is_refused_at_validation(
        url: str, reason: str) -> None:
    """``http://...`` (fsspec reads it, but cannot write, list or delete checkpoints there),
    even a malformed ``http://[::1``, passed validation and failed only once the run was
    under way."""
    with pytest.raises(ScenarioError) as exc:
        parse_scenario(_with(checkpoint={"url": url}), path="s.yaml")
    assert str(exc.value) == f"s.yaml: checkpoint.url: {url}: {reason}"


def test_gpipe_takes_fewer_micro_batches_than_stages_as_the_trainer_does() -> None:
    """Only 1F1B needs a micro-batch per stage (the trainer's rule since 86a9b04); the scenario
    check refused ``micro_batches < pp`` for GPipe too, a run the trainer makes."""
    trainer = {**BASE["trainer"], "parallel": {"dp": 1, "tp": 1, "pp": 2}, "micro_batches": 1,
               "model": {"layers": 2}}
    s = parse_scenario(_with(trainer={**trainer, "schedule": "gpipe"}))
    assert s.trainer.micro_batches == 1
    with pytest.raises(ScenarioError, match="trainer: micro_batches 1 cannot fill 2 pipeline "
                                            "stages with schedule 1f1b"):
        parse_scenario(_with(trainer={**trainer, "schedule": "1f1b"}))


def test_a_model_size_no_memory_here_holds_is_refused_naming_its_key() -> None:
    """The trainer refuses a size whose weights and one layer's attention scores exceed the
    memory available (exit 2 in every worker, which torchrun restarted): the scenario is
    refused first, naming its key."""
    doc = _with(trainer={**_with()["trainer"], "model": {"seq_len": 10**12}})
    with pytest.raises(ScenarioError, match=r"trainer: model\.seq_len 1000000000000: needs at "
                                            r"least [\d,]+ bytes in each process .* bytes of "
                                            r"memory available here"):
        parse_scenario(doc)
    parse_scenario(_with(trainer={**_with()["trainer"], "model": {"seq_len": 256}}))


def test_every_scenario_key_has_its_row_in_the_reference() -> None:
    """``scenarios/README.md`` is the format's reference (the design it came from is not in
    the repository, and the README named the keys only where it told of something else): a
    key added to the scenario models without its row there fails here, as does a fault kind
    missing from its table of kinds."""
    import re

    from antifragile.chaos.faults import FAULT_CONFIGS
    from antifragile.chaos.scenario import CheckpointSpec, Expect, Scenario
    from antifragile.chaos.scenario.trainer import CommandSpec, ModelSpec, Parallel, TrainerSpec

    text = (SCENARIOS / "README.md").read_text()
    rows = {m[1]: m[2] for m in re.finditer(r"^\| `([a-z_]+)` \|(.*)$", text, re.M)}
    for model in (Scenario, TrainerSpec, CommandSpec, CheckpointSpec, Expect,
                  *FAULT_CONFIGS.values()):
        for name, field in model.model_fields.items():
            assert (field.alias or name) in rows, f"{model.__name__}.{name}"
    for parent, model in (("parallel", Parallel), ("model", ModelSpec)):  # in their parent's row
        for name in model.model_fields:
            assert re.search(rf"\b{name}\b", rows[parent]), f"{parent}.{name}"
    assert set(FAULT_CONFIGS) <= set(rows)
