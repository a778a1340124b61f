#!/usr/bin/env bash
# Plant curated bugs one at a time and report the share the test suite catches (see
# scripts/mutation_check.py). On demand, not in CI: about a minute and a half per
# surviving mutation, seconds per caught one. Run it on a clean working tree.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
exec "$PY" scripts/mutation_check.py "$@"
