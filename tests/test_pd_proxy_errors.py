"""The router gives a request's limits and errors as one vLLM server gives them, over
scripted prefill and decode servers (``tests/helpers/pd_scripted.py``):

- an absent output limit is vLLM's (16 tokens for completions, the rest of the context
  for chat), so decode continues with one token fewer (a chat without a limit goes the
  sequential way where the router does not know the context);
- a request a server would refuse for its limits (an empty stop string,
  ``max_completion_tokens`` 0, ``min_tokens`` over ``max_tokens``, ``max_tokens``
  over the context or below 1, ``n`` 0) goes straight to decode, which says why, and
  costs prefill nothing; a client's own ``kv_transfer_params`` reach no server;
- a server's own refusal (4xx) reaches the client with its status and answer, from
  prefill or from decode (once a stream has begun, as its last event), and counts as
  no failure of the server: the next request goes through;
- a client gone before the first byte of its stream is no failure of decode's either:
  the request is not run again for nobody; a decode that fails once the first token
  went out is one (its breaker counts it), and an unfinished answer is no success;
- a body refused unread closes its connection; a long prompt is tokenized on a
  bounded head.
"""

from __future__ import annotations

import http.client
import json
import socket
import struct
import threading
import time
from typing import Any

from tests.helpers.pd_scripted import (
    SEEN,
    Scripted,
    byte_tokenizer,
    exchange,
    pd_proxy,
    post,
    scripted_proxy,
)

CHAT = "/v1/chat/completions"


def _idle() -> bool:
    fleet = pd_proxy.Proxy.router.fleet
    return (int(fleet.prefill.queue.sum()) == 0 and int(fleet.decode.queue.sum()) == 0
            and float(fleet.decode.kv_used.sum()) == 0.0)


def _decode_request(port: int, body: dict[str, Any], path: str = "/v1/completions"
                    ) -> dict[str, Any]:
    """What decode was asked for ``body`` (sent to the router)."""
    SEEN.clear()
    status, _ = post(port, body, path=path)
    assert status == 200, body
    (dec,) = [b for r, b in SEEN if r == "decode"]
    return dec


def test_absent_limits_and_requests_a_server_refuses() -> None:
    tok = byte_tokenizer()
    gen = tok.encode(" of the cache block of the engine").ids
    with scripted_proxy(tok, gen, max_model_len=64) as port:
        base = {"model": "m", "prompt": "the cache"}
        handed = {"do_remote_decode": True}
        # completions: vLLM's default of 16, one of them prefill's
        assert _decode_request(port, base)["max_tokens"] == 15
        assert _decode_request(port, dict(base, max_tokens=None))["max_tokens"] == 15
        chat = {"model": "m", "messages": [{"role": "user", "content": "the cache"}]}
        dec = _decode_request(port, chat, CHAT)  # chat: up to the context's end
        assert dec["prompt"][-1] == gen[0]  # the first-token hand-off
        assert dec["max_tokens"] == 64 - len(dec["prompt"])
        assert _decode_request(port, dict(chat, max_completion_tokens=3, max_tokens=9),
                               CHAT)["max_tokens"] == 2
        # what decode alone would refuse: the original request goes to decode, and
        # prefill computes nothing for it (a client must not make it hold KV for free)
        for path, extra in (("/v1/completions", {"stop": [""], "max_tokens": 4}),
                            ("/v1/completions", {"stop": "", "max_tokens": 4}),
                            (CHAT, {"max_completion_tokens": 0, "max_tokens": 5}),
                            ("/v1/completions", {"min_tokens": 5, "max_tokens": 3}),
                            ("/v1/completions", {"max_tokens": 65}),
                            ("/v1/completions", {"max_tokens": -1}),
                            ("/v1/completions", {"n": 0, "max_tokens": 4}),
                            # sequential for n: prefill's one token needs no more
                            ("/v1/completions", {"n": 2, "min_tokens": 8,
                                                 "max_tokens": 64})):
            body = dict(chat if path == CHAT else base, **extra)
            dec = _decode_request(port, body, path)
            assert {k: dec[k] for k in extra} == extra, extra
            assert ("messages" in dec) == (path == CHAT)
            pre = next((b for r, b in SEEN if r == "prefill"), None)
            if extra.get("n") == 2:
                assert pre is not None
                assert pre["max_tokens"] == 1 and pre["kv_transfer_params"] == handed
                assert pre.get("min_tokens", 0) <= 1 and "max_completion_tokens" not in pre
            else:
                assert pre is None, extra
                assert "kv_transfer_params" not in dec
            assert _idle()
        # a client's own kv_transfer_params never reach a server
        dec = _decode_request(port, dict(base, max_tokens=4, kv_transfer_params={
            "remote_endpoints": ["198.18.0.9:1"], "do_remote_prefill": True}))
        assert dec["kv_transfer_params"] != {"remote_endpoints": ["198.18.0.9:1"],
                                             "do_remote_prefill": True}
        # vLLM stops at the context's end, whatever max_tokens asks (one prompt token
        # short of it: prefill's token is the last there is room for)
        dec = _decode_request(port, dict(base, max_tokens=64))
        assert dec["max_tokens"] == 64 - len(dec["prompt"])
        full = next(t for n in range(20, 200) if len(tok.encode(t := "cache " * n).ids) >= 63)
        assert len(tok.encode(full).ids) == 63  # prefill's token fills the context
        SEEN.clear()
        status, body = post(port, dict(base, prompt=full, max_tokens=5))
        assert status == 200 and json.loads(body)["choices"][0]["finish_reason"] == "length"
        assert [r for r, _ in SEEN] == ["prefill"]
    with scripted_proxy(tok, gen, max_model_len=None) as port:
        # no limit and no context known: decode sets the end itself (sequentially)
        assert "messages" in _decode_request(port, chat, CHAT)
        assert _decode_request(port, base)["max_tokens"] == 15


def test_a_servers_refusal_reaches_the_client_as_it_gave_it() -> None:
    tok = byte_tokenizer()
    gen = tok.encode(" of the cache block").ids
    error = {"error": {"message": "This model's maximum context length is 64 tokens.",
                       "type": "BadRequestError", "param": None, "code": 400}}
    base = {"model": "m", "prompt": "the cache", "max_tokens": 4}
    for role in ("prefill", "decode"):
        for status in (400, 404):
            refusals = {role: (status, error)}
            with scripted_proxy(tok, gen, refuse=refusals) as port:
                got, body = post(port, base)
                assert (got, json.loads(body)) == (status, error), role
                assert _idle()
                got, body = post(port, dict(base, stream=True))
                if role == "prefill":  # nothing was streamed yet: its answer as it is
                    assert (got, json.loads(body)) == (status, error)
                else:  # prefill's first token went out: the error ends the stream
                    events = [line[6:] for line in body.splitlines()
                              if line.startswith("data: ")]
                    assert got == 200 and events[-1] == "[DONE]", body
                    assert json.loads(events[-2]) == error
                    assert "choices" in json.loads(events[0])
                assert _idle()
                # a refusal is the request's fault, not the server's: it stays in use
                refusals.clear()
                SEEN.clear()
                assert post(port, base)[0] == 200
                assert [r for r, _ in SEEN] == ["prefill", "decode"]


def test_a_client_gone_before_its_first_byte_is_no_servers_failure(monkeypatch: Any
                                                                   ) -> None:
    tok = byte_tokenizer()
    gen = tok.encode(" of the cache block").ids
    monkeypatch.setattr(Scripted, "delay", 0.3)  # the client leaves while prefill works
    with scripted_proxy(tok, gen) as port:
        body = json.dumps({"model": "m", "prompt": "the cache", "max_tokens": 4,
                           "stream": True}).encode()
        SEEN.clear()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: "
                      + str(len(body)).encode() + b"\r\n\r\n" + body)
            time.sleep(0.1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        deadline = time.monotonic() + 10  # gone with a reset: the router's writes fail
        while not _idle() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _idle()
        assert [r for r, _ in SEEN].count("prefill") == 1  # not run again for nobody
        board = pd_proxy.Proxy.router.fleet.traffic.breakers
        assert all(b.failures == 0 for b in board._breakers.values())
        assert post(port, {"model": "m", "prompt": "the cache", "max_tokens": 4})[0] == 200


def _board() -> dict[str, int]:
    board = pd_proxy.Proxy.router.fleet.traffic.breakers
    return {name: b.failures for name, b in board._breakers.items()}


def test_a_decode_that_fails_after_the_first_token_counts_against_it(monkeypatch: Any
                                                                     ) -> None:
    """Decode answers 500, or ends its stream unfinished, after prefill's first token
    went out: the client's stream is cut off, and the failure counts against decode
    (streamed requests once never ejected a dead decode server); a non-streamed one
    is answered with an error, never a short 200."""
    tok = byte_tokenizer()
    gen = tok.encode(" of the cache block").ids
    modes = iter(["500", "cut", "500", "cut"])

    def broken(self: Any) -> None:
        if self.role != "decode":
            return real(self)
        self.rfile.read(int(self.headers["Content-Length"]))
        SEEN.append(("decode", {}))
        if next(modes) == "500":
            data = b'{"error": {"message": "EngineDeadError", "code": 500}}'
            self.send_response(500)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        chunk = b'data: {"choices": [{"index": 0, "token_ids": [%d]}]}\n\n' % gen[1]
        self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(chunk), chunk))

    real = Scripted.do_POST
    monkeypatch.setattr(Scripted, "do_POST", broken)
    with scripted_proxy(tok, gen) as port:
        for stream in (True, True, False, False):
            before = sum(_board().values())
            SEEN.clear()
            try:
                status, body = post(port, {"model": "m", "prompt": "the cache",
                                           "max_tokens": 8, "stream": stream})
            except (OSError, ValueError, http.client.HTTPException):  # cut off mid-stream
                status, body = 200, ""
            assert "[DONE]" not in body and (stream or status >= 500), (status, body)
            assert sum(_board().values()) > before
            assert _idle()


def test_a_passed_on_body_is_never_a_request_and_logprobs_0_is_reproduced() -> None:
    """A request for another path is read whole and passed to decode, so its body is
    never taken for a request of its own; one whose body cannot be read (a bad
    Content-Length) is answered and its connection closed; completions' ``logprobs:
    0`` asks for the sampled tokens' logprobs, so it takes the sequential hand-off
    where decode gives them."""
    tok = byte_tokenizer()
    gen = tok.encode(" of the cache block").ids
    with scripted_proxy(tok, gen) as port:
        inner = json.dumps({"model": "m", "prompt": "the cache", "max_tokens": 2}).encode()
        smuggled = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
                    + str(len(inner)).encode() + b"\r\n\r\n" + inner)
        SEEN.clear()
        got = exchange(port, b"POST /v1/other HTTP/1.1\r\nHost: x\r\nConnection: close"
                       b"\r\nContent-Length: " + str(len(smuggled)).encode() + b"\r\n\r\n"
                       + smuggled)
        assert got.count(b"HTTP/1.1 ") == 1 and b" 404 " in got
        assert SEEN == []
        got = exchange(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
                       b"12x\r\n\r\n" + smuggled)
        assert got.count(b"HTTP/1.1 ") == 1 and b" 400 " in got
        assert b"Connection: close" in got and SEEN == []
        # framed two ways at once (a length and chunks): refused, never guessed
        got = exchange(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5"
                       b"\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + smuggled)
        assert got.count(b"HTTP/1.1 ") == 1 and b" 400 " in got and SEEN == []
        dec = _decode_request(port, {"model": "m", "prompt": "the cache", "max_tokens": 4,
                                     "logprobs": 0})
        assert dec["logprobs"] == 0 and dec["prompt"] == "the cache"


def test_a_long_prompt_is_counted_on_a_bounded_head() -> None:
    """A tokenizer keeps the GIL while it runs: the router counts a prompt's tokens on
    its first characters and estimates the rest, so a prompt of megabytes does not
    stop its other requests; text the tokenizer cannot take is estimated."""
    from pd_proxy_routing import CHARS_PER_TOKEN, TOKENIZE_CHARS, request_of

    tok = byte_tokenizer()
    seen: list[int] = []

    class Counting:
        def encode(self, text: str) -> Any:
            seen.append(len(text))
            return tok.encode(text)

    big = "the cache " * 200_000
    req = request_of({"prompt": big}, 64, Counting())
    assert seen == [TOKENIZE_CHARS]
    assert req.input_tokens >= (len(big) - TOKENIZE_CHARS) // CHARS_PER_TOKEN
    assert request_of({"prompt": "a\ud800b"}, 64, tok).input_tokens >= 1


def test_a_client_that_leaves_a_whole_answer_it_waits_for_aborts_decode(monkeypatch: Any
                                                                       ) -> None:
    """A client waiting for a non-streamed answer closes its connection: decode's
    stream is closed at its next token (a server alone aborts such a request), not
    run to its end for nobody; no server is blamed."""
    tok = byte_tokenizer()
    gen = tok.encode(" of the cache block of the engine of the cache block").ids
    sent: list[int] = []

    def slow(self: Any) -> None:
        if self.role != "decode":
            return real(self)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        try:
            for t in self.gen[1:1 + body["max_tokens"]]:
                time.sleep(0.1)
                chunk = {"choices": [{"index": 0, "token_ids": [t], "finish_reason": None}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
                sent.append(t)
        except OSError:
            pass

    real = Scripted.do_POST
    monkeypatch.setattr(Scripted, "do_POST", slow)
    with scripted_proxy(tok, gen) as port:
        body = json.dumps({"model": "m", "prompt": "the cache", "max_tokens": 30}).encode()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
                      + str(len(body)).encode() + b"\r\n\r\n" + body)
            time.sleep(0.5)
        deadline = time.monotonic() + 10
        while not _idle() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        assert _idle() and 0 < len(sent) < 12
        assert all(f == 0 for f in _board().values())


def test_stream_options_the_hand_off_cannot_give_go_elsewhere() -> None:
    """Usage in every chunk takes the sequential hand-off (decode streams all of it);
    stream options a server refuses go straight to decode."""
    tok = byte_tokenizer()
    gen = tok.encode(" of the cache block").ids
    with scripted_proxy(tok, gen) as port:
        base = {"model": "m", "prompt": "the cache", "max_tokens": 4, "stream": True}
        dec = _decode_request(port, dict(base, stream_options={
            "include_usage": True, "continuous_usage_stats": True}))
        assert dec["prompt"] == "the cache" and dec["stream_options"][
            "continuous_usage_stats"] is True
        assert [r for r, _ in SEEN] == ["prefill", "decode"]
        dec = _decode_request(port, dict(base, stream_options={"include_usage": 5}))
        assert [r for r, _ in SEEN] == ["decode"] and "kv_transfer_params" not in dec


def test_models_and_health_are_decodes_and_a_query_string_changes_nothing(
        monkeypatch: Any) -> None:
    """What a client asks before its first request (``GET /v1/models``, ``/health``)
    is answered as decode answers it, and a query string on a path (some clients add
    an API version) is ignored, as the server ignores it."""
    tok = byte_tokenizer()
    gen = tok.encode(" of the cache block").ids
    models = json.dumps({"object": "list", "data": [{"id": "m", "max_model_len": 64}]})

    def do_get(self: Any) -> None:
        path = self.path.split("?", 1)[0]  # as vLLM's server reads it
        if path not in ("/v1/models", "/health"):
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        data = models.encode() if path == "/v1/models" else b""
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    monkeypatch.setattr(Scripted, "do_GET", do_get, raising=False)
    with scripted_proxy(tok, gen) as port:
        for path, want in (("/v1/models?x=1", models), ("/health", ""),
                           ("/v1/other", None)):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", path)
            resp = conn.getresponse()
            body = resp.read().decode()
            conn.close()
            assert (resp.status, body) == (200, want) if want is not None \
                else resp.status == 404, (path, resp.status, body)
        status, _ = post(port, {"model": "m", "prompt": "the cache", "max_tokens": 4},
                         path="/v1/completions?api-version=1")
        assert status == 200


def test_a_burst_of_clients_is_queued_not_reset() -> None:
    """Clients connecting all at once wait in the listen queue (vLLM's is 2048): none
    is reset, every one is answered."""
    tok = byte_tokenizer()
    gen = tok.encode(" of the cache block").ids
    with scripted_proxy(tok, gen) as port:
        n = 96
        ready = threading.Barrier(n)
        results: list[Any] = []

        def client() -> None:
            ready.wait(10)
            try:
                results.append(post(port, {"model": "m", "prompt": "the cache",
                                           "max_tokens": 2}, timeout=60)[0])
            except OSError as exc:
                results.append(exc)

        threads = [threading.Thread(target=client) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert results == [200] * n


def test_a_client_gone_before_decodes_whole_answer_aborts_it(monkeypatch: Any) -> None:
    """The sequential hand-off, not streamed: a client that leaves while decode works
    closes decode's request (vLLM aborts it), and the router lets it go at once, not
    when decode would have answered."""
    tok = byte_tokenizer()
    gen = tok.encode(" of the cache block").ids
    with scripted_proxy(tok, gen) as port:
        monkeypatch.setattr(pd_proxy.Proxy, "handoff", "sequential")
        monkeypatch.setattr(Scripted, "delay", 3.0)
        body = json.dumps({"model": "m", "prompt": "the cache", "max_tokens": 4}).encode()
        SEEN.clear()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: "
                      + str(len(body)).encode() + b"\r\n\r\n" + body)
            deadline = time.monotonic() + 10
            while len(SEEN) < 2 and time.monotonic() < deadline:  # decode has it
                time.sleep(0.02)
        gone = time.monotonic()
        while not _idle() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _idle() and time.monotonic() - gone < 2.0  # decode's answer: 3 s away
        board = pd_proxy.Proxy.router.fleet.traffic.breakers
        assert all(b.failures == 0 for b in board._breakers.values())


def test_a_chat_without_a_generation_prompt_answers_in_the_last_messages_role() -> None:
    from pd_proxy_handoff import event, response_role

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert response_role(chat) == "assistant"
    assert response_role(dict(chat, add_generation_prompt=False)) == "user"
    # a server reads "false" or 0 its own way: such a request takes the sequential path
    from scheduler.handoff import unsupported

    assert unsupported(dict(chat, add_generation_prompt="false"), chat=True) is not None
    assert unsupported(dict(chat, add_generation_prompt=False), chat=True) is None
    opening = event({}, True, None, None, None, None, role="user")
    assert opening["choices"][0]["delta"] == {"role": "user", "content": ""}


def test_the_clients_api_key_reaches_both_servers(monkeypatch: Any) -> None:
    """Servers started with an API key: the client's ``Authorization`` goes with the
    router's requests to prefill and decode, in both hand-offs."""
    tok = byte_tokenizer()
    gen = tok.encode(" of the cache block").ids
    seen: list[tuple[str, Any]] = []
    answer = Scripted.do_POST

    def keyed(self: Any) -> None:
        seen.append((self.role, self.headers["Authorization"]))
        answer(self)

    monkeypatch.setattr(Scripted, "do_POST", keyed)
    with scripted_proxy(tok, gen) as port:
        for handoff in ("first", "sequential"):
            monkeypatch.setattr(pd_proxy.Proxy, "handoff", handoff)
            seen.clear()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("POST", "/v1/completions", json.dumps(
                {"model": "m", "prompt": "the cache", "max_tokens": 4}).encode(),
                {"Content-Type": "application/json", "Authorization": "Bearer k1"})
            assert conn.getresponse().status == 200
            conn.close()
            assert seen == [("prefill", "Bearer k1"), ("decode", "Bearer k1")], handoff


def test_the_routers_own_queries_carry_a_key_and_a_refused_key_is_asked_again(
        tmp_path: Any) -> None:
    """Servers started with an API key answer the router's own queries (the model and
    its context, decode's workers) only with it: the router's ``--api-key`` when given,
    else the key of the request that needs the answer. A refused key is no answer: the
    next request, with the right key, gets the tokenizer and the workers."""
    from http.server import BaseHTTPRequestHandler

    from pd_proxy_upstream import DecodeWorkers

    from tests.helpers.pd_scripted import serve

    byte_tokenizer().save(str(tmp_path / "tokenizer.json"))
    asked: list[tuple[str, Any]] = []

    class Keyed(BaseHTTPRequestHandler):
        def _answer(self, body: dict[str, Any]) -> None:
            asked.append((self.command, self.headers["Authorization"]))
            ok = self.headers["Authorization"] == "Bearer k1"
            data = json.dumps(body if ok else {"error": "Unauthorized"}).encode()
            self.send_response(200 if ok else 401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802
            self._answer({"data": [{"id": "m", "root": str(tmp_path),
                                    "max_model_len": 96}]})

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            self._answer({"kv_transfer_params": {"te_endpoints": ["tcp://127.0.0.1:9"]}})

        def log_message(self, *args: Any) -> None:
            pass

    server, thread = serve(Keyed)
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        toks = pd_proxy.Tokenizers()
        assert toks.get(url, "Bearer wrong") is None and toks.max_model_len(url) is None
        assert toks.get(url, "Bearer k1") is not None and toks.max_model_len(url) == 96
        own = pd_proxy.Tokenizers(auth="Bearer k1")  # the router's own key wins
        assert own.get(url, "Bearer wrong") is not None
        assert [a for _, a in asked] == ["Bearer wrong", "Bearer k1", "Bearer k1"]

        workers = DecodeWorkers(wait_s=5.0)
        deadline = time.monotonic() + 10
        assert workers.get(url, "m", "Bearer wrong") is None
        while asked[-1] != ("POST", "Bearer wrong") and time.monotonic() < deadline:
            time.sleep(0.02)
        found = None
        while found is None and time.monotonic() < deadline:  # asked again, key right
            found = workers.get(url, "m", "Bearer k1")
            time.sleep(0.05)
        assert found == ["tcp://127.0.0.1:9"]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
