# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv when it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH := torch==2.13.0
# pytest workers (pytest-xdist): two keep a 2-core machine busy; each test file runs whole on one of them
TEST_WORKERS ?= 2

.PHONY: install demo finetune-demo dpo-demo test test-full test-quick test-fast lint docs bench gpu-check clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e '.[dev,hf,docs,ray]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/meshkit train examples/demo.yaml

examples/finetune/base/config.json: $(STAMP)
	$(BIN)/python examples/finetune/make_base_model.py

finetune-demo: examples/finetune/base/config.json
	$(BIN)/meshkit finetune examples/finetune/lora.yaml

dpo-demo: examples/finetune/base/config.json
	$(BIN)/meshkit finetune examples/finetune/dpo.yaml

# the suite CI runs (under 15 minutes); test-full adds the wide sweeps (marked `sweep`)
test: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --durations=15 -m "not sweep"

test-full: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --durations=15

test-quick: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) -m "not slow and not sweep"

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not world and not slow"

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

lint: $(STAMP)
	$(BIN)/ruff check meshkit tests bench
	$(BIN)/ruff format --check meshkit tests bench
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/python bench/overhead.py --nproc 2
	$(BIN)/python bench/overhead.py --nproc 4
	$(BIN)/python bench/memory.py --nproc 4
	$(BIN)/python bench/memory.py --nproc 8
	$(BIN)/python bench/activation.py
	$(BIN)/python bench/pipeline.py
	$(BIN)/python bench/checkpoint.py
	$(BIN)/python bench/finetune.py --nproc 2
	$(BIN)/python bench/finetune_quantized.py --nproc 2
	$(BIN)/python bench/preference.py
	$(BIN)/python bench/ps.py
	$(BIN)/python bench/host_collectives.py
	$(BIN)/python bench/peers_deepspeed.py
	$(BIN)/python bench/plan_published.py
	$(BIN)/python bench/plan_vs_measured.py
	$(BIN)/python bench/moe.py
	$(BIN)/python bench/ring_window.py
	$(BIN)/meshkit bench comm --nproc-per-node 2 --out bench/results/comm-w2.json
	$(BIN)/python bench/report.py

# one accelerator, ~8 minutes, no network: tokens/s and MFU, FSDP2, fp8, the fused loss, the estimator (docs/benchmarks.md)
gpu-check: $(STAMP)
	$(BIN)/python bench/gpu_check.py

clean:
	rm -rf $(VENV) runs .pytest_cache site
