#!/usr/bin/env bash
# Installs the project and its test tools into the current Python environment.
# torch: kept as it is when one is importable; otherwise the pinned CPU build
# (TE_TORCH overrides the requirement, TE_TORCH=skip installs none).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# pip's notes about index folders a machine's pip config names but lacks, and about
# running as root, are dropped; pip's own status still decides, through pipefail
pip_q() {
    PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install -q --disable-pip-version-check "$@" \
        2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}
if ! "$PY" -c "import torch" >/dev/null 2>&1 && [ "${TE_TORCH:-}" != "skip" ]; then
    pip_q "${TE_TORCH:-torch==2.13.0}"
fi
# Installed means: importable from this checkout (run from / so that the working folder
# is not on the path), with this pyproject's entry points, and the test tools present.
# An install of another checkout, or of an older version, is replaced.
installed() {
    (cd / && TE_ROOT="$OLDPWD" "$PY" - <<'PYEOF'
import importlib.metadata as m
import os
import sys

import msgpack, numpy, pytest, pytest_timeout, tokenizers, zmq  # noqa: F401, E401
import transfer_engine

here = os.path.realpath(os.path.join(os.environ["TE_ROOT"], "transfer_engine"))
if os.path.realpath(os.path.dirname(transfer_engine.__file__)) != here:
    sys.exit(1)
names = {(ep.group, ep.name) for ep in m.distribution("transfer-engine").entry_points}
sys.exit(0 if ("sglang.srt.plugins", "transfer_engine") in names else 1)
PYEOF
    ) >/dev/null 2>&1
}
if [ "${TE_REINSTALL:-0}" = "1" ] || ! installed; then
    pip_q -e ".[test]"
fi
