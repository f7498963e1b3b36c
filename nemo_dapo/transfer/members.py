"""Who sits where in the weight-transfer groups, and what the driver tells each engine: the
driver's side of the collective paths, free of vLLM (the driver never imports it).

Each exporting training rank is rank 0 of a group of its own; every engine worker joins each
group at its own rank, as vLLM's ``nccl`` engine numbers them: engine e's worker w at the
engine's ``rank_offset`` + w, the engines one after another. The senders' endpoints (what
``PolicyWorker.open_weight_transfer`` returns, in stage order) carry what the engines need.
"""

from __future__ import annotations

# What an nccl sender's endpoint hands on to the engines as it is (vLLM's
# NCCLWeightTransferInitInfo: the rendezvous and the wire parameters both sides must agree on).
NCCL_SHARED_FIELDS = ("master_address", "master_port", "packed", "packed_buffer_size_bytes", "packed_num_buffers")


def rank_offsets(workers_per_engine: list[int]) -> tuple[list[int], int]:
    """The rank of each engine's first worker in every group, and the groups' size: the sender,
    then every worker of every engine."""
    offsets, next_rank = [], 1
    for workers in workers_per_engine:
        offsets.append(next_rank)
        next_rank += workers
    return offsets, next_rank


def engine_init_info(backend: str, endpoints: list[dict], rank_offset: int, world_size: int, timeout_s: float) -> dict:
    """The ``init_weight_transfer_engine`` argument of one engine's workers (each adds its own
    rank to ``rank_offset``)."""
    if backend == "gloo":
        rendezvous = [endpoint["rendezvous"] for endpoint in endpoints]
        return {"rendezvous": rendezvous, "rank_offset": rank_offset, "world_size": world_size, "timeout_s": timeout_s}
    if backend == "nccl":
        if len(endpoints) != 1:  # validation refuses pipeline stages with nccl; never reached
            raise RuntimeError(f"nccl weight transfer: {len(endpoints)} exporting ranks, vLLM's engine joins one")
        shared = {field: endpoints[0][field] for field in NCCL_SHARED_FIELDS}
        return {**shared, "rank_offset": rank_offset, "world_size": world_size}
    raise ValueError(f"no collective weight path {backend!r}")


def update_info(backend: str, endpoints: list[dict], version: int) -> dict:
    """One round's ``update_weights`` argument, the same for every engine worker: gloo's buckets
    describe themselves, so it names the version; nccl's receivers are told every tensor."""
    if backend == "gloo":
        return {"version": version}
    if backend == "nccl":
        return endpoints[0]["update_info"]
    raise ValueError(f"no collective weight path {backend!r}")
