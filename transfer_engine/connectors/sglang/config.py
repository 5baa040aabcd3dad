"""Configuration of the SGLang backend, and how its buffers become engine segments."""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from transfer_engine.errors import NotSupportedError

__all__ = ["SGLangBackendConfig", "local_ip", "device_memory"]

_WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def local_ip() -> str:
    """The address of the interface that routes off this host (no packet is sent);
    loopback when there is none."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


@dataclass(frozen=True)
class SGLangBackendConfig:
    """Settings of one rank's manager.

    :param host: address this rank's engine and side channel listen on and peers reach
        it by.
    :param transports: engine transport names, best first (``None``: ``$TE_TRANSPORTS``
        or the engine's default).
    :param bootstrap_host: where a prefill rank reaches its bootstrap server (the port
        is ``server_args.disaggregation_bootstrap_port``).
    :param timeout_s: seconds for one handshake or control round trip.
    :param bootstrap_timeout_s: prefill: seconds a sender waits for the decode side to
        claim its room before it fails.
    :param waiting_timeout_s: decode: seconds from ``send_metadata`` until every page
        must have landed.
    :param heartbeat_s: decode: seconds between liveness pings of the prefill ranks it
        waits on; a rank that misses ``heartbeat_misses`` in a row fails its rooms.
    :param heartbeat_misses: see ``heartbeat_s``.
    :param fence_timeout_s: decode: seconds a failed room waits for prefill to say its
        writes ended before decode cuts the prefill engine off (fences.py); its pages are
        given back only then. Also the longest one cut waits for served requests.
    :param register_attempts: prefill: tries to reach the bootstrap server at start-up
        (backing off between them) before giving up.
    """

    host: str = "127.0.0.1"
    transports: tuple[str, ...] | None = None
    bootstrap_host: str = "127.0.0.1"
    timeout_s: float = 10.0
    bootstrap_timeout_s: float = 300.0
    waiting_timeout_s: float = 300.0
    heartbeat_s: float = 5.0
    heartbeat_misses: int = 2
    register_attempts: int = 5
    fence_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("timeout_s", "bootstrap_timeout_s", "waiting_timeout_s",
                     "heartbeat_s", "fence_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not math.isfinite(self.fence_timeout_s):
            raise ValueError(f"fence_timeout_s must be finite, got {self.fence_timeout_s}")
        if self.heartbeat_misses < 1 or self.register_attempts < 1:
            raise ValueError("heartbeat_misses and register_attempts must be at least 1")

    @classmethod
    def from_env(cls, server_args: Any = None,
                 environ: Mapping[str, str] | None = None) -> SGLangBackendConfig:
        """Reads ``TE_SGLANG_*`` variables, falling back to SGLang's own
        (``SGLANG_HOST_IP``, ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``,
        ``..._WAITING_TIMEOUT``, ``..._HEARTBEAT_INTERVAL``, ``..._HEARTBEAT_MAX_FAILURE``)
        and to ``server_args.host`` for the bootstrap host."""
        env = os.environ if environ is None else environ

        def pick(*names: str) -> str | None:
            return next((env[n] for n in names if env.get(n)), None)

        server_host = str(getattr(server_args, "host", "") or "")
        transports = pick("TE_SGLANG_TRANSPORTS")
        return cls(
            host=pick("TE_SGLANG_HOST", "SGLANG_HOST_IP") or local_ip(),
            transports=tuple(t.strip() for t in transports.split(",") if t.strip())
            if transports else None,
            bootstrap_host=pick("TE_SGLANG_BOOTSTRAP_HOST")
            or _WILDCARDS.get(server_host, server_host),
            timeout_s=float(pick("TE_SGLANG_TIMEOUT") or cls.timeout_s),
            bootstrap_timeout_s=float(pick("TE_SGLANG_BOOTSTRAP_TIMEOUT",
                                           "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT")
                                      or cls.bootstrap_timeout_s),
            waiting_timeout_s=float(pick("TE_SGLANG_WAITING_TIMEOUT",
                                         "SGLANG_DISAGGREGATION_WAITING_TIMEOUT")
                                    or cls.waiting_timeout_s),
            heartbeat_s=float(pick("TE_SGLANG_HEARTBEAT_INTERVAL",
                                   "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL")
                              or cls.heartbeat_s),
            heartbeat_misses=int(pick("TE_SGLANG_HEARTBEAT_MAX_FAILURE",
                                      "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE")
                                 or cls.heartbeat_misses),
            fence_timeout_s=float(pick("TE_SGLANG_FENCE_TIMEOUT") or cls.fence_timeout_s),
        )


class _CudaMemory:
    """Raw device memory seen through the CUDA array interface, which is how the engine
    registers GPU memory given only an address (SGLang hands out pointers)."""

    def __init__(self, address: int, nbytes: int, device_id: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (address, False), "strides": None,
                                         "version": 3}
        self.device = _Device(device_id)


@dataclass(frozen=True)
class _Device:
    id: int


def device_memory(address: int, nbytes: int, device: str, gpu_id: int) -> Any:
    """What to pass to :meth:`Engine.register` for SGLang memory at ``address`` on
    ``device`` (``server_args.device``: ``cpu`` or ``cuda``)."""
    if device.startswith("cuda"):
        return _CudaMemory(address, nbytes, gpu_id)
    if device == "cpu":
        return (address, nbytes)
    raise NotSupportedError(f"KV memory on device {device!r} cannot be registered with the "
                            "transfer engine (cpu and cuda only)")
