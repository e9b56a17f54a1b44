# `make test` and `make demo` work from a fresh clone: they create (or reuse) a virtual
# environment in $(VENV), install the CPU build of torch that lies on disk, then the package.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.klpenalty-installed

.PHONY: test install demo clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e '.[dev,demo,triton,hf]'  # triton and transformers: no torch dependency, keep the CPU torch
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest

# `make demo DEMO_ARGS="--sweep"` passes options through to `klpenalty demo`
demo: $(STAMP)
	$(VENV)/bin/klpenalty demo $(DEMO_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
