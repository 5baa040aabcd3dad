#!/usr/bin/env bash
# Installs the project and its test tools into the current Python environment.
# torch: kept as it is when one is importable; otherwise the pinned CPU build
# (TE_TORCH overrides the requirement, TE_TORCH=skip installs none).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pip_q() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }
if ! "$PY" -c "import torch" >/dev/null 2>&1 && [ "${TE_TORCH:-}" != "skip" ]; then
    pip_q "${TE_TORCH:-torch==2.13.0}"
fi
if ! "$PY" -c "import importlib.metadata as m; m.version('transfer-engine'); import zmq, msgpack, numpy, pytest, pytest_timeout" >/dev/null 2>&1 \
   || [ "${TE_REINSTALL:-0}" = "1" ]; then
    pip_q -e ".[test]"
fi
