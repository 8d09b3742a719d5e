# Two commands set everything up: `make run` and `make test`. Both create .venv and install on first use;
# the stamp file (keyed on pyproject.toml and requirements.lock) makes a second run skip the install.
# With the default EXTRAS the install is exactly requirements.lock (versions and wheel hashes); `make lock`
# refreshes it after a change of pyproject.toml (the install stops, naming it, while the two are out of step).
# Other EXTRAS (gpu) install from pyproject.toml's ranges.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml requirements.lock 2>/dev/null | cksum | cut -d' ' -f1)
LOCKED_EXTRAS := cpu,test,bench
EXTRAS ?= $(LOCKED_EXTRAS)
# uv installs the lock (downloads and unpacks in parallel, checking the same hashes); pinned with its hash in
# deploy/uv.lock, pip puts it in $(UV_DIR), outside site-packages, so the environment holds the lock alone. Should
# uv fail, pip installs the same lock (slower: one wheel at a time, every module byte-compiled).
UV_DIR := $(VENV)/uv
UV := $(UV_DIR)/bin/uv
# pip's indexes and wheel folders, every index searched for each version as pip does (the hashes pin the files).
UV_INDEX = --index-strategy unsafe-best-match $$($(PY) deploy/lock.py uv-index)
# The CUDA-only wheels vLLM drags in; they break imports on CPU machines, so a CPU install removes them.
CUDA_ONLY := torchvision torchaudio torchcodec
export RAY_AUTH_MODE ?= disabled
export VLLM_CPU_OMP_THREADS_BIND ?= nobind
export VLLM_CPU_KVCACHE_SPACE ?= 1
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_OFFLINE ?= 1
export RAY_USAGE_STATS_ENABLED ?= 0

# Debian packages, each as package:binary, installed when missing. `make run` needs a C++ compiler (the W1 recipes
# compile the learner's layers with torch.compile, `learner.compile`); `make test` also starts a headless browser
# (dashboard test), a Prometheus server and bubblewrap (the tool sandbox's namespaces, docs/tools.md).
RUN_PACKAGES ?= g++:g++
SYSTEM_PACKAGES ?= $(RUN_PACKAGES) chromium:chromium prometheus:prometheus bubblewrap:bwrap

.PHONY: install lock run lint test test-fast test-gpu gpu-wheels bench bench-quick clean system-deps run-deps

$(STAMP): pyproject.toml requirements.lock
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
ifeq ($(EXTRAS),$(LOCKED_EXTRAS))
	$(PY) deploy/lock.py check --extras $(EXTRAS)
	$(PY) -m pip install -q --require-hashes --no-deps --upgrade --target $(UV_DIR) -r deploy/uv.lock
	$(UV) pip install -q --python $(PY) $(UV_INDEX) --require-hashes --no-deps --compile-bytecode -r requirements.lock \
	  || { echo "uv could not install requirements.lock (above): pip installs it"; \
	       $(PY) -m pip install -q --require-hashes --no-deps -r requirements.lock; }
	$(UV) pip install -q --python $(PY) $(UV_INDEX) --no-deps -e .
else
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	@if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip uninstall -q -y $(CUDA_ONLY) 2>/dev/null || true; fi
endif
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)

install: $(STAMP)

# Rewrites requirements.lock from pyproject.toml, keeping the versions it pins where the ranges allow
# (deploy/lock.py; needs pip >= 25.1 in the venv, which the lock's install brings).
lock: $(VENV)/bin/python
	$(PY) -m pip install -q 'pip>=25.1'
	$(PY) deploy/lock.py write --extras $(LOCKED_EXTRAS) --drop $(shell echo $(CUDA_ONLY) | tr ' ' ,)

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

run: $(STAMP) run-deps
	$(VENV)/bin/asyncrl run $(CONFIG) $(ARGS)

# Installs the missing packages of $(1) with apt-get (as root, or through sudo); fails naming them otherwise.
define install_missing
	@missing=""; for pb in $(1); do command -v $${pb#*:} >/dev/null 2>&1 || missing="$$missing $${pb%%:*}"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then as=""; elif command -v sudo >/dev/null 2>&1; then as="sudo"; \
	else echo "make $@ needs the Debian package(s)$$missing: install them as root (apt-get install$$missing)"; exit 1; fi; \
	echo "installing$$missing (apt-get)"; \
	$$as apt-get install -y -q --no-install-recommends $$missing >/dev/null || { $$as apt-get update -q >/dev/null && $$as apt-get install -y -q --no-install-recommends $$missing >/dev/null; }; \
	for pb in $(1); do command -v $${pb#*:} >/dev/null 2>&1 || { echo "$@: $${pb%%:*} did not install $${pb#*:}"; exit 1; }; done
endef

system-deps:
	$(call install_missing,$(SYSTEM_PACKAGES))

run-deps:
	$(call install_missing,$(RUN_PACKAGES))

# Test files run TEST_WORKERS at a time (pytest-xdist), each file whole on one worker: its tests share the file's
# Ray session, engines and clusters (module fixtures). Files go out in collection order, so the long e2e, fault and
# integration files start first and the unit files fill the end. An engine's start-up is mostly imports on one core,
# so one file at a time leaves ~40% of a 2-core machine idle. TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2

# The linter (ruff: lint and format check) and the type checker (mypy) on the package; configured in pyproject.toml.
lint: $(STAMP)
	$(VENV)/bin/ruff check asyncrl
	$(VENV)/bin/ruff format --check asyncrl
	$(VENV)/bin/mypy

test: $(STAMP) system-deps lint
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30 -m 'not bench_quick' tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

test-fast: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests/unit -x; rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

# On a machine with a CUDA GPU (install with EXTRAS=gpu,test,bench): the learner step and the NCCL weight wire
# on the GPU (tests/gpu; `make test` collects them too and skips them without a GPU).
test-gpu: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -rs tests/gpu

# The megatron-core wheel `deploy/gpu_check.sh` installs on a GPU machine without it (and without a network).
gpu-wheels:
	$(PY) -m pip download megatron-core==0.16.1 --no-deps -d .wheels

BENCH_SCRIPTS := algo_throughput queue_throughput weight_sync async_speedup limits learning_add agent_tool logprob_layout engine_start model_scale

bench: $(STAMP)
	@for b in $(BENCH_SCRIPTS); do test -f benchmarks/$$b.py && $(PY) benchmarks/$$b.py || exit 1; done
	$(PY) benchmarks/soak.py  # 20 minutes of faults; not in bench-quick nor in test
	$(PY) benchmarks/report.py > benchmarks/RESULTS.md  # results/*.json and notes/*.md (benchmarks/README.md)

bench-quick: $(STAMP)
	@for b in $(BENCH_SCRIPTS); do test -f benchmarks/$$b.py && $(PY) benchmarks/$$b.py --quick || exit 1; done
	$(PY) -m pytest -q -p no:cacheprovider tests/e2e/test_benchmarks_quick.py  # with the checks, bench_quick too

clean:
	rm -rf $(VENV) runs .pytest_cache
