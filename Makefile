# Two commands do all set-up on a fresh machine:  `make test`  and  `make run`.
PY      := .venv/bin/python
STAMP   := .venv/.installed
# The CPU torch wheel lies on local disk; pip must look there, never fetch a CUDA build.
WHEELS  := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
CONFIG  ?= examples/demo.yaml

.PHONY: setup test run bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --disable-pip-version-check $(WHEELS) -c constraints.txt -e '.[test]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

run: $(STAMP)
	$(PY) -m jobs.generate --config $(CONFIG) $(ARGS)

bench: $(STAMP)
	$(PY) -m jobs.bench $(ARGS)

clean:
	rm -rf .venv build *.egg-info
