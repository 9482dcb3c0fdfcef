# Qwen3-TTS streaming serving stack.
#   make run   - install what running needs (if missing), start the whole stack locally, print where
#                it listens
#   make test  - install that plus the test, benchmark and deployment-test packages, checkov's venv
#                and the system packages the suite needs (if missing) and run the whole test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel of torch 2.13.0 lies on this machine's disk; on a GPU host set TORCH_SPEC to the
# CUDA build you want (or to "" to keep an installed one).
TORCH_SPEC ?= torch==2.13.0
QWEN_TTS_REF ?= qwen-tts==0.1.1
# make test runs the suite on one pytest-xdist worker per core; tests/conftest.py keeps each module
# (and every module of the end-to-end session stack) on one worker. PYTEST_WORKERS=0 runs it in
# this process; PYTEST_ARGS adds to (or narrows) the run: make test PYTEST_ARGS="tests/e2e -x".
PYTEST_WORKERS ?= auto
# The forced aligner's reference (tests/qtts/model/aligner); --no-deps as qwen-tts, for the same reasons.
QWEN_ASR_REF ?= qwen-asr==0.0.6
PYTEST_ARGS ?=

.PHONY: setup setup-test protos run test lint clean lock checkov-env system-deps

# setup: what `make run` needs (requirements.txt: every service's runtime, grpcio-tools for the
# stubs, torch); setup-test adds requirements-{bench,test,deploy}.txt and the references qwen-tts and qwen-asr.
setup: $(VENV)/.installed-run
setup-test: $(VENV)/.installed

# requirements.lock pins every package these pull in (make lock writes it from the venv).
LOCK := -c requirements.lock
RUN_REQUIREMENTS := requirements.txt requirements-cpu.txt requirements-gpu.txt requirements-tracing.txt \
	requirements-torch.txt
TEST_REQUIREMENTS := requirements-bench.txt requirements-test.txt requirements-deploy.txt

$(VENV)/.installed-run: $(RUN_REQUIREMENTS) requirements.lock Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if [ -n "$(TORCH_SPEC)" ]; then $(PY) -m pip install -q "$(TORCH_SPEC)"; fi
	$(PY) -m pip install -q $(LOCK) -r requirements.txt
	touch $@

$(VENV)/.installed: $(VENV)/.installed-run $(TEST_REQUIREMENTS)
	$(PY) -m pip install -q $(LOCK) -r requirements-bench.txt -r requirements-test.txt -r requirements-deploy.txt
	$(PY) -m pip install -q --no-deps "$(QWEN_TTS_REF)"
	$(PY) -m pip install -q --no-deps "$(QWEN_ASR_REF)"
	touch $@

# Rewrite requirements.lock from the venv (after changing a requirements*.txt and `make setup-test`).
# torch and triton are left out: which build is right depends on the host (TORCH_SPEC).
lock: setup-test
	{ echo "# Every package of a full checkout venv, pinned (pip constraints: pip install -c requirements.lock)."; \
	  echo "# Written by make lock from pip freeze; torch and triton come from the build's own index."; \
	  echo "# setuptools is in it (torch needs it at run time; it also pins the wheel's build); pip is not."; \
	  $(PY) -m pip freeze --all --exclude pip --exclude-editable --exclude torch --exclude triton --exclude qwen3-tts-serving; \
	} > requirements.lock

protos: setup
	$(PY) -c "from qtts import pb; pb.generate(force=True)"

run: setup protos
	$(PY) -m services.launcher

# The suite starts with the lint gate: ruff's checks and its formatter (no file left to reformat).
test: system-deps setup-test checkov-env protos lint
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing the suite"; exit 1; fi; exit $$rc

# checkov (tests/deploy/test_checkov.py; make test sets it up) pins packages that clash with the
# main venv's, so it gets a venv of its own; requirements-checkov.lock pins all of it.
CHECKOV_VENV ?= .venv-checkov

checkov-env: $(CHECKOV_VENV)/.installed

$(CHECKOV_VENV)/.installed: requirements-checkov.lock
	test -x $(CHECKOV_VENV)/bin/python || $(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/python -m pip install -q -r requirements-checkov.lock
	touch $@

# system-deps: redis-server and Chromium, which the suite needs from the system: apt-installed when
# missing and run as root; otherwise it stops at once, printing the command that installs them.
system-deps:
	@bash .ci/system-deps

lint: setup-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf qtts/_gen .pytest_cache
