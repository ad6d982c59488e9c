# `make test` and `make demo` create .venv with Python >= 3.12 on a fresh machine, install, and run.
PYTHON ?= $(shell for p in python3.12 python3.13 $$HOME/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do \
  $$p -c 'import sys; assert sys.version_info >= (3, 12)' >/dev/null 2>&1 && { echo $$p; break; }; done)
VENV := .venv
STAMP := $(VENV)/.installed
PY := $(VENV)/bin/python
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8

.PHONY: test test-all demo venv clean

$(STAMP): pyproject.toml
	@test -n "$(PYTHON)" || { echo "Python >= 3.12 not found (set PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

# `make test` (CI) skips the cases tests/conftest.py marks slow (the rest of sampled interpret-mode
# grids); `make test-all` runs them too.
test: $(STAMP)
	$(PY) -m pytest -n 2 -q -p no:cacheprovider --timeout=600 --durations=25 -m "not slow" tests

test-all: $(STAMP)
	$(PY) -m pytest -n 2 -q -p no:cacheprovider --timeout=900 --durations=25 tests

demo: $(STAMP)
	$(PY) examples/demo.py

clean:
	rm -rf $(VENV)
