"""A decoder's word that it has read a request's blocks, the notification that frees
them on prefill: one reader's (``SENT_PREFIX`` + request id), or reader ``k`` of ``n``
where several decode ranks read slices of one prefill rank's blocks
(``SENT_OF_PREFIX`` + ``k/n:`` + request id), freed once all ``n`` have said so."""

from __future__ import annotations

from transfer_engine.connectors.vllm.config import SENT_OF_PREFIX, SENT_PREFIX

__all__ = ["sent_note", "SentNotes"]

MAX_READERS = 64  # as many as tensor-parallel ranks the params may name
MAX_PENDING = 4096  # requests heard of from some readers but not all


def sent_note(request_id: str, reader: int = 0, readers: int = 1) -> bytes:
    """The notification reader ``reader`` of ``readers`` sends once it has every byte."""
    if readers == 1:
        return SENT_PREFIX + request_id.encode()
    return SENT_OF_PREFIX + f"{reader}/{readers}:".encode() + request_id.encode()


class SentNotes:
    """Prefill's tally of the readers heard from, per request (not thread-safe: the
    worker calls it under its lock)."""

    def __init__(self) -> None:
        self._heard: dict[str, tuple[int, set[int]]] = {}  # id -> (readers, heard from)

    def add(self, payload: bytes) -> str | None:
        """The request whose every reader has now said so, or None (another's note,
        not all readers yet, or a malformed one, which is ignored)."""
        if payload.startswith(SENT_PREFIX):
            return payload[len(SENT_PREFIX):].decode(errors="replace")
        if not payload.startswith(SENT_OF_PREFIX):
            return None
        head, sep, rid_bytes = payload[len(SENT_OF_PREFIX):].partition(b":")
        k, slash, n = head.partition(b"/")
        if not (sep and slash and k.isdigit() and n.isdigit()):
            return None
        reader, readers = int(k), int(n)
        if not 0 <= reader < readers <= MAX_READERS:
            return None
        rid = rid_bytes.decode(errors="replace")
        want, heard = self._heard.get(rid, (readers, set()))
        want = max(want, readers)  # readers that disagree on their number: the larger
        heard.add(reader)
        if len(heard) >= want:
            self._heard.pop(rid, None)
            return rid
        if rid not in self._heard and len(self._heard) >= MAX_PENDING:
            self._heard.clear()  # notes for requests never held here must not pile up
        self._heard[rid] = (want, heard)
        return None
