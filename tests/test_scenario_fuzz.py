"""Shipped scenarios, mutated: every file ``chaos validate`` is given is either accepted or
refused with one clean error naming the file (exit 2), never a traceback (hypothesis)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from antifragile.chaos.cli import main
from antifragile.chaos.scenario import SCENARIOS, ScenarioError, load_scenario

SHIPPED = sorted(SCENARIOS.rglob("*.yaml"))
DOCS = {p: yaml.safe_load(p.read_text()) for p in SHIPPED}


def _key_paths(node: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path into ``node`` (mapping keys and list indices)."""
    paths = [at] if at else []
    if isinstance(node, dict):
        for k, v in node.items():
            paths += _key_paths(v, (*at, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            paths += _key_paths(v, (*at, i))
    return paths


_odd_text = st.sampled_from(["", " ", "\t", "\x00", "\x1b[31m", "é", "\u202e", "名", "🙂", "..",
                             ".", "a/b", "-", "~", "nan", "inf", "null", "random", "latest",
                             "s3://", "s3:///x", "1e3", "5e1", "0x10", "x" * 300])
_odd = st.one_of(
    st.none(), st.booleans(),
    st.sampled_from([0, -1, 1, 2, 3, 7, 2**31, 2**62, 2**63, 2**64, 2**70, -(2**70)]),
    st.integers(-10, 100),
    st.sampled_from([0.0, -0.0, 0.5, -1.5, 1e300, -1e300, float("inf"), float("-inf"),
                     float("nan"), 2.0**70, 1e-320]),
    _odd_text, st.text(max_size=6),
    st.lists(st.integers(0, 3) | _odd_text, max_size=3),
    st.dictionaries(st.sampled_from(["dp", "tp", "pp", "kind", "x", "at_step", "command"]),
                    st.integers(-1, 4) | _odd_text, max_size=3),
)


def _mutate(doc: Any, data: st.DataObject) -> Any:
    doc = copy.deepcopy(doc)
    for _ in range(data.draw(st.integers(1, 3))):
        paths = _key_paths(doc)
        if not paths:
            break
        path = data.draw(st.sampled_from(paths))
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        if data.draw(st.booleans()) and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = data.draw(_odd)
    return doc


def _check(file: Path) -> None:
    """Accepted, or a ScenarioError naming ``file``; ``chaos validate`` says the same."""
    try:
        load_scenario(file)
        accepted = True
    except ScenarioError as exc:
        accepted = False
        lines = str(exc).splitlines()
        assert lines and all(line.startswith(f"{file}: ") for line in lines), str(exc)
    result = CliRunner().invoke(main, ["validate", str(file)])
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        repr(result.exception)
    assert "Traceback" not in result.output
    assert result.exit_code == (0 if accepted else 2), result.output
    if not accepted:
        assert result.output.startswith(f"error: {file}: "), result.output


_fuzz = settings(max_examples=150, deadline=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture])


@_fuzz
@given(st.sampled_from(SHIPPED), st.data())
def test_mutated_shipped_scenarios_are_accepted_or_refused_cleanly(
        tmp_path: Path, shipped: Path, data: st.DataObject) -> None:
    doc = _mutate(DOCS[shipped], data)
    # next to the shipped file: a command's script path is relative to the scenario file
    file = tmp_path / shipped.name
    file.write_text(yaml.safe_dump(doc, allow_unicode=data.draw(st.booleans())),
                    encoding="utf-8")
    _check(file)


_raw_texts = st.sampled_from([
    b"", b"   \n", b"# only a comment\n", b"---\n", b"--- a\n--- b\n", b"name: a\n---\nname: b\n",
    b"- name: a\n", b"42\n", b"name\n", b"'name'\n", b"name: a\nname: b\n",
    b"name: &n a\ndescription: *n\n", b"name: *undefined\n", b"a: &x [*x]\n",
    b"name: a\nseed: !!python/object:os.system ls\n", b"name: a\nseed: !!binary aGk=\n",
    b"name: a\nseed: 0o17\n", b"name: a\nseed: 1_000\n", b"name: a\nseed: 0b101\n",
    b"name: a\nseed: 2019-01-01\n", b"name: a\nseed: 1:30\n", b"\xff\xfename: a\n",
    b"\xef\xbb\xbfname: a\n", b"name: a\x00\n", b"name: \xc3(\n", b"\tname: a\n",
    b"name: a\ntrainer: {steps: 10, steps: 11}\n", b"name: a\n? [x]\n: 1\n", b"{[1]: 2}\n",
    b"name: a\ntrainer: {<<: {steps: 10}, steps: 20}\n", b"name: a\nfaults: [{<<: 1}]\n",
    b"name: a\nexpect: {max_recovery_s: .inf}\n", b"name: a\nexpect: {max_recovery_s: .nan}\n",
    b"name: a\nseed: 99999999999999999999999999\n", b"[" * 60 + b"]" * 60 + b"\n",
    b"name: a\ncheckpoint: {url: s3://b/p, storage_options: {endpoint_url: 1}}\n",
    b"name: a\ntrainer: {command: [python, -c, pass], env: {1: x}}\n",
    b"name: a\ntrainer: {command: [python, -c, pass], env: {A: [1]}}\n",
    b"name: a\ntrainer: {command: [1, 2]}\n", b"name: a\ntrainer: {command: []}\n",
    b"name: a\ntrainer: {command: [\"\"]}\n", b"name: a\ntrainer: {command: [/]}\n",
    b"name: a\nfaults: [{kind: [1]}]\n", b"name: a\nfaults: [{kind: {a: 1}}]\n",
    b"name: a\nfaults: [{kind: null}]\n", b"name: a\nfaults: {kind: kill_rank}\n",
    b"name: a\nfaults: [{kind: drop_link, at_step: 3, between: [0]}]\n",
    b"name: a\nfaults: [{kind: kill_rank, at_step: 3, rank: {dp: x}}]\n",
    b"name: a\nfaults: [{kind: storage_node_down, at_step: 3, server: true}]\n",
])


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_raw_texts, st.sampled_from(["", "x.yaml", "sub/x.yaml"]))
def test_odd_files_are_accepted_or_refused_cleanly(tmp_path: Path, raw: bytes,
                                                   name: str) -> None:
    file = tmp_path / name if name else tmp_path  # "": the folder itself
    if name:
        file.parent.mkdir(exist_ok=True)
        file.write_bytes(raw)
    _check(file)


def test_a_missing_file_is_refused_cleanly(tmp_path: Path) -> None:
    _check(tmp_path / "none.yaml")
