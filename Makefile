# Two commands do everything on a fresh Debian 12 machine, as root: `make demo` and `make test`.
SHELL := /bin/bash
VENV := .venv
CLI := $(VENV)/bin/ebpf-proxy
PYTEST_ARGS ?=

.PHONY: setup demo test lint unit clean-lab clean bench soak

setup:
	@scripts/setup.sh

DEMO_ARGS ?=

demo: setup
	$(CLI) lab demo $(DEMO_ARGS)

test: setup
	$(VENV)/bin/lint-imports
	scripts/run-tests.sh $(PYTEST_ARGS)

unit: setup
	$(VENV)/bin/pytest tests/unit -q

bench: setup
	$(CLI) bench --quick

# Not part of `make test`: SOAK_MINUTES of churn per mode (iptables, then ebpf). The short form
# that `make test` runs is tests/e2e/test_soak.py.
SOAK_MINUTES ?= 30
SOAK_ARGS ?=

soak: setup
	$(CLI) soak --minutes $(SOAK_MINUTES) $(SOAK_ARGS)

clean-lab:
	@if [ -x $(CLI) ]; then $(CLI) lab down --all; else echo "no CLI yet: nothing the lab made"; fi

clean: clean-lab
	rm -rf $(VENV) build *.egg-info
