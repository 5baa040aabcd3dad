"""The first-token hand-off's reading of answers: whether prefill's first token ended
the request, decode's stream read into the text assembler, and the usage of the joined
answer. (A helper of ``scripts/pd_proxy.py``, imported from the scripts folder once the
repository root is on ``sys.path``.)"""

from __future__ import annotations

import http.client
import json
import select
import socket
from typing import Any

from scheduler.handoff import TextAssembler

__all__ = ["ClientGone", "first_ended", "usage", "event", "response_role", "follow", "relay",
           "begin_stream", "write_chunk", "end_stream", "end_with_error"]


def first_ended(answer: dict[str, Any]) -> bool:
    """Prefill's first token ended the request (EOS or a stop token): it hands no KV
    over, and decode prefills the prompt itself in the sequential hand-off."""
    return bool((answer.get("choices") or [{}])[0].get("finish_reason") == "stop")


def usage(prompt_ids: list[int], asm: TextAssembler, streamed: bool = False
          ) -> dict[str, Any]:
    """The joined answer's usage, as vLLM writes it: a whole answer names its empty
    details, a stream's usage event leaves them out."""
    n = len(asm.token_ids)
    out: dict[str, Any] = {"prompt_tokens": len(prompt_ids),
                           "total_tokens": len(prompt_ids) + n, "completion_tokens": n}
    if not streamed:
        out.update(prompt_tokens_details=None, completion_tokens_details=None)
    return out


def response_role(request: dict[str, Any]) -> Any:
    """The role of a chat answer, as vLLM names it: the assistant's, or without a
    generation prompt, the last message's (its continuation)."""
    if request.get("add_generation_prompt", True):
        return "assistant"
    last = (request.get("messages") or [{}])[-1]
    return last.get("role", "assistant") if isinstance(last, dict) else "assistant"


def event(head: dict[str, Any], chat: bool, text: str | None, fin: str | None,
          reason: Any, ids: list[int] | None, prompt_ids: list[int] | None = None,
          role: Any = "assistant") -> dict[str, Any]:
    """One streamed event of the joined answer, keyed as vLLM keys a single server's:
    ``text`` None is chat's opening event (the role alone, before any token); ``ids``
    None unless the client asked for token ids; ``prompt_ids`` on the first event
    only, when asked."""
    c: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": fin}
    chunk = dict(head, object="chat.completion.chunk" if chat else "text_completion",
                 choices=[c])
    if not chat:
        c.update(text=text, stop_reason=reason, prompt_token_ids=prompt_ids, token_ids=ids)
    elif text is None:
        c["delta"] = {"role": role, "content": ""}
        chunk.update(prompt_token_ids=prompt_ids, prompt_text=None)
    else:
        c.update(delta={"content": text}, token_ids=ids)
        if fin is not None:
            c["stop_reason"] = reason
    return chunk


def client_gone(sock: socket.socket) -> bool:
    """Whether the client closed its side of ``sock`` (it sends nothing while it
    waits for an answer, so a readable socket with no bytes is its end)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


def follow(resp: http.client.HTTPResponse, asm: TextAssembler,
           emit: Any, client: socket.socket | None = None) -> tuple[str | None, Any]:
    """Reads decode's stream into ``asm`` until it ends or a stop string ends the
    completion first; streams each piece of text through ``emit`` (unless None).
    Returns the finish reason and stop reason. Raises :class:`ClientGone` once the
    ``client`` waiting for the whole answer has gone (decode is then aborted, as a
    server alone aborts a request whose client left)."""
    for raw in iter(resp.readline, b""):
        if client is not None and client_gone(client):
            raise ClientGone("the client closed its connection")
        line = raw.strip()
        if not line.startswith(b"data: "):
            continue
        if line == b"data: [DONE]":
            break
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise ValueError(f"decode stream error: {chunk['error']}")
        added = False
        for c in chunk.get("choices") or []:
            ids = c.get("token_ids") or []
            fin = c.get("finish_reason")
            for i, t in enumerate(ids):
                added = True
                if asm.add(int(t), fin == "stop" and i == len(ids) - 1):
                    return "stop", asm.stop_reason
            if fin is not None:
                return fin, c.get("stop_reason")
        if emit is not None and added:
            # a chunk per step, as vLLM streams: its text may be empty (a token
            # that ends inside a character, text held back for a stop string)
            emit(asm.delta(False), None, None)
    return None, None


class ClientGone(OSError):
    """Writing to the client failed: no fault of the servers'."""


def begin_stream(handler: Any, status: int, content_type: str) -> None:
    """Starts an answer whose length is not known yet: chunked for an HTTP/1.1 client;
    an HTTP/1.0 one, which cannot read chunks, gets the bytes as they are and the
    connection's close as their end. :class:`ClientGone` if the client is gone."""
    handler.chunked = handler.request_version not in ("HTTP/0.9", "HTTP/1.0")
    try:
        handler.send_response(status)
        handler.send_header("Content-Type", content_type)
        if handler.chunked:
            handler.send_header("Transfer-Encoding", "chunked")
        else:
            handler.send_header("Connection", "close")
            handler.close_connection = True
        handler.end_headers()
    except OSError as exc:
        raise ClientGone(str(exc)) from exc


def write_chunk(handler: Any, data: bytes) -> None:
    """One piece of an answer :func:`begin_stream` started, sent at once;
    :class:`ClientGone` if the client cannot take it."""
    try:
        handler.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n"
                            if handler.chunked else data)
        handler.wfile.flush()
    except OSError as exc:
        raise ClientGone(str(exc)) from exc


def end_stream(handler: Any) -> None:
    """Ends an answer :func:`begin_stream` started (a chunked one's last chunk)."""
    try:
        if handler.chunked:
            handler.wfile.write(b"0\r\n\r\n")
        handler.wfile.flush()
    except OSError:
        handler.close_connection = True


def end_with_error(handler: Any, error: bytes) -> None:
    """Ends an event stream with ``error`` (a server's JSON error answer) as its
    last event, as vLLM reports an error met once its stream has begun."""
    for data in (error.strip() or b'{"error": "decode refused the request"}', b"[DONE]"):
        write_chunk(handler, b"data: " + data + b"\n\n")
    end_stream(handler)


def relay(handler: Any, name: str, release: Any, conn: http.client.HTTPConnection,
          resp: http.client.HTTPResponse) -> None:
    """Passes decode server ``name``'s answer on to the client of ``handler`` (the
    sequential hand-off) as it comes; ``release`` frees the routing's hold before the
    client can see the end. A failure of decode's counts against it, the client's
    going away does not."""
    done = False
    try:
        begin_stream(handler, resp.status, resp.getheader("Content-Type",
                                                          "application/json"))
        while True:
            chunk = resp.read1(65536)
            if not chunk:
                break
            write_chunk(handler, chunk)
        done = True
    except ClientGone:
        handler.close_connection = True
    except (OSError, http.client.HTTPException) as exc:
        handler.close_connection = True  # the client sees a cut-off response
        handler._fail(name, f"decode's answer cut off: {exc!r}", set(), [])
    finally:
        conn.close()
        release()  # before the client can see the end
        if done:
            handler._ok(name)
    if done:
        end_stream(handler)
