"""The metric log of a run (a JSON-lines file and the configured sinks) and per-stage timers."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from nemo_dapo.config import Config
from nemo_dapo.folders import open_run_file
from nemo_dapo.trainer.sinks import SINKS, SinkContext


class Tracker:
    """Writes every step's metrics to ``<output_dir>/metrics.jsonl`` and to the sinks named in
    ``trainer.loggers`` (:mod:`~nemo_dapo.trainer.sinks`). A NaN or Inf is written as such: it
    tells that something went wrong (``NaN`` / ``Infinity`` in the JSON lines, as Python writes them)."""

    def __init__(self, loggers: list[str], context: SinkContext) -> None:
        context.output_dir.mkdir(parents=True, exist_ok=True)
        self.sinks = [SINKS[name](context) for name in loggers]
        self._jsonl = open_run_file(context.output_dir / "metrics.jsonl")

    @classmethod
    def for_run(cls, cfg: Config) -> Tracker:
        """The tracker of the run ``cfg`` describes (``trainer.output_dir``, ``trainer.loggers``)."""
        t = cfg.trainer
        context = SinkContext(
            Path(t.output_dir), t.project_name, t.experiment_name, asdict(cfg), t.wandb_mode, t.mlflow_tracking_uri
        )
        return cls(t.loggers, context)

    def log(self, metrics: dict[str, float], step: int) -> None:
        values = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        self._jsonl.write(json.dumps({"step": step, "time": time.time(), **values}) + "\n")
        self._jsonl.flush()
        for sink in self.sinks:
            sink.log(values, step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self._jsonl.close()


class StageTimer:
    """Accumulates wall seconds per named stage (a stage may run several times per step)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start
