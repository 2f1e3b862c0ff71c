# Two commands a fresh machine needs (see README): `make demo` and `make test`.
# Both set everything up first (Debian packages as root, .venv, pinned CPU torch).
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup test test-all demo lint bench clean fuzz models

setup:
	@bash scripts/setup.sh

# The everyday suite: offline, deterministic, a few minutes on 2 cores. Tests marked `slow` (minutes-long
# checks against real engines and long samples) run in `make test-all`, with the fuzz suite at full size.
# Four workers whatever the cores (each holds torch and a model): many tests wait on processes they start
# (torchrun, vllm serve, a wheel build), and on a busy 2-core machine the suite's share of the cores grows with
# its process count (under `stress-ng --cpu 2`: 7:55-8:03 with 2 workers, 6:11-7:33 with 4, 6:04-7:26 with 6,
# the host's own noise as large as the differences). A test file stays on one worker, so its module fixtures are
# built once.
PARALLEL := -n 4 --dist loadfile
# The suite starts many Python processes (workers, CLI runs, torchrun ranks, vLLM servers): with bytecode
# written (an environment may turn it off) each compiles the sources once, not each one again (6:11-6:36 under
# stress on a fresh clone without, 5:45-6:12 with).
unexport PYTHONDONTWRITEBYTECODE

test: setup
	$(BIN)/python -m pytest -q -m "not slow" $(PARALLEL)

test-all: setup
	$(BIN)/python -m pytest -q $(PARALLEL)
	TRACESYNTH_FUZZ_CASES=200 DOOLY_FUZZ_CASES=30 $(BIN)/python -m pytest -q tests/fuzz

demo: setup
	$(BIN)/tracesynth demo
	$(BIN)/dooly demo

# Retrain the shipped checkpoint models/all (70 min on one core; see models/README.md).
models: setup
	$(BIN)/python scripts/train_models.py --threads 1

fuzz: setup
	TRACESYNTH_FUZZ_CASES=2000 $(BIN)/python -m pytest -q tests/fuzz

lint: setup
	$(BIN)/ruff check src tests bench

# these read an input a user names (a profile DB, a validate log, models to serve alone): run them by hand
BENCH_NEEDS_INPUT = bench/bench_shape_kinds.py bench/bench_vllm_lone.py bench/rescore_validation.py

bench: setup
	@for b in $(filter-out $(BENCH_NEEDS_INPUT),$(wildcard bench/*.py)); do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) out build *.egg-info
