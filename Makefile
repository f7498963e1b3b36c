# `make train` runs the embedded default (tiny CPU DAPO); `make test` runs the test suite.
# Both create .venv on first use (python3.11) and refresh it when pyproject.toml changes.
VENV ?= .venv
EXTRAS ?= test,rollout,cluster,megatron,launch,gguf
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)-$(EXTRAS)
PYTEST_ARGS ?=
ARGS ?=

.PHONY: venv train test selfcheck
venv: $(STAMP)

$(STAMP): pyproject.toml tools/bootstrap.sh
	bash tools/bootstrap.sh $(VENV) $(EXTRAS)
	rm -f $(VENV)/.installed-*
	touch $@

train: $(STAMP)
	$(BIN)/nemo-dapo train $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)
