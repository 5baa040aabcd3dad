#!/usr/bin/env bash
# Qualifies a GPU host: what it has (GPUs, driver, RDMA devices), the tests marked gpu
# with those of the device paths, then transfer_engine_bench on GPU memory (--use_vram)
# over tcp (staged through pinned host memory) and shm (device IPC between processes),
# each against device<->host copies measured in the same run.
#
#   bash scripts/gpu_check.sh [OUTDIR]     # logs and JSON under OUTDIR (default /tmp/gpu_check)
#
# Bounded: each step has its own timeout, and a failing step does not stop the next.
set -u
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}.
status=0

{
    date -u
    nvidia-smi --query-gpu=index,name,driver_version,memory.total,pci.bus_id --format=csv
    nvidia-smi topo -m 2>&1 | head -20
    echo "RDMA devices: $(ls /sys/class/infiniband 2>/dev/null | tr '\n' ' ')"
    echo "cpus $(nproc)"
    $py - <<'EOF'
import platform
print("python", platform.python_version())
for name in ("torch", "cupy", "zmq", "msgpack", "numpy", "pynvml"):
    try:
        mod = __import__(name)
        print(name, getattr(mod, "__version__", "?"))
    except Exception as exc:  # noqa: BLE001
        print(name, "missing:", exc)
import torch
print("torch cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      "devices", torch.cuda.device_count())
EOF
} 2>&1 | tee "$out/env.txt"

timeout "${TESTS_TIMEOUT:-300}" $py -m pytest -q -p no:cacheprovider -rs \
    tests/test_gpu.py tests/test_device_staging.py tests/test_shm_device_ipc.py \
    tests/kvstore/test_kvstore_tiers.py::test_device_pool_on_cuda 2>&1 | tee "$out/tests.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1

bench_out=$(mktemp -d)
for protocol in tcp shm; do
    for case in write:65536 write:1048576 read:1048576; do
        operation=${case%%:*} block=${case##*:}
        name="bench-$protocol-$operation-$block"
        echo "## $name" | tee -a "$out/bench.txt"
        timeout 150 $py -m bench.transfer_engine_bench --local --use_vram \
            --protocol "$protocol" --operation "$operation" --block_size "$block" \
            --batch_size $((16 * 1048576 / block)) --buffer_size 128M --duration 1.5 \
            --repeat 2 --baseline --json "$bench_out/$name.json" 2>&1 \
            | tee -a "$out/bench.txt" | tail -3
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
    done
done
tar -C "$bench_out" -czf "$out/bench_json.tgz" . && rm -rf "$bench_out"
echo "gpu_check: $([ $status = 0 ] && echo passed || echo FAILED) (logs in $out)"
exit $status
