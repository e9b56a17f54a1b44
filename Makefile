# `make test` and `make demo` work from a fresh clone: they create (or reuse) a virtual
# environment in $(VENV), install the CPU build of torch that lies on disk, then the package.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.klpenalty-installed
INTEGRATIONS_STAMP := $(VENV)/.klpenalty-integrations-installed
# verl's and OpenRLHF's source, installed without dependencies (importing either needs Ray,
# DeepSpeed, ...): tests/integrations/test_stack_sources.py reads their KL functions from it
STACK_SOURCES ?= verl==0.9.1 openrlhf==0.11.2
# the wrappers a user trains under (tests/integrations/test_trl_torchrun.py): PEFT, and DeepSpeed
# built against the torch that is there (--no-build-isolation; DS_ACCELERATOR=cpu runs it on CPU)
PEFT_SPEC ?= peft==0.21.2
DEEPSPEED_SPEC ?= deepspeed==0.19.8
# `make test` runs pytest in this many processes (pytest-xdist; one torch thread per core each)
TEST_JOBS ?= 2
# the Triton of the GPU machine's image, and a NumPy its interpreter runs under (3.6's
# interpreter fails under NumPy 2.4), in a folder of their own that shadows the venv's on
# PYTHONPATH: `make test-triton-3.6` runs the Triton tests against the Triton a GPU run uses
TRITON_DEVICE_SPEC ?= triton==3.6.0
TRITON_DEVICE_NUMPY ?= numpy<2.4
TRITON_DEVICE := $(VENV)/triton-3.6
TRITON_DEVICE_STAMP := $(TRITON_DEVICE)/.installed
# the kernels' tests, interpreted and compiled for sm_90, and the +inf rule's Triton cases; not
# the `slow` ones (torch.compile, the PTX of every specialisation: `make test` runs those) nor
# the float64 ones (they run the streaming ops)
TRITON_TESTS ?= -m "not slow" -k "triton and not float64" tests/ops/test_triton.py tests/ops/test_triton_compiled.py \
	tests/ops/test_triton_divergence.py tests/ops/test_inf_rule.py

.PHONY: test install demo clean test-integrations test-triton-3.6

# the native CPU kernel compiles (klpenalty.ops.native, its first use in a process, ~40 s on 2
# cores) in the background while pip installs the rest; its log: $(VENV)/native-build.log
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)" ninja
	{ PYTHONPATH=src $(PY) -c "import klpenalty.ops.native as n; n.available()" \
		> $(VENV)/native-build.log 2>&1 & }; \
	$(PY) -m pip install --quiet -e '.[dev,demo,triton,hf]'; status=$$?; wait; exit $$status  # triton and transformers: no torch dependency, keep the CPU torch
	touch $(STAMP)

install: $(STAMP)

# the cold build of the native extension (`-m build`, ~50 s) runs in test-integrations
test: $(STAMP)
	$(PY) -m pytest -n $(TEST_JOBS) --dist loadfile -m "not build"

# the `trl` extra into the same venv; the constraint keeps the CPU torch that is there, and
# pip list checks it afterwards
$(INTEGRATIONS_STAMP): $(STAMP)
	echo "$(TORCH_SPEC)" > $(VENV)/torch-constraint.txt
	$(PY) -m pip install --quiet -c $(VENV)/torch-constraint.txt -e '.[dev,demo,triton,hf,trl]'
	$(PY) -m pip install --quiet --no-deps $(STACK_SOURCES)
	$(PY) -m pip install --quiet -c $(VENV)/torch-constraint.txt "$(PEFT_SPEC)"
	DS_ACCELERATOR=cpu $(PY) -m pip install --quiet --no-build-isolation \
		-c $(VENV)/torch-constraint.txt "$(DEEPSPEED_SPEC)"
	$(PY) -m pip list --format=freeze 2>/dev/null | grep -q '^$(TORCH_SPEC)' \
		|| { echo "torch changed: expected $(TORCH_SPEC), have:"; \
		     $(PY) -m pip list 2>/dev/null | grep -i '^torch '; exit 1; }
	touch $@

test-integrations: $(INTEGRATIONS_STAMP) test-triton-3.6
	KLPENALTY_INTEGRATIONS=1 $(PY) -m pytest tests/integrations
	$(PY) -m pytest -m build tests/ops/test_native.py

# --no-deps: Triton 3.6 needs nothing at run time that the venv lacks, and torch stays as it is
$(TRITON_DEVICE_STAMP): $(STAMP)
	rm -rf $(TRITON_DEVICE)
	$(PY) -m pip install --quiet --no-deps --target $(TRITON_DEVICE) \
		"$(TRITON_DEVICE_SPEC)" "$(TRITON_DEVICE_NUMPY)"
	touch $@

test-triton-3.6: $(TRITON_DEVICE_STAMP)
	PYTHONPATH=$(TRITON_DEVICE) $(PY) -c "import triton, numpy; \
		assert triton.__file__.startswith('$(abspath $(TRITON_DEVICE))'), triton.__file__; \
		assert triton.__version__ == '$(subst triton==,,$(TRITON_DEVICE_SPEC))', triton.__version__; \
		print('triton', triton.__version__, 'numpy', numpy.__version__)"
	PYTHONPATH=$(TRITON_DEVICE) KLPENALTY_EXPECT_TRITON=$(subst triton==,,$(TRITON_DEVICE_SPEC)) \
		$(PY) -m pytest -q -p no:cacheprovider $(TRITON_TESTS)

# `make demo DEMO_ARGS="--sweep"` (or --compare, --distill) passes options through to `klpenalty demo`
demo: $(STAMP)
	$(VENV)/bin/klpenalty demo $(DEMO_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
