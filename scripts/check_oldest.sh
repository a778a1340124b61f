#!/usr/bin/env bash
# The model-code tests under the oldest versions fusible supports, the GPU machine's:
# torch 2.11 and transformers 5.17 (dynamo 2.11 traces less Python than 2.13: a set
# comparison or a signature read there breaks a converted model's graph, and transformers
# 5.17 hands masks to modules 5.25 does not). CI runs the newest; this is the other end.
# Builds .venv-oldest once (torch 2.11 from PyPI is the CUDA build: about 5 GB).
#   bash scripts/check_oldest.sh [pytest arguments]   (default: the conversion tests)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-oldest
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==2.11.0" \
        "transformers==5.17.0" numpy pytest attrs graphviz setuptools wheel
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
    --no-build-isolation -e .
rm -rf fusible.egg-info
"$VENV/bin/python" -c "import torch, transformers; print('torch', torch.__version__,
  'transformers', transformers.__version__)"
if [ $# -eq 0 ]; then
    set -- tests/test_conversion.py tests/test_convert_layers.py tests/test_convert_moe.py \
        tests/test_model_families.py tests/test_captured_step.py tests/test_fused_loss.py \
        tests/test_joined_weights.py tests/test_attention.py
fi
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider -p no:logging "$@"
