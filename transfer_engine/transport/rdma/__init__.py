"""RDMA transport over pyverbs: RC queue pairs, one rail per NIC pair, write-with-imm.

Two providers sit under the same rail code: pyverbs on a real NIC (``verbs``) and,
on machines without one, the emulated verbs provider (``provider="emulated"`` or
``TE_RDMA_PROVIDER=emulated``: ``emulated`` and ``emulated_device``), which
enforces verbs semantics and moves bytes between processes. A work's verbs requests
are built as columns (``batch``) and posted as one chain.

pyverbs (rdma-core's Python bindings, a distribution package) is imported when the
transport is built, never by ``import transfer_engine``. Without pyverbs, without a
device or without an active port the constructor raises ``NotSupportedError`` saying
which, and the engine falls back to tcp. Pure logic (immediates, work-request building,
error mapping, QP info) lives in ``plan`` and is tested without hardware.
Everything that touches pyverbs objects directly (``Device``, ``open_devices``, error
translation, QP attributes, chained work requests and their release) lives in
``verbs``.

Connection protocol (the handshake carries only what ``start`` returns)::

    start() -> {"devices": [names], "endpoint": "tcp://host:port"}

``connect(peer, info, ...)`` is one-sided, but an RC queue pair needs the other side's
QP number, so each transport owns a small TCP side channel at ``endpoint``. Frames are a
4-byte little-endian length and a msgpack map with ``"v": 1``:

    target    -> {"challenge": magic and nonce}                       (on accept)
    initiator -> {"kind": "connect", "rail": index, "device": the target NIC wanted,
                  "ticket", "nonce", "proof": the rail ticket's answer, "qp": our QpInfo}
    target    -> {"qp": its fresh QP's QpInfo, "proof": the target's answer,
                  "segments": {id: [base, length, rkey]}}
    initiator -> {"kind": "segments", "ids": [...]}   (a segment registered later)
    target    -> {"segments": {...}}                    or {"error": code, "message"}

No rkey and no QP leave the target before the initiator proved a ticket from the
engines' handshake (:mod:`~transfer_engine.control.tickets`); the target takes the
peer's name from the ticket, and refuses anything else with a bare "rail refused".
The side connection stays open for the life of the rail: when it closes, the target
destroys that QP, so a dead initiator leaks nothing. Rail ``k`` to a peer uses local NIC
``k % n_local`` and remote NIC ``k % n_remote`` (``plan.stripe_pairs``); ask for
``rails_per_nic * n_nics`` rails to get several QPs per NIC pair.

Data path: a work becomes RDMA WRITE (or READ) requests of at most ``max_sge`` entries
and ``max_msg_sz`` bytes; only the last is signaled. Work with an immediate ends in
RDMA_WRITE_WITH_IMM (``plan.encode_imm``), which consumes a receive at the target;
its completion feeds ``host.deliver_immediate`` exactly as the stream transports do.
Notification bytes do not fit in 32 bits, so work whose immediate carries ``notify``
ends instead in a plain WRITE then a SEND_WITH_IMM whose payload is a
``plan.NOTIFY_HEADER`` (full 64-bit id, expected, origin rail, and a later attempt's
first attempt id) and the bytes; RC ordering makes the SEND land after the WRITE. The
immediates of a transfer's later attempt (after a teardown or a fallback) travel so
too, so that the target notifies once for all attempts. Notify payloads are bounded by
``max_notify``.

Failure: the first error completion moves a QP to the error state and flushes the
rest. Errors that blame the path (retry exceeded, flush, fatal) hand the rail's
unfinished work, in order, to a healthy sibling rail to the same peer; there every
immediate travels as a SEND with header naming the failed rail, and the target counts
each (transfer, origin rail) once, so an immediate whose ack was lost is not counted
twice. Errors that blame the request (remote access: a deregistered segment) fail that
work only. When no sibling is left the work fails with ``PeerLostError``, and
``info("peer_failures")`` tells the engine to demote the peer to tcp.

Completions are read by one thread per NIC that sleeps on the completion channel's file
descriptor (``select.poll`` with a timeout, GIL released) rather than spinning;
pyverbs' own ``get_cq_event`` holds the GIL while it blocks, so it is only called once
the descriptor is readable.
"""

from transfer_engine.transport.rdma.rail import RdmaRail
from transfer_engine.transport.rdma.transport import RdmaTransport

__all__ = ["RdmaTransport", "RdmaRail"]
