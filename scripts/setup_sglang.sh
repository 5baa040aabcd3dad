#!/usr/bin/env bash
# Installs the pinned SGLang wheel, without its dependencies, into the project-local
# .venv-sglang/site (TE_SGLANG_SITE overrides) for tests/test_connector_sglang.py, which
# imports SGLang's disaggregation base classes from there. The main environment is not
# touched: SGLang's runtime needs CUDA-only packages and cannot run here. The version is
# pinned once, as SGLANG_VERSION in tests/helpers/sglang_worker.py. About 15 s and 220 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VERSION=$(sed -n 's/^SGLANG_VERSION = "\([^"]*\)"$/\1/p' tests/helpers/sglang_worker.py)
[ -n "$VERSION" ] || { echo "SGLANG_VERSION not found in tests/helpers/sglang_worker.py" >&2; exit 1; }
TARGET=${TE_SGLANG_SITE:-.venv-sglang/site}
if [ ! -d "$TARGET/sglang-$VERSION.dist-info" ]; then
    rm -rf "$TARGET"
    PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install -q --disable-pip-version-check --no-deps \
        --target "$TARGET" \
        "sglang==$VERSION"
fi
"$PY" - "$TARGET" "$VERSION" <<'PYEOF'
import pathlib, sys
site, version = pathlib.Path(sys.argv[1]), sys.argv[2]
assert (site / "sglang/srt/disaggregation/base/conn.py").is_file(), site
print(f"sglang {version} (no dependencies) in {site}")
PYEOF
