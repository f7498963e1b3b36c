#!/usr/bin/env bash
# Debian packages the Slurm tests need (tests/test_multinode.py, tests/test_slurm.py): Slurm
# (slurmctld, slurmd, the client commands), munge for its authentication, iproute2 for the network
# namespaces its nodes live in, and shellcheck for the scripts in slurm/. Idempotent and quick when
# everything is present; .ci/run calls it before the tests.
set -euo pipefail

packages=(slurmctld slurmd slurm-client munge iproute2 shellcheck)
missing=()
for package in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "ok installed" || missing+=("$package")
done
if [ ${#missing[@]} -eq 0 ]; then
    echo "install_slurm: ${packages[*]} already installed"
    exit 0
fi
as_root=()
[ "$(id -u)" -eq 0 ] || as_root=(sudo -n)
echo "install_slurm: installing ${missing[*]}"
"${as_root[@]}" apt-get update -q
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
