# mypy: ignore-errors
# (it replaces torch.cuda functions and classes with CPU stand-ins: by design not type-correct)
"""Run megatron-core 0.16 on a machine without a GPU (tests and the CPU demo only).

megatron-core assumes CUDA in a few places on the GPTModel / DDP / optimizer path. Every
redirect lives here, each with the reason it is needed, and :func:`enable_cpu_compat` does
nothing when a GPU is present. The optimizer workarounds (``*_adam_*``) and
:func:`define_router_gemm_without_te` fix megatron-core 0.16 defects of its code paths without
apex / TransformerEngine and are applied on every device.

Outside contract (megatron-core 0.16.1's CUDA-only internals): see docs/architecture.md, "Outside contracts".
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_ENABLED = False


def _to_cpu(device):
    """'cuda', 'cuda:0', torch.device('cuda') and bare ints (CUDA ordinals) all mean the CPU here."""
    if isinstance(device, int) or (isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda"):
        return torch.device("cpu")
    return device


class CudaToCpuMode(TorchFunctionMode):
    """Redirects the CUDA-only spellings megatron uses to their CPU meaning.

    - ``device="cuda"`` / ``device=torch.cuda.current_device()`` literals (optimizer, grad
      clipping, schedules, grad buffers) create CPU tensors instead;
    - ``tensor.cuda()`` returns the tensor itself;
    - ``tensor.type()`` answers ``torch.cuda.FloatTensor`` for a CPU float tensor, because the
      optimizers accept only the CUDA type strings.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        if "device" in kwargs:
            kwargs["device"] = _to_cpu(kwargs["device"])
        return func(*args, **kwargs)


class CpuStream(torch.cpu.Stream):
    """torch's CPU stream stand-in, whose ``record_event`` returns an event one can synchronise on."""

    def record_event(self, event=None):
        return event or torch.Event(device="cpu")


def _patch_torch_cuda() -> None:
    torch.cuda.current_device = lambda: "cpu"  # rotary embedding, grad buffers, optimizer place tensors "on the GPU"
    torch.cuda.synchronize = lambda *a, **k: None  # parallel_state / DDP synchronise around collectives
    # the MoE all-to-all dispatcher copies its routing counts to the host on a side stream, then waits for them
    torch.cuda.Stream = CpuStream
    torch.cuda.current_stream = torch.cpu.current_stream
    torch.cuda.stream = torch.cpu.stream


def _host_split_sizes() -> None:
    """The MoE all-to-all dispatcher gets its split sizes as numpy arrays by moving them off the GPU;
    CPU tensors it leaves as tensors, which ``all_to_all_single`` rejects. Convert those too."""
    from megatron.core.transformer.moe import token_dispatcher

    def to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor

    token_dispatcher.maybe_move_tensor_to_cpu = to_host


def _install_cpu_rng_tracker() -> None:
    """Dropout runs inside ``get_cuda_rng_tracker().fork()``, which reads the CUDA generator."""
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """The same named-state bookkeeping, on the CPU generator."""

        def add(self, name, seed):
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            outer = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _device_rng_is_the_cpu_generator() -> None:
    """Activation recompute saves and restores the "CUDA" generator around the replayed forward;
    here the device generator is the CPU's (the RNG tracker above forks it too)."""
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)


def enable_cpu_compat() -> bool:
    """Install the CPU redirects once per process; returns whether they are active."""
    global _ENABLED
    if torch.cuda.is_available():
        return False
    if not _ENABLED:
        _patch_torch_cuda()
        _install_cpu_rng_tracker()
        _device_rng_is_the_cpu_generator()
        _host_split_sizes()
        CudaToCpuMode().__enter__()  # stays active for the life of this (worker) process
        _ENABLED = True
    return True


def define_router_gemm_without_te() -> None:
    """megatron-core 0.16 defect: without TransformerEngine the MoE router's linear reads the
    never-defined ``te_general_gemm`` (NameError); define it as absent so the torch GEMM is used."""
    from megatron.core.transformer.moe import moe_utils

    if not moe_utils.HAVE_TE:
        moe_utils.te_general_gemm = None


def _inner_optimizers(optimizer) -> list:
    """The Megatron optimizers inside a (possibly chained) optimizer."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def uses_fallback_adam() -> bool:
    """megatron-core falls back to ``torch.optim.AdamW`` without apex / TransformerEngine."""
    from megatron.core.optimizer import distrib_optimizer

    return not distrib_optimizer.HAVE_APEX_OR_TE


def init_fallback_adam_state(optimizer) -> None:
    """megatron-core 0.16 defect: the state dict of a fresh fallback Adam (a load template, or a save
    before the first step) needs a ``step`` per parameter (``state_dict`` asserts one), but its
    ``init_state_fn`` creates none. Create the state (zero moments at step 0: what AdamW starts from)."""
    if not uses_fallback_adam():
        return
    for inner in _inner_optimizers(optimizer):
        if inner.init_state_fn is not None:
            inner.init_state_fn(inner.optimizer, inner.config)
        for state in inner.optimizer.state.values():
            state.setdefault("step", torch.tensor(0.0))


def skip_step_when_restoring_adam_state() -> None:
    """megatron-core 0.16 defect: restoring a ``fully_reshardable`` optimizer copies every key of the
    live Adam state from the checkpoint, which stores no per-parameter ``step``: KeyError 'step'.
    ``step`` is restored from the param groups already, so leave it out of that copy."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states
    if not uses_fallback_adam() or getattr(original, "skips_step", False):
        return

    def set_states_without_step(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        step = state.pop("step", None)
        original(self, model_param, tensors)
        if step is not None:
            state["step"] = step

    set_states_without_step.skips_step = True
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states_without_step


def unshare_adam_steps(optimizer) -> None:
    """megatron-core 0.16 defect: after a load every parameter's ``step`` is the same tensor, which
    AdamW increments once per parameter per step: bias correction (and the losses) silently drift."""
    if not uses_fallback_adam():
        return
    for inner in _inner_optimizers(optimizer):
        for state in inner.optimizer.state.values():
            if "step" in state:
                state["step"] = state["step"].clone()
