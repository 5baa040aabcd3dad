"""The verbs values of the emulated provider: access flags, queue pair states,
asynchronous events, the error a refused verbs call raises, the work completion it
delivers, and the limits and opcode mapping every part of the emulation shares."""

from __future__ import annotations

import os
from dataclasses import dataclass

from transfer_engine.errors import TransferEngineError
from transfer_engine.transport.rdma.plan import Opcode, WcOpcode

__all__ = ["ACCESS_LOCAL_WRITE", "ACCESS_REMOTE_WRITE", "ACCESS_REMOTE_READ", "QpState",
           "AsyncEvent", "VerbsError", "WorkCompletion", "WC_WITH_IMM", "MAX_MSG",
           "wc_opcode"]

# enum ibv_access_flags
ACCESS_LOCAL_WRITE = 1
ACCESS_REMOTE_WRITE = 2
ACCESS_REMOTE_READ = 4


class QpState:
    """``enum ibv_qp_state`` values."""

    RESET, INIT, RTR, RTS, SQD, SQE, ERR = range(7)
    NAMES = ("RESET", "INIT", "RTR", "RTS", "SQD", "SQE", "ERR")


class AsyncEvent:
    """``enum ibv_event_type`` values the emulation raises."""

    CQ_ERR = 0
    QP_FATAL = 1
    PORT_ERR = 10
    DEVICE_FATAL = 8


class VerbsError(TransferEngineError):
    """A verbs call failed; ``errno`` as the C library would set it (the emulated
    counterpart of pyverbs' ``PyverbsRDMAError``). Nothing was posted or changed."""

    def __init__(self, what: str, code: int) -> None:
        super().__init__(f"{what} failed. Errno: {code}, {os.strerror(code)}")
        self.error_code = code


@dataclass(slots=True)
class WorkCompletion:
    """One CQE, with the fields of ``struct ibv_wc`` the transport reads."""

    wr_id: int
    status: int
    opcode: int
    vendor_err: int = 0
    byte_len: int = 0
    imm_data: int = 0  # network byte order, as verbs delivers it
    qp_num: int = 0
    wc_flags: int = 0  # 2 = IBV_WC_WITH_IMM


WC_WITH_IMM = 2
MAX_MSG = 1 << 31


def wc_opcode(op: Opcode) -> int:
    return {Opcode.WRITE: WcOpcode.RDMA_WRITE, Opcode.WRITE_WITH_IMM: WcOpcode.RDMA_WRITE,
            Opcode.SEND: WcOpcode.SEND, Opcode.SEND_WITH_IMM: WcOpcode.SEND,
            Opcode.READ: WcOpcode.RDMA_READ}[op]
