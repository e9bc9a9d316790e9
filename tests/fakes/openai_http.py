"""FAKE engines' HTTP (tests only): the JSON answers and the OpenAI chat completion, streamed or
not, as vLLM's server writes them; shared by the fake vLLM servers."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler


class JsonHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *a):
        pass

    def _send(self, status: int, doc=None) -> None:
        body = b"" if doc is None else json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _send_chat(self, req: dict, words: list[str]) -> None:
        """*words* as a chat completion: one document, or (``stream``) one chunk per word after
        the role's, then ``[DONE]``, on a connection that closes."""
        if not req.get("stream"):
            return self._send(200, {"object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(words)}, "finish_reason": "length"}]})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        for delta in [{"role": "assistant", "content": ""}] + [{"content": w} for w in words]:
            doc = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]}
            self.wfile.write(b"data: " + json.dumps(doc).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        self.close_connection = True
        return None
