"""Where a step's metrics go (``trainer.loggers``): TensorBoard, the console, Weights & Biases,
MLflow. Each sink is built by name from :data:`SINKS`; ``metrics.jsonl`` is always written beside.

A resumed run (same ``trainer.output_dir``) continues the W&B run and the MLflow run it started:
their ids are kept in ``<output_dir>/logger_runs.json`` (W&B: see :class:`WandbSink` for the steps
a crashed job logged past its checkpoint). W&B and MLflow are the optional
``loggers`` extra (``pip install 'nemo-dapo[loggers]'``); start-up refuses them when missing.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from nemo_dapo.algo import metric_names as mn
from nemo_dapo.errors import InputError
from nemo_dapo.folders import replace_file

log = logging.getLogger("nemo_dapo")
LOGGER_RUNS = "logger_runs.json"  # the logger runs an output folder continues

# what the console's one line per step shows (every metric is in TensorBoard and metrics.jsonl)
CONSOLE_PREFIXES = (mn.SCORE["mean"].name, "val-core/", mn.NUM_GEN_BATCHES.name, mn.TIME_PER_STEP.name, mn.PG_LOSS.name)


@dataclass
class SinkContext:
    """What a sink needs to open its run."""

    output_dir: Path
    project_name: str
    experiment_name: str
    run_config: dict[str, Any] = field(default_factory=dict)  # the whole config, nested
    wandb_mode: str | None = None
    mlflow_tracking_uri: str | None = None

    def remembered(self, key: str) -> Any:
        """What this output folder's earlier run kept under ``key`` (a sink's run id, the last
        step it logged); None: nothing kept."""
        return self._kept().get(key)

    def remember(self, key: str, value: Any) -> None:
        """Kept atomically (:func:`~nemo_dapo.folders.replace_file`): a crash or a full disk
        mid-write leaves the previous content, never a truncated file."""
        replace_file(self.output_dir / LOGGER_RUNS, json.dumps({**self._kept(), key: value}, indent=1) + "\n")

    def _kept(self) -> dict[str, Any]:
        path = self.output_dir / LOGGER_RUNS
        if not path.is_file():
            return {}
        try:
            return json.loads(path.read_text())
        except ValueError as err:
            raise InputError(
                f"{path}: unreadable ({err}); it names the W&B and MLflow runs this output folder continues. "
                "Repair it, or move it away to log to new runs"
            ) from None


class MetricSink(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def flat_settings(tree: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``{"actor": {"clip_ratio_high": 0.28}}`` as ``("actor.clip_ratio_high", 0.28)``: the keys
    users set on the command line."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from flat_settings(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


class ConsoleSink:
    def __init__(self, context: SinkContext) -> None:
        pass

    def log(self, metrics: dict[str, float], step: int) -> None:
        shown = {k: v for k, v in metrics.items() if k.startswith(CONSOLE_PREFIXES)}
        log.info("step %d: %s", step, " ".join(f"{k}={v:.4g}" for k, v in sorted(shown.items())))

    def close(self) -> None:
        pass


class TensorBoardSink:
    def __init__(self, context: SinkContext) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(context.output_dir / "tensorboard" / context.experiment_name))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A W&B run in ``<output_dir>/wandb``, named after the experiment, with the whole config.
    ``trainer.wandb_mode=offline`` needs no network (``wandb sync`` uploads it later).

    A resumed run continues the W&B run of the folder, unless that run logged steps past the
    checkpoint it resumed from (the job died after the checkpoint): a W&B run's steps only go up,
    so the redone steps would be dropped. Those go to a new run in the same group, named with the
    step it starts at, whose config says which run it continues (``resumed_from``). The run opens
    at the first logged step, when that step is known."""

    def __init__(self, context: SinkContext) -> None:
        self.context = context
        self.run: Any = None

    def _open(self, first_step: int) -> None:
        import wandb

        context = self.context
        earlier, last_step = context.remembered("wandb"), context.remembered("wandb_last_step")
        continues = earlier is not None and (last_step is None or first_step > last_step)
        config, name = context.run_config, context.experiment_name
        if earlier is not None and not continues:
            config = {**config, "resumed_from": {"wandb_run": earlier, "step": first_step}}
            name = f"{name} (redone from step {first_step})"
        self.run = wandb.init(
            project=context.project_name,
            name=name,
            group=context.experiment_name,
            dir=str(context.output_dir),
            config=config,
            mode=context.wandb_mode,  # type: ignore[arg-type]  # the schema allows online | offline | null
            id=earlier if continues else None,
            resume="allow" if continues else None,
        )
        context.remember("wandb", self.run.id)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.run is None:
            self._open(step)
        self.run.log(metrics, step=step)
        self.context.remember("wandb_last_step", step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


def mlflow_metric_name(name: str) -> str:
    """MLflow allows letters, digits, ``_ - . / : `` and spaces: ``val-core/x/acc/mean@4`` is
    logged as ``val-core/x/acc/mean_at_4``."""
    return re.sub(r"[^/\w.\- :]", "_", name.replace("@", "_at_"))


class MlflowSink:
    """An MLflow run in experiment ``trainer.project_name``, named after the experiment, with
    every config setting as a parameter. The store is ``trainer.mlflow_tracking_uri``, else
    ``MLFLOW_TRACKING_URI``, else ``sqlite:///<output_dir>/mlflow.db`` (MLflow's local default)."""

    def __init__(self, context: SinkContext) -> None:
        import os

        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        local = f"sqlite:///{(context.output_dir / 'mlflow.db').resolve()}"
        uri = context.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or local
        self.client = MlflowClient(tracking_uri=uri)
        self.run_id = context.remembered("mlflow") or self._new_run(context)
        context.remember("mlflow", self.run_id)
        if not self.client.get_run(self.run_id).data.params:
            params = [Param(k, str(v)[:6000]) for k, v in flat_settings(context.run_config)]
            for start in range(0, len(params), 100):  # MLflow takes at most 100 per batch
                self.client.log_batch(self.run_id, params=params[start : start + 100])

    def _new_run(self, context: SinkContext) -> str:
        experiment = self.client.get_experiment_by_name(context.project_name)
        experiment_id = (
            experiment.experiment_id
            if experiment
            else self.client.create_experiment(
                context.project_name, artifact_location=(context.output_dir / "mlflow-artifacts").resolve().as_uri()
            )
        )
        return self.client.create_run(experiment_id, run_name=context.experiment_name).info.run_id

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        entries = [Metric(mlflow_metric_name(k), v, now, step) for k, v in metrics.items()]
        for start in range(0, len(entries), 1000):  # MLflow takes at most 1000 per batch
            self.client.log_batch(self.run_id, metrics=entries[start : start + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


SINKS: dict[str, Callable[[SinkContext], MetricSink]] = {
    "console": ConsoleSink,
    "tensorboard": TensorBoardSink,
    "wandb": WandbSink,
    "mlflow": MlflowSink,
}


def missing_packages(loggers: list[str]) -> list[str]:
    """The optional sinks of ``trainer.loggers`` whose package is not installed here, as problems."""
    import importlib.util

    return [
        f"trainer.loggers: {name!r} needs the {name} package: pip install 'nemo-dapo[loggers]' "
        "(or `make venv EXTRAS=...,loggers`), or drop it from the list"
        for name in ("wandb", "mlflow")
        if name in loggers and importlib.util.find_spec(name) is None
    ]
