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
from tests.run_logs import mlflow_history, wandb_history

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
    assert json.loads((tmp_path / "logger_runs.json").read_text()) == first

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
