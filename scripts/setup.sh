#!/usr/bin/env bash
# Set up a virtual environment for fusible on a fresh machine, saying what it installs:
# .venv with PyTorch, fusible itself (editable) with the extras of the purpose, and
# graphviz's 'dot' for plan diagrams (without it, diagrams are written as DOT source).
#   bash scripts/setup.sh [example|test]   (default: test, which includes the example's)
# PyTorch: a torch >= 2.11 already in .venv, or in the Python that creates it, is kept (the
# venv then sees that Python's packages). Otherwise torch 2.13.0 from pip's configured index,
# after saying which build pip resolved (from PyPI on Linux x86-64: the CUDA build, several
# GB); FUSIBLE_TORCH=cpu installs the CPU-only build (about 200 MB) from PyTorch's CPU index.
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
TORCH_CHOICE=${FUSIBLE_TORCH:-default}
case "$TORCH_CHOICE" in
    default|cpu) ;;
    *) echo "setup.sh: FUSIBLE_TORCH must be 'cpu' or unset, got '$TORCH_CHOICE'" >&2; exit 2 ;;
esac
say() { echo "fusible setup: $*"; }
pip_install() { .venv/bin/python -m pip install --quiet --disable-pip-version-check "$@"; }
# "2.13.0" when the interpreter has a torch >= 2.11, nothing otherwise
usable_torch() {
    "$1" -c 'import torch, sys
v = torch.__version__.split("+")[0]
sys.exit(tuple(int(p) for p in v.split(".")[:2]) < (2, 11)) or print(torch.__version__)' \
        2>/dev/null || true
}

if [ ! -x .venv/bin/python ]; then
    THERE=$(usable_torch "$PYTHON")
    if [ -n "$THERE" ] && [ "$TORCH_CHOICE" = default ]; then
        say "creating .venv with $("$PYTHON" --version), keeping its torch $THERE" \
            "(the venv sees that Python's packages)"
        "$PYTHON" -m venv --system-site-packages .venv
    else
        say "creating .venv with $("$PYTHON" --version)"
        "$PYTHON" -m venv .venv
    fi
fi

# What pip resolves for torch 2.13.0, said before the download: the CPU or the CUDA build.
describe_torch() {
    local report
    report=$(mktemp)
    if .venv/bin/python -m pip install --dry-run --ignore-installed --quiet \
            --disable-pip-version-check --report "$report" "$@" >/dev/null 2>&1; then
        .venv/bin/python - "$report" <<'PY'
import json, sys
names = [(i["metadata"]["name"], i["metadata"]["version"])
         for i in json.load(open(sys.argv[1]))["install"]]
torch = dict(names).get("torch", "?")
cuda = [n for n, _ in names if n.startswith("nvidia-")]
build = (f"the CUDA build, with {len(cuda)} nvidia-* packages: several GB"
         if cuda else "the CPU build")
print(f"torch {torch} ({build}) and {len(names) - 1 - len(cuda)} other package(s)")
PY
    else
        echo "torch 2.13.0 (pip's dry run failed: the build it resolves is unknown)"
    fi
    rm -f "$report"
}

install_torch() {
    local args=(torch==2.13.0)
    if [ "$TORCH_CHOICE" = cpu ]; then
        args+=(--index-url https://download.pytorch.org/whl/cpu)
    fi
    local what
    what=$(describe_torch "${args[@]}")
    say "installing $what"
    if [ "$TORCH_CHOICE" = default ] && [[ "$what" != *"(the CPU build)"* ]]; then
        say "(FUSIBLE_TORCH=cpu bash scripts/setup.sh installs the CPU-only build instead)"
    fi
    # pip's own progress: the download can be long
    .venv/bin/python -m pip install --disable-pip-version-check --progress-bar on "${args[@]}"
}
STAMP=".venv/.fusible-setup-$PURPOSE"
WANT="$(sha256sum pyproject.toml | cut -c1-16)"
installed() { ls -d .venv/lib/python*/site-packages/"$1"-*.dist-info >/dev/null 2>&1; }
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && installed torch && installed fusible
then
    say "$PURPOSE environment up to date (.venv)"
else
    HAVE=$(usable_torch .venv/bin/python)
    if [ -n "$HAVE" ] && [ "$TORCH_CHOICE" = default ]; then
        say "keeping torch $HAVE"
    elif [ "$TORCH_CHOICE" = cpu ] && [[ "$HAVE" == *+cpu ]]; then
        say "keeping torch $HAVE (CPU build)"
    else
        install_torch
    fi
    say "installing fusible (editable) with extras [$EXTRAS]"
    pip_install -e ".[$EXTRAS]"
    echo "$WANT" > "$STAMP"
fi

if ! command -v dot >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi
    if command -v apt-get >/dev/null 2>&1 && { [ -z "$SUDO" ] || sudo -n true 2>/dev/null; }
    then
        say "installing graphviz (apt: the 'dot' binary renders plan diagrams)"
        $SUDO apt-get install -y -q graphviz >/dev/null 2>&1 \
            || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q graphviz \
                 >/dev/null; } \
            || say "graphviz did not install: plan diagrams will be written as DOT source"
    else
        say "graphviz's 'dot' is not installed and apt-get (as root) is not available: plan" \
            "diagrams will be written as DOT source (install graphviz for SVGs)"
    fi
fi
TORCH=$(.venv/bin/python -c "import torch; print(torch.__version__)")
DOT=$(dot -V 2>&1 || echo "no graphviz dot")
say "done: torch $TORCH, $DOT"
