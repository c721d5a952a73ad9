"""The trainer: bitwise-deterministic resume, changed layouts, events (torchrun on CPU gloo)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from _dist import RankGroup

from tests._trainer import assert_bitwise_equal, checkpoint_arrays, events, losses, run_trainer

pytestmark = pytest.mark.multiproc

# one rank alone is the nightly's: each other layout resumes through the same path and more
LAYOUTS = [pytest.param(1, 1, 1, marks=pytest.mark.slow), (2, 1, 1), (1, 2, 1), (1, 1, 2)]


def _step_3_of(straight: Path, resumed: Path) -> None:
    """A run dir whose checkpoints are the straight run's step 3 alone: a job stopped after
    that step (one launch fewer than training steps 1-3 again)."""
    shutil.copytree(straight / "ckpt" / "step_000000003", resumed / "ckpt" / "step_000000003")


def _resume_matches_straight(tmp_path: Path, dp: int, tp: int, pp: int) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_trainer(straight, dp=dp, tp=tp, pp=pp, steps=6, ckpt_every=3)
    _step_3_of(straight, resumed)
    run_trainer(resumed, dp=dp, tp=tp, pp=pp, steps=6, ckpt_every=3)

    restore = [e for e in events(resumed) if e["event"] == "restore_end"]
    assert restore and {e["step"] for e in restore} == {3}
    assert len(losses(straight)) == 6
    assert losses(resumed) == {step: loss for step, loss in losses(straight).items() if step > 3}
    assert_bitwise_equal(checkpoint_arrays(str(straight / "ckpt"), 6),
                         checkpoint_arrays(str(resumed / "ckpt"), 6))


@pytest.mark.parametrize(("dp", "tp", "pp"), LAYOUTS, ids=lambda v: str(v))
def test_resume_is_bitwise_identical(tmp_path: Path, dp: int, tp: int, pp: int) -> None:
    _resume_matches_straight(tmp_path, dp, tp, pp)


@pytest.mark.slow
def test_resume_is_bitwise_identical_3d(tmp_path: Path) -> None:
    _resume_matches_straight(tmp_path, 2, 2, 2)


def test_events_describe_the_run(tmp_path: Path) -> None:
    run_trainer(tmp_path, dp=2, steps=4, ckpt_every=2)
    log = events(tmp_path)
    kinds = {e["event"] for e in log}
    assert {"start", "step_end", "ckpt_staged", "ckpt_committed", "exit"} <= kinds
    assert all({"t", "rank", "attempt", "event"} <= set(e) for e in log)
    committed = [e for e in log if e["event"] == "ckpt_committed"]
    assert {e["step"] for e in committed} == {2, 4}
    assert all(e["bytes"] > 0 and e["persist_s"] >= 0 for e in committed)
    staged = [e for e in log if e["event"] == "ckpt_staged"]
    assert all(e["stall_s"] >= 0 for e in staged)
    assert {e["rank"] for e in log if e["event"] == "exit"} == {0, 1}


@pytest.mark.parametrize(("before", "after"), [((2, 1, 1), (1, 1, 1)), ((1, 2, 1), (1, 1, 1))],
                         ids=["dp2-to-dp1", "tp2-to-tp1"])
def test_resume_on_a_smaller_layout(tmp_path: Path, before: tuple[int, int, int],
                                    after: tuple[int, int, int]) -> None:
    """A job that lost a host comes back smaller: it loads the checkpoint and trains on.

    Not bitwise (reduction order changes): the loss after resuming stays within 1e-3
    (relative) of the uninterrupted run's - documented tolerance.
    """
    straight, shrunk = tmp_path / "straight", tmp_path / "shrunk"
    run_trainer(straight, dp=before[0], tp=before[1], pp=before[2], steps=6, ckpt_every=3)
    _step_3_of(straight, shrunk)
    run_trainer(shrunk, dp=after[0], tp=after[1], pp=after[2], steps=6, ckpt_every=3)
    expected, got = losses(straight), losses(shrunk)
    for step in (4, 5, 6):
        assert got[step] == pytest.approx(expected[step], rel=1e-3)
    restored = checkpoint_arrays(str(shrunk / "ckpt"), 6)
    assert all(torch.isfinite(v).all() for v in restored.values()
               if isinstance(v, torch.Tensor) and v.is_floating_point())


def test_activation_checkpointing_changes_nothing_numerically(tmp_path: Path) -> None:
    plain, recomputed = tmp_path / "plain", tmp_path / "ac"
    run_trainer(plain, steps=3, ckpt_every=3)
    run_trainer(recomputed, steps=3, ckpt_every=3, extra=["--activation-checkpointing"])
    assert losses(plain) == losses(recomputed)


@pytest.mark.parametrize("extra", [[], ["--schedule", "gpipe", "--micro-batches", "1"]],
                         ids=["1f1b", "gpipe-one-micro-batch"])
def test_a_pipelined_run_trains_like_an_unpipelined_one(tmp_path: Path,
                                                         extra: list[str]) -> None:
    """Stages send activations forward and their gradients back: a stage that computed no
    gradient for what it received would leave the stages before it untrained, which neither a
    resume nor the bitwise verdict (its reference trains the same way) can show; the losses
    against the same model in one piece do (micro-batches only reorder sums). GPipe also with
    fewer micro-batches than stages (one: the stages take turns)."""
    whole, piped = tmp_path / "whole", tmp_path / "piped"
    run_trainer(whole, steps=4, ckpt_every=4)
    run_trainer(piped, pp=2, steps=4, ckpt_every=4, extra=extra)
    expected, got = losses(whole), losses(piped)
    assert sorted(got) == sorted(expected) == [1, 2, 3, 4]
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-5, abs=0), step


@pytest.mark.slow
def test_gpipe_schedule_resumes_bitwise(tmp_path: Path) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    gpipe = ["--schedule", "gpipe"]
    run_trainer(straight, pp=2, steps=6, ckpt_every=3, extra=gpipe)
    run_trainer(resumed, pp=2, steps=3, ckpt_every=3, extra=gpipe)
    run_trainer(resumed, pp=2, steps=6, ckpt_every=3, extra=gpipe)
    assert losses(straight) == losses(resumed)
    assert_bitwise_equal(checkpoint_arrays(str(straight / "ckpt"), 6),
                         checkpoint_arrays(str(resumed / "ckpt"), 6))


def test_a_resumed_run_trains_at_the_lr_it_is_given(tmp_path: Path) -> None:
    """--lr is the run's learning rate also after a resume: the checkpoint restores the
    optimizer's state (moments, step counts), not the hyperparameters the run is started
    with. The checkpoint's lr used to win, so --lr 0 on a resume went on training at 3e-3."""
    run_trainer(tmp_path, steps=3, ckpt_every=3)
    run_trainer(tmp_path, steps=4, ckpt_every=1, extra=["--lr", "0"])
    before, after = (checkpoint_arrays(str(tmp_path / "ckpt"), s) for s in (3, 4))
    lrs = {v for k, v in after.items() if k.startswith("optim/param_groups.") and k.endswith(".lr")}
    assert lrs == {0.0}
    for key in (k for k in before if k.startswith("model/")):
        assert torch.equal(before[key], after[key]), key  # lr 0, no weight decay: no change
    assert after["optim/state.output.weight.step"] == 4  # the step counts went on


def test_a_resume_past_the_last_step_says_it_trains_nothing(tmp_path: Path) -> None:
    """A run started again with --steps at or below its newest checkpoint (a smaller --steps
    by mistake, or a finished job launched again) has nothing to train; it ended with code 0
    and said nothing, as if it had trained to --steps."""
    run_trainer(tmp_path, steps=3, ckpt_every=3)
    proc = run_trainer(tmp_path, steps=2, ckpt_every=1)
    assert "resumed at step 3, past --steps 2: nothing to train" in proc.stderr
    proc = run_trainer(tmp_path, steps=3, ckpt_every=1)
    assert "resumed at step 3, the last (--steps 3): nothing to train" in proc.stderr


def _shards(activation_checkpointing: bool) -> dict[str, tuple[str, ...]]:
    """On each of 2 ranks: every parameter of a tp 2 Trainer, by its name without the
    checkpoint wrapper, as (its type, its local shape)."""
    import types

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from antifragile.trainer.config import TrainConfig
    from antifragile.trainer.model import ModelConfig
    from antifragile.trainer.parallel.dims import ParallelDims
    from antifragile.trainer.train import Trainer

    cfg = TrainConfig(parallel=ParallelDims(tp=2),
                      model=ModelConfig(layers=2, d_model=32, heads=4, vocab=64, seq_len=16),
                      activation_checkpointing=activation_checkpointing)
    ctx = types.SimpleNamespace(world_size=dist.get_world_size(), device=torch.device("cpu"),
                                rank=dist.get_rank())
    trainer = Trainer(cfg, ctx, types.SimpleNamespace(bump=lambda: None))  # type: ignore[arg-type]
    return {name.replace("_checkpoint_wrapped_module.", ""):
            (type(p).__name__, *map(str, (p.to_local() if isinstance(p, DTensor) else p).shape))
            for name, p in trainer.model.named_parameters()}


def test_activation_checkpointing_keeps_the_blocks_tensor_parallel() -> None:
    """The blocks were wrapped for activation checkpointing before the TP plan was applied,
    and the plan's keys (attn.wq, ...) name no child of a wrapper: with
    --activation-checkpointing every tp rank held and computed whole blocks, with a warning
    per key in the log and the same losses (tp was only the embedding and the head)."""
    with RankGroup(2, timeout_s=300) as ranks:
        plain = ranks.run(_shards, False)
        checkpointed = ranks.run(_shards, True)
    assert plain[0]["layers.0.attn.wq.weight"] == ("DTensor", "16", "32")
    assert checkpointed == plain


LR = 3e-3  # the trainer's default --lr, which these runs train at


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("one_process")
    run_trainer(run, steps=2, ckpt_every=1)
    return run


@pytest.mark.slow
@pytest.mark.parametrize(("dp", "tp", "pp"), [(2, 1, 1), (1, 2, 1), (1, 1, 2)],
                         ids=["dp2", "tp2", "pp2"])
def test_every_layout_takes_the_one_process_gradient_steps(
        tmp_path: Path, one_process_run: Path, dp: int, tp: int, pp: int) -> None:
    """The same global batch and seed on dp, tp or pp 2 leaves the one-process run's AdamW
    moments and weights after steps 1 and 2 (float tolerance: reduction order changes).

    The losses alone cannot show a gradient of the wrong scale (summed over dp instead of
    averaged, micro-batches summed instead of averaged): AdamW divides the scale away, so the
    weights and the losses hardly move. Its moments keep it: after step 1 exp_avg is
    (1 - beta1) * grad and exp_avg_sq (1 - beta2) * grad**2, so a factor 2 puts them off by
    at least half their norm; the reduction order, by about 1e-6 after step 1 and 4e-5 after
    step 2 (dp x tp x pp 2 x 2 x 2: step 1's weights differ). The weights catch an update
    lost or doubled (AdamW moves every weight by about lr at step 1); their tolerance is a
    tenth of lr, as a weight whose gradient is near eps flips with the reduction order."""
    run_trainer(tmp_path, dp=dp, tp=tp, pp=pp, steps=2, ckpt_every=1)
    _assert_same_gradient_steps(one_process_run, tmp_path)


def _assert_same_gradient_steps(one_process_run: Path, run: Path) -> None:
    """``run`` reported the one-process run's losses (1e-5 relative) and left its AdamW
    moments and weights after steps 1 and 2 (see the test above for the tolerances)."""
    want_losses, got_losses = losses(one_process_run), losses(run)
    assert sorted(got_losses) == sorted(want_losses) == [1, 2]
    for step, want in want_losses.items():
        assert abs(got_losses[step] - want) <= 1e-5 * abs(want), (step, got_losses, want_losses)
    for step in (1, 2):
        expected = checkpoint_arrays(str(one_process_run / "ckpt"), step)
        got = checkpoint_arrays(str(run / "ckpt"), step)
        moments = [k for k in expected if k.endswith((".exp_avg", ".exp_avg_sq"))]
        weights = [k for k in expected if k.startswith("model/")]
        assert len(moments) == 2 * len(weights) > 0
        for key in moments:
            want, have = expected[key], got[key]
            off = (have - want).norm().item() / max(want.norm().item(), 1e-30)
            assert off <= 1e-3, f"step {step} {key}: off by {off:.3g} of its norm"
        for key in weights:
            off = (got[key] - expected[key]).abs().max().item()
            assert off <= LR / 10, f"step {step} {key}: off by {off:.3g} (lr {LR})"
        steps = {k: v for k, v in expected.items() if k.endswith(".step")}
        assert steps and all(got[k] == v for k, v in steps.items())


# a vocabulary tp does not divide (rows 32 and 31 at tp 2), stages of unequal depth (blocks
# 0-1 and 2 at pp 2), more micro-batches than stages (one row each at dp 2)
UNEVEN = ["--vocab", "63", "--layers", "3", "--micro-batches", "4"]


@pytest.fixture(scope="module")
def uneven_one_process_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("uneven_one_process")
    run_trainer(run, steps=2, ckpt_every=1, extra=UNEVEN)
    return run


@pytest.mark.slow
@pytest.mark.parametrize(("dp", "tp", "pp", "extra"), [
    (1, 2, 1, []),
    (1, 1, 2, ["--schedule", "gpipe"]),
    (2, 2, 2, ["--activation-checkpointing"]),
], ids=["tp2", "pp2-gpipe", "dp2-tp2-pp2-recomputed"])
def test_uneven_shards_take_the_one_process_gradient_steps(
        tmp_path: Path, uneven_one_process_run: Path, dp: int, tp: int, pp: int,
        extra: list[str]) -> None:
    """Shards of unequal size take the one-process run's steps too: the vocabulary's last tp
    shard one row short (no padding row to take probability mass or a gradient), a pipeline
    stage of fewer blocks, the GPipe schedule, and all three axes at once with recomputed
    activations (FSDP over a tp shard of 31 rows)."""
    run_trainer(tmp_path, dp=dp, tp=tp, pp=pp, steps=2, ckpt_every=1, extra=UNEVEN + extra)
    _assert_same_gradient_steps(uneven_one_process_run, tmp_path)
