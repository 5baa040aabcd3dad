"""Mooncake's integer results: the error.h codes and transfer statuses its Python API
returns, the exception that carries a code inside the API until a method returns it,
and the logger every failure's reason goes to (WARNING)."""

from __future__ import annotations

import logging

__all__ = ["ERR_INVALID_ARGUMENT", "ERR_ADDRESS_NOT_REGISTERED", "ERR_ADDRESS_OVERLAPPED",
           "ERR_DNS", "ERR_SOCKET", "ERR_METADATA", "STATUS_COMPLETED", "STATUS_PENDING",
           "STATUS_FAILED", "STATUS_TIMEOUT", "Failed", "log"]

log = logging.getLogger("transfer_engine.connectors.mooncake.engine")
"""The logger of the whole ``TransferEngine`` API, named after the module users import."""

# Mooncake's error.h codes that its Python API returns.
ERR_INVALID_ARGUMENT = -1
ERR_ADDRESS_NOT_REGISTERED = -3
ERR_ADDRESS_OVERLAPPED = -7
ERR_DNS = -101
ERR_SOCKET = -102
ERR_METADATA = -200

# transfer_check_status results
STATUS_COMPLETED = 1
STATUS_PENDING = 0
STATUS_FAILED = -1
STATUS_TIMEOUT = -2


class Failed(Exception):
    """A call fails with ``code``; ``str`` says why (logged, never raised out)."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
