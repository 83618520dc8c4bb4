# Two commands for a fresh machine: `make demo` and `make test`. Both create .venv
# when missing and install the project; torch's CPU wheel goes in first where no
# torch is installed, because a plain `torch` requirement pulls a multi-GB CUDA build.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TORCH_CPU := torch==2.13.0

.PHONY: install demo test test-fast lint bench slurm-up slurm-down clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q $(TORCH_CPU)
	$(BIN)/pip install -q -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/gnsweep launch --sweep-dir runs/demo
	$(BIN)/gnsweep analyze runs/demo
	$(BIN)/gnsweep plot runs/demo
	$(BIN)/gnsweep report runs/demo
	@echo "Done. Tables: runs/demo/*.parquet  Figures: runs/demo/figures/"
	@echo "Report (one file, figures inside; open it in a browser): file://$(CURDIR)/runs/demo/report.html"

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy gnsweep
	$(BIN)/pytest -q

test-fast: $(STAMP)
	$(BIN)/pytest -q -m "not slow and not distributed and not slurm and not browser"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy gnsweep

bench: $(STAMP)
	$(BIN)/python -m gnsweep.bench

slurm-up:
	bash scripts/slurm-up.sh

slurm-down:
	bash scripts/slurm-down.sh

clean:
	rm -rf $(VENV) runs/demo
