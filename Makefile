# specdec: two commands a newcomer needs.
#   make demo   train an EAGLE-3 head on the embedded SmolLM2-135M and benchmark it
#   make test   run the test suite
# Both create .venv and install everything on first use.

PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
TORCH   ?= torch==2.13.0
export SPECDEC_CACHE ?= $(CURDIR)/.cache/specdec
export WANDB_MODE ?= offline
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/.cache/inductor
export DS_ACCELERATOR ?= $(shell $(PY) -c "import shutil;print('cuda' if shutil.which('nvidia-smi') else 'cpu')")

.PHONY: venv install test test-formats demo gpu-check clean help

help:
	@echo "make demo          - the main job: fetch SmolLM2-135M, self-distil data, train EAGLE-3, benchmark"
	@echo "make test          - the test suite (CPU, ~10 min)"
	@echo "make test-formats  - opt-in: load our exports with the 'speculators' package (own venv)"
	@echo "make gpu-check     - on a CUDA machine: Triton kernels vs reference + step timings"
	@echo "make install       - only create .venv and install specdec into it (the others do it first)"
	@echo "make clean         - remove .venv and the build files (keeps .cache: the converted model, kernels; rm -rf .cache for those)"

# A torch that already imports (say the user's CUDA build) is kept: the venv then sees it.
$(BIN)/python:
	@if $(PY) -c "import torch" 2>/dev/null; then \
	  echo "keeping the torch already installed for $(PY)"; $(PY) -m venv --system-site-packages $(VENV); \
	else $(PY) -m venv $(VENV) && $(BIN)/pip install -q $(TORCH); fi

$(VENV)/.installed: $(BIN)/python pyproject.toml setup.py
	$(BIN)/pip install -q -e ".[test]"
	@touch $@

venv install: $(VENV)/.installed

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q tests

test-formats: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m formats tests --run-formats

demo: $(VENV)/.installed
	$(BIN)/specdec-train recipes/smollm2-135m/eagle3.yaml
	$(BIN)/specdec-bench --target smollm2-135m --methods plain,eagle3=runs/smollm2-135m/eagle3/final --limit 16 --max-new-tokens 128 --dtype auto --overwrite --out runs/bench-demo

gpu-check: $(VENV)/.installed
	$(BIN)/python -m specdec.infer.gpu_check

clean:
	rm -rf $(VENV) build *.egg-info
