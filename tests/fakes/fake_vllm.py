"""FAKE vLLM OpenAI server: the sleep-mode HTTP API of vLLM (0.26) on a GPU, without a model or a GPU.

vLLM's sleep mode needs a CUDA (or ROCm/XPU) platform: the CPU build refuses
``--enable-sleep-mode`` at start ("Sleep mode is not supported on current platform"), so the
lifecycle's ``sleep``/``wake`` on vLLM are tested against this fake. It is no kinder than the
real server:

* arguments parsed strictly (an unknown flag stops it at start, as vLLM's parser does; the
  ``--fake-*`` ones are the fake's own);
* the sleep endpoints exist only with ``VLLM_SERVER_DEV_MODE=1`` (404 otherwise):
  ``POST /sleep?level=1|2`` (200, empty), ``POST /wake_up`` with optional ``tags`` query
  parameters (``weights``, ``kv_cache``; none means all), ``GET /is_sleeping`` ->
  ``{"is_sleeping": bool}``, ``POST /collective_rpc`` ``{"method": "reload_weights"}``;
* without ``--enable-sleep-mode`` a sleep fails inside the engine: HTTP 500
  ("Sleep mode is not enabled in the model config");
* level 1 offloads the weights to host memory and drops the KV cache; level 2 drops both:
  after a level-2 sleep, waking the weights without ``reload_weights`` leaves garbage in
  them, and the replies change (as the real engine's do);
* work on released memory is what the real engine dies on (an illegal memory access): a
  generation while anything is asleep, a ``reload_weights`` while the weights' memory is
  asleep, end the server.

Every call is logged on stdout as ``fake-vllm call: {"method", "path"}``. The reply is a
deterministic function of the weights files' bytes and the prompt (as the fake SGLang's).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fake_sglang import WORDS, weights_digest  # noqa: E402
from openai_http import JsonHandler  # noqa: E402

TAGS = ("weights", "kv_cache")


def die(why: str) -> None:
    print("EngineCore hit an exception: %s" % why, flush=True)
    os._exit(1)


class Engine:
    def __init__(self, args) -> None:
        self.digest = weights_digest(args.model)
        if self.digest is None:
            die("no *.safetensors under %s" % args.model)
        self.sleep_mode = args.enable_sleep_mode
        self.asleep: set[str] = set()
        self.weights_ok = True  # False: the weights' memory was woken empty after a level-2 sleep
        self.offloaded = False  # level 1 kept a copy of the weights in host memory
        self.reload_seconds = args.fake_reload_seconds
        self.lock = threading.Lock()

    def sleep(self, level: int) -> tuple[int, str]:
        if not self.sleep_mode:
            return 500, "Sleep mode is not enabled in the model config"
        if level not in (1, 2):
            return 400, "level must be 1 or 2"
        self.asleep = set(TAGS)
        self.offloaded = level == 1
        return 200, ""

    def wake(self, tags: list[str]) -> None:
        for tag in tags or TAGS:
            if tag not in TAGS:
                die("unknown tag %r" % tag)
            if tag in self.asleep and tag == "weights" and not self.offloaded:
                self.weights_ok = False  # the memory is mapped again, its content is not the weights
            self.asleep.discard(tag)

    def reload(self, model_dir: str) -> None:
        if "weights" in self.asleep:
            die("CUDA error: an illegal memory access was encountered (weights loaded into released memory)")
        time.sleep(self.reload_seconds)
        self.digest = weights_digest(model_dir) or self.digest
        self.weights_ok = True

    def generate(self, prompt: str, n: int) -> list[str]:
        if self.asleep:
            die("CUDA error: an illegal memory access was encountered (generation with %s asleep)" % sorted(self.asleep))
        seed = hashlib.sha256(((self.digest if self.weights_ok else "garbage") + prompt).encode()).digest()
        return [" " + WORDS[seed[i % len(seed)] % len(WORDS)] for i in range(n)]


def make_handler(engine: Engine, args):
    dev = os.environ.get("VLLM_SERVER_DEV_MODE") == "1"

    class Handler(JsonHandler):
        def _route(self) -> tuple[str, dict]:
            parts = urlsplit(self.path)
            print("fake-vllm call: %s" % json.dumps({"method": self.command, "path": self.path}), flush=True)
            return parts.path, parse_qs(parts.query)

        def do_GET(self):
            path, _ = self._route()
            if path == "/health":
                return self._send(200)
            if path == "/v1/models":
                return self._send(200, {"object": "list", "data": [{"id": args.served_model_name or args.model, "object": "model", "owned_by": "vllm"}]})
            if path == "/is_sleeping" and dev:
                return self._send(200, {"is_sleeping": bool(engine.asleep)})
            self._send(404, {"detail": "Not Found"})

        def do_POST(self):
            path, query = self._route()
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            body = json.loads(raw) if raw else {}
            with engine.lock:
                if path == "/v1/chat/completions":
                    return self._chat(body)
                if not dev or path not in ("/sleep", "/wake_up", "/collective_rpc"):
                    return self._send(404, {"detail": "Not Found"})
                if path == "/sleep":
                    status, message = engine.sleep(int((query.get("level") or ["1"])[0]))
                    return self._send(status, {"error": {"message": message, "type": "InternalServerError", "code": status}} if message else None)
                if path == "/wake_up":
                    engine.wake(query.get("tags") or [])
                    return self._send(200)
                if body.get("method") != "reload_weights":
                    return self._send(400, {"error": {"message": "unknown method %r" % body.get("method"), "code": 400}})
                engine.reload(args.model)
                return self._send(200, {"results": [None]})

        def _chat(self, req: dict) -> None:
            words = engine.generate(str((req.get("messages") or [{}])[-1].get("content", "")), int(req.get("max_tokens") or 16))
            self._send_chat(req, words)

    return Handler


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="FAKE vLLM server (tests only)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--revision", default=None)
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--enable-sleep-mode", action="store_true")
    ap.add_argument("--fake-reload-seconds", type=float, default=0.1)
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    engine = Engine(args)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(engine, args))
    print("fake-vllm: serving %s on %s:%d" % (args.model, args.host, args.port), flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
