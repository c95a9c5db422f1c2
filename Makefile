# Two entry points do all set-up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint venv clean

venv: $(STAMP)

# Re-install whenever pyproject.toml changes. torch==2.13.0 resolves to the CPU wheel on local disk.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m gyre.demo

test: $(STAMP)
	$(BIN)/ruff check gyre tests benchmarks agents tasks
	$(BIN)/python -m pytest; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 1; fi; exit $$rc

lint: $(STAMP)
	$(BIN)/ruff check gyre tests benchmarks agents tasks scripts

clean:
	rm -rf $(VENV) build *.egg-info
