#!/usr/bin/env bash
# Set up a virtual environment for fusible on a fresh machine (CPU), saying what it installs:
# .venv with PyTorch 2.13.0 (CPU build, from the local wheel cache), fusible itself
# (editable) with the extras of the purpose, and graphviz's 'dot' for plan diagrams.
#   bash scripts/setup.sh [example|test]   (default: test, which includes the example's)
# The example needs neither Triton nor pytest. A second run with nothing changed does nothing
# (a stamp in .venv records what was installed, for which pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."

PURPOSE=${1:-test}
case "$PURPOSE" in
    example) EXTRAS="example" ;;
    test) EXTRAS="test,example" ;;
    *) echo "setup.sh: purpose must be 'example' or 'test', got '$PURPOSE'" >&2; exit 2 ;;
esac
PYTHON=${PYTHON:-python3}
say() { echo "fusible setup: $*"; }
pip_install() { .venv/bin/python -m pip install --quiet --disable-pip-version-check "$@"; }

if [ ! -x .venv/bin/python ]; then
    say "creating .venv with $("$PYTHON" --version)"
    "$PYTHON" -m venv .venv
fi
STAMP=".venv/.fusible-setup-$PURPOSE"
WANT="$(sha256sum pyproject.toml | cut -c1-16)"
installed() { ls -d .venv/lib/python*/site-packages/"$1"-*.dist-info >/dev/null 2>&1; }
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && installed torch && installed fusible
then
    say "$PURPOSE environment up to date (.venv)"
else
    # Pin the CPU build: an unpinned torch pulls a multi-GB CUDA build.
    if ! .venv/bin/python -c "import torch" 2>/dev/null; then
        say "installing torch 2.13.0 (CPU build, about 200 MB)"
        pip_install torch==2.13.0
    fi
    say "installing fusible (editable) with extras [$EXTRAS]"
    pip_install -e ".[$EXTRAS]"
    echo "$WANT" > "$STAMP"
fi

if ! command -v dot >/dev/null 2>&1; then
    say "installing graphviz (apt: the 'dot' binary renders plan diagrams)"
    if [ "$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi
    $SUDO apt-get install -y -q graphviz >/dev/null 2>&1 \
        || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q graphviz >/dev/null; }
fi
TORCH=$(basename .venv/lib/python*/site-packages/torch-*.dist-info .dist-info)
say "done: ${TORCH/-/ }, $(dot -V 2>&1)"
