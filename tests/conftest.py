"""Shared fixtures: the tiny model is built once per machine (cached) and reused by every test."""

import os

import pytest

from nemo_dapo.cluster.ray_env import apply_loopback_env

apply_loopback_env()  # before any test imports ray / vllm / torch.distributed


@pytest.fixture(scope="session")
def tiny_model_dir():
    from nemo_dapo.model.tiny import ensure_tiny_model

    return ensure_tiny_model()


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """Run a test inside its own folder so relative output paths land there."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def pytest_configure(config):
    os.environ.setdefault("NEMO_DAPO_TEST", "1")
