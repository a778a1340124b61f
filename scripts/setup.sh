#!/usr/bin/env bash
# Set up a virtual environment for fusible on a fresh machine (CPU): .venv with PyTorch
# 2.13.0 (CPU build, from the local wheel cache), fusible itself with its test and example
# extras, and the graphviz 'dot' binary for rendering plan diagrams.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
pip_install() { .venv/bin/python -m pip install --quiet --disable-pip-version-check "$@"; }

# Pin the CPU build: an unpinned torch pulls a multi-GB CUDA build.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    pip_install torch==2.13.0
fi
pip_install -e ".[test,example]"

if ! command -v dot >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi
    $SUDO apt-get install -y -q graphviz >/dev/null 2>&1 \
        || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q graphviz >/dev/null; }
fi
echo "setup done: $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'),"\
     "$(dot -V 2>&1)"
