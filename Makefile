# make demo   run the main job on the embedded defaults
# make test   lint, type-check and run the tests
# make bench  run the benchmarks (tables on stdout, JSON under out/)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-4

.PHONY: install demo test bench test-long clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[model,plot,storage,serve,dev]'
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/shadowradix demo

test: install
	$(BIN)/ruff check shadowradix tests benchmarks
	$(BIN)/mypy
	$(BIN)/python -m pytest -n 2 --dist loadfile

test-long: install
	SHADOWRADIX_HYPOTHESIS_SCALE=20 $(BIN)/python -m pytest tests/test_tree_machine.py tests/test_tiers_machine.py \
		tests/test_manager_machine.py

bench: install
	mkdir -p out
	$(BIN)/python benchmarks/tree_ops.py data/traces/conversation_trace.jsonl.gz \
		--layout full+swa --window 128 --page-size 256 --capacity-tokens 2000000 \
		--json out/tree_ops_full_swa.json
	$(BIN)/python benchmarks/tree_ops.py data/traces/conversation_trace.jsonl.gz \
		--layout deepseek-v4-flash --page-size 256 --capacity-tokens 2000000 \
		--json out/tree_ops_dsv4_flash.json
	$(BIN)/python benchmarks/engine.py --json out/engine.json
	$(BIN)/python benchmarks/tiers.py --json out/tiers.json
	$(BIN)/python benchmarks/serve.py --json out/serve.json
	$(BIN)/python benchmarks/fleet.py --json out/fleet.json
	$(BIN)/python benchmarks/hisparse_replay.py --json out/hisparse_replay.json
	$(BIN)/python benchmarks/hisparse.py --json out/hisparse.json
	test -f out/tiny_mtp/config.json || $(BIN)/python benchmarks/train_tiny.py --out out/tiny_mtp
	$(BIN)/python benchmarks/spec_decode.py --model out/tiny_mtp --json out/spec_decode.json

clean:
	rm -rf $(VENV) out .pytest_cache .mypy_cache .ruff_cache .hypothesis
