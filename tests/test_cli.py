"""``chaos ckpt``: listing, verifying and inspecting checkpoints from the command line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from antifragile.chaos.cli import main
from antifragile.engine import CheckpointEngine


def _save_steps(url: str, steps: list[int]) -> None:
    with CheckpointEngine(url, keep_last=None) as ckpt:
        for step in steps:
            state = {"model": {"w": torch.arange(64.0).reshape(8, 8) + step,
                               "b": torch.ones(8, dtype=torch.bfloat16)},
                     "step": step}
            ckpt.save(step, state, blocking=True)


def test_ls_lists_committed_steps(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    _save_steps(url, [10, 20])
    (tmp_path / "ckpt" / "step_000000030").mkdir()  # uncommitted debris is not listed
    result = CliRunner().invoke(main, ["ckpt", "ls", url])
    assert result.exit_code == 0, result.output
    steps = [line.split()[0] for line in result.output.splitlines()[1:]]
    assert steps == ["10", "20"]


def test_ls_lists_every_step_past_one_whose_commit_is_damaged(tmp_path: Path) -> None:
    """A damaged COMMIT stopped the listing at that step with exit 2 (bad input): the steps
    after it went unlisted. It is a damaged step, listed as such, exit 1 (damage)."""
    url = str(tmp_path / "ckpt")
    _save_steps(url, [10, 20, 30])
    (tmp_path / "ckpt" / "step_000000020" / "COMMIT").write_text("garbage")
    result = CliRunner().invoke(main, ["ckpt", "ls", url])
    assert result.exit_code == 1, result.output
    rows = result.output.splitlines()[1:]
    assert [line.split()[0] for line in rows] == ["10", "20", "30"]
    assert rows[1].split(None, 1)[1].startswith("DAMAGED: step 20: COMMIT marker: no checksum")
    assert rows[1].endswith("(chaos ckpt verify --step 20)") and "error:" not in result.output


@pytest.mark.parametrize("nbytes", ["abc", None, float("nan")])
def test_a_sealed_commit_whose_size_is_not_a_number_is_damage_not_a_traceback(
        tmp_path: Path, nbytes: Any) -> None:
    """The marker's ``nbytes`` was used as it came (``int()`` in ls and inspect): a sealed
    marker that says anything else there (a buggy or hostile writer: ``_forge``) was a
    traceback, exit 1 without a word of which step. It is a malformed marker now: damage."""
    from _forge import edit_commit

    url = str(tmp_path / "ckpt")
    _save_steps(url, [10, 20, 30])
    edit_commit(tmp_path / "ckpt" / "step_000000020" / "COMMIT",
                lambda doc: doc.__setitem__("nbytes", nbytes))
    runner = CliRunner()
    listed = runner.invoke(main, ["ckpt", "ls", url])
    assert listed.exit_code == 1, listed.output
    rows = listed.output.splitlines()[1:]
    assert [line.split()[0] for line in rows] == ["10", "20", "30"], listed.output
    assert rows[1].split(None, 1)[1].startswith("DAMAGED: step 20: COMMIT marker"), rows[1]
    verified = runner.invoke(main, ["ckpt", "verify", url, "--step", "20"])
    assert verified.exit_code == 1 and "DAMAGED" in verified.output, verified.output
    inspected = runner.invoke(main, ["ckpt", "inspect", url, "--step", "20"])
    assert inspected.exit_code == 1, inspected.output  # damage, as ls and verify say: not 2
    assert inspected.output.startswith("error: step 20: COMMIT marker"), inspected.output


def test_verify_exit_codes(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    _save_steps(url, [10, 20])
    runner = CliRunner()
    ok = runner.invoke(main, ["ckpt", "verify", url])
    assert ok.exit_code == 0, ok.output
    assert "step 10: ok" in ok.output and "step 20: ok" in ok.output

    shard = tmp_path / "ckpt" / "step_000000020" / "model" / "w" / "c.0.0"
    data = bytearray(shard.read_bytes())
    data[5] ^= 0x10
    shard.write_bytes(bytes(data))
    bad = runner.invoke(main, ["ckpt", "verify", url, "--step", "20"])
    assert bad.exit_code == 1
    assert "DAMAGED" in bad.output and "model/w" in bad.output

    missing = runner.invoke(main, ["ckpt", "verify", url, "--step", "30"])
    assert missing.exit_code == 2
    assert "step 30 is not a committed checkpoint" in missing.output
    assert "Traceback" not in missing.output


def test_verify_of_a_step_deleted_after_the_listing_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention beside a running job can delete a listed step before verify reads it: exit 2
    naming the step as not committed, not exit 1 "DAMAGED"."""
    from antifragile.engine import commit

    url = str(tmp_path / "ckpt")
    _save_steps(url, [10, 20])
    monkeypatch.setattr(commit, "committed_steps", lambda storage: [10, 20, 30])
    result = CliRunner().invoke(main, ["ckpt", "verify", url])
    assert result.exit_code == 2, result.output
    assert f"error: step 30 is not committed under {url}" in result.output
    assert "DAMAGED" not in result.output and "Traceback" not in result.output


def test_inspect_of_a_quarantined_step_says_it_is_quarantined(tmp_path: Path) -> None:
    """It said "step 20 is not committed", of a step that was, until a load found it damaged
    and set its COMMIT aside."""
    from antifragile.engine.quarantine import quarantine
    from antifragile.engine.storage import open_storage

    url = str(tmp_path / "ckpt")
    _save_steps(url, [10, 20])
    quarantine(open_storage(url), 20, "flipped bit", reports={0: "flipped bit"}, confirmed_by=0)
    result = CliRunner().invoke(main, ["ckpt", "inspect", url, "--step", "20"])
    assert result.exit_code == 2, result.output
    assert f"error: step 20 under {url} is quarantined" in result.output, result.output
    assert "chaos ckpt verify" in result.output and "Traceback" not in result.output


def test_inspect_of_a_superseded_step_says_why_it_was_set_aside(tmp_path: Path) -> None:
    """A step superseded by a rollback's save is intact: inspect said "a load found it
    damaged", and sent the user to verify for damage that is not there."""
    url = str(tmp_path / "ckpt")
    _save_steps(url, [10, 20])
    with CheckpointEngine(url) as engine:
        engine.load({"model": {"w": torch.empty(8, 8)}}, step=10)
        engine.save(15, {"w": torch.ones(3)}, blocking=True)  # went back: 20 superseded
    result = CliRunner().invoke(main, ["ckpt", "inspect", url, "--step", "20"])
    assert result.exit_code == 2, result.output
    assert (f"error: step 20 under {url} is quarantined: superseded: the run went back to "
            "step 10") in result.output, result.output
    assert "damaged" not in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("command", ["ls", "verify"])
@pytest.mark.parametrize("refused", ["COMMIT", "QUARANTINE"])
def test_storage_refusing_a_read_is_an_error_not_damage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str, refused: str
) -> None:
    """Storage refusing to read a step's COMMIT, or a quarantined step's note (a 403, an
    outage), says nothing about the data: exit 2 naming the failure, not exit 1 with the
    step listed as DAMAGED."""
    from antifragile.engine.quarantine import quarantine
    from antifragile.engine.storage import open_storage
    from antifragile.engine.storage._local import LocalStorage

    url = str(tmp_path / "ckpt")
    _save_steps(url, [10, 20])
    if refused == "QUARANTINE":
        quarantine(open_storage(url), 20, "flipped bit", reports={0: "flipped bit"},
                   confirmed_by=0)
    read = LocalStorage.read

    def refusing(self: Any, key: str, *args: Any, **kwargs: Any) -> Any:
        if key == f"step_000000020/{refused}":
            raise PermissionError(f"403 Forbidden: {key}")
        return read(self, key, *args, **kwargs)

    monkeypatch.setattr(LocalStorage, "read", refusing)
    result = CliRunner().invoke(main, ["ckpt", command, url])
    assert result.exit_code == 2, result.output
    assert "403 Forbidden" in result.output
    assert "DAMAGED" not in result.output and "Traceback" not in result.output


def test_storage_option_booleans_are_booleans(tmp_path: Path) -> None:
    """``--storage-option anon=false`` arrived as the text "false", which is true: the S3
    client then sent unsigned requests (403s on a private bucket)."""
    from antifragile.chaos.cli.ckpt import _options

    options = _options(None, ("anon=false", "use_ssl=True", "region_name=eu-1", "key=true1"),
                       "memory://bucket/run")
    assert options == {"anon": False, "use_ssl": True, "region_name": "eu-1", "key": "true1"}


@pytest.mark.parametrize("flags", [
    ["--storage-option", "endpoint_url=http://a:1", "--storage-option", "endpoint_url=http://b:2"],
    ["--endpoint-url", "http://a:1", "--storage-option", "endpoint_url=http://b:2"],
])
def test_a_storage_option_given_twice_with_two_values_is_refused(flags: list[str]) -> None:
    """The last given was used, the other dropped without a word (an S3 error then named the
    endpoint chaos went to, not the one the user meant). No value is echoed: it may be a
    secret."""
    for command in (["ls"], ["verify"], ["inspect", "--step", "1"]):
        result = CliRunner().invoke(main, ["ckpt", command[0], "s3://b/run", *command[1:],
                                           *flags])
        assert result.exit_code == 2, result.output
        assert "endpoint_url given twice, with two values (one is dropped): give it once" in \
            result.output, result.output
        assert "Traceback" not in result.output


@pytest.mark.parametrize(("url", "flags"), [
    ("github://a/b", []),  # its file system takes org= and repo=, not the URL: TypeError
    ("tar://run", ["--storage-option", "fo=MISSING"]),  # an archive that is not there: OSError
])
def test_an_fsspec_url_whose_file_system_cannot_be_made_is_bad_input(
        tmp_path: Path, url: str, flags: list[str]) -> None:
    """fsspec raises what it likes when a file system cannot be made from the options (a
    TypeError for a missing argument, an OSError for a missing archive): that was a traceback
    (exit 1, which reads as damage), not the one-line error naming the URL."""
    flags = [f.replace("MISSING", str(tmp_path / "missing.tar")) for f in flags]
    for command in (["ls"], ["verify"], ["inspect", "--step", "1"]):
        result = CliRunner().invoke(main, ["ckpt", command[0], url, *command[1:], *flags])
        assert result.exit_code == 2, result.output
        assert result.output.startswith(f"error: cannot open {url}: "), result.output
        assert len(result.output.strip().splitlines()) == 1, result.output


def test_a_step_of_another_format_is_listed_as_such_not_as_damage(tmp_path: Path) -> None:
    """A COMMIT of a format this engine does not read (a newer engine's step, intact) was
    listed as DAMAGED and verified as damaged (exit 1): an operator may delete it."""
    url = str(tmp_path / "ckpt")
    _save_steps(url, [10, 20])
    marker = tmp_path / "ckpt" / "step_000000020" / "COMMIT"
    marker.write_bytes(b'{"format": 99, "step": 20, "nonce": 5, "objects": {}}')
    runner = CliRunner()
    listing = runner.invoke(main, ["ckpt", "ls", url])
    assert listing.exit_code == 0, listing.output
    assert "DAMAGED" not in listing.output
    assert "step 20 was written in checkpoint format 99" in listing.output
    report = runner.invoke(main, ["ckpt", "verify", url, "--step", "20"])
    assert report.exit_code == 2, report.output
    assert "DAMAGED" not in report.output and "checkpoint format 99" in report.output


def test_verify_goes_past_a_step_of_another_format_to_the_damage_after_it(
        tmp_path: Path) -> None:
    """Verifying a whole root stopped at a step of a format this engine does not read (exit 2,
    "bad input"): the steps after it went unverified, so damage in them was never reported.
    That step is named and passed over; the damage after it is exit 1."""
    url = str(tmp_path / "ckpt")
    _save_steps(url, [10, 20, 30])
    marker = tmp_path / "ckpt" / "step_000000020" / "COMMIT"
    marker.write_bytes(b'{"format": 99, "step": 20, "nonce": 5, "objects": {}}')
    runner = CliRunner()
    intact = runner.invoke(main, ["ckpt", "verify", url])
    assert intact.exit_code == 2, intact.output
    assert "step 10: ok" in intact.output and "step 30: ok" in intact.output, intact.output
    assert "step 20 was written in checkpoint format 99" in intact.output
    chunk = tmp_path / "ckpt" / "step_000000030" / "model" / "w" / "c.0.0"
    data = bytearray(chunk.read_bytes())
    data[10] ^= 0x01
    chunk.write_bytes(bytes(data))
    damaged = runner.invoke(main, ["ckpt", "verify", url])
    assert damaged.exit_code == 1, damaged.output
    assert "step 30: DAMAGED" in damaged.output and "model/w/c.0.0" in damaged.output


def test_inspect_describes_arrays(tmp_path: Path) -> None:
    url = str(tmp_path / "ckpt")
    _save_steps(url, [10])
    result = CliRunner().invoke(main, ["ckpt", "inspect", url, "--step", "10", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    arrays = {a["array"]: a for a in doc["arrays"]}
    assert arrays["model/w"]["shape"] == [8, 8] and arrays["model/w"]["dtype"] == "float32"
    assert arrays["model/b"]["dtype"] == "bfloat16"
    assert arrays["model/w"]["bytes"] >= 8 * 8 * 4
    assert doc["values"] == {"step": 10}
    # requests: what the save made (each rank, through its record), what a load of the whole
    # step makes (COMMIT, group metadata with every array's layout, each shard object)
    shards = sum(a["shards"] for a in doc["arrays"])
    assert doc["requests"]["load"] == 2 + shards
    objects = shards + len(doc["arrays"]) + 2  # + model/zarr.json and the group's zarr.json
    assert objects - 1 <= doc["requests"]["save"] <= objects + 4, doc["requests"]
    assert doc["requests"]["save_by_rank"] == {"0": doc["requests"]["save"]}
    table = CliRunner().invoke(main, ["ckpt", "inspect", url, "--step", "10"])
    assert table.exit_code == 0 and "model/w" in table.output
    assert f"requests: save {doc['requests']['save']}" in table.output


@pytest.mark.parametrize("layout", ["x", [1, 2], None])
def test_inspect_of_a_step_whose_layout_index_is_not_a_mapping(tmp_path: Path,
                                                             layout: Any) -> None:
    """The group's ``layout`` (world size, meshes) is shown by inspect and used by nothing
    else, so the reader does not check it: a sealed step whose group document holds another
    value there (its manifest entry consistent: ``_forge``) was a traceback in inspect."""
    from _forge import edit_commit, part_crcs, set_entry

    from antifragile.engine import _format

    url = str(tmp_path / "ckpt")
    _save_steps(url, [10])
    group = tmp_path / "ckpt" / "step_000000010" / "zarr.json"
    doc = json.loads(group.read_bytes())
    doc["attributes"]["antifragile"]["layout"] = layout
    data = _format.dumps(doc)
    group.write_bytes(data)
    edit_commit(group.with_name("COMMIT"),
                lambda commit: set_entry(commit, "zarr.json", len(data), part_crcs(data, None)))
    for flags in ([], ["--json"]):
        result = CliRunner().invoke(main, ["ckpt", "inspect", url, "--step", "10", *flags])
        assert result.exit_code == 0, result.output
        assert "model/w" in result.output


def test_a_step_that_is_not_committed_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "none").mkdir()
    result = CliRunner().invoke(main, ["ckpt", "inspect", str(tmp_path / "none"), "--step", "1"])
    assert result.exit_code == 2
    assert f"step 1 is not committed under {tmp_path / 'none'}" in result.output


def test_a_local_url_that_is_missing_or_a_file_is_bad_input(tmp_path: Path) -> None:
    """A typo in a local path is not "no checkpoint": exit 2 naming the path and why, for
    every subcommand (an existing empty folder is still a plain "no committed checkpoint")."""
    runner = CliRunner()
    (tmp_path / "notes.txt").write_text("hello")
    for command in (["ls"], ["verify"], ["inspect", "--step", "1"]):
        missing = runner.invoke(main, ["ckpt", command[0], str(tmp_path / "nope"), *command[1:]])
        assert missing.exit_code == 2, missing.output
        assert f"{tmp_path / 'nope'}: no such folder" in missing.output
        a_file = runner.invoke(main, ["ckpt", command[0], str(tmp_path / "notes.txt"),
                                      *command[1:]])
        assert a_file.exit_code == 2, a_file.output
        assert "is a file, not a checkpoint folder" in a_file.output
    (tmp_path / "empty").mkdir()
    empty = runner.invoke(main, ["ckpt", "ls", str(tmp_path / "empty")])
    assert empty.exit_code == 0 and "no committed checkpoint" in empty.output


def test_an_empty_url_is_bad_input_that_says_so() -> None:
    """``chaos ckpt ls "$CKPT"`` with the variable unset: the error was ": no such folder",
    naming nothing."""
    for command in (["ls"], ["verify"], ["inspect", "--step", "1"]):
        result = CliRunner().invoke(main, ["ckpt", command[0], "", *command[1:]])
        assert result.exit_code == 2, result.output
        assert result.output.strip() == "error: URL: empty (give a checkpoint folder or URL)"


@pytest.mark.parametrize("url", ["local", "s3://bucket/run"])
def test_an_empty_endpoint_url_is_bad_input(tmp_path: Path, url: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """``--endpoint-url "$ENDPOINT"`` with the variable unset was taken as no option: a local
    folder was listed as if it had not been given (exit 0), and an s3:// URL went to the
    environment's endpoint or AWS itself (here: "cannot use https://s3.amazonaws.com: no
    credentials"), never naming the empty option."""
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID",
                 "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    if url == "local":
        url = str(tmp_path / "ckpt")
        _save_steps(url, [10])
    for command in (["ls"], ["verify"], ["inspect", "--step", "10"]):
        result = CliRunner().invoke(main, ["ckpt", command[0], url, *command[1:],
                                           "--endpoint-url", ""])
        assert result.exit_code == 2, result.output
        assert result.output.strip().startswith("error: --endpoint-url: empty"), result.output


@pytest.mark.parametrize("endpoint", ["http://[::1", "localhost:9000", "ftp://host",
                                      "http://host:port", "http://:9000"])
def test_an_endpoint_url_that_is_no_endpoint_is_refused_naming_the_option(
        endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The error named the checkpoint URL and botocore's words ("s3://b/x: Invalid IPv6
    URL", "s3://b/x: cannot use ftp://host: EndpointResolutionError: ..."), never the option
    that was wrong."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    for command in (["ls"], ["verify"], ["inspect", "--step", "10"]):
        result = CliRunner().invoke(main, ["ckpt", command[0], "s3://bucket/run", *command[1:],
                                           "--endpoint-url", endpoint])
        assert result.exit_code == 2, result.output
        assert result.output.strip() == (f"error: --endpoint-url {endpoint}: not an endpoint "
                                         "URL (give http://host:port or https://host)")


@pytest.mark.parametrize("flags", [["--endpoint-url", "http://127.0.0.1:9000"],
                                   ["--storage-option", "anon=true"]])
def test_storage_flags_on_a_local_url_are_bad_input(tmp_path: Path, flags: list[str]) -> None:
    """--endpoint-url and --storage-option reach S3 or fsspec only: given with a local path
    (``bucket/run`` where ``s3://bucket/run`` was meant) they were ignored and the folder's
    listing, often "no committed checkpoint" (exit 0), answered a question not asked."""
    runner = CliRunner()
    (tmp_path / "bucket" / "run").mkdir(parents=True)
    url = str(tmp_path / "bucket" / "run")
    for command in (["ls"], ["verify"], ["inspect", "--step", "1"]):
        result = runner.invoke(main, ["ckpt", command[0], url, *command[1:], *flags])
        assert result.exit_code == 2, result.output
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert lines == [f"error: {flags[0]}: {url} is a local folder; {flags[0]} is for "
                         "s3:// (or another fsspec) URLs"], result.output


def test_ctrl_c_is_not_an_exit_code_of_damage(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Exit 1 means damage (README); click turns Ctrl-C into "Aborted!" and exit 1, so a
    verify interrupted by hand read as a DAMAGED checkpoint to the script that ran it. An
    interrupt is 130 (128 + SIGINT), as SIGTERM is 143."""
    from antifragile.engine import verify as verify_module

    url = str(tmp_path / "ckpt")
    _save_steps(url, [10])

    def interrupted(*_: object, **__: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(verify_module, "verify_step", interrupted)
    result = CliRunner().invoke(main, ["ckpt", "verify", url])
    assert result.exit_code == 130, result.output
    assert "Traceback" not in result.output


def test_ls_of_a_step_deleted_after_the_listing_does_not_call_it_damaged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention beside a running job can delete a listed step (COMMIT first) before ls reads
    its COMMIT: the step is gone, not damaged, so it is not listed as DAMAGED with exit 1."""
    from antifragile.engine import commit

    url = str(tmp_path / "ckpt")
    _save_steps(url, [10, 20])
    monkeypatch.setattr(commit, "committed_steps", lambda storage: [10, 20, 30])
    result = CliRunner().invoke(main, ["ckpt", "ls", url])
    assert result.exit_code == 0, result.output
    assert "DAMAGED" not in result.output and "Traceback" not in result.output
    assert [line.split()[0] for line in result.output.splitlines()[1:]] == ["10", "20"]


@pytest.mark.parametrize("command", ["ls", "verify"])
@pytest.mark.parametrize("when", ["between the listings", "after them"])
def test_a_step_quarantined_after_the_listing_is_listed_once_as_quarantined(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str, when: str
) -> None:
    """A load beside a running job can quarantine a listed step before ls or verify reads it
    (its COMMIT listed, then moved aside): verify reported it DAMAGED with exit 1, though a
    quarantined step does not make the exit code 1, and both listed it twice."""
    from antifragile.engine import commit
    from antifragile.engine import quarantine as hiding
    from antifragile.engine.storage import open_storage

    url = str(tmp_path / "ckpt")
    _save_steps(url, [10, 20])
    hiding.quarantine(open_storage(url), 20, "flipped bit", reports={0: "flipped bit"},
                      confirmed_by=0)
    monkeypatch.setattr(commit, "committed_steps", lambda storage: [10, 20])  # the listing
    if when == "after them":
        monkeypatch.setattr(hiding, "quarantined_steps", lambda storage: [])
    result = CliRunner().invoke(main, ["ckpt", command, url])
    assert result.exit_code == 0, result.output
    assert "DAMAGED" not in result.output and "Traceback" not in result.output
    rows = [line for line in result.output.splitlines() if "20" in line.split()[:2]
            or "step 20:" in line]
    assert len(rows) == 1 and "quarantined" in rows[0].lower(), result.output


def test_verify_of_a_root_whose_every_step_is_quarantined_is_damage(tmp_path: Path) -> None:
    """Nothing under it loads (``load`` raises CheckpointCorruptError: no intact checkpoint),
    yet verify listed the quarantined steps and exited 0: a script that verifies before it
    resumes went on to a load that fails."""
    from antifragile.engine.quarantine import quarantine
    from antifragile.engine.storage import open_storage

    url = str(tmp_path / "ckpt")
    _save_steps(url, [10, 20])
    runner = CliRunner()
    quarantine(open_storage(url), 20, "flipped bit", reports={0: "flipped bit"}, confirmed_by=0)
    assert runner.invoke(main, ["ckpt", "verify", url]).exit_code == 0  # step 10 loads
    quarantine(open_storage(url), 10, "torn write", reports={0: "torn write"}, confirmed_by=0)
    result = runner.invoke(main, ["ckpt", "verify", url])
    assert result.exit_code == 1, result.output
    assert "step 10: QUARANTINED: torn write" in result.output
    assert "step 20: QUARANTINED: flipped bit" in result.output
    assert "no intact step" in result.output and "Traceback" not in result.output
    # --step: its objects read intact now (quarantined by hand here), yet it does not load:
    # it was reported "ok" under its QUARANTINED line
    one = runner.invoke(main, ["ckpt", "verify", url, "--step", "20"])
    assert one.exit_code == 1, one.output
    assert "step 20: ok" not in one.output, one.output
    assert "step 20: every object reads intact now (" in one.output, one.output


def test_ls_ignores_a_temporary_file_left_in_the_quarantine_log(tmp_path: Path) -> None:
    """A local write goes to ``<key>.<pid>-<token>-<tid>.tmp`` and is renamed: a process
    killed in between (or a quarantine being written while ls runs) leaves such a file in
    ``quarantined/``. It is no quarantine note: ls neither fails on it nor lists it."""
    from antifragile.engine.quarantine import quarantine, quarantine_log
    from antifragile.engine.storage import open_storage

    url = str(tmp_path / "ckpt")
    _save_steps(url, [10, 20])
    storage = open_storage(url)
    quarantine(storage, 10, "flipped bit", reports={0: "flipped bit"}, confirmed_by=0)
    log_dir = tmp_path / "ckpt" / "quarantined"
    temporary = "step_000000020.1700000000000000000.4242-9f3a01c2-140000.tmp"
    (log_dir / temporary).write_bytes(b'{"step": 2')
    assert [step for step, _ in quarantine_log(storage)[0]] == [10]
    result = CliRunner().invoke(main, ["ckpt", "ls", url])
    assert result.exit_code == 0, result.output
    rows = result.output.splitlines()[1:]
    assert [line.split()[0] for line in rows] == ["10", "20"], result.output
    assert "quarantined: flipped bit" in rows[0] and "error" not in result.output


@pytest.mark.parametrize("when", ["yesterday", None, float("nan"), 1e300])
def test_a_sealed_quarantine_note_whose_time_is_not_a_date_is_damage_not_a_traceback(
        tmp_path: Path, when: Any) -> None:
    """ls sorts the quarantine log by each note's time and shows it as a date: a sealed note
    that says anything else there (a buggy or hostile writer) was a traceback (float() or
    localtime()). The note is damaged: named, no traceback, a non-zero exit."""
    from antifragile.engine import _format
    from antifragile.engine.quarantine import quarantine
    from antifragile.engine.storage import open_storage

    url = str(tmp_path / "ckpt")
    _save_steps(url, [10, 20, 30])
    quarantine(open_storage(url), 20, "flipped bit", reports={0: "flipped bit"}, confirmed_by=0)
    notes = [tmp_path / "ckpt" / "step_000000020" / "QUARANTINE",
             *(tmp_path / "ckpt" / "quarantined").iterdir()]
    for note in notes:
        doc = json.loads(note.read_bytes())
        doc.pop("crc32c")
        note.write_bytes(_format.seal({**doc, "time": when}))
    runner = CliRunner()
    report = runner.invoke(main, ["ckpt", "verify", url, "--step", "20"])
    assert report.exit_code == 1, report.output
    assert "step 20: QUARANTINE note: malformed (time" in report.output, report.output
    for _ in range(2):  # then with only the log's note left (the step saved again or retired)
        listing = runner.invoke(main, ["ckpt", "ls", url])
        assert isinstance(listing.exception, SystemExit), listing.output
        assert listing.exit_code == 1, listing.output
        assert "quarantined/step_000000020." in listing.output, listing.output
        assert "malformed (time" in listing.output, listing.output
        shutil.rmtree(notes[0].parent, ignore_errors=True)


def test_ls_and_verify_list_every_step_past_one_whose_quarantine_note_is_damaged(
    tmp_path: Path,
) -> None:
    """A quarantined step's note holds its moved-aside COMMIT. A damaged note stopped ls
    (and verify's list of quarantined steps) at that step with exit 2 (bad input), the steps
    after it unlisted: like a damaged COMMIT, it is listed as damaged, exit 1."""
    from antifragile.engine.quarantine import quarantine
    from antifragile.engine.storage import open_storage

    url = str(tmp_path / "ckpt")
    _save_steps(url, [10, 20, 30])
    quarantine(open_storage(url), 20, "flipped bit", reports={0: "flipped bit"}, confirmed_by=0)
    note = tmp_path / "ckpt" / "step_000000020" / "QUARANTINE"
    data = bytearray(note.read_bytes())
    data[30] ^= 0x01
    note.write_bytes(bytes(data))
    runner = CliRunner()
    listing = runner.invoke(main, ["ckpt", "ls", url])
    assert listing.exit_code == 1, listing.output
    rows = listing.output.splitlines()[1:]
    assert [line.split()[0] for line in rows[:3]] == ["10", "20", "30"], listing.output
    assert "DAMAGED" in rows[1] and "QUARANTINE note" in rows[1] and "error:" not in listing.output
    assert rows[3:] == [] or "quarantined earlier" in rows[3]  # the log's copy of the note
    report = runner.invoke(main, ["ckpt", "verify", url])
    assert report.exit_code == 1, report.output
    assert "step 10: ok" in report.output and "step 30: ok" in report.output
    assert "step 20: QUARANTINED" in report.output and "QUARANTINE note" in report.output
    assert "error:" not in report.output


def test_ls_lists_every_note_of_the_quarantine_log_past_a_damaged_one(tmp_path: Path) -> None:
    """A damaged note in the quarantine log (``quarantined/``) stopped ls there with exit 2
    (bad input), the notes after it and their steps unlisted: it is damage, listed by the
    note's name, exit 1, and the listing goes on."""
    from antifragile.engine.quarantine import quarantine
    from antifragile.engine.storage import open_storage

    url = str(tmp_path / "ckpt")
    _save_steps(url, [10, 20, 30])
    storage = open_storage(url)
    quarantine(storage, 10, "flipped bit", reports={0: "flipped bit"}, confirmed_by=0)
    quarantine(storage, 20, "torn shard", reports={0: "torn shard"}, confirmed_by=0)
    for step in (10, 20):  # retired since: only the log's notes are left
        shutil.rmtree(tmp_path / "ckpt" / f"step_{step:09d}")
    log = sorted((tmp_path / "ckpt" / "quarantined").iterdir())
    assert [p.name.split(".")[0] for p in log] == ["step_000000010", "step_000000020"]
    data = bytearray(log[0].read_bytes())
    data[30] ^= 0x01
    log[0].write_bytes(bytes(data))
    listing = CliRunner().invoke(main, ["ckpt", "ls", url])
    assert listing.exit_code == 1, listing.output
    rows = listing.output.splitlines()[1:]
    assert rows[0].split()[0] == "30", listing.output
    damaged = [row for row in rows if "DAMAGED" in row]
    assert len(damaged) == 1 and f"quarantined/{log[0].name}" in damaged[0], listing.output
    assert any("quarantined earlier" in row and "torn shard" in row for row in rows), rows
    assert "error:" not in listing.output


def test_a_step_two_processes_quarantine_at_once_is_listed_once(tmp_path: Path) -> None:
    """Two loads (a job and a reader beside it) that find one step damaged both read its
    COMMIT before either deletes it: each writes its note to the quarantine log. ls listed
    the step as quarantined and also as "quarantined earlier" (the other process's note,
    whose time differs): one quarantine of one COMMIT read as two, as if the step had been
    saved again and damaged again."""
    import threading

    from antifragile.engine.quarantine import quarantine
    from antifragile.engine.storage import open_storage

    url = str(tmp_path / "ckpt")
    _save_steps(url, [10, 20])
    both_read = threading.Barrier(2, timeout=10)

    class Racing:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def read(self, key: str, *args: Any) -> Any:
            data = self.inner.read(key, *args)
            if key.endswith("/COMMIT"):
                both_read.wait()  # each has the COMMIT before either deletes it
            return data

    threads = [threading.Thread(target=quarantine, args=(Racing(open_storage(url)), 20,
                                                          "flipped bit"),
                                kwargs={"reports": {0: "flipped bit"}, "confirmed_by": rank})
               for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    result = CliRunner().invoke(main, ["ckpt", "ls", url])
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines()[1:] if line.split()[0] == "20"]
    assert len(rows) == 1 and "quarantined: flipped bit" in rows[0], result.output


@pytest.mark.parametrize("command", [["ls"], ["verify"], ["inspect", "--step", "20"]])
def test_a_step_folder_given_as_the_url_is_bad_input(tmp_path: Path, command: list[str]
                                                      ) -> None:
    """``chaos ckpt ls ckpt/step_000000020`` said "no committed checkpoint" (exit 0), as if
    the step were not there. It says the URL is a step folder and which root to give."""
    url = str(tmp_path / "ckpt")
    _save_steps(url, [20])
    result = CliRunner().invoke(main, ["ckpt", command[0], f"{url}/step_000000020",
                                       *command[1:]])
    assert result.exit_code == 2, result.output
    assert "is a step folder" in result.output and f"give {url}" in result.output


@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_a_negative_step_is_refused_as_the_option_it_is(tmp_path: Path, command: str) -> None:
    """``verify --step -1`` said "step -1 is not a committed checkpoint" (as if it could be
    one) where ``inspect --step -1`` said "step must be a non-negative int": both are now the
    option's range, named, before the checkpoint is opened; exit 2."""
    _save_steps(str(tmp_path), [1])
    result = CliRunner().invoke(main, ["ckpt", command, str(tmp_path), "--step", "-1"])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--step': -1 is not in the range x>=0." in result.output, \
        result.output


@pytest.mark.parametrize(("engine", "marker"), [("dcp", ".metadata"),
                                                 ("torchsnapshot", ".snapshot_metadata")])
@pytest.mark.parametrize(("command", "code"), [(["ls"], 0), (["verify"], 2),
                                               (["verify", "--step", "10"], 2),
                                               (["inspect", "--step", "10"], 2)])
def test_a_peer_engine_s_checkpoints_are_named_not_said_to_be_none(
        tmp_path: Path, engine: str, marker: str, command: list[str], code: int) -> None:
    """``chaos ckpt ls reports/<run>/ckpt`` after a run of ``checkpoint.engine: dcp`` (the
    shipped ``scenarios/engines/``) said "no committed checkpoint" where eight committed DCP
    steps were, as if the run had saved nothing (and ``--step 10`` "not committed"). It says
    what is there and that ``chaos ckpt`` reads the antifragile engine's checkpoints."""
    for step in (5, 10):
        (tmp_path / f"step_{step:09d}").mkdir()
        (tmp_path / f"step_{step:09d}" / marker).write_bytes(b"x")
    result = CliRunner().invoke(main, ["ckpt", command[0], str(tmp_path), *command[1:]])
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    assert (f"no committed checkpoint under {tmp_path}" if len(command) == 1
            else "step 10 is not") in result.output, result.output
    assert f"it holds committed {engine} checkpoints (steps 5, 10)" in result.output, \
        result.output
