"""The shipped examples are real clients (a transformers GPT-2 with DDP and our engine; plain
FSDP2 with torch.distributed.checkpoint): each survives its scenario's kill under ``chaos run``
and ends bit-identical to its fault-free reference, read back through its engine's reader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from antifragile.chaos.cli import main
from antifragile.chaos.scenario import SCENARIOS

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


@pytest.mark.parametrize(("scenario", "killed_after", "restored"), [
    # asynchronous saves: the save of step 15 may still be in flight 2 steps later
    ("hf-gpt2-kill.yaml", 17, (15, 10)),
    ("fsdp2-dcp-kill.yaml", 23, (20,)),  # blocking DCP saves
])
def test_example_survives_a_kill_bitwise(scenario: str, killed_after: int,
                                         restored: tuple[int, ...], tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANTIFRAGILE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["run", str(SCENARIOS / "examples" / scenario),
                                       "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["verdict"] == {"verdict": "pass", "reasons": [], "bitwise_equal": True}
    (fault,) = report["faults"]
    assert fault["kind"] == "kill_rank" and fault["injected_step"] == killed_after
    newest = max(c["step"] for c in report["checkpoints"]
                 if c["committed"] and c["attempt"] == 0 and c["step"] <= killed_after)
    assert fault["restored_step"] == newest and newest in restored, report["checkpoints"]
    assert fault["lost_steps"] == killed_after - newest
    assert fault["recovery_s"] is not None and report["not_measured"] == []
    assert report["run"]["final_step"] == report["run"]["expected_step"] == 40
    committed = [c for c in report["checkpoints"] if c["committed"]]
    assert committed and all(c["bytes"] and c["persist_s"] is not None for c in committed
                             if "restored_by" not in c)  # known only by its restore


def test_fsdp2_dcp_whose_every_checkpoint_fails_to_load_starts_from_its_initial_model(
        tmp_path: Path) -> None:
    """DCP loads into the model's own tensors: a step that failed to load part way had
    already overwritten some of them, and where no older step loaded either the script
    trained "from step 0" on a mixture of its initial weights and the damaged checkpoint's,
    which a run without those checkpoints (its reference) never sees."""
    import subprocess
    import sys

    from antifragile.trainer.ckpt_backends.dcp import read
    from tests._trainer import assert_bitwise_equal, env

    def train(ckpt: Path, every: int) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc-per-node=1", f"--log-dir={ckpt.parent / 'torchelastic'}",
             str(Path(__file__).resolve().parent.parent / "examples" / "fsdp2_dcp" / "train.py"),
             "--steps", "2", "--ckpt-every", str(every), "--ckpt-url", str(ckpt)],
            env=env(), capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    fresh, damaged = tmp_path / "fresh" / "ckpt", tmp_path / "damaged" / "ckpt"
    train(fresh, 2)
    train(damaged, 1)
    for data in damaged.glob("step_*/*.distcp"):  # the tail of every step's tensors is gone
        data.write_bytes(data.read_bytes()[:data.stat().st_size // 2])
    out = train(damaged, 2)
    assert "step 2 does not load" in out and "step 1 does not load" in out, out
    assert_bitwise_equal(read(str(fresh), 2), read(str(damaged), 2))


def test_fsdp2_dcp_writes_a_file_url_to_its_folder(tmp_path: Path) -> None:
    """``checkpoint.url: file:///...`` is a local folder chaos accepts for DCP and hands the
    script as written; ``Path("file:///x")`` is the relative folder ``file:/x``, so the script
    checkpointed into its working directory, where chaos's reader never looked."""
    import subprocess
    import sys

    from tests._trainer import env

    ckpt, work = tmp_path / "ckpt", tmp_path / "work"
    work.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
         f"--log-dir={tmp_path / 'torchelastic'}",
         str(Path(__file__).resolve().parent.parent / "examples" / "fsdp2_dcp" / "train.py"),
         "--steps", "1"],
        env={**env(), "ANTIFRAGILE_CKPT_URL": f"file://{ckpt}"}, cwd=work,
        capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (ckpt / "step_000000001" / ".metadata").is_file()
    assert list(work.iterdir()) == []


def test_fsdp2_dcp_saving_a_step_again_hides_its_old_folder_until_the_save_is_done(
        tmp_path: Path) -> None:
    """A step saved again (the job fell back past it) went into a folder whose old
    ``.metadata`` stayed until DCP wrote the new one: a save that failed or was killed part
    way left a folder that looked complete, mixing old and new shards. Rank 0 now removes the
    old ``.metadata`` before any rank writes (a barrier between)."""
    import subprocess
    import sys

    from tests._trainer import env

    ckpt = tmp_path / "ckpt"
    folder = ckpt / "step_000000001"
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(b"an earlier run's, which no longer loads")
    (folder / "__0_0.distcp").mkdir()  # where this save's shard goes: its write fails
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
         f"--log-dir={tmp_path / 'torchelastic'}",
         str(Path(__file__).resolve().parent.parent / "examples" / "fsdp2_dcp" / "train.py"),
         "--steps", "1", "--ckpt-url", str(ckpt)],
        env=env(), capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode != 0, done.stdout  # the save failed, as arranged
    assert not (folder / ".metadata").exists()  # and left no folder that looks complete
