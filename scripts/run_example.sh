#!/usr/bin/env bash
# Set up (if needed) and run the main example: train an MLP block, write its plan as SVG.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh example
.venv/bin/python examples/train_mlp.py "$@"
