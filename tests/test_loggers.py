"""W&B (offline) and MLflow (local SQLite store) sinks: the scalars read back from what each wrote,
the config travels as run parameters, a resumed run continues the same runs, nothing listens on
the network, and a missing package is refused at start-up naming the extra."""

import json
import math
from pathlib import Path

import pytest

from nemo_dapo.trainer.sinks import SinkContext, flat_settings, missing_packages, mlflow_metric_name
from nemo_dapo.trainer.tracking import Tracker
from tests.listeners import is_loopback, our_listeners
from tests.run_logs import mlflow_history, wandb_config, wandb_history

wandb = pytest.importorskip("wandb")
mlflow = pytest.importorskip("mlflow")

STEPS = [
    {"actor/pg_loss": 0.5, "val-core/arith/acc/mean@4": 0.25, "timing_s/gen": 1.0},
    {"actor/pg_loss": -0.125, "val-core/arith/acc/mean@4": 0.5, "timing_s/gen": float("nan")},
    {"actor/pg_loss": 0.0625, "val-core/arith/acc/mean@4": 0.75, "timing_s/gen": 3.0},
]
CONFIG = {"actor": {"clip_ratio_high": 0.28, "optim": {"lr": 1e-6}}, "trainer": {"loggers": ["wandb", "mlflow"]}}


def open_tracker(output: Path) -> Tracker:
    context = SinkContext(output, "nemo-dapo-test", "tiny", CONFIG, wandb_mode="offline")
    return Tracker(["wandb", "mlflow"], context)


@pytest.fixture
def quiet_wandb(monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def test_wandb_offline_and_mlflow_read_back_and_resume_continues_the_runs(tmp_path, quiet_wandb):
    tracker = open_tracker(tmp_path)
    for step, metrics in enumerate(STEPS[:2], start=1):
        tracker.log(metrics, step)
    assert [address for address, _ in our_listeners() if not is_loopback(address)] == []  # wandb-core: sockets
    tracker.close()
    first = json.loads((tmp_path / "logger_runs.json").read_text())
    tracker = open_tracker(tmp_path)  # the run resumed from a checkpoint, in the same output folder
    tracker.log(STEPS[2], 3)
    tracker.close()
    assert json.loads((tmp_path / "logger_runs.json").read_text()) == {**first, "wandb_last_step": 3}

    # MLflow: one run, all three steps, '@' spelled out, the non-finite value kept as NaN (visible)
    run_id = first["mlflow"]
    assert mlflow_history(tmp_path, run_id, "actor/pg_loss") == {1: 0.5, 2: -0.125, 3: 0.0625}
    assert mlflow_history(tmp_path, run_id, "val-core/arith/acc/mean_at_4") == {1: 0.25, 2: 0.5, 3: 0.75}
    timing = mlflow_history(tmp_path, run_id, "timing_s/gen")
    assert timing[1] == 1.0 and math.isnan(timing[2]) and timing[3] == 3.0
    from mlflow.tracking import MlflowClient

    run = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(run_id)
    assert run.data.params["actor.clip_ratio_high"] == "0.28" and run.data.params["actor.optim.lr"] == "1e-06"
    assert run.info.run_name == "tiny" and run.info.status == "FINISHED"

    # W&B: both offline files belong to the run id kept in the output folder
    files = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and all(f.name == f"run-{first['wandb']}.wandb" for f in files)
    rows = {**wandb_history(files[0]), **wandb_history(files[1])}
    assert {step: row["actor/pg_loss"] for step, row in rows.items()} == {1: 0.5, 2: -0.125, 3: 0.0625}
    assert {step: row["val-core/arith/acc/mean@4"] for step, row in rows.items()} == {1: 0.25, 2: 0.5, 3: 0.75}
    assert math.isnan(rows[2]["timing_s/gen"])


def test_metric_names_mlflow_accepts():
    from mlflow.utils.validation import _validate_metric_name

    for name in ("val-core/arith/acc/mean@4", "val-aux/aime/pass@32", "actor/pg_loss", "timing_s/gen"):
        _validate_metric_name(mlflow_metric_name(name))
    assert mlflow_metric_name("val-aux/aime/pass@32") == "val-aux/aime/pass_at_32"
    assert mlflow_metric_name("actor/pg_loss") == "actor/pg_loss"


def test_settings_flatten_to_command_line_keys():
    assert dict(flat_settings(CONFIG)) == {
        "actor.clip_ratio_high": 0.28,
        "actor.optim.lr": 1e-6,
        "trainer.loggers": ["wandb", "mlflow"],
    }


def test_a_missing_logger_package_is_named_with_its_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    (problem,) = missing_packages(["console", "wandb", "mlflow"])
    assert problem.startswith("trainer.loggers: 'wandb' needs the wandb package: pip install 'nemo-dapo[loggers]'")
    assert missing_packages(["console", "tensorboard"]) == []


def test_steps_redone_after_a_crash_go_to_a_new_wandb_run_linked_to_the_first(tmp_path, quiet_wandb):
    """The job logged steps 1-3 and died; it resumes from its step-2 checkpoint and redoes step 3:
    W&B would drop a step it already has, so the redone steps go to a new run naming the first."""
    tracker = open_tracker(tmp_path)
    for step, metrics in enumerate(STEPS, start=1):
        tracker.log(metrics, step)
    tracker.close()
    first = json.loads((tmp_path / "logger_runs.json").read_text())["wandb"]
    tracker = open_tracker(tmp_path)
    redone = {"actor/pg_loss": 0.25}
    tracker.log(redone, 3)
    tracker.log({"actor/pg_loss": 0.375}, 4)
    tracker.close()
    second = json.loads((tmp_path / "logger_runs.json").read_text())["wandb"]
    assert second != first

    def run_file(run_id: str) -> Path:
        (path,) = (tmp_path / "wandb").glob(f"offline-run-*/run-{run_id}.wandb")
        return path

    old, new = wandb_history(run_file(first)), wandb_history(run_file(second))
    assert {step: row["actor/pg_loss"] for step, row in old.items()} == {1: 0.5, 2: -0.125, 3: 0.0625}
    assert {step: row["actor/pg_loss"] for step, row in new.items()} == {3: 0.25, 4: 0.375}
    assert wandb_config(run_file(second))["resumed_from"] == {"wandb_run": first, "step": 3}


def test_the_logger_runs_file_survives_a_full_disk_mid_write_and_a_damaged_one_is_named(tmp_path):
    """logger_runs.json on a 64 KiB tmpfs, the disk full when a large value is kept: the write
    fails and the file still holds what it held (written in place it would be truncated, and
    every later start would die reading it). A damaged file stops the start, naming it."""
    import errno
    import subprocess

    from nemo_dapo.errors import InputError

    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)], capture_output=True).returncode:
        pytest.skip("no tmpfs can be mounted here")
    try:
        context = SinkContext(small, "p", "e")
        context.remember("wandb", "run-1")
        (small / "filler").write_bytes(b"\0" * 40 * 1024)
        with pytest.raises(OSError) as full:
            context.remember("notes", "x" * 64 * 1024)
        assert full.value.errno == errno.ENOSPC
        assert json.loads((small / "logger_runs.json").read_text()) == {"wandb": "run-1"}
        assert SinkContext(small, "p", "e").remembered("wandb") == "run-1"
    finally:
        subprocess.run(["umount", str(small)], check=True)
    (tmp_path / "logger_runs.json").write_text('{"wandb": "run-')
    with pytest.raises(InputError, match=r"logger_runs\.json: unreadable .* move it away to log to new runs"):
        SinkContext(tmp_path, "p", "e").remembered("wandb")
