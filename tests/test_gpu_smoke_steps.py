"""The GPU smoke script's steps run here, on the CPU, so a lent GPU's minutes are not lost to a
script that broke while nobody could run it (bench/gpu_megatron_smoke.py runs only on a GPU, and
a GPU is lent to few sessions).

Its steps (timed updates on rows of varied length, the asynchronous checkpoint and its replay,
the checkpoint's timing split, packed against padded log-probs) run on the tiny model at one
rank over gloo. Only the two CUDA calls that have no CPU meaning are replaced: the device
synchronisation before a timer, and the peak-memory reading.
"""

import importlib.util
import os
import sys
import types
from pathlib import Path

import pytest
import torch

from nemo_dapo.policy.base import WorkerSettings
from tests.ranks import spawn

pytestmark = [
    pytest.mark.megatron,
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
]

BENCH = Path(__file__).resolve().parents[1] / "bench"


def run_smoke_steps(rank: int, world_size: int, model_dir: str, work: str) -> None:
    sys.path.insert(0, str(BENCH))
    import gpu_megatron_smoke as smoke

    from nemo_dapo.config.schema_actor import MegatronConfig, OptimConfig
    from nemo_dapo.policy.base import LossSettings
    from nemo_dapo.policy.megatron.worker import MegatronPolicyWorker

    torch.cuda.synchronize = lambda *args: None  # no device to wait for
    torch.cuda.max_memory_allocated = lambda *args: 0
    torch.set_num_threads(1)
    worker = MegatronPolicyWorker(
        rank,
        world_size,
        os.path.join(work, "rdv"),
        WorkerSettings(model_dir, OptimConfig(lr=1e-6, warmup_steps=0)),
        MegatronConfig(),
    )
    args = types.SimpleNamespace(steps=2, rows=4, prompt=16, response=32, varied_lengths=True, peak_flops=1e12)
    vocab, settings = 400, LossSettings()
    steps = smoke.timed_updates(worker, args, 1, vocab, settings)
    checkpoint = smoke.check_async_checkpoint(worker, os.path.join(work, "checkpoint"), args, vocab, settings)
    rows = smoke.varied_lengths(smoke.synthetic_batch(args.rows, args.prompt, args.response, vocab, 98), 98)
    packing_gap = smoke.check_packing_matches_padding(worker, rows, train_packed=False)
    released = worker.release_memory()  # no CUDA here: nothing cached, nothing given back
    out = {"steps": steps, "checkpoint": checkpoint, "packing_gap": packing_gap, "released": released}
    torch.save(out, os.path.join(work, "out.pt"))


def test_the_gpu_smoke_steps_run_on_the_cpu(tmp_path, tiny_model_dir):
    spawn(run_smoke_steps, 1, str(tiny_model_dir), str(tmp_path))
    out = torch.load(tmp_path / "out.pt", weights_only=False)
    steps = out["steps"]
    assert [s["step"] for s in steps] == [0, 1]
    # varied lengths: each step's real tokens lie between all-prompt and full rows
    assert all(4 * 16 < s["tokens"] < 4 * 48 for s in steps)
    assert all(s["update_tokens_per_s"] == pytest.approx(s["tokens"] / s["update_s"]) for s in steps)
    assert out["checkpoint"]["replay_grad_norm_gap"] < 1e-6
    assert {"async_save_call_again_s", "hf_copy_s", "sync_save_s"} <= set(out["checkpoint"])
    assert out["packing_gap"] < 1e-5
    assert out["released"] == 0
