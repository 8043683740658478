# Two commands on a fresh machine with Python 3.11 and make:  `make train`  and  `make test`.
# On a GPU node whose Python already has a CUDA torch (>= pyproject.toml's floor):  make train PYTHON=python
# keeps that torch: the venv sees the node's packages and pip is held to the installed torch by a constraint.
# Otherwise (the course machines, CI) a fresh venv gets the CPU wheel below.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CONSTRAINT := $(VENV)/torch-constraint.txt
KERNELS := $(VENV)/.installed-kernels

.PHONY: train test test-fast lab grade book lint clean-venv

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: $(PYTHON) not found; set PYTHON=/path/to/python3.11"; exit 1; }
	@node_torch=$$($(PYTHON) scripts/node_torch.py); \
	if [ -n "$$node_torch" ]; then \
		echo "keeping $(PYTHON)'s torch $$node_torch (venv with --system-site-packages, pip held to it)"; \
		test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV); \
		echo "torch==$$node_torch" > $(CONSTRAINT); \
	else \
		test -x $(PY) || $(PYTHON) -m venv $(VENV); \
		: > $(CONSTRAINT); \
	fi
	$(PY) -m pip install --quiet --upgrade pip
	@test -s $(CONSTRAINT) || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev,bench]" -c $(CONSTRAINT)
	@touch $(STAMP)

# Triton (~1 GB) for chapter 19's kernels: the tests and the notebooks need it, `make train` does not.
$(KERNELS): $(STAMP)
	$(PY) -m pip install --quiet -e ".[kernels]" -c $(CONSTRAINT)
	@touch $(KERNELS)

# A demo: --overwrite replaces the previous `make train` run in runs/tiny, so it can be run again and again.
train: $(STAMP)
	$(PY) -m minidist.train --config configs/default.toml --overwrite

test: $(KERNELS)
	$(PY) -m ruff check .
	$(PY) -m pytest tests
	$(PY) -m pytest --nbval-lax notebooks

test-fast: $(KERNELS)
	$(PY) -m pytest tests -x -q

# Grade your own exercise answers for one chapter:  make grade CH=00
# (CH=5 is taken as 05)
grade: $(KERNELS)
	@test -n "$(CH)" || { echo "usage: make grade CH=00"; exit 2; }
	$(PY) -m pytest tests/exercises -q -k "ch$(shell echo '$(CH)' | sed 's/^[0-9]$$/0&/')" --impl exercises

# Execute every notebook and render it with its outputs and figures to HTML: open book/index.html.
book: $(KERNELS)
	$(PY) tools/build_book.py --out book

# As root (a container), JupyterLab needs --allow-root.
lab: $(KERNELS)
	$(VENV)/bin/jupyter lab notebooks $$([ "$$(id -u)" = 0 ] && echo --allow-root)

lint: $(STAMP)
	$(PY) -m ruff check .

clean-venv:
	rm -rf $(VENV)
