# `make train` runs the embedded default (tiny CPU DAPO); `make test` runs the test suite.
# Both create .venv on first use (python3.11) and refresh it when pyproject.toml changes.
VENV ?= .venv
# tools/cpu-lock.txt pins the environment of these extras; other EXTRAS resolve afresh
LOCKED_EXTRAS := test,rollout,cluster,megatron,launch,gguf,loggers
EXTRAS ?= $(LOCKED_EXTRAS)
LOCK := $(if $(filter $(LOCKED_EXTRAS),$(EXTRAS)),tools/cpu-lock.txt)
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml $(LOCK) | sha1sum | cut -c1-12)-$(EXTRAS)
PYTEST_ARGS ?=
ARGS ?=

.PHONY: venv train test selfcheck lock image-cpu image-test
venv: $(STAMP)

$(STAMP): pyproject.toml tools/bootstrap.sh $(LOCK)
	bash tools/bootstrap.sh $(VENV) $(EXTRAS) $(LOCK)
	rm -f $(VENV)/.installed-*
	touch $@

train: $(STAMP)
	$(BIN)/nemo-dapo train $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 $(PYTEST_ARGS)

# Re-resolve pyproject.toml in a scratch venv and record it in tools/cpu-lock.txt (then run `make test`)
lock:
	rm -rf .venv-lock
	bash tools/bootstrap.sh .venv-lock $(LOCKED_EXTRAS)
	.venv-lock/bin/python tools/env_lock.py write
	rm -rf .venv-lock

# The CPU image (containers/README.md): the base with mmdebstrap, the image with podman (root)
image-cpu:
	bash tools/install_containers.sh
	bash containers/build_cpu_image.sh

# The image at work: the embedded default inside it, the two-node job in containers (not in `make test`)
image-test: image-cpu $(STAMP)
	bash tools/install_slurm.sh
	$(BIN)/python -m pytest -p no:cacheprovider tests/image_runs.py $(PYTEST_ARGS)
