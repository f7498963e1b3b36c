#!/usr/bin/env bash
# A cluster's own settings for a training job: sourced by slurm/dapo_32b.sbatch and by the batch
# script NeMo-Run writes, before Ray starts, so the trainer and every Ray process inherit them
# (srun passes the environment into every step and container). Each has a default here; give
# another value in sbatch's environment (docs/cluster.md, "Site settings").
#
#   FABRIC_IFNAME            the fast network's interface on every node (IPoIB ib0, a RoCE bond...):
#                            gloo, NCCL's bootstrap, the engines' TP ranks and the ranks' rendezvous
#                            use its address; Ray's control traffic and object store stay on the
#                            Ray node address (the management network). Unset: one network for all
#                            (a multi-node GPU run says what that sends over it).
#   GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME   default FABRIC_IFNAME (when set)
#   NCCL_IB_HCA              the InfiniBand adapters NCCL uses (e.g. mlx5_0,mlx5_1); unset: all
#   NCCL_CONF=/etc/nccl.conf the site's NCCL settings (NCCL_IB_HCA, NCCL_IB_GID_INDEX, ...): a container
#                            does not see the host's file, so its KEY=VALUE lines are exported here
#                            (a variable already set wins)
#   HF_HUB_OFFLINE=1         the nodes read HF_MODEL from disk and never ask the hub
#   NODE_CACHE_DIR=/tmp/nemo-dapo-cache-$USER   node-local caches, never on shared storage (where 128
#                            ranks would contend) nor in HOME (often a small quota): Triton,
#                            TorchInductor, vLLM, CUDA's JIT, torch extensions, Hugging Face, XDG;
#                            this user's alone (each node's preflight makes it 0700, or refuses it)
#   open files: the soft limit is raised to the hard one (Ray and NCCL open many sockets)
# CUDA_DEVICE_MAX_CONNECTIONS=1, which Megatron's communication overlap needs, is set for the
# training ranks alone (nemo_dapo/trainer/assembly.py): the engines keep CUDA's default.

if [ -n "${FABRIC_IFNAME:-}" ]; then
    export FABRIC_IFNAME
    export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$FABRIC_IFNAME}
    export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$FABRIC_IFNAME}
fi
[ -z "${NCCL_IB_HCA:-}" ] || export NCCL_IB_HCA
if [ -r "${NCCL_CONF:-/etc/nccl.conf}" ]; then
    while IFS='=' read -r key value; do
        if [[ $key =~ ^NCCL_[A-Z0-9_]+$ ]] && [ -z "${!key:-}" ]; then export "$key=$value"; fi
    done < <(sed -e 's/#.*//' -e 's/[[:space:]]*$//' "${NCCL_CONF:-/etc/nccl.conf}")
fi
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
export NODE_CACHE_DIR=${NODE_CACHE_DIR:-/tmp/nemo-dapo-cache-${USER:-$(id -un)}}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$NODE_CACHE_DIR/triton}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$NODE_CACHE_DIR/inductor}
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$NODE_CACHE_DIR/vllm}
export CUDA_CACHE_PATH=${CUDA_CACHE_PATH:-$NODE_CACHE_DIR/cuda}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$NODE_CACHE_DIR/torch_extensions}
export HF_HOME=${HF_HOME:-$NODE_CACHE_DIR/huggingface}
export XDG_CACHE_HOME=${XDG_CACHE_HOME:-$NODE_CACHE_DIR/xdg}
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
