"""The first-token hand-off's text: a completion's tokens come from two servers (the
first from prefill, the rest from decode, whose prompt ends with that first token), so
the router detokenizes the joined stream itself, the way vLLM's incremental
detokenizer does for one server. A first token that ends inside a UTF-8 character is
held back until a later token completes it, and stop strings are found across the
join, which neither server's own text can do.

Needs ``tokenizers`` (and ``transformers`` to load a tokenizer the way vLLM does).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# request fields the hand-off reproduces exactly; any other field (or a value the
# checks in ``unsupported`` reject) sends the request down the sequential path
FIRST_TOKEN_FIELDS = frozenset({
    "model", "prompt", "max_tokens", "stream", "stream_options", "temperature", "top_p",
    "top_k", "min_p", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
    "skip_special_tokens", "include_stop_str_in_output", "return_token_ids", "n",
    "user", "repetition_penalty", "echo", "logprobs", "seed", "best_of",
    "spaces_between_special_tokens", "presence_penalty", "frequency_penalty",
})


CHAT_FIELDS = (FIRST_TOKEN_FIELDS - {"prompt", "best_of"}) | {
    "messages", "max_completion_tokens", "chat_template", "chat_template_kwargs",
    "add_generation_prompt", "continue_final_message", "top_logprobs"}

# the sampling fields decode's completions request keeps
SAMPLING_FIELDS = ("model", "temperature", "top_p", "top_k", "min_p", "stop_token_ids",
                   "ignore_eos", "repetition_penalty", "seed", "skip_special_tokens",
                   "spaces_between_special_tokens", "user")


COMPLETIONS_MAX_TOKENS = 16  # vLLM's completions default when the field is absent


def requested_max_tokens(body: dict[str, Any], chat: bool = False) -> Any:
    """The request's output limit as vLLM reads it: chat's ``max_completion_tokens``
    when set (a 0 too), else ``max_tokens``; an absent (or null) limit is 16 tokens for
    completions and the rest of the model's context for chat (None)."""
    limit = body.get("max_completion_tokens") if chat else None
    limit = body.get("max_tokens") if limit is None else limit
    return COMPLETIONS_MAX_TOKENS if limit is None and not chat else limit


def unsupported(body: dict[str, Any], chat: bool = False,
                max_model_len: int | None = None) -> str | None:
    """Why the first-token hand-off cannot give exactly a single server's answer to
    this completions (or chat completions) request, or ``None`` when it can. A request
    a server would refuse goes the sequential way, where a server says why (prefill
    sees only its first token's limits)."""
    return invalid(body, chat, max_model_len) or beyond(body, chat)


def beyond(body: dict[str, Any], chat: bool = False) -> str | None:
    """What of this (valid) request the first-token hand-off cannot reproduce, if
    anything: a server answers it, but only a single one gives that answer."""
    extra = sorted(set(body) - (CHAT_FIELDS if chat else FIRST_TOKEN_FIELDS))
    if extra:
        return f"fields {extra}"
    if chat and any(name in body and type(body[name]) is not bool
                    for name in ("add_generation_prompt", "continue_final_message")):
        return "a boolean the server reads its own way"  # "false", 0: the role it names
    if not chat:
        prompt = body.get("prompt")
        if not (isinstance(prompt, str) or (
                isinstance(prompt, list) and prompt
                and all(type(t) is int and 0 <= t < 1 << 31 for t in prompt))):
            return "not one prompt"
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("continuous_usage_stats"):
        return "fields ['stream_options.continuous_usage_stats']"  # usage in every chunk
    if body.get("n", 1) != 1 or body.get("best_of") not in (None, 1):
        return "n > 1"
    if body.get("echo") or body.get("top_logprobs") or (
            body.get("logprobs") if chat else body.get("logprobs") is not None):
        return "echo or logprobs"  # completions' logprobs 0 asks for the sampled ones
    if body.get("presence_penalty") or body.get("frequency_penalty"):
        return "penalties over output tokens"  # the first token would count as prompt
    if body.get("seed") is not None and body.get("temperature") != 0:
        return "a seeded sampler"  # decode's draws would start one token late
    if body.get("spaces_between_special_tokens") is False and \
            body.get("skip_special_tokens") is False:
        return "spaces_between_special_tokens"
    return None


def invalid(body: dict[str, Any], chat: bool = False,
            max_model_len: int | None = None) -> str | None:
    """Why a server would refuse this request for its limits or field types alone
    (as far as the router can tell), or ``None``."""
    if chat and not isinstance(body.get("messages"), list):
        return "no messages"
    # fields the hand-off reads itself, or drops, must have their types (else the
    # server's error); a value a server might still take goes to decode, which says
    for name in ("stream", "skip_special_tokens", "include_stop_str_in_output",
                 "return_token_ids"):
        if name in body and not isinstance(body[name], bool):
            return f"{name} not a boolean"
    for name in ("max_tokens", "max_completion_tokens"):
        if body.get(name) is not None and type(body[name]) is not int:
            return f"{name} not an integer"
    n = body.get("n", 1)
    if not (type(n) is int and n >= 1):
        return "n not a positive integer"
    min_tokens = body.get("min_tokens")
    if min_tokens is not None and (type(min_tokens) is not int or min_tokens < 0):
        return "min_tokens"
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        return "stop not a string or strings"
    if stop == "" or (isinstance(stop, list) and "" in stop):
        return "an empty stop string"
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, dict) and all(
            k in ("include_usage", "continuous_usage_stats") and isinstance(v, bool | None)
            for k, v in options.items())):
        return "stream_options not an object of booleans"
    if options is not None and not body.get("stream"):
        return "stream_options without stream"  # the server's error to give
    max_tokens = requested_max_tokens(body, chat)
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
        return "max_tokens"
    if max_tokens is not None and min_tokens is not None and min_tokens > max_tokens:
        return "min_tokens over max_tokens"
    if max_tokens is not None and max_model_len is not None and max_tokens > max_model_len:
        return "max_tokens over the model's context"
    return None


def refused(body: dict[str, Any], chat: bool = False,
            max_model_len: int | None = None) -> bool:
    """Whether a server would refuse this request for its limits or field types alone
    (it then goes straight to decode, which says why, and costs prefill nothing)."""
    return invalid(body, chat, max_model_len) is not None


def load_tokenizer(path: str) -> Any:
    """The ``tokenizers.Tokenizer`` vLLM detokenizes with for the model at ``path``."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)._tokenizer
    except Exception as exc:  # noqa: BLE001 - any failure: try the bare file
        file = Path(path) / "tokenizer.json"
        if not file.is_file():
            raise RuntimeError(f"no fast tokenizer at {path}: {exc}") from exc
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(file))


def _check_stop_strings(text: str, new_chars: int, stop: Sequence[str],
                        include: bool) -> tuple[str, int] | None:
    """vLLM's stop-string check: the stop string completing earliest in the new text,
    and the length to cut the text to (-1: no cut)."""
    if not new_chars or not stop:
        return None
    best: str | None = None
    best_index, best_end = 0, sys.maxsize
    for s in stop:
        index = text.find(s, 1 - new_chars - len(s))
        if index != -1 and index + len(s) < best_end:
            best, best_index, best_end = s, index, index + len(s)
    if best is None:
        return None
    if include:
        return (best, -1) if best_end >= len(text) else (best, best_end)
    return best, best_index


class TextAssembler:
    """One completion's text from its token ids, as vLLM's fast incremental
    detokenizer gives it: primed with the prompt, one token at a time, stop strings
    checked after each (from ``min_tokens`` on), and in a stream the last characters
    that could start a stop string held back."""

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], *,
                 skip_special_tokens: bool = True, stop: str | Sequence[str] | None = None,
                 include_stop_str_in_output: bool = False, min_tokens: int = 0) -> None:
        from tokenizers.decoders import DecodeStream

        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._stream = DecodeStream(ids=list(prompt_ids), skip_special_tokens=skip_special_tokens)
        self.stop = [stop] if isinstance(stop, str) else list(stop or [])
        self.include = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.hold = max(map(len, self.stop)) - 1 if self.stop and not self.include else 0
        self.text = ""
        self.token_ids: list[int] = []
        self.stop_reason: str | None = None
        self._sent = 0

    def _step(self, token_id: int) -> str:
        from tokenizers.decoders import DecodeStream

        try:
            piece = self._stream.step(self._tokenizer, token_id)
        except (OverflowError, TypeError):
            piece = None
        except Exception as exc:
            if not str(exc).startswith("Invalid prefix encountered"):
                raise
            # as vLLM does: start the stream over from this token
            self._stream = DecodeStream(skip_special_tokens=self._skip)
            piece = self._stream.step(self._tokenizer, token_id)
        return piece or ""

    def add(self, token_id: int, stop_terminated: bool = False) -> bool:
        """Appends one generated token; ``stop_terminated``: it is the stop token
        (EOS or a stop token id) that ended the sequence, kept out of the text unless
        ``include_stop_str_in_output``. True once a stop string ends the completion
        (the text is then cut as vLLM cuts it)."""
        start = len(self.text)
        self.token_ids.append(token_id)
        if not (stop_terminated and not self.include):
            self.text += self._step(token_id)
        if not self.stop or len(self.token_ids) <= self.min_tokens:
            return False
        found = _check_stop_strings(self.text, len(self.text) - start, self.stop,
                                    self.include)
        if found is None:
            return False
        self.stop_reason, cut = found
        if cut != -1:
            self.text = self.text[:cut]
        return True

    def delta(self, finished: bool) -> str:
        """Text not yet sent; while not finished, less what could start a stop
        string."""
        end = len(self.text) - (0 if finished else self.hold)
        if end <= self._sent:
            return ""
        piece, self._sent = self.text[self._sent:end], end
        return piece
