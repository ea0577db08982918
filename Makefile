PY := .venv/bin/python
NPROC ?= 2

.PHONY: install train test lint

# Idempotent: the stamp is rebuilt only when the project's metadata changes.
install: .venv/.installed

.venv/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

train: install
	.venv/bin/torchrun --standalone --nproc-per-node=$(NPROC) train.py mode=zero

test: install
	$(PY) -m pytest -q -n 2 --dist loadfile

lint: install
	.venv/bin/ruff check . && .venv/bin/ruff format --check .
