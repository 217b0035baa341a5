# Set-up and checks. `make demo` and `make test` build .venv on a fresh machine (torch's CPU wheel first, then the
# package with its extras under the pinned constraints); `make demo` runs the main job on the real SmolLM2
# checkpoint, `make test` the test suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.attnres-installed

.PHONY: demo test test-fast docs install browser bench clean

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

test: $(STAMP) browser
	$(PY) -m pytest -q

# The routing explorer's page tests drive Debian's chromium (tests/test_explorer.py): installed here where this user
# may (root, apt-get); elsewhere those tests skip and the run's summary says what they need.
browser:
	@if [ ! -x /usr/bin/chromium ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "Installing Debian's chromium for the browser tests"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	      || echo "Could not install chromium: the browser tests will skip"; \
	  else echo "No /usr/bin/chromium (apt-get install chromium as root): the browser tests will skip"; fi; \
	fi

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
