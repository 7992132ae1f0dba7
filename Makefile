# Two commands on a fresh machine:  `make demo`  and  `make test`.
# Each creates .venv on first use and installs what it needs; later runs reuse it.
# TORCH_SPEC pins the CPU build that CI uses; GPU users: make TORCH_SPEC=torch  (or install torch themselves).
# Each install step says what it does; pip shows its own progress for the large download (torch; progress bars on a
# terminal) and stays quiet otherwise (errors still print). PIP_FLAGS=-q quiets torch too; PIP_FLAGS=-v shows more.

PYTHON ?= python3
VENV ?= .venv
# fla's Triton kernels under Triton's CPU interpreter get a venv of their own: with fla and triton importable,
# transformers (in .venv, the parity tests' reference) would pick fla's kernels for its own CPU forward and crash
VENV_FLA ?= .venv-fla
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
ARGS ?=
PIP_FLAGS ?=
PIP := $(BIN)/python -m pip install --disable-pip-version-check $(PIP_FLAGS)

.PHONY: demo test test-slow test-fla bench clean-venv gpu-wheels

$(BIN)/python:
	@echo "==> creating $(VENV) with $(PYTHON) and upgrading pip"
	$(PYTHON) -m venv $(VENV)
	@$(PIP) -q --upgrade pip
	@echo "==> installing $(TORCH_SPEC) (the largest download: minutes on a slow link)"
	$(PIP) "$(TORCH_SPEC)"

$(VENV)/.base: $(BIN)/python pyproject.toml
	@echo "==> installing longstraw (editable) with safetensors, numpy, tqdm, matplotlib"
	$(PIP) -q -e ".[plot]"
	@touch $@

$(VENV)/.test: $(VENV)/.base
	@echo "==> installing the test extras: transformers, pytest, pytest-xdist, pytest-timeout, pyarrow, wandb, peft, trl"
	$(PIP) -q -e ".[test,plot]"
	@touch $@
	@echo "==> $(VENV) is ready; running the tests"

demo: $(VENV)/.base
	$(BIN)/longstraw demo $(ARGS)

# the fast suite (the developer's loop); --dist loadgroup keeps each context-parallel job's tests on one worker
test: $(VENV)/.test
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --timeout 900 $(ARGS)

# subprocess and end-to-end checks (context-parallel launches, CLI runs, measured memory); CI runs both
test-slow: $(VENV)/.test
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup -m slow --timeout 1800 $(ARGS)

# fla's forward and backward kernels (the GPU path of the DeltaNet layers) run under Triton's CPU interpreter against
# the torch rule and a float64 GRPO step (tests/fla_interpret.py says how and what it cannot show); CI runs it too
$(VENV_FLA)/.ready: pyproject.toml
	@echo "==> creating $(VENV_FLA) with $(TORCH_SPEC), fla-core and triton (fla's kernels under Triton's CPU interpreter)"
	$(PYTHON) -m venv $(VENV_FLA)
	@$(VENV_FLA)/bin/python -m pip install --disable-pip-version-check -q --upgrade pip
	$(VENV_FLA)/bin/python -m pip install --disable-pip-version-check $(PIP_FLAGS) "$(TORCH_SPEC)"
	$(VENV_FLA)/bin/python -m pip install --disable-pip-version-check $(PIP_FLAGS) -q -e ".[fla-cpu]"
	@touch $@

test-fla: $(VENV_FLA)/.ready
	TRITON_INTERPRET=1 $(VENV_FLA)/bin/python -m pytest -q -m fla --timeout 900 tests/ops/test_fla_rule.py \
		tests/engine/test_fla_grpo.py $(ARGS)

# the packages a lent GPU machine lacks (it has torch and Triton, no registry), as wheels for its Python 3.12 in
# .whl/ (ignored by git), which the device tool carries: benchmarks/gpu_session.sh installs and runs them
GPU_WHEELS ?= fla-core==0.6.0 transformers==5.23.0
gpu-wheels:
	$(PYTHON) -m pip download --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)

clean-venv:
	rm -rf $(VENV) $(VENV_FLA)
