"""GPU memory for transfer_engine_bench's ``--use_vram``: the buffers each side
registers (CUDA tensors filled from the run's seed), their bytes read back for the
check, and the PCIe copy baseline a staged transfer cannot beat."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from bench.engine_bench_options import UsageError
from bench.stats import fill_random

__all__ = ["require", "device_buffer", "to_host", "copy_baseline"]


def require(gpu_id: int) -> Any:
    try:
        import torch
    except ImportError:
        raise UsageError("--use_vram needs torch with CUDA (pip install torch)") from None
    if not torch.cuda.is_available():
        raise UsageError("--use_vram: torch finds no CUDA device")
    if not 0 <= gpu_id < torch.cuda.device_count():
        raise UsageError(f"--gpu_id {gpu_id}: this host has {torch.cuda.device_count()} "
                         "CUDA device(s)")
    return torch


def device_buffer(nbytes: int, gpu_id: int, seed: int) -> Any:
    """``nbytes`` on ``cuda:gpu_id`` holding what ``fill_random(seed)`` gives a host
    buffer (so that READs are checked against the same bytes as on the host)."""
    torch = require(gpu_id)
    host = np.empty(nbytes, dtype=np.uint8)
    fill_random(host, seed)
    out = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{gpu_id}")
    out.copy_(torch.from_numpy(host))
    torch.cuda.synchronize(out.device)
    return out


def to_host(buf: Any) -> np.ndarray:
    """A CUDA tensor's bytes on the host (a copy)."""
    return buf.cpu().numpy()


def copy_baseline(nbytes: int, gpu_id: int, duration: float = 0.5) -> dict[str, float]:
    """GB/s of one ``nbytes`` copy at a time between the device and pinned host memory,
    each way: what a transfer staged through host memory is measured against."""
    torch = require(gpu_id)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{gpu_id}")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev.random_(0, 256)
    out = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        dst.copy_(src, non_blocking=True)  # warm-up
        torch.cuda.synchronize(dev.device)
        count, t0 = 0, time.perf_counter()
        end = t0 + duration
        while True:
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(dev.device)
            count += 1
            if time.perf_counter() >= end or count >= 100_000:
                break
        out[f"baseline_{name}_gbps"] = count * nbytes / (time.perf_counter() - t0) / 1e9
    return out
