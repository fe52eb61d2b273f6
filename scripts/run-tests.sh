#!/usr/bin/env bash
# The whole suite. pytest's exit 5 (nothing collected) is a failure here, never a silent pass.
set -uo pipefail
cd "$(dirname "$0")/.."
.venv/bin/pytest "$@"
rc=$?
if [ $rc -eq 5 ]; then echo "run-tests: pytest collected no tests: failing" >&2; exit 1; fi
# Whatever a failing test left behind must not leak into the next run.
.venv/bin/ebpf-proxy lab down --all --quiet || true
exit $rc
