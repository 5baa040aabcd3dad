"""What a client of an OpenAI-compatible server sees of an answer, streamed or not: one
reader for completions and chat completions, so that tests compare answers field by
field whichever way they were served."""

from __future__ import annotations

import json
from typing import Any

from bench.vllm_servers import http_json


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    return {k: usage[k] for k in ("prompt_tokens", "completion_tokens")}


def answer(port: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """POSTs ``body`` to ``path`` and returns the answer's text, finish and stop reason,
    token ids (completions, when asked) and usage (when given)."""
    status, raw = http_json(port, "POST", path, body, timeout=120)
    assert status == 200, raw
    chat = "chat" in path
    if not body.get("stream"):
        whole = json.loads(raw)
        c = whole["choices"][0]
        return {"text": c["message"]["content"] if chat else c["text"],
                "finish_reason": c["finish_reason"], "stop_reason": c["stop_reason"],
                "token_ids": None if chat else c.get("token_ids"),
                "usage": _usage(whole["usage"])}
    assert raw.rstrip().endswith("data: [DONE]"), raw[-300:]
    out: dict[str, Any] = {"text": "", "finish_reason": None, "stop_reason": None,
                           "token_ids": None, "usage": None}
    for line in raw.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            out["usage"] = _usage(chunk["usage"])
        for c in chunk["choices"]:
            out["text"] += (c["delta"].get("content") or "") if chat else c["text"]
            if not chat and c.get("token_ids") is not None:
                out["token_ids"] = (out["token_ids"] or []) + c["token_ids"]
            if c.get("finish_reason") is not None:
                out["finish_reason"], out["stop_reason"] = c["finish_reason"], \
                    c.get("stop_reason")
    return out


def completion(port: int, body: dict[str, Any]) -> dict[str, Any]:
    return answer(port, "/v1/completions", body)


def chat(port: int, body: dict[str, Any]) -> dict[str, Any]:
    return answer(port, "/v1/chat/completions", body)


def sse_text(body: str) -> str:
    """The completion text of a streamed answer."""
    return "".join(json.loads(line[6:])["choices"][0]["text"] for line in body.splitlines()
                   if line.startswith("data: ") and line != "data: [DONE]")


def _keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _keys(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_keys(v) for v in value[:1]]  # a list's shape: its first item's
    return None if value is None else type(value).__name__


def shape(port: int, path: str, body: dict[str, Any]) -> Any:
    """What a strict client parses of an answer, values aside: each event's keys
    (recursively, with the types of their values, ``None`` kept), consecutive equal
    shapes counted once (how many tokens one event carries is the server's timing)."""
    status, raw = http_json(port, "POST", path, body, timeout=120)
    assert status == 200, raw
    if not body.get("stream"):
        return [_keys(json.loads(raw))]
    shapes: list[Any] = []
    for line in raw.splitlines():
        if line.startswith("data: "):
            s = line[6:] if line == "data: [DONE]" else _keys(json.loads(line[6:]))
            if not shapes or shapes[-1] != s:
                shapes.append(s)
    return shapes


def _earlier(event: Any, last: Any) -> bool:
    """Whether ``event`` has the shape of a stream's ``last`` event before its end:
    no key the last one lacks, and the same values but where it still has None (no
    finish reason yet)."""
    if event is None:
        return True
    if isinstance(event, dict) and isinstance(last, dict):
        return event.keys() <= last.keys() and all(_earlier(v, last[k])
                                                   for k, v in event.items())
    if isinstance(event, list) and isinstance(last, list):
        return len(event) == len(last) and all(map(_earlier, event, last))
    return bool(event == last)


def alike(got: list[Any], want: list[Any]) -> bool:
    """Two :func:`shape` results a client parses alike: the same opening and closing
    events, and middle events of shapes the other also sends. A loaded server may fold
    every token after the first into the last event, so one side can lack the middle
    shapes the other has; it never has one of its own. One folded into its closing
    event alone matches a stream whose earlier events are that event's, unfinished."""
    if len(got) <= 2 or len(want) <= 2:
        if got == want:
            return True
        short, full = sorted((got, want), key=len)
        return (len(short) == 2 and full[-2:] == short
                and all(_earlier(e, full[-2]) for e in full[:-2]))
    if got[0] != want[0] or got[-2:] != want[-2:]:
        return False
    a, b = ({json.dumps(s, sort_keys=True) for s in x[1:-2]} for x in (got, want))
    return a <= b or b <= a
