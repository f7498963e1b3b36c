#!/usr/bin/env bash
# Debian packages the CPU image needs (containers/build_cpu_image.sh, `make image-cpu` and
# `make image-test`): podman with the runc runtime, and mmdebstrap for the Debian base image.
# Not part of CI: the image is built on demand.
set -euo pipefail
exec bash "$(dirname "$0")/install_debian.sh" install_containers podman runc mmdebstrap uidmap
