"""The asynchronous trainer end to end: learns, matches sync at max_staleness=0, recovers in-flight prompts."""

import json

import pytest

from tests.train_runs import (
    FIRST_STEP,
    SMALL,
    assert_same_first_update,
    last_per_step,
    records,
    sigkill_after_checkpoint,
    train,
)

pytestmark = pytest.mark.slow


def test_async_run_learns_and_reports_staleness(workdir):
    out = workdir / "async"
    done = train(
        out, "trainer.mode=async", "trainer.total_training_steps=40", "trainer.test_freq=20", "trainer.save_freq=40"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_val_acc"] > summary["initial_val_acc"] + 0.05, summary
    rows = [r for r in records(out / "metrics.jsonl") if "staleness/lag/max" in r]
    assert len(rows) == 40
    assert all(r["staleness/lag/max"] <= 1 for r in rows)  # max_staleness=1 is respected
    assert sum(r["staleness/lag/mean"] for r in rows) > 30  # generation really overlapped training


def test_max_staleness_zero_reproduces_the_sync_first_update(workdir, sync_first_step):
    asyn = train(workdir / "async", "trainer.mode=async", "trainer.max_staleness=0", *FIRST_STEP)
    assert asyn.returncode == 0, asyn.stderr[-2000:]
    assert_same_first_update(sync_first_step, workdir / "async")


def test_sigkill_then_resume_trains_each_inflight_prompt_exactly_once(workdir):
    out = workdir / "run"
    steps = ["trainer.mode=async", "trainer.save_freq=2", "algorithm.filter_groups.enable=false", *SMALL]
    sigkill_after_checkpoint(out, steps, total_steps=8, at_step=4)
    resumed = train(out, "trainer.total_training_steps=8", *steps)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "reissued" in resumed.stderr
    by_step = last_per_step(records(out / "prompts.jsonl"))
    assert sorted(by_step) == list(range(1, 9))
    trained = [key for step in sorted(by_step) for key in by_step[step]["prompt_keys"]]
    prompt_ids = [key.split("#")[0] for key in trained]
    assert len(prompt_ids) == len(set(prompt_ids)) == 8 * 8  # every trained prompt exactly once, 8 per step
    reissued = [key for key in trained if key.endswith("#2")]
    assert reissued, "the prompts in flight at the checkpoint were not reissued"
    metrics = [r for r in records(out / "metrics.jsonl") if r.get("recovery/reissued_prompts", 0) > 0]
    assert metrics and metrics[-1]["recovery/reissued_prompts"] == len(reissued)
