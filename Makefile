# Set-up and checks. `make demo` and `make test` build .venv on a fresh machine (torch's CPU wheel first, then the
# package with its extras under the pinned constraints); `make demo` runs the main job on the real SmolLM2
# checkpoint, `make test` the test suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.attnres-installed

.PHONY: demo test test-fast docs install bench clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: a plain `torch` requirement with no torch installed pulls a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e ".[convert,train,eval,plot,test]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/attnres demo

test: $(STAMP)
	$(PY) -m pytest -q

# The inner loop: the tests not marked slow (CI runs `make test`).
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

# The documentation site, offline, into site/ (mkdocs.yml; tests/test_docs.py builds it with --strict).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# Eager, regionally compiled and (decode) whole-model compiled, every Block knob eager; about an hour on 2 cores.
bench: $(STAMP)
	$(PY) benchmarks/overhead.py --compiled-workloads decode

clean:
	rm -rf $(VENV) build site src/*.egg-info .pytest_cache
