"""SIGKILL and resume end to end: `nemo-dapo train` killed whole, then one of its policy ranks,
then resumed on a damaged newest checkpoint with twice the ranks. In the multi-node lane
(tests/lanes.py), after the multi-node tests: beside them it slowed both lanes."""

import json
import os
import re
import signal
import subprocess

import pytest

from tests.train_runs import CLI, ENV, SMALL, expected_rounds, kill_worker, last_per_step, records, wait_for

pytestmark = pytest.mark.slow


def test_sigkill_resume_same_prompts_then_fallback_and_new_dp_size(workdir):
    """Three runs on one output folder: the whole run SIGKILLed; resumed, then one policy rank
    SIGKILLed; resumed on a damaged newest checkpoint with twice the policy ranks. Across all of
    them every step consumes the prompts an uninterrupted run would, none skipped, none repeated."""
    out = workdir / "run"
    steps = ["trainer.save_freq=2", "checkpoint.keep_last=3", *SMALL]

    def start(total: int, *extra: str) -> subprocess.Popen:
        command = [*CLI, "train", f"trainer.output_dir={out}", f"trainer.total_training_steps={total}", *steps, *extra]
        return subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True, env=ENV
        )

    victim = start(8)
    wait_for(out / "checkpoints" / "global_step_4", victim, timeout=300)
    os.killpg(victim.pid, signal.SIGKILL)  # the trainer, its Ray, vLLM and worker processes
    victim.wait()
    crashed_steps = [r["step"] for r in records(out / "prompts.jsonl")]
    assert max(crashed_steps) < 8

    # resumed; a policy rank killed while the run continues: it stops at once naming the group and
    # the call, the checkpoints stay whole (the fallback below resumes from them)
    policy_killed = start(10)
    try:
        wait_for(out / "checkpoints" / "global_step_6", policy_killed, timeout=300)
        kill_worker(policy_killed, "ray::TorchPolicyWorker", timeout=60)
        _, stderr = policy_killed.communicate(timeout=120)
    finally:
        if policy_killed.poll() is None:
            os.killpg(policy_killed.pid, signal.SIGKILL)
    assert "resumed from" in stderr
    assert policy_killed.returncode == 1, stderr[-3000:]
    assert re.search(r"nemo-dapo: actor\.\w+: a worker died .*their logs: /\S+/logs", stderr), stderr[-3000:]
    assert "run the same command again (checkpoint.resume=auto)" in stderr
    assert "RemoteCallError" not in stderr  # the message alone: no traceback of ours
    rows = records(out / "prompts.jsonl")
    resumed_from = max(s for s in (2, 4) if s <= max(crashed_steps))
    assert rows[len(crashed_steps)]["step"] == resumed_from + 1  # picks up right after its checkpoint
    newest = int((out / "checkpoints" / "latest").read_text().strip().removeprefix("global_step_"))
    assert newest >= 6

    (out / "checkpoints" / f"global_step_{newest}" / "trainer_state.pt").write_bytes(b"damaged on purpose")
    fallback = start(newest + 3, "actor.num_workers=2")
    _, stderr = fallback.communicate(timeout=600)
    assert fallback.returncode == 0, stderr[-3000:]
    assert f"skipping checkpoint of step {newest}" in stderr
    assert "resumed from" in stderr and f"global_step_{newest - 2}" in stderr
    by_step = last_per_step(records(out / "prompts.jsonl"))
    assert sorted(by_step) == list(range(1, newest + 4))
    consumed = [i for step in sorted(by_step) for i in by_step[step]["consumed"]]
    rounds = expected_rounds(1800, 12, seed=1, count=len(consumed) // 12)
    assert consumed == [i for r in rounds for i in r]  # no prompt skipped, none repeated
    # the generated-sample count (trainer.total_generated_samples' axis) survives both kills
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == newest + 3 and summary["generated_samples"] == 8 * len(consumed)
