# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
FRONT_STAMP := frontend/node_modules/.installed
DIST := frontend/dist/index.html

# `make image`: the container image of deploy/Dockerfile, with docker or buildah (deploy/README.md)
.PHONY: demo test install frontend image test-unit test-api test-integration test-e2e bench openapi clean

$(STAMP): backend/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e 'backend[test]'
	$(PY) -m pip install -q 'torch==2.13.0'
	touch $@

install: $(STAMP)

$(FRONT_STAMP): frontend/package.json frontend/package-lock.json
	cd frontend && npm ci --no-audit --no-fund
	touch $@

$(DIST): $(FRONT_STAMP) $(shell find frontend/src -type f 2>/dev/null) frontend/index.html
	cd frontend && npm run build

frontend: $(DIST)

demo: $(STAMP) $(DIST)
	$(VENV)/bin/hai dev $(ARGS)

openapi: $(STAMP)
	$(VENV)/bin/hai openapi --out frontend/openapi.json
	cd frontend && npm run gen:api

test: $(STAMP) $(DIST)
	cd frontend && npm test
	eval "$$(scripts/test-services.sh)" && $(PY) -m pytest $(PYTEST_ARGS)

test-unit: $(STAMP)
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

test-api: $(STAMP)
	$(PY) -m pytest tests/api $(PYTEST_ARGS)

test-integration: $(STAMP)
	eval "$$(scripts/test-services.sh)" && $(PY) -m pytest tests/integration $(PYTEST_ARGS)

test-e2e: $(STAMP) $(DIST)
	$(PY) -m pytest tests/e2e $(PYTEST_ARGS)

image:
	deploy/build-image.sh

clean:
	rm -rf $(VENV) frontend/node_modules frontend/dist .hai
