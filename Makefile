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
# `make laws-lm`: the same for the character-level LM (Adam) on the CPU: widths x token budgets,
# each a fixed-budget sweep (conf/sweep/laws_lm.yaml), then the laws with the largest cell held
# out and a prediction at the next width and budget. Resumable.
LAWS_LM_DIR ?= runs/laws-lm
LAWS_LM_WIDTHS ?= 16 32
LAWS_LM_BUDGETS ?= 16384 32768 65536
LAWS_LM_PREDICT ?= N=1e5,D=131072
LAWS_LM_TOLERANCE ?= 0.005
LAWS_LM_ARGS ?=

.PHONY: install demo test test-fast lint bench paper laws laws-lm slurm-up slurm-down clean

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
# share one worker (one node, one port). mypy (about 50 s of one core from a cold cache, as in
# a clean clone) runs beside them for the same reason; its report follows the tests', and
# either failing fails the target.
test: $(DEV_STAMP)
	$(BIN)/ruff check .
	@log=$$(mktemp); $(BIN)/mypy gnsweep > $$log 2>&1 & types=$$!; \
	$(BIN)/pytest -q -n 3 --dist loadgroup; tests=$$?; \
	wait $$types; typed=$$?; echo "mypy gnsweep:"; cat $$log; rm -f $$log; \
	exit $$(( tests || typed ))

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

laws-lm: $(STAMP)
	for w in $(LAWS_LM_WIDTHS); do for d in $(LAWS_LM_BUDGETS); do \
	  $(BIN)/gnsweep launch task=chars sweep=laws_lm task.width=$$w sweep.budget=$$d \
	    $(LAWS_LM_ARGS) --sweep-dir $(LAWS_LM_DIR)/w$$w-d$$d -q || exit $$?; \
	done; done
	$(BIN)/gnsweep laws $(foreach w,$(LAWS_LM_WIDTHS),$(foreach d,$(LAWS_LM_BUDGETS),\
	  $(LAWS_LM_DIR)/w$(w)-d$(d))) --out $(LAWS_LM_DIR)/laws \
	  --predict $(LAWS_LM_PREDICT) --tolerance $(LAWS_LM_TOLERANCE)
	@echo "Laws: $(LAWS_LM_DIR)/laws/laws.json  Figures: $(LAWS_LM_DIR)/laws/laws_fits.png"

bench: $(DEV_STAMP)
	$(BIN)/python -m gnsweep.bench

slurm-up:
	bash scripts/slurm-up.sh

slurm-down:
	bash scripts/slurm-down.sh

clean:
	rm -rf $(VENV) runs/demo
