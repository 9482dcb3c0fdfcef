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

.PHONY: setup protos run test lint clean

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt requirements-test.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if [ -n "$(TORCH_SPEC)" ]; then $(PY) -m pip install -q "$(TORCH_SPEC)"; fi
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q -r requirements-test.txt
	$(PY) -m pip install -q --no-deps "$(QWEN_TTS_REF)"
	touch $@

protos: setup
	$(PY) -c "from qtts import pb; pb.generate(force=True)"

run: setup protos
	$(PY) -m services.launcher

test: setup protos
	$(PY) -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing the suite"; exit 1; fi; exit $$rc

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf qtts/_gen .pytest_cache
