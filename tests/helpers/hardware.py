"""Why a hardware test cannot run here: one function per kind of hardware.

``conftest.py`` turns a non-None reason into a skip of every test marked ``rdma`` or
``gpu``, so a machine without the device reports *what* is missing instead of failing.
The checks import nothing heavy at module import time.
"""

from __future__ import annotations

import functools
import os

__all__ = ["rdma_skip_reason", "gpu_skip_reason"]


@functools.cache
def rdma_skip_reason(sysfs_root: str = "/sys") -> str | None:
    """None when pyverbs imports and a device has an ACTIVE port, else the reason."""
    ib = os.path.join(sysfs_root, "class", "infiniband")
    try:
        import pyverbs.device as device  # noqa: PLC0415
    except ImportError as exc:
        return (f"no RDMA device: pyverbs not importable ({exc}); install python3-pyverbs "
                "(see docs/rdma.md)")
    if not os.path.isdir(ib) or not os.listdir(ib):
        return f"no RDMA device: {ib} is empty or missing"
    try:
        found = device.get_device_list()
    except Exception as exc:  # PyverbsRDMAError: no devices, no provider library
        return f"no RDMA device: pyverbs cannot list devices ({exc})"
    if not found:
        return "no RDMA device: pyverbs lists none"
    from transfer_engine.topology import discover_nics  # noqa: PLC0415

    if not any(n.active for n in discover_nics(sysfs_root)):
        return f"no RDMA device: no ACTIVE port among {[n.name for n in discover_nics(sysfs_root)]}"
    return None


@functools.cache
def gpu_skip_reason() -> str | None:
    """None when cupy finds a CUDA device, else the reason."""
    from transfer_engine.gpu import cuda_unavailable_reason  # noqa: PLC0415

    reason = cuda_unavailable_reason()
    return f"no CUDA GPU: {reason}" if reason else None
