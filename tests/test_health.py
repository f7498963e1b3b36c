"""The collapse warnings: once each, when the reward or the response length collapses, never on a
run that learns; and the stop after ``trainer.max_nonfinite_steps`` skipped steps in a row. One
real run made to collapse (a subprocess, as a user runs it)."""

import json
import re
import shutil
from pathlib import Path

import pytest

from nemo_dapo.errors import TrainingDiverged
from nemo_dapo.trainer.health import LearningHealth, NonFiniteSteps
from tests.train_runs import SMALL, records, train


def feed(rows):
    health = LearningHealth()
    return [(step, w) for step, row in enumerate(rows, 1) for w in health.observe(step, row)]


def test_a_reward_collapse_warns_once_with_the_settings_to_look_at():
    rows = [{"critic/acc/mean": a, "response_length/mean": 12.0} for a in (0.06, 0.03, 0.0, 0.0, 0.0, 0.0, 0.0)]
    warnings = feed(rows)
    assert [step for step, _ in warnings] == [5]
    assert "critic/acc/mean 0" in warnings[0][1] and "algorithm.filter_groups.enable" in warnings[0][1]


def test_a_length_collapse_warns_once():
    lengths = (12, 13, 11, 9, 5, 5.8, 5.5, 6, 6)
    warnings = feed([{"critic/acc/mean": 0.1, "response_length/mean": n} for n in lengths])
    assert [step for step, _ in warnings] == [7] and "12.0 -> 5.5 tokens" in warnings[0][1]


def test_a_run_that_learns_or_never_scored_is_left_alone():
    learning = [{"critic/acc/mean": 0.05 * i, "response_length/mean": 12 + i} for i in range(10)]
    never = [{"critic/acc/mean": 0.0, "response_length/mean": 12.0}] * 10  # nothing to have collapsed from
    assert feed(learning) == [] and feed(never) == []


def test_skipped_steps_warn_and_stop_the_run_at_the_limit_in_a_row():
    guard = NonFiniteSteps(limit=3)
    assert guard.observe(1, 0.0) is None
    assert "50% of its optimizer steps skipped" in guard.observe(2, 0.5)
    assert "2 such step(s) in a row" in guard.observe(3, 1.0)
    assert guard.observe(4, 0.0) is None  # a finite step starts the count again
    guard.observe(5, 1.0), guard.observe(6, 1.0)
    with pytest.raises(TrainingDiverged, match=r"steps 5-7: .*max_nonfinite_steps=3"):
        guard.observe(7, 1.0)
    never = NonFiniteSteps(limit=0)
    assert all("the run stops at none" in never.observe(step, 1.0) for step in range(1, 20))


def without_pad_token(model_dir: Path, copy: Path) -> Path:
    """A copy of the model whose tokenizer declares no pad token, as Llama 3's and Mistral's do."""
    shutil.copytree(model_dir, copy)
    for name in ("tokenizer_config.json", "config.json", "generation_config.json"):
        settings = json.loads((copy / name).read_text())
        settings.pop("pad_token_id", None)
        if "pad_token" in settings:
            settings["pad_token"] = None  # absent, the Qwen2 tokenizer class falls back to its own default
        (copy / name).write_text(json.dumps(settings))
    return copy


@pytest.mark.slow
def test_a_run_made_to_collapse_is_warned_about_once_and_running_it_again_changes_nothing(workdir, tiny_model_dir):
    """A learning rate that wrecks the tiny model after its first update (dynamic sampling off):
    some first-step samples are right, none after; the trainer names the collapse and its causes.
    The model's tokenizer has no pad token (padded with its EOS token, said once). The finished
    run started again is found complete before Ray starts and leaves its summary and export; with
    its export cut short, it exports again, still before any worker starts."""
    model = without_pad_token(Path(tiny_model_dir), workdir / "no_pad_model")
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(model).pad_token_id is None
    out = workdir / "run"
    run = [
        f"model.path={model}",
        "algorithm.filter_groups.enable=false",
        "actor.optim.lr=0.5",
        "trainer.total_training_steps=5",
        "trainer.save_freq=0",
        *SMALL,
        "data.gen_batch_size=8",
    ]
    done = train(out, *run)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "has no pad token: padding with its EOS token '<|im_end|>'" in done.stderr
    accuracy = [row["critic/acc/mean"] for row in records(out / "metrics.jsonl") if "critic/acc/mean" in row]
    assert accuracy[0] > 0 and accuracy[1:] == [0.0] * 4
    warnings = re.findall(r"step (\d+): no training sample was correct in the last 3 steps.*", done.stderr)
    assert warnings == ["4"]
    assert "algorithm.filter_groups.enable=false" in done.stderr and "actor.optim.lr" in done.stderr

    summary = (out / "summary.json").read_bytes()
    exported = {p.name: p.stat().st_mtime_ns for p in (out / "hf_export").iterdir()}
    again = train(out, *run)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "the run is already complete (step 5 of 5)" in again.stderr
    assert "worker(s) on" not in again.stderr  # known before any worker was placed
    assert (out / "summary.json").read_bytes() == summary
    assert {p.name: p.stat().st_mtime_ns for p in (out / "hf_export").iterdir()} == exported

    # the export failed after the summary was written (cut short: no record, a file missing):
    # started again, the run exports its last checkpoint, still without a worker
    from nemo_dapo.trainer.export import EXPORT_RECORD

    (out / "hf_export" / EXPORT_RECORD).unlink()
    (out / "hf_export" / "model.safetensors").unlink()
    third = train(out, *run)
    assert third.returncode == 0 and "worker(s) on" not in third.stderr, third.stderr[-3000:]
    assert re.search(r"exporting \S+global_step_5 to \S+hf_export", third.stderr)
    final = out / "checkpoints" / "global_step_5" / "policy" / "model" / "model.safetensors"
    assert (out / "hf_export" / "model.safetensors").read_bytes() == final.read_bytes()
    assert (out / "summary.json").read_bytes() == summary
    # continued in another trainer.mode: refused before Ray, naming the fix
    other = train(out, *run, "trainer.mode=stream", "trainer.total_training_steps=6")
    assert other.returncode == 2 and "worker(s) on" not in other.stderr, other.stderr[-3000:]
    assert "written by a trainer.mode=sync run, which this trainer.mode=stream run cannot continue" in other.stderr
