#!/usr/bin/env bash
# Debian packages the CPU image needs (containers/build_cpu_image.sh, `make image-cpu` and
# `make image-test`): podman with the runc runtime, and mmdebstrap for the Debian base image.
# Idempotent and quick when everything is present. Not part of CI: the image is built on demand.
set -euo pipefail

packages=(podman runc mmdebstrap uidmap)
missing=()
for package in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "ok installed" || missing+=("$package")
done
if [ ${#missing[@]} -eq 0 ]; then
    echo "install_containers: ${packages[*]} already installed"
    exit 0
fi
as_root=()
[ "$(id -u)" -eq 0 ] || as_root=(sudo -n)
echo "install_containers: installing ${missing[*]}"
"${as_root[@]}" apt-get update -q
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
