"""FAKE SGLang server: the HTTP API of ``sglang.launch_server`` (0.5.17), without a model.

SGLang cannot run on the CPU machines CI uses (no CPU build of its kernels), so
the adapter is tested against this fake. It answers the same paths with the
same bodies, status codes and streaming format as the real server:

* ``GET /health``: empty body; 503 while starting, 200 once up; the real one then
  answers by generating one token, so it is 503 too while weights or KV cache are
  released;
* ``GET /v1/models``: ``{"object": "list", "data": [{"id": served name, ...}]}``;
* ``POST /v1/chat/completions``: the model name is not checked; with
  ``stream`` the events are ``data: <json>\\n\\n``: a role chunk
  (``{"reasoning_content": null, "role": "assistant", "content": ""}``), content
  chunks, a finish chunk, then ``data: [DONE]``; errors are
  ``{"object": "error", "message": ..., "type": ..., "param": null, "code": 400}``;
* ``POST /release_memory_occupation`` / ``/resume_memory_occupation`` with
  ``{"tags": [...]}`` (``weights``, ``kv_cache``, ``cuda_graph``; none means all):
  200 with ``null``; released tags are tracked with or without
  ``--enable-memory-saver``; resuming a tag that was not released kills the server
  (the real scheduler raises). Released weights are dropped, not kept: after
  resuming ``weights`` without ``/update_weights_from_disk`` the real server (0.5.17
  on an H200) answered every request with empty text, and so does this one;
* ``POST /update_weights_from_disk`` ``{"model_path": ...}``: 200
  ``{"success": true, "message": "Succeeded to update model weights.", "num_paused_requests": 0}``,
  400 with ``success: false`` otherwise (weights released or not: the real server does
  not check); on success the served name becomes the path.

The reply is a deterministic function of the weights file's bytes and the
prompt, so a restore that brought back the wrong weights answers differently.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ALL_TAGS = ("kv_cache", "weights", "cuda_graph")
WORDS = ["cold", "start", "capsule", "restore", "token", "warm", "graph", "kernel", "weights", "ready"]


class State:
    def __init__(self, args) -> None:
        self.served = args.served_model_name or args.model_path
        self.released: set[str] = set()
        # False once the weights' memory was released: resuming gives the memory back, not the
        # weights (seen on the real server); only /update_weights_from_disk loads them again.
        self.weights_loaded = True
        self.ready_at = time.monotonic() + args.startup_seconds
        self.weights_digest = self._digest(args.model_path)

    @staticmethod
    def _digest(path: str) -> str:
        h = hashlib.sha256()
        for p in sorted(Path(path).glob("*.safetensors")):
            h.update(p.read_bytes())
        return h.hexdigest()

    def reply(self, prompt: str, max_tokens: int) -> list[str]:
        seed = hashlib.sha256((self.weights_digest + prompt).encode()).digest()
        return [" " + WORDS[seed[i % len(seed)] % len(WORDS)] for i in range(max_tokens)]


def make_handler(state: State):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *a):
            print("fake-sglang:", fmt % a, flush=True)

        def _send(self, status: int, body: bytes = b"", content_type: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, status: int, doc) -> None:
            self._send(status, json.dumps(doc).encode())

        def _error(self, status: int, message: str, kind: str = "BadRequest") -> None:
            self._json(status, {"object": "error", "message": message, "type": kind, "param": None, "code": status})

        def _body(self):
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            try:
                return json.loads(raw) if raw else None
            except ValueError:
                return "malformed"

        def do_GET(self):
            if self.path in ("/health", "/health_generate"):
                up = time.monotonic() >= state.ready_at and not state.released & {"weights", "kv_cache"}
                self._send(200 if up else 503)
            elif self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": state.served, "object": "model", "created": int(time.time()), "owned_by": "sglang", "root": state.served, "parent": None, "max_model_len": 2048}]})
            else:
                self._error(404, "Not Found", "404")

        def do_POST(self):
            body = self._body()
            if body == "malformed":
                return self._error(400, "invalid JSON body", "Bad Request")
            if self.path == "/v1/chat/completions":
                return self._chat(body or {})
            if self.path in ("/release_memory_occupation", "/resume_memory_occupation"):
                if body is None:
                    return self._error(400, "body required", "Bad Request")
                tags = set(body.get("tags") or ALL_TAGS)
                if self.path.startswith("/release"):
                    state.released |= tags
                    if "weights" in tags:
                        state.weights_loaded = False
                else:
                    if not tags <= state.released:
                        # The real scheduler raises KeyError and the server exits.
                        print("Scheduler hit an exception: KeyError %s" % sorted(tags - state.released), flush=True)
                        os._exit(1)
                    state.released -= tags
                return self._json(200, None)
            if self.path == "/update_weights_from_disk":
                path = (body or {}).get("model_path")
                if not path or not Path(path).is_dir():
                    return self._json(400, {"success": False, "message": "Failed to get weights iterator: %s not found." % path, "num_paused_requests": 0})
                state.weights_digest = state._digest(path)
                state.weights_loaded = True
                state.served = path
                return self._json(200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0})
            self._error(404, "Not Found", "404")

        def _chat(self, req: dict) -> None:
            if self.headers.get("Content-Type", "").split(";")[0] != "application/json":
                return self._error(400, "Unsupported Media Type: Only 'application/json' is allowed", "Bad Request")
            messages = req.get("messages") or []
            if not messages:
                return self._error(400, "Messages cannot be empty.", "BadRequestError")
            if state.released & {"weights", "kv_cache"}:
                return self._error(500, "memory is released: resume it first", "InternalServerError")
            model = req.get("model", "default")
            words = state.reply(str(messages[-1].get("content", "")), int(req.get("max_tokens") or 16))
            if not state.weights_loaded:
                words = [""] * len(words)  # weights resumed but not reloaded: empty text, as the real server
            rid = hashlib.md5(os.urandom(8)).hexdigest()
            created = int(time.time())
            if not req.get("stream"):
                msg = {"role": "assistant", "content": "".join(words), "reasoning_content": None, "tool_calls": None}
                return self._json(200, {"id": rid, "object": "chat.completion", "created": created, "model": model,
                                        "choices": [{"index": 0, "message": msg, "logprobs": None, "finish_reason": "length", "matched_stop": None}],
                                        "usage": {"prompt_tokens": 8, "total_tokens": 8 + len(words), "completion_tokens": len(words)}, "metadata": {"weight_version": "default"}})  # fmt: skip
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()

            def event(delta, finish=None):
                doc = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                       "choices": [{"index": 0, "delta": {"reasoning_content": None, **delta}, "logprobs": None, "finish_reason": finish, "matched_stop": None}]}  # fmt: skip
                self.wfile.write(b"data: " + json.dumps(doc).encode() + b"\n\n")
                self.wfile.flush()

            event({"role": "assistant", "content": ""})
            for w in words:
                event({"content": w})
            event({}, "length")
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            self.close_connection = True

    return Handler


def main() -> None:
    ap = argparse.ArgumentParser(description="FAKE SGLang server (tests only)")
    ap.add_argument("--model-path", "--model", dest="model_path", required=True)
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--enable-memory-saver", action="store_true")
    ap.add_argument("--startup-seconds", type=float, default=1.0, help="(fake only) how long /health answers 503")
    args, _unknown = ap.parse_known_args()
    server = ThreadingHTTPServer((args.host, args.port), make_handler(State(args)))
    print("fake-sglang: serving %s on %s:%d" % (args.model_path, args.host, args.port), flush=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
