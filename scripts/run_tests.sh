#!/usr/bin/env bash
# Set up (if needed) and run the test suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/python -m pytest "$@"  # a line of progress per test file
