"""trainer.log_level=info drops exactly the known-harmless library messages (each one's own example,
at its own logger) and keeps every other warning; debug keeps everything."""

import logging
import os
import warnings

import pytest

from nemo_dapo import logs


class Keep(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def fresh_loggers(monkeypatch):
    """The harmless loggers without filters, and the environment and warning filters restored."""
    names = {entry.logger for entry in logs.HARMLESS}
    for name in names:
        monkeypatch.setattr(logging.getLogger(name), "filters", [])
    for key in [logs.LOG_LEVEL_ENV, *logs.QUIET_ENV]:
        monkeypatch.delenv(key, raising=False)
    levels = {name: logging.getLogger(name).level for name in ("", "nemo_dapo")}
    with warnings.catch_warnings():
        yield names
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def emitted(entry: logs.Harmless, message: str) -> list[str]:
    logger = logging.getLogger(entry.logger)
    kept = Keep()
    logger.addHandler(kept)
    try:
        logger.warning("%s", message)
    finally:
        logger.removeHandler(kept)
    return kept.lines


@pytest.mark.parametrize("entry", logs.HARMLESS, ids=lambda e: e.logger)
def test_info_drops_each_harmless_message_and_keeps_real_warnings(entry, fresh_loggers):
    logs.configure_logging("info")
    logs.configure_logging("info")  # idempotent: one filter per logger
    assert emitted(entry, entry.example) == []
    assert emitted(entry, "QKVParallelLinear: Failed to load weights") == ["QKVParallelLinear: Failed to load weights"]
    assert sum(isinstance(f, logs.KnownHarmless) for f in logging.getLogger(entry.logger).filters) == 1
    assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING" and os.environ[logs.LOG_LEVEL_ENV] == "info"
    assert logging.getLogger().level == logging.WARNING and logging.getLogger("nemo_dapo").level == logging.INFO


def test_debug_keeps_everything(fresh_loggers):
    logs.configure_logging("debug")
    assert logs.verbose() and "VLLM_LOGGING_LEVEL" not in os.environ
    for entry in logs.HARMLESS:
        assert emitted(entry, entry.example) == [entry.example]


def test_harmless_python_warnings_are_ignored_at_info(fresh_loggers):
    logs.configure_logging("info")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # what catch_warnings reset; configure again on top of it
        logs.configure_logging("info")
        warnings.warn("`torch.distributed.reduce_op` is deprecated, please use ReduceOp", FutureWarning, stacklevel=1)
        warnings.warn("a real deprecation", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["a real deprecation"]
