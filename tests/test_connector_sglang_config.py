"""The SGLang backend's settings, read from SGLang's and our environment variables,
and the device memory it registers from SGLang's raw pointers (no SGLang needed)."""

from __future__ import annotations

import pytest

from tests.helpers import sglang_worker as sw
from transfer_engine.connectors.sglang import SGLangBackendConfig
from transfer_engine.connectors.sglang.config import device_memory
from transfer_engine.errors import NotSupportedError
from transfer_engine.segment import describe_memory


def test_config_from_environment_and_device_memory() -> None:
    args = sw.server_args(8998)
    args.host = "0.0.0.0"
    cfg = SGLangBackendConfig.from_env(args, {
        "SGLANG_HOST_IP": "10.1.2.3", "TE_SGLANG_TRANSPORTS": "tcp, shm",
        "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "60", "TE_SGLANG_HEARTBEAT_INTERVAL": "2",
        "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "4"})
    assert (cfg.host, cfg.bootstrap_host, cfg.transports) == ("10.1.2.3", "127.0.0.1",
                                                              ("tcp", "shm"))
    assert (cfg.waiting_timeout_s, cfg.heartbeat_s, cfg.heartbeat_misses) == (60.0, 2.0, 4)
    assert cfg.bootstrap_timeout_s == 300.0
    with pytest.raises(ValueError, match="heartbeat_s must be positive"):
        SGLangBackendConfig(heartbeat_s=0)
    # SGLang hands out device pointers: they register through the CUDA array interface
    info = describe_memory(device_memory(0x7F0000000000, 4096, "cuda", 3))
    assert (info.address, info.length, info.device) == (0x7F0000000000, 4096, "cuda:3")
    assert device_memory(0x1000, 64, "cpu", 0) == (0x1000, 64)
    with pytest.raises(NotSupportedError, match="'npu'"):
        device_memory(0x1000, 64, "npu", 0)
