"""One error tree for the whole project.

Every error the engine raises is a :class:`TransferEngineError`. Transfer failures carry
the context a operator needs to find the fault (peer, op, transport, segment, offset,
length); they are split by *phase* (connect, register, protocol, timeout) and by *blame*
(the peer broke it: :class:`PeerLostError`; you closed it: :class:`ClosedError`).
The kvstore and scheduler packages subclass the same root.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "TransferEngineError",
    "TransferError",
    "InvalidDescriptorError",
    "RegistrationError",
    "ConnectError",
    "ProtocolError",
    "AuthenticationError",
    "TransferTimeout",
    "TransferCancelled",
    "PeerLostError",
    "ClosedError",
    "BusyError",
    "NotSupportedError",
    "UnknownPeerError",
    "RemoteError",
    "error_from_wire",
]


class TransferEngineError(Exception):
    """Root of every error raised by this project."""


class TransferError(TransferEngineError):
    """A transfer (or a step of one) failed.

    What is left behind: any prefix of the destination bytes may have been written; the
    notification was not delivered. Fields that are unknown are ``None`` and omitted
    from the message.
    """

    _FIELDS = ("peer", "op", "transport", "segment", "offset", "length")

    def __init__(
        self,
        message: str,
        *,
        peer: str | None = None,
        op: str | None = None,
        transport: str | None = None,
        segment: Any = None,
        offset: int | None = None,
        length: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.peer = peer
        self.op = op
        self.transport = transport
        self.segment = segment
        self.offset = offset
        self.length = length

    def context(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self._FIELDS if getattr(self, f) is not None}

    def with_context(self, **fields: Any) -> TransferError:
        """Fills fields that are still unknown (the caller knows more than the raiser)."""
        for key, value in fields.items():
            if getattr(self, key, None) is None and value is not None:
                setattr(self, key, value)
        return self

    def __str__(self) -> str:
        ctx = " ".join(f"{k}={v}" for k, v in self.context().items())
        return f"{self.message} [{ctx}]" if ctx else self.message

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.message, self.context()))


def _rebuild(cls: type[TransferError], message: str, ctx: dict[str, Any]) -> TransferError:
    return cls(message, **ctx)


class InvalidDescriptorError(TransferError):
    """A descriptor names an unknown or deregistered segment, lies out of bounds, has zero
    length, or its pair has a different length. Nothing was written."""


class RegistrationError(TransferError):
    """Memory could not be registered (unsupported object, not contiguous, not writable,
    device not reachable by a transport). Nothing stays registered."""


class ConnectError(TransferError):
    """A peer could not be reached or refused the handshake."""


class ProtocolError(TransferError):
    """A message was malformed, of an unknown kind or version, or too large."""


class AuthenticationError(ProtocolError):
    """A control message was unsigned, signed with another secret, stale or replayed; or
    the other side refused ours. Nothing was acted upon."""


class TransferTimeout(TransferError):
    """A bounded wait ran out. The transfer may still complete or fail later."""


class TransferCancelled(TransferError):
    """The caller cancelled the transfer (``TransferHandle.cancel``). As after any
    failure, a prefix of the destination may have been written; by the time the handle
    fails, this side moves none of its bytes any more (see
    :mod:`transfer_engine.handle` for what may still reach the peer)."""


class PeerLostError(TransferError):
    """The other side went away (process died, connection reset) mid-operation."""


class ClosedError(TransferError):
    """This side closed the engine, rail or segment the operation needed."""


class BusyError(TransferError):
    """A resource is in use and cannot be changed now (e.g. deregistering a segment that a
    transfer is writing into)."""


class NotSupportedError(TransferError):
    """The operation or transport is not available here (missing device or library)."""


class UnknownPeerError(TransferError):
    """No peer of that name is connected."""


class RemoteError(TransferError):
    """The peer reported a failure it could not classify further."""


_WIRE_CODES: dict[int, type[TransferError]] = {
    1: InvalidDescriptorError,
    2: ProtocolError,
    3: ClosedError,
    4: BusyError,
    5: NotSupportedError,
    6: RemoteError,
    7: AuthenticationError,
}
_CODES_BY_TYPE = {cls: code for code, cls in _WIRE_CODES.items()}


def error_code(exc: BaseException) -> int:
    """The wire code a peer uses to report ``exc`` back to the initiator."""
    for cls in type(exc).__mro__:
        if cls in _CODES_BY_TYPE:
            return _CODES_BY_TYPE[cls]
    return 6


def error_from_wire(code: int, message: str, **ctx: Any) -> TransferError:
    """Rebuilds the error a peer reported; unknown codes become :class:`RemoteError`."""
    return _WIRE_CODES.get(code, RemoteError)(message, **ctx)
