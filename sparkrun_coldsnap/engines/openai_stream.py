"""A streamed chat completion against an OpenAI-compatible server, timed.

Validation is a real request: greedy (temperature 0, fixed seed) so the
reply is reproducible, streamed so the first non-empty token can be timed.
The adapter may add fields that make the engine return each generated token's
id and log-probability alongside the text (the token oracle); an engine that
ignores them still answers, with no token record.
``Connection: close`` so no client connection is left established when the
server is captured right after.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import requests

from sparkrun_coldsnap.errors import EngineError


@dataclass(frozen=True)
class StreamedReply:
    text: str
    sent_at: float
    first_token_at: float | None
    finished_at: float
    #: the generated tokens' ids and log-probabilities, both empty when the engine sent none
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()

    @property
    def request_ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.sent_at

    @property
    def has_tokens(self) -> bool:
        """The engine sent one id and one log-probability for every token, and at least one."""
        return bool(self.token_ids) and len(self.token_ids) == len(self.logprobs)


def chat_body(model: str, prompt: str, max_tokens: int, extra: Mapping[str, Any] | None = None) -> dict:
    return {
        **(extra or {}),
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": 0,
        "stream": True,
    }


class _Tokens:
    """The token ids and log-probabilities a stream's chunks carry, gathered in order; a chunk
    whose fields are malformed spoils the record (the text is still the reply)."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.spoiled = False

    def add(self, choice: dict) -> None:
        ids = choice.get("token_ids")
        if ids is not None:
            if isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                self.ids.extend(ids)
            else:
                self.spoiled = True
        content = (choice.get("logprobs") or {}).get("content") if isinstance(choice.get("logprobs"), dict) else None
        for entry in content or ():
            value = entry.get("logprob") if isinstance(entry, dict) else None
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self.logprobs.append(float(value))
            else:
                self.spoiled = True

    def record(self) -> tuple[tuple[int, ...], tuple[float, ...]]:
        if self.spoiled or len(self.ids) != len(self.logprobs):
            return (), ()
        return tuple(self.ids), tuple(self.logprobs)


def stream_chat(base_url: str, model: str, prompt: str, *, max_tokens: int, timeout: float, extra: Mapping[str, Any] | None = None, api_key: str | None = None) -> StreamedReply:
    """The streamed reply to *prompt*; *extra*: request fields of the engine's (the token record's); *api_key*: sent as a bearer token."""
    url = base_url.rstrip("/") + "/v1/chat/completions"
    headers = {"Connection": "close"}
    if api_key:
        headers["Authorization"] = "Bearer " + api_key
    parts: list[str] = []
    tokens = _Tokens()
    first: float | None = None
    sent = time.monotonic()
    try:
        with requests.post(url, json=chat_body(model, prompt, max_tokens, extra), stream=True, timeout=timeout, headers=headers) as r:
            if r.status_code != 200:
                raise EngineError("validation request to %s failed: HTTP %d: %s" % (url, r.status_code, r.text[:300]))
            for raw in r.iter_lines():
                if not raw.startswith(b"data:"):
                    continue
                data = raw[5:].strip()
                if data == b"[DONE]":
                    break
                try:
                    chunk = json.loads(data)
                except ValueError as err:
                    raise EngineError("validation stream from %s sent a malformed event: %r" % (url, data[:200])) from err
                if chunk.get("error"):
                    raise EngineError("validation stream from %s reported an error: %s" % (url, chunk["error"]))
                for choice in chunk.get("choices") or []:
                    tokens.add(choice)
                    piece = (choice.get("delta") or {}).get("content") or ""
                    if piece:
                        if first is None:
                            first = time.monotonic()
                        parts.append(piece)
    except requests.RequestException as err:
        raise EngineError("validation request to %s failed: %s" % (url, err)) from err
    ids, logprobs = tokens.record()
    return StreamedReply("".join(parts), sent, first, time.monotonic(), ids, logprobs)


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        return requests.get(url, timeout=timeout, headers={"Connection": "close"}).status_code == 200
    except requests.RequestException:
        return False


def wait_until_ok(
    url: str,
    *,
    deadline_seconds: float,
    alive: Callable[[], bool],
    on_tick: Callable[[float], None] | None = None,
    interval: float = 0.05,
    request_timeout: float = 2.0,
) -> float:
    """Poll *url* until it answers 200, giving each poll *request_timeout*; returns seconds waited.

    Stops early with EngineError when *alive* says the server process died.
    """
    t0 = time.monotonic()
    while True:
        if http_ok(url, timeout=min(request_timeout, deadline_seconds)):
            return time.monotonic() - t0
        waited = time.monotonic() - t0
        if not alive():
            raise EngineError("the engine exited before %s answered (after %.0f s)" % (url, waited))
        if waited > deadline_seconds:
            raise EngineError("the engine did not answer %s within %.0f s: raise coldsnap.ready_timeout_seconds or check the engine log" % (url, deadline_seconds))
        if on_tick is not None:
            on_tick(waited)
        time.sleep(interval)
