# Two commands for a fresh machine: `make demo` and `make test`. Both create .venv
# when missing and install the project; torch's CPU wheel goes in first where no
# torch is installed, because a plain `torch` requirement pulls a multi-GB CUDA build.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
# The demo installs the package alone; the tests add the dev extra (linters and the
# frameworks the integrations are tested against), which the demo does not need.
STAMP   := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
TORCH_CPU := torch==2.13.0

# `make paper`: every built-in family's default sweep, analysed and compared (README, "The
# headline comparison"). Resumable: run it again to finish what is missing.
PAPER_DIR ?= runs/paper
PAPER_ARGS ?=
# `make laws`: a family of fixed-budget linreg sweeps at four data budgets D, then the laws
# across them (docs/laws.md) with the largest budget held out and predicted. Resumable.
LAWS_DIR ?= runs/laws
LAWS_BUDGETS ?= 1024 2048 4096 8192
LAWS_PREDICT ?= N=17,D=65536
LAWS_TOLERANCE ?= 0.03

.PHONY: install demo test test-fast lint bench paper laws slurm-up slurm-down clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q $(TORCH_CPU)
	$(BIN)/pip install -q -e .
	@touch $(STAMP)

$(DEV_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[dev]'
	@touch $(DEV_STAMP)

install: $(DEV_STAMP)

demo: $(STAMP)
	$(BIN)/gnsweep launch --sweep-dir runs/demo
	$(BIN)/gnsweep analyze runs/demo
	$(BIN)/gnsweep plot runs/demo
	$(BIN)/gnsweep report runs/demo
	@echo "Done. Tables: runs/demo/*.parquet  Figures: runs/demo/figures/"
	@echo "Report (one file, figures inside; open it in a browser): file://$(CURDIR)/runs/demo/report.html"

# Three pytest workers on two cores: much of the suite's time waits on processes (torchrun's
# start, Slurm's requeue, a script's run), so a third worker runs meanwhile; the Slurm tests
# share one worker (one node, one port).
test: $(DEV_STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy gnsweep
	$(BIN)/pytest -q -n 3 --dist loadgroup

test-fast: $(DEV_STAMP)
	$(BIN)/pytest -q -m "not slow and not distributed and not slurm and not browser and not process"

lint: $(DEV_STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy gnsweep

paper: $(STAMP)
	$(BIN)/python scripts/paper.py --paper-dir $(PAPER_DIR) $(PAPER_ARGS)
	@echo "Table: $(PAPER_DIR)/compare/compare.parquet  Figure: $(PAPER_DIR)/compare/bcrit_vs_noise_scale.png"

laws: $(STAMP)
	for d in $(LAWS_BUDGETS); do \
	  $(BIN)/gnsweep launch task=linreg sweep=laws sweep.budget=$$d \
	    --sweep-dir $(LAWS_DIR)/d$$d -q || exit $$?; \
	done
	$(BIN)/gnsweep laws $(addprefix $(LAWS_DIR)/d,$(LAWS_BUDGETS)) --out $(LAWS_DIR)/laws \
	  --predict $(LAWS_PREDICT) --tolerance $(LAWS_TOLERANCE)
	@echo "Laws: $(LAWS_DIR)/laws/laws.json  Figures: $(LAWS_DIR)/laws/laws_fits.png"

bench: $(DEV_STAMP)
	$(BIN)/python -m gnsweep.bench

slurm-up:
	bash scripts/slurm-up.sh

slurm-down:
	bash scripts/slurm-down.sh

clean:
	rm -rf $(VENV) runs/demo
