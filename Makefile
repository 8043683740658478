# Two commands on a fresh machine with Python 3.11 and make:  `make train`  and  `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: train test test-fast lab grade book lint clean-venv

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: $(PYTHON) not found; set PYTHON=/path/to/python3.11"; exit 1; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev,bench]"
	@touch $(STAMP)

# A demo: --overwrite replaces the previous `make train` run in runs/tiny, so it can be run again and again.
train: $(STAMP)
	$(PY) -m minidist.train --config configs/default.toml --overwrite

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest tests
	$(PY) -m pytest --nbval-lax notebooks

test-fast: $(STAMP)
	$(PY) -m pytest tests -x -q

# Grade your own exercise answers for one chapter:  make grade CH=00
grade: $(STAMP)
	@test -n "$(CH)" || { echo "usage: make grade CH=00"; exit 2; }
	$(PY) -m pytest tests/exercises -q -k "ch$(CH)" --impl exercises

# Execute every notebook and render it with its outputs and figures to HTML: open book/index.html.
book: $(STAMP)
	$(PY) tools/build_book.py --out book

lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks

lint: $(STAMP)
	$(PY) -m ruff check .

clean-venv:
	rm -rf $(VENV)
