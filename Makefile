# Two commands for a newcomer: `make demo` and `make test`. Both bootstrap .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo serve bench-services test lint venv clean train-demo protos tools gpu-check

venv: $(STAMP)

# NOTE: pip runs without -q: the first install takes minutes (torch alone is large), and
# its Collecting/Downloading/Installing lines show that it is moving.
$(STAMP): pyproject.toml
	@test -x $(PY) || { echo "make: creating $(VENV) with $(PYTHON)"; $(PYTHON) -m venv $(VENV); }
	@echo "make: installing chainspec and its dependencies into $(VENV)" \
		"(first run: a few minutes, mostly torch)..."
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -e '.[test]'
	touch $(STAMP)
	@echo "make: $(VENV) is ready; the CLI is $(VENV)/bin/chainspec" \
		"(or: source $(VENV)/bin/activate)"

demo: $(STAMP)
	RAY_AUTH_MODE=disabled $(PY) -m chainspec.demo

serve: $(STAMP)
	RAY_AUTH_MODE=disabled $(VENV)/bin/chainspec serve

bench-services: $(STAMP)
	RAY_AUTH_MODE=disabled $(PY) benchmarks/services_bench.py --out benchmarks/results/services_bench

test: $(STAMP) lint
	RAY_AUTH_MODE=disabled $(PY) -m pytest -q tests

# GPU tests plus a timing pass into benchmarks/results/gpu (one line and exit 0 without
# CUDA). On a GPU machine without the venv: make gpu-check PY=python3 (no bootstrap).
gpu-check: $(if $(filter $(VENV)/bin/python,$(PY)),$(STAMP))
	@PYTHONPATH=services:. $(PY) benchmarks/gpu_check.py --out benchmarks/results/gpu

lint: $(STAMP)
	$(VENV)/bin/ruff check services tests benchmarks

# System tools some tests drive (helm into ./.tools/bin; promtool, prometheus and
# redis-server from apt; NVIDIA's aiperf load generator in its own venv under
# ~/.cache/chainspec).
tools:
	bash deploy/install-tools.sh
	bash deploy/install-prometheus.sh
	bash deploy/install-redis.sh
	bash deploy/install-aiperf.sh

protos: $(STAMP)
	$(PY) -m chainspec.rpc.build_protos

train-demo: $(STAMP)
	$(VENV)/bin/chainspec train-demo --out services/chainspec/assets/demo

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info services/*.egg-info
