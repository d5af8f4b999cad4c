# `make demo` and `make test` are the two commands in the README's quick start.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: venv demo lint test test-slow test-simulation test-all bench soak clean comfy-test

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch/torchvision first, pinned to the releases the tests run with (a CUDA build that also runs on
	# the CPU); a user's CUDA machine can install any torch the range in pyproject allows.
	$(PIP) install -q "torch==2.14.1" "torchvision==0.29.1"
	$(PIP) install -q -e ".[test]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/qwen-edit demo --out demo_out

# `make test` is the inner loop: every test except those marked slow (several processes, inductor
# compilation) or simulation (real-size memory simulations, minutes of CPU each); `make test-slow` and
# `make test-simulation` run those, `make test-all` everything. Each prints its slowest tests.
test: venv
	$(PY) -m pytest tests -m "not slow and not simulation" --durations=15

test-slow: venv
	$(PY) -m pytest tests -m slow --durations=15

test-simulation: venv
	$(PY) -m pytest tests -m simulation --durations=15

test-all: venv
	$(PY) -m pytest tests --durations=15

# `ruff check` with pyproject's rules (tests/structure/test_lint.py runs the same inside `make test`)
lint: venv
	$(PY) -m ruff check .

bench: venv
	$(VENV)/bin/qwen-edit bench sample

# every fault (kills inside cache/checkpoint writes and steps, full disk, damaged cache entry, second run) x3
soak: venv
	$(VENV)/bin/qwen-edit bench soak --rounds 3

clean:
	rm -rf $(VENV) demo_out .pytest_cache comfy_test_out

# Real-ComfyUI checks (not part of `make test`): every shipped workflow on a fresh base directory, the
# training-job lifecycle, and the live view in headless Chromium. COMFY_PYTHON is the Python of that
# ComfyUI's environment (with the pack's requirements installed).
COMFY_PYTHON ?= $(firstword $(wildcard $(COMFYUI_DIR)/venv/bin/python $(COMFYUI_DIR)/.venv/bin/python) python3)
COMFY_TEST_OUT ?= comfy_test_out

comfy-test:
	@test -n "$(COMFYUI_DIR)" || { echo "usage: make comfy-test COMFYUI_DIR=/path/to/ComfyUI [COMFY_PYTHON=...]"; exit 2; }
	$(COMFY_PYTHON) tools/comfy_test/run.py --comfyui-dir "$(COMFYUI_DIR)" --python "$(COMFY_PYTHON)" --out $(COMFY_TEST_OUT)
