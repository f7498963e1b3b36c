"""`nemo-dapo train` as the end-to-end tests run it: a real subprocess, and its records read back."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from nemo_dapo.data import ResumableBatchSampler

CLI = [sys.executable, "-m", "nemo_dapo.cli"]
REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
SMALL = [  # runs that check the mechanics, not the learning: small batches, no validation at all
    "data.train_batch_size=8",
    "data.gen_batch_size=12",
    "actor.ppo_mini_batch_size=4",
    "data.val_files=[]",
]
# one step, checkpointed, with the thread count both modes use then (stream divides the
# cores between engine and policy by default): the same arithmetic in both modes, so the same
# numbers to the last bit; without dynamic sampling a sync round is one batch, as a stream's
FIRST_STEP = [
    "trainer.total_training_steps=1",
    "trainer.save_freq=1",
    "trainer.cpu_threads_per_worker=1",
    "algorithm.filter_groups.enable=false",
    *SMALL,
]


def train(output: Path, *overrides: str, timeout: float = 600) -> subprocess.CompletedProcess:
    command = [*CLI, "train", f"trainer.output_dir={output}", *overrides]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=ENV)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def last_per_step(rows: list[dict]) -> dict[int, dict]:
    """A resumed run re-does the steps after its checkpoint: the last record of a step counts."""
    return {row["step"]: row for row in rows}


def latest_state(out: Path) -> dict:
    """The trainer state of the run's newest checkpoint (the stream's untrained rows among it)."""
    import torch

    folders = sorted((out / "checkpoints").glob("global_step_*"), key=lambda p: int(p.name.split("_")[-1]))
    return torch.load(folders[-1] / "trainer_state.pt", weights_only=False)


def expected_rounds(dataset_size: int, batch_size: int, seed: int, count: int) -> list[list[int]]:
    sampler = ResumableBatchSampler(dataset_size, batch_size, seed=seed)
    rounds: list[list[int]] = []
    while len(rounds) < count:
        rounds += [sorted(b) for b in sampler]
    return rounds[:count]


def assert_same_first_update(first: Path, second: Path) -> dict:
    """Two one-step runs made the same update, to the last bit: loss, gradient norm, score, clip
    fraction and the checkpointed weights; returns the second run's step record."""
    steps = [records(run / "metrics.jsonl")[-1] for run in (first, second)]
    for key in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "actor/pg_clipfrac"):
        assert steps[0][key] == steps[1][key], key
    assert_same_weights(first, second, step=1)
    return steps[1]


def assert_same_weights(first: Path, second: Path, step: int) -> None:
    """The two runs' checkpoints of ``step`` hold the same policy weights, to the last bit."""
    from safetensors.torch import load_file

    weights = [
        load_file(run / "checkpoints" / f"global_step_{step}" / "policy" / "model" / "model.safetensors")
        for run in (first, second)
    ]
    assert all((weights[0][k] == weights[1][k]).all() for k in weights[0])


def wait_for(path: Path, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert process.poll() is None, process.stderr.read()[-3000:]
        assert time.time() < deadline, f"{path} did not appear"
        time.sleep(0.2)


def sigkill_after_checkpoint(output: Path, overrides: list[str], total_steps: int, at_step: int) -> None:
    """Start `nemo-dapo train` and SIGKILL its whole process group once checkpoint ``at_step`` exists."""
    command = [*CLI, "train", f"trainer.output_dir={output}", f"trainer.total_training_steps={total_steps}"]
    victim = subprocess.Popen(
        [*command, *overrides],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=ENV,
    )
    wait_for(output / "checkpoints" / f"global_step_{at_step}", victim, timeout=300)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()


def with_an_overlong_first_prompt(model_dir: Path, folder: Path) -> Path:
    """The tiny task's training rows behind one prompt longer than the preset's
    ``data.max_prompt_length``: overlong filtering drops row 0, so every dataset position is one
    less than its row's ``index`` in the file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = pq.read_table(model_dir / "data" / "train.parquet").to_pylist()
    overlong = {**rows[0], "prompt": [{"role": "user", "content": "+".join(["1"] * 200)}]}
    path = folder / "train_after_an_overlong_prompt.parquet"
    pq.write_table(pa.Table.from_pylist([overlong, *rows]), path)
    return path


def kill_worker(victim: subprocess.Popen, title: str, timeout: float) -> int:
    """SIGKILL the run's Ray worker whose process title starts with ``title`` (Ray titles an actor
    process ``ray::Class`` and, while it executes a call, ``ray::Class.method``); returns its pid."""
    import psutil

    deadline = time.time() + timeout
    while time.time() < deadline:
        assert victim.poll() is None, victim.stderr.read()[-3000:]
        for process in psutil.Process(victim.pid).children(recursive=True):
            try:
                name = " ".join(process.cmdline())
            except psutil.Error:
                continue
            if name.startswith(title):
                process.kill()
                return process.pid
        time.sleep(0.02)
    raise AssertionError(f"no worker titled {title!r} within {timeout} s")
