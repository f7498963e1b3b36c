"""summary.json's final accuracy is the validation of the run's last weights, however the run ended.

The real trainer (trainer/fit.py) runs its loop, checkpoints, resumes and writes the summary on
the tiny task's real held-out set, scored by the real reward; what a step trains and how the
engines answer are stood in for (a stop can then be timed to a step, which a real run cannot do
cheaply): the engines answer every problem right once their weights are trained (version 1 on),
wrong before, so the initial accuracy is 0 and the final one 1.
"""

import json
import os
import re
import signal
from dataclasses import replace
from pathlib import Path

import pytest

from nemo_dapo.config import load_config
from nemo_dapo.digest import digest_files
from nemo_dapo.errors import GenerationStopped
from nemo_dapo.rollout.base import Generation
from nemo_dapo.trainer import assembly
from nemo_dapo.trainer.fit import DAPOTrainer
from nemo_dapo.trainer.preemption import PREEMPTED_EXIT_CODE, Preempted

QUESTION = re.compile(r"(\d+)([+-])(\d+)")


class Policy:
    """The policy group's side of a checkpoint: a weights file per save, the real hasher."""

    world_size = 1
    digest_files = staticmethod(digest_files)

    def save(self, path: str, asynchronous: bool) -> None:
        Path(path).mkdir(parents=True)
        (Path(path) / "weights.txt").write_text("trained")

    def finish_save(self, blocking: bool) -> bool:
        return True

    def load(self, path: str) -> None:
        assert (Path(path) / "weights.txt").read_text() == "trained"

    def export_weights(self, bucket_bytes: int):
        return iter(())


class Engines:
    """The rollout group: answers ``Answer: N`` to the arithmetic question, right from weight
    version 1 on; a stop asked before or while it generates ends the call (as the real wait does)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.version, self.generate_calls = tokenizer, 0, 0
        self.store = self  # the object-store path's send

    def set_weight_source(self, source) -> None:
        pass

    def in_service(self) -> list[int]:
        return [0]

    def restore_lost(self) -> list[int]:
        return []

    def send(self, buckets, version: int, ranks=None) -> None:
        self.version = version

    def generate(self, prompts, sampling, stop=None) -> list[Generation]:
        if stop is not None and stop():
            raise GenerationStopped("a stop came while 1 call(s) still ran")
        self.generate_calls += 1
        return [self._answer(prompt, sampling.n) for prompt in prompts]

    def _answer(self, prompt: list[int], n: int) -> Generation:
        a, op, b = QUESTION.search(self.tokenizer.decode(prompt)).groups()
        right = int(a) + int(b) if op == "+" else int(a) - int(b)
        text = f"Answer: {right if self.version >= 1 else right + 1}"
        tokens = [*self.tokenizer.encode(text), self.tokenizer.eos_token_id]
        return Generation([tokens] * n, [[0.0] * len(tokens)] * n, ["stop"] * n)


class Trainer(DAPOTrainer):
    """The real trainer whose step only syncs new weights; ``stop_while_training`` sends SIGUSR1
    to this process while that step trains (the stop is then pending when the step ends)."""

    stop_while_training: int | None = None

    def train_step(self) -> dict[str, float]:
        if self.global_step + 1 == self.stop_while_training:
            os.kill(os.getpid(), signal.SIGUSR1)
        self.sync_weights()
        return {}


@pytest.fixture(scope="module")
def tiny_run():
    """A two-step run's config (validated before the first step and at the last only), its data
    and its reward."""
    overrides = ["trainer.total_training_steps=2", "trainer.test_freq=0", "trainer.loggers=[console]"]
    cfg = assembly.resolve_paths(load_config("tiny_cpu", [*overrides, "rollout.weight_transfer=object_store"]))
    reward = assembly.reward_manager(cfg)
    yield cfg, assembly.load_data(cfg), reward
    reward.close()


def trainer(tiny_run, out: Path, stop_while_training: int | None = None) -> Trainer:
    """The run in ``out``, resumed from its newest checkpoint if it has one (checkpoint.resume=auto)."""
    cfg, data, reward = tiny_run
    cfg = replace(cfg, trainer=replace(cfg.trainer, output_dir=str(out)))
    made = Trainer(cfg, Policy(), Engines(data.tokenizer), data.tokenizer, data.train, data.val, reward)
    made.stop_while_training = stop_while_training
    return made


def test_a_stop_pending_at_the_last_step_leaves_its_validation_to_the_resumed_run(tiny_run, tmp_path):
    """Before: the final validation was given up at once, the run ended as complete (exit 0) and
    summary.json said final_val_acc null. Now: the last step is checkpointed, the run stops
    (exit 3, requeued) without a summary, and the resumed run validates those weights first."""
    out = tmp_path / "run"
    with pytest.raises(Preempted) as stop:
        trainer(tiny_run, out, stop_while_training=2).fit()
    assert stop.value.step == 2 and stop.value.exit_code == PREEMPTED_EXIT_CODE
    assert (out / "checkpoints" / "global_step_2").is_dir() and not (out / "summary.json").exists()
    resumed = trainer(tiny_run, out)
    said = resumed.fit()
    assert said == json.loads((out / "summary.json").read_text())
    assert said["initial_val_acc"] == 0.0 and said["final_val_acc"] == 1.0 and said["steps"] == 2
    assert resumed.rollout.generate_calls == 1  # the final validation, of the checkpoint's weights


def test_a_run_resumed_at_its_last_step_takes_its_final_accuracy_from_the_checkpoint(tiny_run, tmp_path):
    """Killed between the final checkpoint's commit and summary.json: the resumed run has nothing
    left to train. Before: it reported the initial accuracy as final. Now: the checkpoint's."""
    out = tmp_path / "run"
    complete = trainer(tiny_run, out).fit()
    assert complete["initial_val_acc"] == 0.0 and complete["final_val_acc"] == 1.0
    (out / "summary.json").unlink()
    resumed = trainer(tiny_run, out)
    said = resumed.fit()
    assert said["final_val_acc"] == 1.0 and said["final_val"] == complete["final_val"] and said["steps"] == 2
    assert resumed.rollout.generate_calls == 0  # nothing validated again: the checkpoint had it
