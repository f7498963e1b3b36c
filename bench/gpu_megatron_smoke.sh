#!/usr/bin/env bash
# GPU smoke test of the Megatron policy worker (~0.5B Qwen2 shape, random init, a few DAPO updates).
#
# Ran on one H200 with --impl local (bf16); the TransformerEngine/FP8 path is still untested on a
# GPU. See bench/gpu_megatron_smoke.py and the README.
#
# One GPU (sized for one H200), at most 8 minutes (SMOKE_TIMEOUT_S seconds), never in CI. Prints
# per-step tokens/s, MFU (6N estimate against the H200's 989 TFLOP/s dense BF16 peak) and peak GPU
# memory; fails loudly when no GPU is visible. Extra arguments go to the Python script (e.g.
# --no-fp8, --steps 3).
# Results land in ${OUT:-.}/gpu_megatron_smoke.json.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python}
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "ERROR: no NVIDIA GPU visible (nvidia-smi missing or failing): this smoke test needs one GPU" >&2
    exit 2
fi
nvidia-smi -L
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
export CUDA_DEVICE_MAX_CONNECTIONS=1  # Megatron's usual setting for TP/SP comm overlap ordering
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo} GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
export PYTHONUNBUFFERED=1
mkdir -p "${OUT:-.}"
timeout --signal=TERM --kill-after=20 "${SMOKE_TIMEOUT_S:-480}" \
    "$PYTHON" bench/gpu_megatron_smoke.py --json "${OUT:-.}/gpu_megatron_smoke.json" "$@"
