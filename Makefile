# Qwen3-TTS streaming serving stack.
#   make run   - set up what is missing, start the whole stack locally, print where it listens
#   make test  - set up what is missing and run the whole test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel of torch 2.13.0 lies on this machine's disk; on a GPU host set TORCH_SPEC to the
# CUDA build you want (or to "" to keep an installed one).
TORCH_SPEC ?= torch==2.13.0
QWEN_TTS_REF ?= qwen-tts==0.1.1
PYTEST_ARGS ?=

.PHONY: setup protos run test lint clean lock checkov-env

setup: $(VENV)/.installed

# requirements.lock pins every package these pull in (make lock writes it from the venv).
REQUIREMENTS := $(wildcard requirements*.txt) requirements.lock
LOCK := -c requirements.lock

$(VENV)/.installed: $(REQUIREMENTS) Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if [ -n "$(TORCH_SPEC)" ]; then $(PY) -m pip install -q "$(TORCH_SPEC)"; fi
	$(PY) -m pip install -q $(LOCK) -r requirements.txt -r requirements-bench.txt
	$(PY) -m pip install -q $(LOCK) -r requirements-test.txt -r requirements-deploy.txt
	$(PY) -m pip install -q --no-deps "$(QWEN_TTS_REF)"
	touch $@

# Rewrite requirements.lock from the venv (after changing a requirements*.txt and `make setup`).
# torch and triton are left out: which build is right depends on the host (TORCH_SPEC).
lock: setup
	{ echo "# Every package of a full checkout venv, pinned (pip constraints: pip install -c requirements.lock)."; \
	  echo "# Written by make lock from pip freeze; torch and triton come from the build's own index."; \
	  $(PY) -m pip freeze --exclude-editable --exclude torch --exclude triton --exclude qwen3-tts-serving; \
	} > requirements.lock

protos: setup
	$(PY) -c "from qtts import pb; pb.generate(force=True)"

run: setup protos
	$(PY) -m services.launcher

test: setup protos
	$(PY) -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing the suite"; exit 1; fi; exit $$rc

# checkov (tests/deploy/test_checkov.py; .ci/run sets it up) pins packages that clash with the
# main venv's, so it gets a venv of its own; requirements-checkov.lock pins all of it.
CHECKOV_VENV ?= .venv-checkov

checkov-env: $(CHECKOV_VENV)/.installed

$(CHECKOV_VENV)/.installed: requirements-checkov.lock
	test -x $(CHECKOV_VENV)/bin/python || $(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/python -m pip install -q -r requirements-checkov.lock
	touch $@

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf qtts/_gen .pytest_cache
