# Two commands on a fresh machine: `make demo` and `make test`.
# Each creates .venv when missing; on CPU-only machines the local CPU torch wheel goes in
# first so the project's torch range does not pull a multi-GB CUDA build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_CPU := torch==2.13.0

.PHONY: demo test bench venv clean

venv: $(VENV)/.installed

# the install also compiles the C kernels (setup.py), so a changed kernel source reinstalls
$(VENV)/.installed: pyproject.toml setup.py engramflow/kernels/native_kernels.c engramflow/kernels/native_io.c engramflow/kernels/block_scaled.c engramflow/kernels/kernel_common.h engramflow/kernels/native_build.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then \
	  $(BIN)/python -m pip install -q $(TORCH_CPU) || echo "note: CPU torch wheel not available, falling back to the project's torch range"; \
	fi
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

demo: venv
	$(BIN)/engramflow demo

# --durations=25: the 25 slowest tests at the end of every run (CI's log included)
# -n 2: two pytest-xdist workers, a file (or a group of files sharing a server) whole on one, its
# own Ray each (tests/conftest.py); a single file runs as before: pytest tests/test_x.py
test: venv
	$(BIN)/python -m pytest -q --durations=25 -n 2

bench: venv
	$(BIN)/python benchmarks/bench_hashing.py

clean:
	rm -rf $(VENV) build *.egg-info engramflow/kernels/_native_kernels-*.so engramflow/kernels/_native_io-*.so engramflow/kernels/_block_scaled-*.so
