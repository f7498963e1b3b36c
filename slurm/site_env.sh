#!/usr/bin/env bash
# A cluster's own settings for a training job: sourced by slurm/dapo_32b.sbatch and by the batch
# script NeMo-Run writes, before Ray starts, so the trainer and every Ray process inherit them.
# Each has a default here; give another value in sbatch's environment (docs/cluster.md,
# "Site settings").
#
#   FABRIC_IFNAME            the fast network's interface on every node (IPoIB ib0, a RoCE bond...):
#                            gloo, NCCL's bootstrap, the engines' TP ranks and the ranks' rendezvous
#                            use its address; Ray's control traffic and object store stay on the
#                            Ray node address (the management network). Unset: one network for all.
#   GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME   default FABRIC_IFNAME (when set)
#   NCCL_IB_HCA              the InfiniBand adapters NCCL uses (e.g. mlx5_0,mlx5_1); unset: all
#   CUDA_DEVICE_MAX_CONNECTIONS=1   one hardware queue, the order Megatron's communication overlap needs
#   HF_HUB_OFFLINE=1         the nodes read HF_MODEL from disk and never ask the hub
#   NODE_CACHE_DIR=/tmp/nemo-dapo-cache-$USER   node-local compile caches (Triton, TorchInductor,
#                            vLLM): never on shared storage, where 128 ranks would contend
#   open files: the soft limit is raised to the hard one (Ray and NCCL open many sockets)

if [ -n "${FABRIC_IFNAME:-}" ]; then
    export FABRIC_IFNAME
    export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$FABRIC_IFNAME}
    export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$FABRIC_IFNAME}
fi
[ -z "${NCCL_IB_HCA:-}" ] || export NCCL_IB_HCA
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
NODE_CACHE_DIR=${NODE_CACHE_DIR:-/tmp/nemo-dapo-cache-${USER:-$(id -un)}}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$NODE_CACHE_DIR/triton}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$NODE_CACHE_DIR/inductor}
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$NODE_CACHE_DIR/vllm}
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
