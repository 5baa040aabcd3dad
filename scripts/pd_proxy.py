"""Disaggregation router: an OpenAI-style ``/v1/completions`` endpoint in front of any
number of prefill and decode vLLM servers joined by our connector.

For each request the scheduler (:mod:`scheduler.router`, policy ``--policy``) picks a
prefill server (the one caching the longest prefix of the prompt, weighed against its
queue) and a decode server (room for the KV, nearest to the prefill server). The proxy
asks the prefill server for one token with ``kv_transfer_params={"do_remote_decode":
true}``. With the default hand-off (``--handoff first``) that token goes to the client
at once and decode continues from the prompt's token ids plus that token, so decode's
first step samples the second token instead of recomputing the prompt's last; the
proxy detokenizes the joined tokens with the model's tokenizer
(:mod:`scheduler.handoff`) and applies stop strings, so text, usage and finish reasons
are one server's (chat too: decode continues from the templated prompt's token ids
on its completions endpoint). Requests it cannot reproduce exactly (``n`` > 1, logprobs,
echo, presence/frequency penalties, a seeded sampler, structured output or any other
field it does not know, limits only decode would refuse), and every request when the
tokenizer cannot be loaded, take the sequential hand-off (``--handoff sequential`` for
all): decode gets the original request with prefill's ``kv_transfer_params`` and its
answer is relayed.

Decode reads the KV from prefill's blocks. With ``--push``, prefill pushes it layer by
layer, as its forward computes it, into a room of the decode server's staging memory
instead: the router asks each decode server once where its connector workers are,
then names them and a fresh unguessable room id in prefill's ``kv_transfer_params``;
decode copies the room into its blocks when the request reaches it, and reads where
the room is not whole or not that request's.

Prompts of at most ``--local-below`` uncached tokens go straight to decode, and so does
every request while no prefill server can take it (one log line each).

Servers come from the command line (``--prefill URL ... --decode URL ...``) and/or from
the registry (``--registry tcp://HOST:PORT``: members announced with
``python -m scheduler.announce``, joining and leaving while the proxy runs). A server
that fails or dies before the decode answer starts (not one refusing the request, a
4xx, which the client gets as it is) is counted against its circuit breaker (ejected
after repeated failures, at most half of a pool at once) and the request is retried
on another one; once the answer has started streaming, a failure ends that response.

Start the pair and the proxy (one host; add ``"host"`` in the extra config for others)::

    CFG='"kv_connector":"TransferEngineConnector","kv_connector_module_path":"transfer_engine.connectors.vllm","kv_load_failure_policy":"recompute"'
    VLLM_CPU_OMP_THREADS_BIND=0 vllm serve MODEL --port 8100 \\
        --kv-transfer-config "{$CFG,\\"kv_role\\":\\"kv_producer\\"}" &
    VLLM_CPU_OMP_THREADS_BIND=1 vllm serve MODEL --port 8200 \\
        --kv-transfer-config "{$CFG,\\"kv_role\\":\\"kv_consumer\\"}" &
    python3 scripts/pd_proxy.py --port 8000 --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200      # more URLs after each flag, or --registry
    curl -s localhost:8000/v1/completions -H 'content-type: application/json' \\
        -d '{"model": "MODEL", "prompt": "Hello", "max_tokens": 16, "stream": true}'

The routing pieces live beside this file: ``pd_proxy_routing.py`` (router, request
view, tokenizers, options), ``pd_proxy_upstream.py`` (calls to the servers, the HTTP
server with its bound on clients), ``pd_proxy_http.py`` (bodies, errors, and every
request not routed here passed to a decode server) and ``pd_proxy_handoff.py``
(reading answers for the first-token hand-off).
"""

from __future__ import annotations

import http.client
import json
import secrets
import sys
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
if str(HERE) not in sys.path:  # the helpers beside this file, however it was loaded
    sys.path.insert(1, str(HERE))

from pd_proxy_handoff import (  # noqa: E402
    ClientGone,
    begin_stream,
    end_stream,
    end_with_error,
    event,
    first_ended,
    follow,
    relay,
    response_role,
    usage,
    write_chunk,
)
from pd_proxy_http import (  # noqa: E402
    ROUTED,
    BodyError,
    error_body,
    pass_on,
    read_body,
    refuse,
    target,
)
from pd_proxy_routing import (  # noqa: E402
    CHARS_PER_TOKEN,
    Tokenizers,
    arguments,
    make_router,
    request_of,
)
from pd_proxy_upstream import (  # noqa: E402
    BoundedServer,
    DecodeWorkers,
    UpstreamError,
    json_headers,
    post_json,
)

from scheduler.errors import NoInstanceError  # noqa: E402
from scheduler.handoff import (  # noqa: E402
    SAMPLING_FIELDS,
    TextAssembler,
    refused,
    requested_max_tokens,
    unsupported,
)
from scheduler.router import Decision, Router  # noqa: E402
from transfer_engine.control.client import RegistryStore  # noqa: E402


class Proxy(BaseHTTPRequestHandler):
    router: Router = make_router()
    timeout = 60.0  # seconds a client's connection may stall (http.server's socket bound)
    upstream_timeout = 600.0  # seconds per call to a prefill or decode server
    connect_timeout = 10.0
    protocol_version = "HTTP/1.1"
    handoff = "first"  # or "sequential"
    tokenizers = Tokenizers()
    push: DecodeWorkers | None = None  # where decode's workers are: prefill pushes

    def _error(self, code: int, message: str) -> None:
        self._reply(code, error_body(code, message))

    def _reply(self, code: int, data: bytes) -> None:
        """An answer as a server gave it (a client error is the client's to see)."""
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _pass_on(self) -> None:
        """Not a request the router routes: the first decode server answers it."""
        try:
            body = read_body(self) if self.command not in ("GET", "HEAD") else None
        except BodyError as exc:
            refuse(self, exc)
            return
        self.path = target(self)
        pass_on(self, self.command, body, self.router.fleet.decode.urls,
                self.upstream_timeout)

    do_GET = do_HEAD = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _pass_on  # noqa: N815

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        try:
            body = read_body(self)
        except BodyError as exc:  # what is left of it is no request
            refuse(self, exc)
            return
        self.path = target(self)
        path = self.path.split("?", 1)[0]  # a query changes nothing
        ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        try:
            request = json.loads(body) if path in ROUTED and ctype == "application/json" \
                else None
        except (ValueError, RecursionError):
            request = None
        if not isinstance(request, dict) or not isinstance(
                request.get("kv_transfer_params", {}), dict | None):
            # the server's own words for it (a body it cannot parse, another path)
            pass_on(self, "POST", body, self.router.fleet.decode.urls,
                    self.upstream_timeout)
            return
        self.path = path
        request.pop("kv_transfer_params", None)  # the router's alone to set
        try:
            self._dispatch(request)
        except Exception as exc:  # a bug or an input not foreseen: answer, count nothing
            self.log_message("request failed: %r", exc)
            if self._holding is not None:
                self._release(self._holding[0])
            if self._started:
                self.close_connection = True  # the client sees a cut-off response
            else:
                self._error(500, f"the router failed on this request: {exc!r:.200}")
        finally:
            self._holding = None

    def _dispatch(self, request: dict[str, Any]) -> None:
        self._started = False
        router = self.router
        fleet = router.fleet
        chat = self.path == "/v1/chat/completions"
        first = self.handoff == "first" and unsupported(request, chat=chat) is None
        tok = None
        if (first or router.local_prefill_tokens > 0) and fleet.decode.urls:
            tok = self.tokenizers.get(fleet.decode.urls[0], self.headers["Authorization"])
            first = first and unsupported(request, chat, self.tokenizers.max_model_len(
                fleet.decode.urls[0])) is None
        req = request_of(request, router.cost.block_tokens * CHARS_PER_TOKEN, tok)
        failed: set[str] = set()
        errors: list[str] = []
        # a request a server refuses for its limits goes where it is refused for free
        local = refused(request, chat, self.tokenizers.max_model_len(
            fleet.decode.urls[0]) if fleet.decode.urls else None)
        attempts = 2 + len(fleet.prefill) + len(fleet.decode)
        for _ in range(attempts):
            try:
                decision = router.route(req, time.monotonic(), exclude=failed, local=local)
                self._holding = (decision, decision.prefill is not None, True)
            except NoInstanceError as exc:
                if local or getattr(exc, "role", None) != "prefill":
                    errors.append(str(exc))
                    break
                # no prefill server can take it: decode prefills it itself
                why = errors[-1] if errors else str(exc)
                sys.stderr.write(f"pd_proxy: no prefill server ({why:.200}); "
                                 "prefilling on decode\n")
                local = True
                continue
            try:
                url = fleet.decode.urls[decision.decode]
                tok = self.tokenizers.get(url, self.headers["Authorization"]) \
                    if first and not decision.local else None
                # without a limit of the request's, decode's is where the context ends
                if tok is not None and (requested_max_tokens(request, chat) is not None
                                        or self.tokenizers.max_model_len(url)):
                    self._first_token(request, decision, failed, errors, tok)
                    return
                conn, resp = self._attempt(request, decision, failed, errors)
            except UpstreamError:
                continue
            if conn is None or resp is None:
                return  # answered (an upstream refusal the client must see)
            self._relay(decision, conn, resp)
            return
        code = 503 if not errors or "no live instance" in errors[-1] else 502
        self._error(code, "no server could take the request: " + "; ".join(errors[-4:]))

    def _fail(self, name: str, why: str, failed: set[str], errors: list[str]) -> None:
        with self.router.fleet.lock:
            self.router.fleet.traffic.breakers.record(name, False)
        failed.add(name)
        errors.append(f"{name}: {why}")

    def _ok(self, name: str) -> None:
        with self.router.fleet.lock:
            self.router.fleet.traffic.breakers.record(name, True)

    _started = False  # a response's status line went out

    def send_response(self, code: int, message: str | None = None) -> None:
        self._started = True
        super().send_response(code, message)

    # The request's dispatch as the router counts it, released once whatever happens:
    # (decision, prefill still counted, decode still counted).
    _holding: tuple[Decision, bool, bool] | None = None

    def _prefill_done(self, d: Decision) -> None:
        held = self._holding
        if held is not None and held[0] is d and held[1]:
            self._holding = (d, False, held[2])
            self.router.fleet.prefill_done(d.prefill, d.decode, time.monotonic())

    def _release(self, d: Decision) -> None:
        """The request left the fleet: what the router still counts of it goes."""
        self._prefill_done(d)
        held = self._holding
        if held is not None and held[0] is d and held[2]:
            self._holding = (d, held[1], False)
            self.router.fleet.decode_done(d.decode, d.kv_tokens, time.monotonic(),
                                          local_prefill=d.local)

    def _handover(self, request: dict[str, Any], d: Decision) -> dict[str, Any]:
        """prefill's kv_transfer_params: hand the KV over to decode, pushing it layer
        by layer into a room of decode's (a fresh unguessable id) once decode's
        workers are known."""
        params: dict[str, Any] = {"do_remote_decode": True}
        if self.push is not None:
            workers = self.push.get(self.router.fleet.decode.urls[d.decode],
                                    request.get("model"), self.headers["Authorization"])
            if workers:
                params["push"] = {"room": secrets.token_urlsafe(24), "to": workers}
        return params

    def _prefill(self, pre: dict[str, Any], d: Decision, failed: set[str],
                 errors: list[str], need_params: bool = True,
                 ended: Any = None) -> dict[str, Any] | None:
        """Prefill's answer to ``pre``; ``None`` once an error was answered to the
        client. An answer without kv_transfer_params is an error unless
        ``ended(answer)`` (its first token ended it, so prefill hands nothing over).
        Raises :class:`UpstreamError` when a retry may help."""
        fleet = self.router.fleet
        assert d.prefill is not None
        name = fleet.prefill.names[d.prefill]
        try:
            conn, resp = post_json(fleet.prefill.urls[d.prefill], self.path, pre,
                                   self.upstream_timeout, auth=self.headers["Authorization"])
            try:
                raw = resp.read()
            finally:
                conn.close()
        except (OSError, http.client.HTTPException) as exc:
            self._fail(name, f"prefill failed: {exc!r}", failed, errors)
            self._release(d)
            raise UpstreamError from exc
        self._prefill_done(d)
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = raw[:200].decode("utf-8", "replace")
        if resp.status >= 500 or not isinstance(answer, dict):
            self._fail(name, f"prefill answered {resp.status}", failed, errors)
            self._release(d)
            raise UpstreamError
        if resp.status != 200:  # the request's own error, as one server answers it
            self._release(d)
            self._reply(resp.status, raw)
            return None
        if need_params and not answer.get("kv_transfer_params") and not (
                ended is not None and ended(answer)):
            self._release(d)
            self._error(502, "prefill server returned no kv_transfer_params: is the "
                        "connector mounted with kv_role kv_producer?")
            return None
        self._ok(name)
        return answer

    def _attempt(self, request: dict[str, Any], d: Decision, failed: set[str],
                 errors: list[str]
                 ) -> tuple[http.client.HTTPConnection | None, http.client.HTTPResponse | None]:
        """The sequential hand-off: prefill (unless local), then start decode with the
        original request. Returns the decode connection and response with the status
        line read; ``(None, None)`` once a client error was answered. Raises
        :class:`UpstreamError` when a retry may help."""
        fleet = self.router.fleet
        dec_url = fleet.decode.urls[d.decode]
        decode_body = request
        if d.prefill is not None:
            pre = {k: v for k, v in request.items()  # its first token only
                   if k not in ("max_completion_tokens", "stream_options")}
            pre.update(max_tokens=1, stream=False,
                       kv_transfer_params=self._handover(request, d))
            if type(request.get("min_tokens")) is int:  # else decode's to refuse
                pre["min_tokens"] = min(1, request["min_tokens"])
            answer = self._prefill(pre, d, failed, errors, ended=first_ended)
            if answer is None:
                return None, None
            params = answer.get("kv_transfer_params")
            decode_body = dict(request, kv_transfer_params=params) if params else request
        name = fleet.decode.names[d.decode]
        try:
            conn, resp = post_json(dec_url, self.path, decode_body, self.upstream_timeout,
                                   None if request.get("stream") else self.connection,
                                   self.headers["Authorization"])
        except ClientGone:  # before decode answered: it aborts the request
            self._release(d)
            self.close_connection = True
            return None, None
        except (OSError, http.client.HTTPException) as exc:
            self._fail(name, f"decode failed: {exc!r}", failed, errors)
            self._release(d)
            raise UpstreamError from exc
        if resp.status >= 500:
            conn.close()
            self._fail(name, f"decode answered {resp.status}", failed, errors)
            self._release(d)
            raise UpstreamError
        return conn, resp

    # --- the first-token hand-off ---------------------------------------------------

    def _first_token(self, request: dict[str, Any], d: Decision, failed: set[str],
                     errors: list[str], tok: Any) -> None:
        """Prefill samples the first token, which goes to the client at once; decode
        continues from the prompt plus that token (its first step samples the second
        token instead of recomputing the prompt's last), and the router detokenizes
        the joined tokens itself so that the text is exactly one server's. Raises
        :class:`UpstreamError` (nothing sent yet) when a retry may help."""
        fleet = self.router.fleet
        chat = self.path == "/v1/chat/completions"
        max_tokens = requested_max_tokens(request, chat)
        min_tokens = int(request.get("min_tokens") or 0)
        stream = bool(request.get("stream"))
        pre = {k: v for k, v in request.items()
               if k not in ("stop", "stream_options", "include_stop_str_in_output",
                            "max_completion_tokens")}
        pre.update(max_tokens=1, stream=False, return_token_ids=True,
                   min_tokens=min(1, min_tokens))
        if max_tokens != 1:  # the whole answer otherwise: nothing to hand over
            pre["kv_transfer_params"] = self._handover(request, d)
        answer = self._prefill(pre, d, failed, errors, need_params=max_tokens != 1,
                               ended=first_ended)
        if answer is None:
            return
        choice = (answer.get("choices") or [{}])[0]
        prompt_ids = answer.get("prompt_token_ids") if chat else choice.get(
            "prompt_token_ids")
        first = choice.get("token_ids")
        if not prompt_ids or not first:
            self._release(d)
            self._error(502, "prefill server returned no token ids")
            return
        asm = TextAssembler(tok, prompt_ids,
                            skip_special_tokens=request.get("skip_special_tokens", True),
                            stop=request.get("stop"), min_tokens=min_tokens,
                            include_stop_str_in_output=bool(
                                request.get("include_stop_str_in_output")))
        limit = self.tokenizers.max_model_len(fleet.decode.urls[d.decode])
        caps = [c for c in (max_tokens, limit and limit - len(prompt_ids)) if c is not None]
        rest = (min(caps) if caps else 0) - 1  # decode's part: vLLM stops at the context's end
        head = {"id": answer.get("id", "cmpl-pd"), "created": answer.get("created",
                int(time.time())), "model": answer.get("model", request.get("model"))}
        want_ids = bool(request.get("return_token_ids"))
        finish: str | None = None
        stop_reason: Any = None
        stopped_by_token = choice.get("finish_reason") == "stop"  # no stop strings there
        if asm.add(int(first[0]), stopped_by_token):
            finish, stop_reason = "stop", asm.stop_reason
        elif stopped_by_token:
            finish, stop_reason = "stop", choice.get("stop_reason")
        elif rest < 1:
            finish = choice.get("finish_reason") or "length"
        sent_ids = 0
        started = False

        obj = "chat.completion.chunk" if chat else "text_completion"

        with_usage = bool((request.get("stream_options") or {}).get("include_usage"))
        fingerprint = answer.get("system_fingerprint")

        def emit(text: str, fin: str | None, reason: Any) -> None:
            nonlocal sent_ids, started
            ids = None
            if want_ids:
                ids, sent_ids = asm.token_ids[sent_ids:], len(asm.token_ids)
            first_ids = prompt_ids if want_ids and not started else None
            events = [event(head, chat, text, fin, reason, ids,
                            None if chat else first_ids)]
            if chat and not started:  # the role alone comes first
                events.insert(0, event(head, chat, None, None, None, None, first_ids,
                                       role=response_role(request)))
            if fin is not None and not with_usage and fingerprint is not None:
                events[-1]["system_fingerprint"] = fingerprint  # on the last, as vLLM
            if not started:  # from here a failure is the client's or the stream's
                started = True  # (a client gone at once is no fault of decode's)
                begin_stream(self, 200, "text/event-stream; charset=utf-8")
            write_chunk(self, b"".join(b"data: " + json.dumps(e).encode() + b"\n\n"
                                       for e in events))

        conn: http.client.HTTPConnection | None = None
        try:
            if finish is None:
                params = answer.get("kv_transfer_params")
                dec = {k: request[k] for k in SAMPLING_FIELDS if k in request}
                dec.update(prompt=list(prompt_ids) + [int(first[0])], stream=True,
                           return_token_ids=True, kv_transfer_params=params)
                dec["max_tokens"] = rest
                if min_tokens > 1:
                    dec["min_tokens"] = min_tokens - 1
                url = urllib.parse.urlsplit(fleet.decode.urls[d.decode])
                conn = http.client.HTTPConnection(url.hostname or "127.0.0.1",
                                                  url.port or 80, timeout=self.upstream_timeout)
                conn.request("POST", "/v1/completions", json.dumps(dec).encode(),
                             json_headers(self.headers["Authorization"]))
                if stream:  # the first token goes out while decode starts
                    emit(asm.delta(False), None, None)
                resp = conn.getresponse()
                if 400 <= resp.status < 500:  # the request's own error, as decode says it
                    refused = resp.read()
                    self._release(d)  # before the client can see the end
                    d = None  # type: ignore[assignment]
                    self._refused(resp.status, refused, started)
                    return
                if resp.status != 200:
                    raise http.client.HTTPException(
                        f"decode answered {resp.status}: {resp.read()[:300]!r}")
                finish, stop_reason = follow(resp, asm, emit if stream else None,
                                             None if stream else self.connection)
                if finish is None:
                    raise http.client.HTTPException("decode's answer ended unfinished")
                self._ok(fleet.decode.names[d.decode])
            elif max_tokens != 1 and isinstance(stop_reason, str) and \
                    answer.get("kv_transfer_params"):
                # a stop string at once: prefill holds blocks nobody reads (an EOS or
                # stop token first held none); they are free when its lease runs out
                self.log_message("first token ended %s; prefill's lease frees its blocks",
                                 head["id"])
            if stream:
                emit(asm.delta(True), finish, stop_reason)
                if with_usage:
                    chunk = dict(head, object=obj, choices=[],
                                 usage=usage(prompt_ids, asm, streamed=True))
                    if fingerprint is not None:
                        chunk["system_fingerprint"] = fingerprint
                    write_chunk(self, b"data: " + json.dumps(chunk).encode() + b"\n\n")
                write_chunk(self, b"data: [DONE]\n\n")
                self._release(d)  # before the client can see the end
                d = None  # type: ignore[assignment]
                end_stream(self)
                return
            c = dict(choice, finish_reason=finish, stop_reason=stop_reason,
                     token_ids=asm.token_ids if want_ids else None)
            body = dict(answer, choices=[c], usage=usage(prompt_ids, asm),
                        kv_transfer_params=None)
            if chat:
                c["message"] = dict(choice.get("message") or {"role": "assistant"},
                                    content=asm.text)
                body["prompt_token_ids"] = prompt_ids if want_ids else None
            else:
                c.update(text=asm.text, prompt_token_ids=prompt_ids if want_ids else None)
            data = json.dumps(body).encode()
            self._release(d)  # before the client can see the answer
            d = None  # type: ignore[assignment]
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            if d is None or isinstance(exc, ClientGone):  # the client went away
                self.close_connection = True
                return
            name = fleet.decode.names[d.decode]
            if conn is not None:  # decode's fault, whether the client saw a token or not
                self._fail(name, f"decode failed: {exc!r}", failed, errors)
            if not started and conn is not None:
                self._release(d)
                d = None  # type: ignore[assignment]
                raise UpstreamError from exc
            self.log_message("decode stream from %s ended: %r", name, exc)
            self.close_connection = True  # the client sees a cut-off response
        finally:
            if conn is not None:
                conn.close()  # before its end: decode aborts the request
            if d is not None:
                self._release(d)

    def _refused(self, status: int, body: bytes, started: bool) -> None:
        """Decode refused the request: its answer, or once prefill's first token went
        out, its error as an event of the stream, as a server reports a late error."""
        if not started:
            self._reply(status, body)
        else:
            end_with_error(self, body)

    def _relay(self, d: Decision, conn: http.client.HTTPConnection,
               resp: http.client.HTTPResponse) -> None:
        relay(self, self.router.fleet.decode.names[d.decode], lambda: self._release(d),
              conn, resp)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        sys.stderr.write(f"pd_proxy: {format % args}\n")


def main(argv: list[str] | None = None) -> None:
    args = arguments(argv, __doc__.split("\n\n")[0])
    Proxy.router = make_router(args.prefill, args.decode, policy=args.policy,
                               local_prefill_tokens=args.local_below)
    Proxy.upstream_timeout = args.timeout
    Proxy.handoff = args.handoff
    key = f"Bearer {args.api_key}" if args.api_key else None
    Proxy.push = DecodeWorkers(auth=key) if args.push else None
    Proxy.tokenizers = Tokenizers(args.tokenizer, key)
    store = subscription = None
    try:
        if args.registry:
            store = RegistryStore(args.registry, timeout=5.0, name="pd_proxy")
            subscription = Proxy.router.fleet.watch(store)
        with BoundedServer((args.host, args.port), Proxy) as server:
            fleet = Proxy.router.fleet
            if Proxy.push is not None:  # where decode's workers are, asked at once
                for url in fleet.decode.urls:
                    Proxy.push.get(url, None)
            print(f"pd_proxy on http://{args.host}:{server.server_port} policy "
                  f"{Proxy.router.policy}: prefill {fleet.prefill.names}, decode "
                  f"{fleet.decode.names}{' + registry ' + args.registry if store else ''}",
                  flush=True)
            try:
                server.serve_forever()
            except KeyboardInterrupt:
                pass
    finally:
        if subscription is not None:
            subscription.close()
        if store is not None:
            store.close()


if __name__ == "__main__":
    main()
