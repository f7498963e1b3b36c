"""How the workers' C allocator treats the memory a pass frees (docs/benchmarks.md,
"The allocator of the workers").

A training pass on CPU allocates and frees hundreds of MB per micro-batch (activations, logit
chunks, gradients). glibc serves blocks above its mmap threshold (dynamic, at most 32 MiB) with
fresh ``mmap`` calls and trims the heap's free top, so every pass faults those pages in again and
the kernel zeroes each one: a quarter of the policy worker's CPU time on a 2-core machine. The
settings below serve every block from the heap and never trim it, so freed memory is reused
without a page fault. The mmap threshold does the work: a trim threshold alone fixes it at its
128 KiB start (10x the faults), a 32 MiB one leaves larger blocks (logit chunks) mapped; the trim
threshold keeps the heap's top as well. A CPU rollout engine gains the same way at every weight
sync: the arriving buckets and the reload's buffers are served from the heap it kept.
glibc reads them once, at process start, so they go into the worker's start environment; as the
``MALLOC_*_`` variables rather than one ``GLIBC_TUNABLES`` string, which Ray splits at its colons
on the way to a worker. Other C libraries ignore them.
"""

from __future__ import annotations

from collections.abc import Mapping

REUSE_FREED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": str(4 << 30), "MALLOC_TRIM_THRESHOLD_": str(4 << 30)}


def keeps_freed_memory(setting: bool | None, on_gpu: bool) -> bool:
    """``trainer.keep_freed_memory``; unset: on in CPU mode, off on GPU nodes, where the host
    memory a worker frees (checkpoint copies, weight buffers of a 32B model) should go back."""
    return not on_gpu if setting is None else setting


def allocator_env(keep: bool, environ: Mapping[str, str]) -> dict[str, str]:
    """The start environment of a policy, reference or rollout worker; a value the user set in
    ``environ`` wins."""
    return {key: environ.get(key, value) for key, value in REUSE_FREED_MEMORY.items()} if keep else {}
