"""Metric sinks: TensorBoard event files, a JSON-lines log, and the console."""

from __future__ import annotations

import json
import logging
import math
import time
from contextlib import contextmanager
from pathlib import Path

from nemo_dapo.algo import metric_names as mn

log = logging.getLogger("nemo_dapo")


class Tracker:
    """Writes every step's metrics to ``<output_dir>/tensorboard`` and ``metrics.jsonl``."""

    def __init__(self, output_dir: str | Path, loggers: list[str], experiment_name: str) -> None:
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.console = "console" in loggers
        self.writer = None
        if "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(self.output_dir / "tensorboard" / experiment_name))
        self._jsonl = open(self.output_dir / "metrics.jsonl", "a", encoding="utf-8")

    def log(self, metrics: dict[str, float], step: int) -> None:
        finite = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        if self.writer is not None:
            for key, value in finite.items():
                self.writer.add_scalar(key, value, step)
            self.writer.flush()
        self._jsonl.write(json.dumps({"step": step, "time": time.time(), **finite}) + "\n")
        self._jsonl.flush()
        if self.console:
            shown = {
                k: v
                for k, v in finite.items()
                if k.startswith(
                    (
                        mn.SCORE["mean"].name,
                        "val-core/",
                        mn.NUM_GEN_BATCHES.name,
                        mn.TIME_PER_STEP.name,
                        mn.PG_LOSS.name,
                    )
                )
            }
            log.info("step %d: %s", step, " ".join(f"{k}={v:.4g}" for k, v in sorted(shown.items())))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
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
