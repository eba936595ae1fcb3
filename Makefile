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

.PHONY: venv data test test-slow lint book book-run book-html clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@# torch first, so that the range in pyproject.toml is already met and pip pulls no CUDA build
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $@

data: venv
	$(PY) -m drc_core.data prepare --out $(CORPUS)

lint: venv
	$(VENV)/bin/ruff check .

test: venv lint
	$(PY) -m pytest -m "not slow"

test-slow: venv
	$(PY) -m pytest -m slow

book: book-run book-html

book-run: data
	$(PY) -m drc_core.book run --profile $(PROFILE) $(if $(RETRAIN),--set retrain=true)

book-html: venv
	$(PY) -m drc_core.book build --profile $(PROFILE)

clean:
	rm -rf _build _static .pytest_cache .ruff_cache
