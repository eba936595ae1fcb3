# Two commands do everything on a fresh machine: `make book` and `make test` (see README.md).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# This machine has no GPU: the CPU wheel of torch 2.13.0 lies on its disk. A GPU user passes a CUDA build,
# e.g. `make TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" test`.
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= book,dev
CORPUS ?= data/corpus/default
comma := ,
STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))

# `make book` runs the reference profile (shipped checkpoint); `make book RETRAIN=1` trains the cpu preset instead;
# `make book PROFILE=smoke` runs another profile of book/profiles.toml (HTML under _build/<profile>/_build/html).
PROFILE ?= reference
RETRAIN ?=

.PHONY: venv data test test-slow test-newest constraints lint book book-run book-html docs lab clean

# JupyterLab reads settings overrides from the venv: jupyter/overrides.json makes jupytext's notebook view the
# default for Python files, so book/*.py open as notebooks (a user's own settings still take precedence).
LAB_SETTINGS := $(VENV)/share/jupyter/lab/settings/overrides.d/drc-book.json

venv: $(STAMP) $(LAB_SETTINGS)

# constraints.txt pins every other package to the version the suite passed with, so a fresh `make` installs what was
# tested, not whatever is newest (pyproject.toml keeps ranges, for users who install the library into their own env)
$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@# torch first, so that the range in pyproject.toml is already met and pip pulls no CUDA build
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]" -c constraints.txt
	touch $@

$(LAB_SETTINGS): jupyter/overrides.json $(STAMP)
	install -D -m 644 $< $@

data: venv
	$(PY) -m drc_core.data prepare --out $(CORPUS)

lint: venv
	$(VENV)/bin/ruff check .

test: venv lint
	$(PY) -m pytest -m "not slow"

test-slow: venv
	$(PY) -m pytest -m slow

# The newest releases of every dependency (torch stays TORCH_SPEC) in a separate venv, on a cheap subset of the suite:
# prints which versions differ from constraints.txt, then runs the subset. CI runs it after the main tests and only
# reports (.ci/run); once the whole suite passes on newer versions, `make constraints` moves the pins forward.
NEWEST_VENV ?= runs/venv-newest
NEWEST_TESTS ?= tests/test_untrusted.py tests/test_untrusted_book.py tests/test_reliability.py tests/test_data.py \
	tests/test_rundir.py tests/test_api.py
test-newest:
	rm -rf $(NEWEST_VENV)
	$(PYTHON) -m venv $(NEWEST_VENV)
	$(NEWEST_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(NEWEST_VENV)/bin/python -m pip install --quiet $(TORCH_SPEC)
	$(NEWEST_VENV)/bin/python -m pip freeze | grep '^torch==' > $(NEWEST_VENV)/torch.txt
	$(NEWEST_VENV)/bin/python -m pip install --quiet --upgrade --upgrade-strategy eager -e ".[$(EXTRAS)]" \
	    -c $(NEWEST_VENV)/torch.txt
	@echo "newest releases that differ from constraints.txt (pinned -> newest):"
	@join -t= <(grep -v '^#' constraints.txt | sed 's/==/=/' | sort -t= -k1,1) \
	    <($(NEWEST_VENV)/bin/python -m pip freeze --exclude-editable | sed 's/==/=/' | sort -t= -k1,1) \
	    | awk -F= '$$2 != $$3 {print "  " $$1 " " $$2 " -> " $$3; n++} END {if (!n) print "  none"}'
	$(NEWEST_VENV)/bin/python -m pytest -q -m "not slow" -p no:cacheprovider $(NEWEST_TESTS)

# Rewrite constraints.txt from the venv (after the whole suite passed in it): every package but the project and torch.
constraints: venv
	{ sed -n '/^#/p' constraints.txt; $(PY) -m pip freeze --exclude-editable | grep -v '^torch=='; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

book: book-run book-html

book-run: data
	$(PY) -m drc_book run --profile $(PROFILE) $(if $(RETRAIN),--set retrain=true)

book-html: venv
	$(PY) -m drc_book build --profile $(PROFILE)

# the README's headline block and the generated tables of docs/*.md, from papermill_runs/reference/results
docs: venv
	$(PY) scripts/readme_tables.py --write

# JupyterLab from the venv on 127.0.0.1, at the repository root (book/*.py open as notebooks); extra options go in
# LAB_ARGS, e.g. `make lab LAB_ARGS="--port 8890 --no-browser"`. As root (containers) it needs --allow-root.
LAB_ARGS ?=
lab: venv
	$(VENV)/bin/jupyter lab --ServerApp.ip=127.0.0.1 --ServerApp.root_dir="$(CURDIR)" \
	    $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS)

clean:
	rm -rf _build _static .pytest_cache .ruff_cache
