"""Congestion control for TCP rails: a loss-based algorithm on rails whose two ends are
on one host (see :mod:`~transfer_engine.transport.tcp`), the host's or the operator's
choice elsewhere."""

from __future__ import annotations

import ipaddress
import socket

__all__ = ["AUTO", "LOOPBACK_CONGESTION", "congestion_of", "set_congestion",
           "check_congestion", "is_loopback_socket"]

AUTO = "auto"
LOOPBACK_CONGESTION = ("cubic", "reno")  # loss-based, in order of preference
_TCP_CONGESTION = getattr(socket, "TCP_CONGESTION", None)  # Linux only


def is_loopback_socket(sock: socket.socket) -> bool:
    """Whether both ends of a connected socket are on this host."""
    try:
        peer, own = sock.getpeername()[0], sock.getsockname()[0]
        return peer == own or ipaddress.ip_address(peer.split("%")[0]).is_loopback
    except (OSError, ValueError):
        return False


def congestion_of(sock: socket.socket) -> str | None:
    """The congestion control algorithm ``sock`` uses (None where it cannot be read)."""
    if _TCP_CONGESTION is None:
        return None
    try:
        name = sock.getsockopt(socket.IPPROTO_TCP, _TCP_CONGESTION, 16)
    except OSError:
        return None
    return name.split(b"\0", 1)[0].decode("ascii", "replace")


def set_congestion(sock: socket.socket, policy: str | None) -> str | None:
    """Applies a :class:`TcpTransport` ``congestion`` policy to a connected socket.

    Returns the algorithm set, or None where the host's choice stays: no policy, a rail
    to another host under ``"auto"``, or (``"auto"`` only) no loss-based algorithm the
    host allows. Raises OSError when the host refuses an algorithm named explicitly.
    """
    if policy is None or _TCP_CONGESTION is None:
        return None
    if policy != AUTO:
        sock.setsockopt(socket.IPPROTO_TCP, _TCP_CONGESTION, policy.encode())
        return policy
    if not is_loopback_socket(sock):
        return None
    for name in LOOPBACK_CONGESTION:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, _TCP_CONGESTION, name.encode())
        except OSError:  # not built in, or not allowed to this user
            continue
        return name
    return None


def check_congestion(policy: str | None) -> None:
    """Raises ValueError, at construction, for an algorithm this host refuses."""
    if policy is None or policy == AUTO or _TCP_CONGESTION is None:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            set_congestion(probe, policy)
        except OSError as exc:
            try:
                with open("/proc/sys/net/ipv4/tcp_allowed_congestion_control") as f:
                    allowed = f.read().split()
            except OSError:
                allowed = []
            raise ValueError(f"congestion control {policy!r} refused by this host "
                             f"({exc.strerror}); allowed here: {' '.join(allowed) or '?'}"
                             ) from None
