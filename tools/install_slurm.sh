#!/usr/bin/env bash
# Debian packages the Slurm tests need (tests/test_multinode.py, tests/test_slurm.py): Slurm
# (slurmctld, slurmd, the client commands), munge for its authentication, iproute2 for the network
# namespaces its nodes live in, and shellcheck for the scripts in slurm/. .ci/run calls it before
# the tests.
set -euo pipefail
exec bash "$(dirname "$0")/install_debian.sh" install_slurm slurmctld slurmd slurm-client munge iproute2 shellcheck
