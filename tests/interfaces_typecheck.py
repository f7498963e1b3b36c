"""Read by the type checker only (tests/test_code_quality.py): every backend implements its interface.

A worker method whose signature drifts from ``PolicyWorker`` / ``RolloutWorker`` makes one of
these returns a type error.
"""

from nemo_dapo.policy.base import PolicyWorker
from nemo_dapo.policy.megatron.worker import MegatronPolicyWorker
from nemo_dapo.policy.torch_worker import TorchPolicyWorker
from nemo_dapo.rollout.base import RolloutWorker
from nemo_dapo.rollout.vllm_worker import VLLMRolloutWorker


def torch_backend(worker: TorchPolicyWorker) -> PolicyWorker:
    return worker


def megatron_backend(worker: MegatronPolicyWorker) -> PolicyWorker:
    return worker


def vllm_engine(worker: VLLMRolloutWorker) -> RolloutWorker:
    return worker
