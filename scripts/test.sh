#!/usr/bin/env bash
# The project's test command: set up if needed, then run the whole suite in two steps.
#
#   1. every test but the vLLM ones, in the main environment (PYTHON, default python3),
#      the SGLang backend's among them, against the pinned SGLang wheel that
#      scripts/setup_sglang.sh puts in .venv-sglang/site (about 20 s the first time),
#      and tests/test_rdma_pyverbs_api.py against Debian's pyverbs, which
#      scripts/setup_pyverbs.sh unpacks into .venv-pyverbs (a few seconds the first time;
#      only its site/ and lib/ go on PYTHONPATH and LD_LIBRARY_PATH, for this step);
#   2. the vLLM connector tests, contract and end to end (real vLLM engines on CPU), in
#      the project-local .venv-vllm that scripts/setup_vllm.sh makes (minutes the first
#      time, seconds after).
#
# Arguments go to pytest in step 1 and then leave step 2 out (a chosen subset runs
# alone); TE_VLLM=skip leaves step 2 out, TE_VLLM=1 runs it even with arguments.
# In a full run a failed vLLM, SGLang or pyverbs install fails the command: none is
# skipped. (RDMA tests that need a device still skip, saying so.)
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_TESTS=(tests/test_connector_vllm*.py)
bash scripts/setup.sh
bash scripts/setup_etcd.sh  # never fails: without etcd its tests skip
PY=${PYTHON:-python3}
run_vllm=${TE_VLLM:-auto}
if [ "$run_vllm" = auto ]; then
    run_vllm=$([ $# -eq 0 ] && echo 1 || echo skip)
fi
if [ "$run_vllm" = skip ]; then
    exec "$PY" -m pytest -q "$@"
fi
bash scripts/setup_sglang.sh
bash scripts/setup_pyverbs.sh
PV=${TE_PYVERBS_DIR:-.venv-pyverbs}
[[ $PV = /* ]] || PV=$PWD/$PV
TE_SGLANG_REQUIRED=1 TE_PYVERBS_REQUIRED=1 PYTHONPATH="$PV/site${PYTHONPATH:+:$PYTHONPATH}" \
    LD_LIBRARY_PATH="$PV/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    "$PY" -m pytest -q "${VLLM_TESTS[@]/#/--ignore=}" "$@"
bash scripts/setup_vllm.sh
TE_VLLM_REQUIRED=1 exec "${TE_VLLM_VENV:-.venv-vllm}/bin/python" -m pytest -q "${VLLM_TESTS[@]}"
