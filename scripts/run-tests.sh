#!/usr/bin/env bash
# The whole suite. pytest's exit 5 (nothing collected) is a failure here, never a silent pass.
set -uo pipefail
cd "$(dirname "$0")/.."
.venv/bin/pytest "$@"
rc=$?
if [ $rc -eq 5 ]; then echo "run-tests: pytest collected no tests: failing" >&2; exit 1; fi
# Every test removes what it made (fixtures with finally). No `lab down --all` here: on a shared
# machine it would also take down labs that are not the suite's (a demo, a bench).
exit $rc
