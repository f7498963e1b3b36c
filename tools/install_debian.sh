#!/usr/bin/env bash
# Installs the Debian packages named that are missing: `tools/install_debian.sh WHO PACKAGE...`
# (WHO names the caller in what it prints). Idempotent and quick when everything is present; as
# root, or through `sudo -n`.
set -euo pipefail
who=$1
shift
missing=()
for package in "$@"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "ok installed" || missing+=("$package")
done
if [ ${#missing[@]} -eq 0 ]; then
    echo "$who: $* already installed"
    exit 0
fi
as_root=()
[ "$(id -u)" -eq 0 ] || as_root=(sudo -n)
echo "$who: installing ${missing[*]}"
"${as_root[@]}" apt-get update -q
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
