# Two commands on a fresh machine:  `make demo`  and  `make test`.
# Each creates .venv on first use and installs what it needs; later runs reuse it.
# TORCH_SPEC pins the CPU build that CI uses; GPU users: make TORCH_SPEC=torch  (or install torch themselves).

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
ARGS ?=

.PHONY: demo test test-slow bench clean-venv

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"

$(VENV)/.base: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q -e ".[plot]"
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(BIN)/python -m pip install -q -e ".[test,plot]"
	touch $@

demo: $(VENV)/.base
	$(BIN)/longstraw demo $(ARGS)

# the fast suite (the developer's loop); --dist loadgroup keeps each context-parallel job's tests on one worker
test: $(VENV)/.test
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --timeout 900 $(ARGS)

# subprocess and end-to-end checks (context-parallel launches, CLI runs, measured memory); CI runs both
test-slow: $(VENV)/.test
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup -m slow --timeout 1800 $(ARGS)

clean-venv:
	rm -rf $(VENV)
